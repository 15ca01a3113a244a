"""How a job snapshot is laid out as etcd records, so that a save writes only what changed.

A snapshot (:meth:`master.job.job.Job.snapshot`) becomes ``{key suffix: value}`` records under the job's
prefix:

``state``
    The root record: the snapshot's small fields, and the content hashes of the chunks that hold the rest.
    Written last in a save, by every save that writes anything.
``node/<node id>``
    One per node: its lasting facts (host, nproc, failure count, credential hash).
``nstate/<node id>``
    One per node: ``[state, round]``, which change every round (kept apart so that a round rewrites a few
    bytes per node, not the credential hash).
``event/<seq>``
    One per stored event (the last hundred), empty fields left out: an event never changes, so each is
    written once.
``chunk/<hash>``
    Content-addressed, never rewritten: the snapshot's larger fields (statistics, node-check results...),
    and the long lists (node order, the rendezvous' joined candidates and expected members, the current
    round's slots, the finished nodes) cut into chunks at items chosen by a hash of the item's node id
    (content-defined chunking), under a small tree of index chunks. A node joining, leaving or moving
    changes one leaf and one index chunk per level, not the list. A slot whose rank and rank offset follow
    from its position is stored as ``[node, nproc]`` (a node leaving from the middle of a round changes
    no slot after it); a candidate as the list of its values.

:func:`encode` and :func:`decode` are inverses; :func:`plan` turns the records stored so far and the new
ones into fenced transactions of bounded size, the root record in the last write so that a reader pinned
to the root's revision sees one whole save (``master/store/etcd_state.py``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Iterable
from typing import Any

Records = dict[str, bytes]

#: Key suffix of the root record (the one key the previous release wrote the whole snapshot to).
ROOT = "state"
NODE, NSTATE, EVENT, CHUNK = "node/", "nstate/", "event/", "chunk/"
#: Marks a root record of this layout; a ``state`` value without it is a whole snapshot (older release).
LAYOUT_KEY, LAYOUT = "layout", 2
#: Schema stamped on the root, so that a master of the previous release (it reads schema 1 only) refuses
#: this layout with "run a newer elastic-master" instead of misreading it.
ROOT_SCHEMA = 2
#: A chunk ends after an item whose key hashes to 0 modulo this (so ~this many items per chunk) ...
CHUNK_ITEMS = 16
#: Index chunks (lists of chunk hashes) end after about this many hashes.
INDEX_ITEMS = 8
#: Hex digits of a chunk's content hash (64 bits: no collision among a job's chunks).
HASH_CHARS = 16
#: ... or once it holds this many items or bytes (bounds a value whatever the hashes say).
MAX_CHUNK_ITEMS, MAX_CHUNK_BYTES = 256, 16 * 1024
#: A field of the snapshot whose JSON is longer than this gets a chunk of its own.
PART_BYTES = 64
#: The long lists: name -> path in the snapshot.
LISTS: dict[str, tuple[str, ...]] = {
    "joined": ("rendezvous", "joined"),
    "expected": ("rendezvous", "expected"),
    "slots": ("rendezvous", "current", "slots"),
    "succeeded": ("succeeded",),
}
#: A node's fields that change every round (the ``nstate/`` record); the others go to ``node/``.
ROUND_FIELDS = ("state", "round")
#: A joined candidate's fields, stored as a list of their values (in this order).
CANDIDATE_FIELDS = ("node_id", "host", "nproc", "store_port", "joined_at")
#: Fields of an event record (master.job.events.Event.record) left out when they hold these values.
EVENT_DEFAULTS: dict[str, Any] = {"round": None, "node": None, "cause": None, "durations": {}, "data": {}}
#: etcd's defaults: 128 operations per transaction, 1.5 MiB per request; kept well below both.
MAX_TXN_OPS, MAX_TXN_BYTES = 120, 1024 * 1024


class LayoutError(ValueError):
    """The stored records do not form a state (a missing chunk or node record); one line."""


#: One encoder for every record (``json.dumps`` with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def _dump(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def _dumped_size(item: Any) -> int:
    """``len(_dump(item))``; for a plain printable ASCII string (a node id) without encoding it."""
    if (
        isinstance(item, str)
        and item.isascii()
        and item.isprintable()
        and '"' not in item
        and "\\" not in item
    ):
        return len(item) + 2
    return len(_dump(item))


def _item_key(item: Any) -> str:
    if isinstance(item, dict):
        return str(item.get("node_id", ""))
    if isinstance(item, list) and item:
        return str(item[0])
    return str(item)


@functools.lru_cache(maxsize=1 << 16)  # the same node ids come back in every save
def _boundary(key: str, average: int) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % average == 0


def chunk_items(items: list[Any], average: int = CHUNK_ITEMS) -> list[list[Any]]:
    """Cut ``items`` into chunks after every item whose key (node id, or a chunk's hash) is a boundary
    (about one in ``average``), or at the size caps."""
    out: list[list[Any]] = []
    current: list[Any] = []
    size = 0
    for item in items:
        current.append(item)
        size += _dumped_size(item) + 1
        if _boundary(_item_key(item), average) or len(current) >= MAX_CHUNK_ITEMS or size >= MAX_CHUNK_BYTES:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def _to_row(item: Any, fields: tuple[str, ...]) -> Any:
    """A dict with exactly ``fields`` as a list of their values (the keys are not stored); else as is."""
    if isinstance(item, dict) and len(item) == len(fields) and all(f in item for f in fields):
        return [item[f] for f in fields]
    return item


def _from_row(item: Any, fields: tuple[str, ...]) -> Any:
    return dict(zip(fields, item, strict=True)) if isinstance(item, list) else item


def _compact_event(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in EVENT_DEFAULTS or v != EVENT_DEFAULTS[k]}


def _expand_event(record: dict) -> dict:
    return {**copy.deepcopy(EVENT_DEFAULTS), **record}


def _compact_slots(slots: list[dict]) -> list[Any]:
    """Slots as ``[node, nproc]`` where rank and offset follow from the position; else unchanged."""
    out: list[Any] = []
    offset = 0
    for rank, slot in enumerate(slots):
        derived = {"node_id": slot.get("node_id"), "node_rank": rank, "rank_offset": offset}
        derived["nproc"] = slot.get("nproc")
        out.append([slot["node_id"], slot["nproc"]] if slot == derived else slot)
        offset += int(slot.get("nproc") or 0)
    return out


def _expand_slots(items: list[Any]) -> list[dict]:
    out: list[dict] = []
    offset = 0
    for rank, item in enumerate(items):
        slot = item if isinstance(item, dict) else dict(node_id=item[0], node_rank=rank, rank_offset=offset)
        if not isinstance(item, dict):
            slot["nproc"] = item[1]
        out.append(slot)
        offset += int(slot.get("nproc") or 0)
    return out


def _parent(data: dict, path: tuple[str, ...]) -> dict | None:
    parent = data
    for name in path[:-1]:
        child = parent.get(name) if isinstance(parent, dict) else None
        if not isinstance(child, dict):
            return None
        parent = child
    return parent


def _detached(snapshot: dict) -> dict:
    """``snapshot`` with new dicts at the top and along the :data:`LISTS` paths (what :func:`encode` pops)."""
    job = dict(snapshot)
    for path in LISTS.values():
        parent = job
        for name in path[:-1]:
            child = parent.get(name)
            if not isinstance(child, dict):
                break
            parent[name] = dict(child)
            parent = parent[name]
    return job


def encode(snapshot: dict) -> Records:
    """The records of ``snapshot`` (a dict of :meth:`master.job.job.Job.snapshot`'s shape), which stays as it
    was: encoding pops the lists it stores apart from a copy of the dicts on their paths (the rest is only
    read; a deep copy was half the cost of a save at 10,000 nodes)."""
    job = _detached(snapshot)
    records: Records = {}
    lists: dict[str, list[Any]] = {}

    def put_chunk(value: Any) -> str:
        data = _dump(value)
        digest = hashlib.sha256(data).hexdigest()[:HASH_CHARS]
        records[CHUNK + digest] = data
        return digest

    def store_list(name: str, items: list[Any]) -> None:
        # Leaves, then levels of index chunks naming them (content-defined too, so a changed leaf
        # rewrites one index chunk per level) up to one chunk: the root names that one.
        level = [put_chunk(chunk) for chunk in chunk_items(items)]
        depth = 0
        while len(level) > 1 or depth == 0:
            chunks = chunk_items(level, INDEX_ITEMS)
            if len(chunks) >= len(level) > 1:  # no hash fell on a boundary but every one: one chunk
                chunks = [level]
            level = [put_chunk(chunk) for chunk in chunks]
            depth += 1
        lists[name] = [level[0], depth] if level else ["", depth]

    nodes = job.pop("nodes", None)
    for node in nodes or []:
        node_id = node["node_id"]
        lasting = {k: v for k, v in node.items() if k not in ("node_id", *ROUND_FIELDS)}
        records[NODE + node_id] = _dump(lasting)
        if any(k in node for k in ROUND_FIELDS):  # soft since schema 2: absent from new snapshots
            records[NSTATE + node_id] = _dump(
                _to_row({k: node[k] for k in ROUND_FIELDS if k in node}, ROUND_FIELDS)
            )
    if nodes is not None:
        store_list("nodes", [node["node_id"] for node in nodes])
    root: dict[str, Any] = {"schema": ROOT_SCHEMA, LAYOUT_KEY: LAYOUT, "job": job, "lists": lists}
    events = job.pop("events", None)
    if events is not None:
        root["events"] = _store_events(records, events, int(job.get("event_count", len(events))))
    for name, path in LISTS.items():
        parent = _parent(job, path)
        if parent is None or not isinstance(parent.get(path[-1]), list):
            continue
        items = parent.pop(path[-1])
        if name == "slots":
            items = _compact_slots(items)
        elif name == "joined":
            items = [_to_row(item, CANDIDATE_FIELDS) for item in items]
        store_list(name, items)
    # Larger fields (statistics, node-check results...) change seldom: a chunk each, named by the root.
    parts = {k: put_chunk(job.pop(k)) for k in list(job) if len(_dump(job[k])) > PART_BYTES}
    if parts:
        root["parts"] = parts
    records[ROOT] = _dump(root)
    return records


def _event_key(seq: int) -> str:
    return f"{EVENT}{seq:012d}"


def _store_events(records: Records, events: list[dict], count: int) -> list[int] | dict[str, int]:
    """One record per event, keyed by its sequence number (which an older record lacks: then the
    number its position implies); the numbers in order, as ``{first, count}`` when consecutive."""
    first = count - len(events) + 1
    seqs = [int(record.get("seq", first + i)) for i, record in enumerate(events)]
    for seq, record in zip(seqs, events, strict=True):
        records[_event_key(seq)] = _dump(_compact_event(record))
    start = seqs[0] if seqs else first
    if seqs == list(range(start, start + len(seqs))):
        return {"first": start, "count": len(seqs)}
    return seqs


def _event_seqs(stored: list[int] | dict[str, int]) -> list[int]:
    """The sequence numbers :func:`_store_events` wrote."""
    if isinstance(stored, dict):
        return list(range(int(stored["first"]), int(stored["first"]) + int(stored["count"])))
    return [int(seq) for seq in stored]


def is_layout(root: Any) -> bool:
    """Whether a decoded ``state`` value is a root record of this layout (else: a whole snapshot)."""
    return isinstance(root, dict) and root.get(LAYOUT_KEY) == LAYOUT and isinstance(root.get("job"), dict)


def decode(records: Records) -> dict:
    """The snapshot that :func:`encode` made ``records`` from; :class:`LayoutError` when one is missing.
    Nodes and events come back in their stored order; dict key order may differ."""
    try:
        root = json.loads(records[ROOT])
    except KeyError:
        raise LayoutError(f"the root record {ROOT} is missing") from None
    if not is_layout(root):
        raise LayoutError(f"the root record {ROOT} is not of layout {LAYOUT}")
    job = root["job"]

    def load(key: str) -> Any:
        if key not in records:
            raise LayoutError(f"the record {key} that {ROOT} refers to is missing")
        return json.loads(records[key])

    def optional(key: str, default: Any) -> Any:
        return json.loads(records[key]) if key in records else default

    def items(name: str) -> list[Any]:
        top, depth = root["lists"][name]
        level = [top] if top else []
        for _ in range(int(depth) + 1):
            level = [item for digest in level for item in load(CHUNK + digest)]
        return level

    for key, digest in root.get("parts", {}).items():
        job[key] = load(CHUNK + digest)

    if "nodes" in root["lists"]:
        job["nodes"] = [
            {"node_id": n, **load(NODE + n), **_from_row(optional(NSTATE + n, {}), ROUND_FIELDS)}
            for n in items("nodes")
        ]
    if "events" in root:
        job["events"] = [_expand_event(load(_event_key(seq))) for seq in _event_seqs(root["events"])]
    for name, path in LISTS.items():
        if name not in root["lists"] or name == "nodes":
            continue
        parent = _parent(job, path)
        if parent is None:
            raise LayoutError(f"the root record {ROOT} lists {name} but has no {'.'.join(path[:-1])}")
        listed = items(name)
        if name == "slots":
            listed = _expand_slots(listed)
        elif name == "joined":
            listed = [_from_row(item, CANDIDATE_FIELDS) for item in listed]
        parent[path[-1]] = listed
    return job


def plan(
    old: Records, new: Records, *, max_ops: int = MAX_TXN_OPS, max_bytes: int = MAX_TXN_BYTES
) -> list[list[tuple[str, bytes | None]]]:
    """Transactions (each a list of ``(key, value)``; ``None`` deletes) that turn ``old`` into ``new``:
    changed and new records first, the root record (whenever anything changed) in the last transaction
    that puts anything, deletions with or after it. Each holds at most ``max_ops`` operations and about
    ``max_bytes`` bytes."""
    puts = [(k, v) for k, v in new.items() if k != ROOT and old.get(k) != v]
    deletes: list[tuple[str, bytes | None]] = [(k, None) for k in old if k not in new]
    if ROOT in new and (puts or deletes or old.get(ROOT) != new[ROOT]):
        # Written by every save that writes anything, unchanged or not: its revision then marks the last
        # whole save, so a reader recognises records newer than it as a save cut off half-way.
        puts.append((ROOT, new[ROOT]))
    return _batches([*puts, *deletes], max_ops, max_bytes)


def _batches(
    ops: Iterable[tuple[str, bytes | None]], max_ops: int, max_bytes: int
) -> list[list[tuple[str, bytes | None]]]:
    out: list[list[tuple[str, bytes | None]]] = []
    current: list[tuple[str, bytes | None]] = []
    size = 0
    for key, value in ops:
        cost = len(key) + 64 + (len(value) if value is not None else 0)
        if current and (len(current) >= max_ops or size + cost > max_bytes):
            out.append(current)
            current, size = [], 0
        current.append((key, value))
        size += cost
    if current:
        out.append(current)
    return out
