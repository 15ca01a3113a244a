"""The heartbeats of one load-generator process (bench/fake_fleet.py): every node's beats from ONE timer and
reply callbacks, not a coroutine, sleep or task per beat, so that the load generator stays cheap.

Each node beats on a fixed schedule (a random phase, a small jitter per beat). A beat that falls due while
the node's previous one is unanswered is skipped, as the agent's single heartbeat thread would: it counts as
offered, not sent; so is one due while the node waits the ``retry_after_s`` of a beat an overloaded master
shed (``429 busy``), as the agent's stream client waits (counted as held).

A beat goes straight onto the node's open connection; when there is none, or it is lost
or answered 503 (a standby), the beat goes the slow way, :meth:`bench.fleet_wire.Link.call`, which tries
the other master addresses in turn, each once, as the agent's client does. A beat that fails there is
retried at the node's next beat (the random phases spread the retries over the interval, as the agent's
random 50-100 % of it does)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from bench.fleet_wire import HttpConn, Link, StreamConn, WireError

#: Latencies are kept as a histogram of 1 %-wide buckets: bucket = round(100 * ln(milliseconds)).
BUCKETS_PER_E = 100
#: How often the timer looks for due beats (a beat is late by at most this).
TICK_S = 0.005
#: A beat fired later than this after it was due counts as the load generator's lag.
LATE_S = 0.05
#: A beat answered later than this counts as slow, by the second it was sent (when the master stalled).
SLOW_S = 0.1


def bucket(seconds: float) -> int:
    return round(BUCKETS_PER_E * math.log(max(seconds * 1e3, 1e-3)))


def quantile(hist: dict[int, int], q: float) -> float | None:
    """The ``q`` quantile, in milliseconds, of a histogram of :func:`bucket` counts."""
    total = sum(hist.values())
    if not total:
        return None
    seen = 0
    for key in sorted(hist):
        seen += hist[key]
        if seen >= q * total:
            return math.exp(key / BUCKETS_PER_E)
    return None


@dataclass
class Window:
    """Heartbeats whose send time falls in ``[t0, t1)``."""

    t0: float = math.inf
    t1: float = math.inf
    offered: int = 0  # beats due in the window (sent, or skipped while the previous one was unanswered)
    sent: int = 0
    served: int = 0  # answered 200
    statuses: Counter = field(default_factory=Counter)  # other answers ("lost": no master answered)
    hist: Counter = field(default_factory=Counter)
    cpu: list[float] = field(default_factory=list)  # the process's CPU seconds at t0 and t1
    slow: Counter = field(default_factory=Counter)  # send second (epoch) -> beats answered after SLOW_S
    late: int = 0  # beats this process fired more than LATE_S after they were due (its own lag)
    late_max: float = 0.0
    held: int = 0  # beats not sent: the node waited the retry_after_s of a shed beat


class Beating(Protocol):
    """What a node shows the heartbeat timer."""

    beat: bytes  # the heartbeat call, encoded (Link.encode)
    beating: bool  # a beat is in flight
    must_rejoin: bool  # set when the master forgot the node (404) or says "rejoin"
    running: bool  # holds an assignment
    back_at: float | None  # first beat answered 200 after the failover mark
    hold_until: float  # no beat before this time: an overloaded master's retry_after_s (a shed beat)


class Beats:
    """Every node's heartbeats in this process."""

    def __init__(self, interval: float, jitter: float) -> None:
        self.interval, self.jitter = interval, jitter * interval
        self.heap: list[tuple[float, int, Any, Link]] = []
        self.seq = itertools.count()
        self.window = Window()
        self.failover_at: float | None = None
        self.samples: dict[str, str] = {}  # "heartbeat: status" -> the first such reply
        self.commands: Counter = Counter()  # heartbeat replies whose command was not "continue"
        self._slow_tasks: set[asyncio.Task] = set()

    def add(self, node: Beating, link: Link) -> None:
        """Start beating for ``node``, at a random phase."""
        due = time.time() + random.uniform(0, self.interval)
        heapq.heappush(self.heap, (due, next(self.seq), node, link))

    async def run(self) -> None:
        heap, seq = self.heap, self.seq
        while True:
            now = time.time()
            while heap and heap[0][0] <= now:
                due, _, node, link = heapq.heappop(heap)
                self._fire(node, link, now, now - due)
                nxt = due + self.interval + random.uniform(-self.jitter, self.jitter)
                if nxt <= now:  # this process fell a whole interval behind: never fire a node twice at once
                    nxt = now + self.interval
                heapq.heappush(heap, (nxt, next(seq), node, link))
            await asyncio.sleep(TICK_S)

    def _fire(self, node: Beating, link: Link, now: float, late: float) -> None:
        w = self.window
        counted = w if w.t0 <= now < w.t1 else None
        if counted:
            w.offered += 1
            w.late_max = max(w.late_max, late)
            w.late += late > LATE_S
        if node.beating:
            return
        if now < node.hold_until:  # the master shed its last beat and asked it to wait (as the agent does)
            if counted:
                w.held += 1
            return
        node.beating = True
        if counted:
            w.sent += 1
        beat = _Beat(node, link, node.beat, now, time.perf_counter(), counted)
        conn = link.ready("heartbeat")
        if conn is not None:
            try:
                fut = conn.send(beat.data)
            except WireError:
                pass
            else:
                fut.add_done_callback(partial(self._answered, beat, conn))
                return
        self._slow(beat)

    def _answered(self, beat: _Beat, conn: StreamConn | HttpConn, fut: asyncio.Future) -> None:
        role = beat.link.role("heartbeat")
        if fut.cancelled() or fut.exception() is not None:
            beat.link.drop(role, conn)
            self._slow(beat, tried=1)  # the agent's client tries the next address at once
            return
        if fut.result()[0] == 503:  # a standby: the next address, keeping the stream to this one
            beat.link.skip(role, conn)
            self._slow(beat, tried=1)
            return
        self._record(beat, *fut.result())

    def _slow(self, beat: _Beat, tried: int = 0) -> None:
        """Send ``beat`` the slow way, to each address not ``tried`` yet (the agent's client tries each
        address once a call)."""
        task = asyncio.create_task(self._call(beat, tried))
        self._slow_tasks.add(task)
        task.add_done_callback(self._slow_tasks.discard)

    async def _call(self, beat: _Beat, tried: int) -> None:
        try:
            status, reply = await beat.link.call("heartbeat", encoded=beat.data, tried=tried)
        except WireError as exc:
            status, reply = "lost", str(exc)
        self._record(beat, status, reply)

    def _record(self, beat: _Beat, status: Any, reply: Any) -> None:
        node, w = beat.node, beat.window
        node.beating = False
        ok = status == 200
        if ok and self.failover_at is not None and node.back_at is None and beat.sent >= self.failover_at:
            node.back_at = time.time()
        # A verdict on this node counts only if it still is the incarnation and state that beat reported
        # (not a reply that arrives after the node joined again).
        current = node.beat is beat.data
        if not ok:
            self.samples.setdefault(f"heartbeat: {status}", str(reply)[:300])
            if (
                status == 429
                and isinstance(reply, dict)
                and isinstance(reply.get("retry_after_s"), (int, float))
            ):
                node.hold_until = time.time() + reply["retry_after_s"]  # shed: wait, as the agent does
            node.must_rejoin = node.must_rejoin or (current and status == 404)  # unknown_node: join again
        elif (command := reply.get("command") if isinstance(reply, dict) else reply) != "continue":
            self.commands[f"heartbeat: {command}"] += 1  # the master wants something of this node
            # Like the agent, only a node whose workers run acts on a command (a waiting one is joining).
            node.must_rejoin = node.must_rejoin or (current and node.running and command == "rejoin")
        if w is not None:
            if ok:
                w.served += 1
                took = time.perf_counter() - beat.t
                w.hist[bucket(took)] += 1
                if took > SLOW_S:
                    w.slow[int(beat.sent)] += 1
            else:
                w.statuses[str(status)] += 1


class _Beat:
    """One heartbeat in flight: whose, on which link, what was sent, when, and the window counting it."""

    __slots__ = ("node", "link", "data", "sent", "t", "window")

    def __init__(self, node: Beating, link: Link, data: bytes, sent: float, t: float, window: Window | None):
        self.node, self.link, self.data, self.sent, self.t, self.window = node, link, data, sent, t, window
