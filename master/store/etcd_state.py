"""Reading and writing a job's state records (``master/store/etcd_layout.py``) in etcd.

What a reader sees: the root record ``state`` is written in the last transaction of a save, after (or
with) every record it refers to, and records that a save drops are deleted with or after it. A reader
that finds records written after the root (a save cut off half-way: its master lost the lead or crashed)
reads the prefix as it was at the root's revision instead, so it always sees one whole save. That
revision survives compaction here, which keeps the history from the previous save on (see
:class:`StateRecords`); should etcd's own auto-compaction have removed it, the current records are read
and the reader is told (a node's state may then be one save ahead of the round, which its next
heartbeat settles).

Every transaction of a save is fenced by the caller's compare (the leader key still this term's), so a
deposed master writes nothing, and holds at most :data:`~master.store.etcd_layout.MAX_TXN_OPS` operations of
at most :data:`~master.store.etcd_layout.MAX_TXN_BYTES`, within etcd's default limits.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import aetcd
from aetcd import rpc, utils

from master.store import etcd_layout as layout
from master.store.base import Snapshot

log = logging.getLogger(__name__)

#: Keys per range request when reading the prefix (values are small: a page stays within the client's
#: 64 MiB message limit, master/store/etcd_client.py).
PAGE_KEYS = 500
#: Compact etcd's history once this many revisions passed since the last compaction.
COMPACT_EVERY = 1000


class RevisionGone(Exception):
    """The revision asked for was compacted."""


@dataclass
class Read:
    """The records under a prefix at one revision, and each record's modification revision."""

    records: layout.Records
    mods: dict[str, int]
    revision: int


def _rpc_error(exc: rpc.AioRpcError) -> Exception:
    code, details = exc.code(), exc.details() or ""
    if code is rpc.StatusCode.OUT_OF_RANGE or "compacted" in details:
        return RevisionGone(details)
    if code is rpc.StatusCode.UNAVAILABLE:
        return aetcd.ConnectionFailedError(details)
    if code is rpc.StatusCode.DEADLINE_EXCEEDED:
        return aetcd.ConnectionTimeoutError(details)
    return aetcd.ClientError(details)


async def read_prefix(
    client: aetcd.Client, prefix: bytes, skip: frozenset[str], revision: int = 0, timeout: float = 5.0
) -> Read:
    """Every record under ``prefix`` (suffixes in ``skip`` left out) at ``revision`` (0: now), paged."""
    await client.connect()
    records: layout.Records = {}
    mods: dict[str, int] = {}
    start, end = prefix, utils.prefix_range_end(prefix)
    while True:
        request = rpc.RangeRequest(key=start, range_end=end, limit=PAGE_KEYS, revision=revision)
        try:
            reply = await client.kvstub.Range(request, timeout=timeout, metadata=client.metadata)
        except rpc.AioRpcError as exc:
            raise _rpc_error(exc) from None
        revision = revision or reply.header.revision  # every later page at the first page's revision
        for kv in reply.kvs:
            suffix = kv.key[len(prefix) :].decode(errors="replace")
            if suffix not in skip:
                records[suffix], mods[suffix] = kv.value, kv.mod_revision
        if not reply.more or not reply.kvs:
            return Read(records, mods, revision)
        start = reply.kvs[-1].key + b"\0"


class StateRecords:
    """The records of one job under ``prefix``: loads a snapshot, saves one by writing what changed.

    ``written`` mirrors what etcd holds now (None: unknown, read before the next save); a master sets it
    to None whenever it starts a term, since a deposed master may have written part of a save, and
    :meth:`load` sets it to what it read."""

    def __init__(self, prefix: bytes, skip: frozenset[str]) -> None:
        self.prefix, self.skip = prefix, skip
        self.written: layout.Records | None = None
        self._root_revision = 0  # of the last save: readers may still be pinned to it
        self._compacted = 0
        #: Bytes of values put and transactions of the last save (for benchmarks and tests).
        self.last_bytes = self.last_txns = 0

    async def load(self, client: aetcd.Client) -> tuple[Snapshot | None, str | None]:
        """``(snapshot, problem)``: the stored snapshot (None: no state), or ``problem``, one line saying
        why the records do not form one. A ``state`` value of the previous release (the whole snapshot
        in one value) is returned as it is. Raises ``ValueError`` when ``state`` is not JSON."""
        now = await read_prefix(client, self.prefix, self.skip)
        # What etcd holds now, for the next save's diff: a master loads right after winning its term, so
        # its first save need not read every record again (10,000 nodes: the replies waiting on that save
        # waited for a second full read).
        self.written = now.records
        if layout.ROOT not in now.records:
            return None, None
        root = json.loads(now.records[layout.ROOT])
        schema = root.get("schema") if isinstance(root, dict) else None
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > layout.ROOT_SCHEMA:
            return None, (
                f"cannot be read: its schema version {schema} is not one this master reads "
                f"({layout.ROOT_SCHEMA} and older): run a newer elastic-master"
            )
        if not layout.is_layout(root):
            return root, None
        read = now
        root_revision = now.mods[layout.ROOT]
        if any(mod > root_revision for mod in now.mods.values()):
            try:  # a save was cut off after some of its records: read the last whole one
                read = await read_prefix(client, self.prefix, self.skip, revision=root_revision)
            except RevisionGone:
                log.warning(
                    "the state under %s holds records of an unfinished save and etcd compacted the "
                    "revision of the last whole one (%d); using the newest records",
                    self.prefix.decode(),
                    root_revision,
                )
        try:
            return layout.decode(read.records), None
        except layout.LayoutError as exc:
            return None, str(exc)
        except (ValueError, KeyError, TypeError) as exc:
            return None, f"{type(exc).__name__}: {exc}"

    async def save(self, client: aetcd.Client, snapshot: Snapshot, fence: list) -> bool:
        """Write ``snapshot``'s changed records in fenced transactions; False when the fence failed
        (nothing more is written). Transport errors propagate; ``written`` is then unknown."""
        if self.written is None:
            self.written = (await read_prefix(client, self.prefix, self.skip)).records
        new = layout.encode(snapshot)
        batches = layout.plan(self.written, new)
        self.last_bytes = sum(len(v) for batch in batches for _, v in batch if v is not None)
        self.last_txns = len(batches)
        tx = client.transactions
        old, self.written = self.written, None  # unknown until every transaction went through
        root_revision = self._root_revision
        for batch in batches:
            keys = [(self.prefix + key.encode(), value) for key, value in batch]
            ops = [tx.delete(k) if v is None else tx.put(k, v) for k, v in keys]
            ok, responses = await client.transaction(compare=fence, success=ops, failure=[])
            if not ok:
                return False
            if any(key == layout.ROOT and value is not None for key, value in batch) and responses:
                root_revision = responses[0].response_put.header.revision
        self.written = new if batches or old is None else old
        if root_revision != self._root_revision:
            await self._compact(client, previous=self._root_revision, now=root_revision)
            self._root_revision = root_revision
        return True

    async def _compact(self, client: aetcd.Client, previous: int, now: int) -> None:
        """Drop etcd's history before the previous save (a reader may still be pinned to it) once
        :data:`COMPACT_EVERY` revisions passed. Compaction is cluster-wide; a failure only waits."""
        if not previous or previous - self._compacted < COMPACT_EVERY:
            return
        try:
            await client.compact(previous)
        except aetcd.ClientError as exc:
            if "compacted" not in str(exc):
                log.info("could not compact etcd's history at revision %d: %s", previous, exc)
                return
        self._compacted = previous
