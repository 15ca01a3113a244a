"""Node liveness and identity, pure: who is alive (last heartbeat per node, dead verdicts at ``now``), and
which agent may speak for a node id (its incarnation's secret).

**Liveness** (:class:`Liveness`): last heartbeat per node, dead verdicts at ``now``.

**Self-suspicion** (:func:`silent_at_once`, :class:`SelfSuspicion`): a leader that stops hearing from most of
its running round at once suspects its own network and holds the verdicts (master.service.service resigns).

**Credentials**: one secret per node *incarnation* (one agent process's life under a node id).

A join that starts an incarnation gets a fresh random secret (:func:`new_secret`); the master keeps only
its hash (:func:`hash_secret`, stored with the job's durable state so that it survives a failover), and
every later request for the node must carry the secret (:func:`matches`). The token lets a process into
the job; the secret binds a node id to the one agent that holds it, so that no other token holder can
report that node's failure, heartbeat for it or make it leave.

:func:`judge_join` is the whole decision about a join for a node id: pure, on facts the job computes at
``now`` (whether the current incarnation is alive), tested without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Collection, Container, Iterable, Mapping
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic.control.job_settings import JobSettings
    from master.job.rendezvous import ClosedRound

#: A takeover's grace lasts while the nodes the new leader inherited keep coming back (see
#: :meth:`Liveness.grant_grace`), but never more than this many heartbeat timeouts after the takeover.
GRACE_CAP_TIMEOUTS = 3.0


class Liveness:
    """Tracks when each node was last heard from.

    A node is dead when nothing was heard from it for ``timeout_s``, or, once :meth:`suspect` was called
    for it, when nothing was heard from it by the earlier deadline given there. :meth:`grant_grace` pushes
    every deadline out, which a master that just took over uses so that nodes are not declared dead for
    heartbeats they sent while no master was listening.

    The tick asks for verdicts ten times a second, so :meth:`dead` costs O(overdue + suspects), not
    O(nodes): last heartbeats are kept in the order they came, which is the order of their times (the
    master's clock is monotonic), so the overdue nodes are a prefix. A clock that reads earlier than a
    previous beat (fake clocks in tests) makes the next :meth:`dead` scan every node and sort them once.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: OrderedDict[str, float] = OrderedDict()  # oldest heartbeat first (see above)
        self._in_order = True  # whether _last_seen's order is that of its times
        self._suspect_until: dict[str, float] = {}
        self._suspect_why: dict[str, str] = {}  # what the suspicion of a node rests on (for its verdict)
        self._grace_until = self._grace_cap = float("-inf")
        #: Nodes inherited by a takeover and not heard from since (while its grace lasts).
        self._awaited: set[str] = set()
        #: Seconds a node's last heartbeat was moved later by :meth:`excuse` (its true age stays known).
        self._excused: dict[str, float] = {}

    def beat(self, node_id: str, now: float) -> None:
        seen = self._last_seen
        if seen and self._in_order and now < next(reversed(seen.values())):
            self._in_order = False
        seen[node_id] = now
        seen.move_to_end(node_id)
        if self._suspect_until:
            self._suspect_until.pop(node_id, None)
            self._suspect_why.pop(node_id, None)
        if self._excused:
            self._excused.pop(node_id, None)
        if self._awaited and node_id in self._awaited:
            self._awaited.discard(node_id)
            if now < self._grace_until:  # the reconnect wave goes on: so does the grace
                self._grace_until = min(max(self._grace_until, now + self.timeout_s), self._grace_cap)

    def forget(self, node_id: str) -> None:
        self._last_seen.pop(node_id, None)
        self._suspect_until.pop(node_id, None)
        self._suspect_why.pop(node_id, None)
        self._excused.pop(node_id, None)
        self._awaited.discard(node_id)

    def suspect(
        self, node_id: str, now: float, within_s: float, why: str = "after closing its connection"
    ) -> None:
        """Dead at ``now + within_s`` (if that is earlier than its timeout) unless it beats before; ``why``
        (the first one given) ends its dead verdict's line."""
        if node_id in self._last_seen:
            deadline = min(now + within_s, self._last_seen[node_id] + self.timeout_s)
            self._suspect_until[node_id] = min(deadline, self._suspect_until.get(node_id, deadline))
            self._suspect_why.setdefault(node_id, why)

    def suspected(self, node_id: str) -> bool:
        return node_id in self._suspect_until

    def suspicion(self, node_id: str) -> str:
        """What the suspicion of ``node_id`` rests on (``""``: none)."""
        return self._suspect_why.get(node_id, "")

    def knows(self, node_id: str) -> bool:
        return node_id in self._last_seen

    def alive(self, node_id: str, now: float) -> bool:
        """Heard from within the timeout (any time during a takeover's grace), and its connection not seen
        to close since: an agent that another one may not replace."""
        seen = self._last_seen.get(node_id)
        if seen is None or node_id in self._suspect_until:
            return False
        return now < self._grace_until or now - seen <= self.timeout_s

    def age(self, node_id: str, now: float) -> float | None:
        """Time since the node's last heartbeat (its true age, whatever :meth:`excuse` moved)."""
        seen = self._last_seen.get(node_id)
        return None if seen is None else max(0.0, now - seen + self._excused.get(node_id, 0.0))

    def grant_grace(self, now: float) -> None:
        """No dead verdict before ``now + timeout``, and every node counts as just seen.

        The grace goes on while the nodes known at ``now`` come back: the first heartbeat of each after
        ``now`` extends it to that heartbeat plus the timeout (at most ``GRACE_CAP_TIMEOUTS`` timeouts
        after ``now``). A new leader of thousands of nodes meets them all reconnecting at once and may
        need longer than one timeout to hear each; a node that really died is declared at most one
        timeout after the last of the others came back.
        """
        self._grace_until = now + self.timeout_s
        self._grace_cap = now + GRACE_CAP_TIMEOUTS * self.timeout_s
        self._awaited = set(self._last_seen)
        self._suspect_until.clear()
        self._suspect_why.clear()
        self._excused.clear()
        for node_id in self._last_seen:
            self._last_seen[node_id] = now
        self._in_order = True  # all equal

    def hold(self, now: float) -> None:
        """No dead verdict before ``now + timeout`` (a leader that suspects itself: see
        :func:`silent_at_once`); unlike :meth:`grant_grace`, every heartbeat keeps its true age, so the
        verdicts at the end name it."""
        self._grace_until = max(self._grace_until, now + self.timeout_s)
        self._grace_cap = max(self._grace_cap, self._grace_until)

    def holding(self, now: float) -> bool:
        """Whether verdicts are held now (a takeover's grace, or a leader that suspects itself)."""
        return now < self._grace_until

    def quiet(self, now: float, older_than_s: float) -> dict[str, float]:
        """The nodes not heard from for more than ``older_than_s``, with their heartbeat ages (as the
        verdicts count them); O(quiet nodes): a prefix of the heartbeat order. Call after :meth:`dead`
        (which restores that order)."""
        quiet = {}
        for n, seen in self._last_seen.items():
            if now - seen <= older_than_s:
                break
            quiet[n] = now - seen
        return quiet

    def excuse(self, seconds: float) -> None:
        """The master itself was stalled for ``seconds`` (heartbeats waited unread in its sockets): every
        node's last heartbeat and suspicion deadline move that much later (order unchanged). O(nodes), for
        a rare event."""
        excused = self._excused
        for node_id, seen in self._last_seen.items():
            self._last_seen[node_id] = seen + seconds
            excused[node_id] = excused.get(node_id, 0.0) + seconds
        for node_id, until in self._suspect_until.items():
            self._suspect_until[node_id] = until + seconds

    def dead(self, now: float) -> list[str]:
        """Nodes whose last heartbeat is older than the timeout, or past their suspicion deadline; oldest
        heartbeat first."""
        if now < self._grace_until:
            return []
        if self._awaited:
            self._awaited = set()  # the grace is over
        if not self._in_order:
            self._last_seen = OrderedDict(sorted(self._last_seen.items(), key=lambda item: item[1]))
            self._in_order = True
        overdue = []
        for n, seen in self._last_seen.items():  # oldest first: stop at the first one in time
            if now - seen <= self.timeout_s:
                break
            overdue.append((seen, n))
        for n, until in self._suspect_until.items():
            seen = self._last_seen[n]
            if now > until and now - seen <= self.timeout_s:  # (else listed above already)
                overdue.append((seen, n))
        overdue.sort()  # few (the overdue ones), ties by node id
        return [n for _, n in overdue]


#: A node not heard from for this many heartbeat intervals counts as silent for :func:`silent_at_once`
#: and :func:`corroborated` (a live agent beats every interval: two missed beats in a row).
SILENT_INTERVALS = 2.0


def corroborated(
    liveness: Liveness,
    members: Iterable[str],
    reporter: str,
    now: float,
    closed: bool,
    stall_interval_s: float | None,
) -> list[tuple[str, str]]:
    """The members other than ``reporter`` that its failure report makes dead at once, each with why
    (DESIGN.md, liveness corroboration): with ``closed``, those whose connection to the master closed; for
    a stall (a hang report: a collective that waits; ``stall_interval_s``, the heartbeat interval), those
    not suspected already and not heard from for :data:`SILENT_INTERVALS` intervals. A partitioned or
    frozen node stops talking to its peers and to the master alike: its peers' stall and its silence
    together name it, seconds before its heartbeat timeout, where the stall alone named a survivor as
    hung. Nothing while the master holds its verdicts."""
    if liveness.holding(now):
        return []
    found = []
    for member in members:
        if member == reporter:
            continue
        if liveness.suspected(member):
            if closed:
                found.append((member, "closed its connection to the master"))
            continue
        age = liveness.age(member, now) if stall_interval_s is not None else None
        if age is not None and stall_interval_s is not None and age > SILENT_INTERVALS * stall_interval_s:
            found.append(
                (member, f"was silent for {age:.1f}s")
            )  # (the verdict says "while its peers stalled")
    return found


#: The fewest silent nodes that make a leader suspect itself: the loss of a single node is believed.
MIN_SILENT = 2


def silent_at_once(
    quiet: Mapping[str, float],
    due: Collection[str],
    corroborated: Container[str],
    membership: int,
    interval_s: float,
) -> frozenset[str]:
    """The self-suspicion rule: the members a leader has stopped hearing from together, when they are most
    of the membership; else the empty set (believe the verdicts).

    ``quiet``: heartbeat ages of the running round's members, at least of those older than
    :data:`SILENT_INTERVALS` heartbeat intervals (a member left out was heard recently); ``due``: the members
    whose dead verdict is due now; ``corroborated``: members whose master connection was seen to close (a
    FIN or RST reached this master, so its network works: their loss is believed and never counts as
    silence); ``membership``: how many members the round has; ``interval_s``: the heartbeat interval. A
    member is silent when it is due or older than :data:`SILENT_INTERVALS` intervals (two missed beats).

    Why: a leader cut off from every agent (but not from etcd) hears nothing from anyone, while the agents,
    failing over, are heard by the standby. Independent failures take nodes one at a time; most of the
    membership going quiet within the same heartbeat timeout is more likely this master's own network. Pure:
    the caller decides what the suspicion costs (:meth:`master.job.job.Job.tick`)."""
    if not due:
        return frozenset()
    limit = SILENT_INTERVALS * interval_s
    silent = frozenset(n for n in (*quiet, *due) if (n in due or quiet[n] > limit) and n not in corroborated)
    if len(silent) < MIN_SILENT or 2 * len(silent) <= membership:
        return frozenset()
    return silent


class SelfSuspicion:
    """A leader's self-suspicion (:func:`silent_at_once`) over the running round, once per incident.

    :attr:`incident`, durable (stored with the job): the silent members of the current incident. While it
    is not empty the rule does not fire again: a leader that restored it (it took over after its
    predecessor resigned over those nodes) or that held its own verdicts for one heartbeat timeout declares
    the nodes still silent dead. It empties as its nodes are heard from again or removed.
    :attr:`resign_wanted` (soft) asks the server to resign its leadership (master.service.service)."""

    def __init__(self) -> None:
        self.incident: set[str] = set()
        self.resign_wanted = False
        self._ended = False  # the incident ended since the last settle()

    def judge(
        self,
        liveness: Liveness,
        due: list[str],
        active: ClosedRound | None,
        settings: JobSettings,
        now: float,
    ) -> str | None:
        """When the dead verdicts ``due`` now make this master suspect itself (the running round ``active``
        has most of its members silent): the event's message; every verdict is then held for one heartbeat
        timeout and :attr:`resign_wanted` is set. Else None (believe them). O(quiet nodes)."""
        if self.incident or active is None:
            return None  # once per incident; a mass silence matters where it would restart a running world
        interval, members = settings.heartbeat_interval_s, len(active.members)
        quiet = liveness.quiet(now, SILENT_INTERVALS * interval)
        silent = silent_at_once(
            {n: age for n, age in quiet.items() if active.has(n)},
            [n for n in due if active.has(n)],
            liveness._suspect_until,  # closed connections: the same module's record
            members,
            interval,
        )
        if not silent:
            return None
        self.incident, self.resign_wanted = set(silent), True
        liveness.hold(now)
        return (
            f"the master heard nothing from {len(silent)} of {members} nodes at once; suspecting its own "
            f"network, it holds their dead verdicts for {settings.heartbeat_timeout_s:g}s and resigns its "
            "leadership where a standby can take over"
        )

    def data(self) -> dict[str, list[str]]:
        """The suspicion event's data: the incident's nodes."""
        return {"silent": sorted(self.incident)}

    def heard(self, node_id: str) -> None:
        """A node was heard from (a heartbeat, a join): it is silent no more. O(1)."""
        if self.incident and node_id in self.incident:
            self.incident.discard(node_id)
            self._ended = not self.incident

    def settle(self, liveness: Liveness) -> bool:
        """Drop the incident's nodes no longer watched (declared dead, left, finished); True once when the
        incident ended since the last call (a durable change)."""
        if self.incident:
            self.incident = {n for n in self.incident if liveness.knows(n)}
            self._ended = self._ended or not self.incident
        ended, self._ended = self._ended, False
        return ended

    def restore(self, silent: Iterable[str], nodes: Container[str]) -> None:
        """The stored incident (a successor of a master that resigned over these nodes declares them dead
        after its grace, instead of resigning in turn)."""
        self.incident = {n for n in silent if n in nodes}


#: Random bytes of a secret (``secrets.token_urlsafe``: 43 URL-safe characters).
SECRET_BYTES = 32


class JoinKind(Enum):
    """What a join for a node id is, given the node's current incarnation."""

    NEW = "new"  # no incarnation of this id (never joined, or declared dead, left, excluded): a new secret
    REJOIN = "rejoin"  # the current incarnation's own agent (it sent its secret): the secret stays
    REPLACE = "replace"  # the current incarnation closed its master connection or went silent: a new secret
    DUPLICATE = "duplicate"  # another live agent holds this id: refused (409 duplicate_node)


#: The length bounds of a secret a join names for its new incarnation (:func:`incarnation_secret`): at least
#: as long as :func:`new_secret`'s, so that it is as hard to guess.
NAMED_SECRET_CHARS = (43, 256)


def new_secret() -> str:
    """A fresh secret for a new incarnation."""
    return secrets.token_urlsafe(SECRET_BYTES)


def incarnation_secret(kind: JoinKind, sent: str | None) -> str:
    """The secret of the incarnation a join of ``kind`` leaves, given the one it carried (``sent``).

    A rejoin keeps its secret. A new incarnation (NEW, REPLACE) takes the secret its join names when it is
    long enough, else a fresh one: the agent names its secret, so a join is idempotent. A join whose reply
    was lost (a partition that heals mid-call, a timed-out attempt whose request arrived late) is retried
    with the same secret, and that retry is then the new incarnation's rejoin, not a duplicate of itself;
    the agent's other requests in flight meanwhile carry that secret too. A different agent holds another
    secret, so a live node's id stays refused to it (DUPLICATE, 403 on its other requests)."""
    if kind is JoinKind.DUPLICATE:
        raise ValueError("a duplicate join starts no incarnation")
    low, high = NAMED_SECRET_CHARS
    if sent and (kind is JoinKind.REJOIN or low <= len(sent) <= high):
        return sent
    return new_secret()


def hash_secret(secret: str) -> str:
    """What the master stores instead of the secret: its SHA-256, hex. A secret has 256 random bits, so
    a plain (unsalted, fast) hash is enough: there is nothing to guess a dictionary for."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret_hash: str, secret: str | None) -> bool:
    """Whether ``secret`` is the one whose hash is ``secret_hash`` (constant-time comparison). A missing
    secret, or a node with no stored hash, never matches."""
    if not secret or not secret_hash:
        return False
    return hmac.compare_digest(hash_secret(secret), secret_hash)


def check_secret(
    secret_hash: str, verified: tuple[str, bytes] | None, secret: str | None
) -> tuple[str, bytes] | None:
    """The node's proof of ``secret`` when it is the secret of the incarnation hashed ``secret_hash``, else
    None. ``verified`` is the proof an earlier request of the node left (``NodeInfo.verified``): a secret
    already checked for this incarnation is compared, not hashed again (a heartbeat's hot path)."""
    if not secret:
        return None
    if (
        verified is not None
        and verified[0] == secret_hash
        and hmac.compare_digest(verified[1], secret.encode())
    ):
        return verified
    return (secret_hash, secret.encode()) if matches(secret_hash, secret) else None


def judge_join(current_hash: str | None, alive: bool, secret: str | None) -> JoinKind:
    """Decide a join for a node id.

    ``current_hash``: the stored hash of the id's current incarnation, None when there is none. ``alive``:
    whether that incarnation is alive at the join's time: heard from within the heartbeat timeout, its
    master connection not seen to close, not declared dead and not gone. ``secret``: what the join sent in
    ``X-Elastic-Node-Secret`` (None: nothing).
    """
    if current_hash is None:
        return JoinKind.NEW  # nobody holds the id
    if matches(current_hash, secret):
        return JoinKind.REJOIN  # the same agent, e.g. after its workers failed
    if alive:
        return JoinKind.DUPLICATE  # a second agent under a live agent's id: never take over a live node
    return JoinKind.REPLACE  # the previous agent is gone (or as good as): its restart takes the id over
