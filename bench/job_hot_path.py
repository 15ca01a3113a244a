"""The job's share of the master's hot path, in process: master CPU per steady heartbeat (request
validation, ``Job.heartbeat``, ``MasterService.changed``, reply building), per tick, per join and per wake-up
of pending long-polls, at N nodes. No sockets: the transport's share is measured by bench/control_plane.py.

A real :class:`master.service.service.MasterService` (memory store) leads a real :class:`master.job.job.Job`;
N nodes join through ``Job.join`` (``--nproc`` workers each), the round closes, every node reports its workers
running, and then every node heartbeats (``--sweeps`` times, one heartbeat interval apart) as the agent
does: ``--nproc`` workers with step, step time and compute time, the checkpointed and persisted steps.
Figures are CPU seconds of this process (``time.process_time``), medians over the sweeps, so they scale
with the node count only if the code does. Wake-ups: every node holds a ``/v1/watch`` long-poll
(``MasterService.long_poll`` with the route's probe) and one waiting node that is no member is removed
(which changes no member's answer), then a member dies (which changes every member's answer); the
figures are the probes run and the CPU until the loop is idle again. Keyed wake-ups
(``master.service.waiting``) take effect where ``MasterService.long_poll`` passes the node's id as its
ticket's key; the table says whether it does.

    python bench/job_hot_path.py --nodes 1000,10000 --json hot-path.json
    python bench/job_hot_path.py --nodes 200 --sweeps 3            # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_json_option, table, write_json  # noqa: E402
from elastic.control.job_settings import JobSettings  # noqa: E402
from elastic.control.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    CommandReply,
    HeartbeatRequest,
    JoinRequest,
    NodeState,
    WorkerProgress,
)
from master.http.wire_compat import for_client  # noqa: E402
from master.job.job import Job  # noqa: E402
from master.service.service import MasterService  # noqa: E402
from master.service.settings import ServerSettings  # noqa: E402

US = 1e6


@dataclass
class Figures:
    """One node count's figures (microseconds of CPU unless named otherwise)."""

    nodes: int
    nproc: int
    join_us: float  # per join, the whole first round (N joins, the last one closes the round)
    validate_us: float  # HeartbeatRequest.model_validate_json of the request body
    job_heartbeat_us: float  # Job.heartbeat (steady: running, progress, checkpoint steps)
    changed_us: float  # MasterService.changed() after it (and the health counter)
    reply_us: float  # master.http.wire_compat.for_client + model_dump_json of the CommandReply
    heartbeat_total_us: float  # all four, one heartbeat at a time as the server runs them, gc included
    heartbeat_gc_us: float  # of which garbage collection
    tick_us: float  # MasterService.tick (Job.tick, changed, the waiting reason) without the aggregates
    aggregate_tick_us: float  # a tick that refreshes the aggregates (every AGGREGATE_PERIOD_S)
    steady_wakes: int  # wake-ups (notifies) asked for by the sweeps' heartbeats and ticks (must be 0)
    steady_persists: int  # ... store writes asked for (durable version changes; must be 0)
    keyed_polls: bool  # whether MasterService.long_poll takes the node's key (keyed wake-ups)
    wake_other_probes: int  # watch probes run when a waiting non-member is removed
    wake_other_ms: float  # CPU milliseconds until the loop is idle again
    wake_all_probes: int  # watch probes run when a member dies (every member's answer changes)
    wake_all_ms: float
    rejoin_us: float  # per join of the round that follows (every member rejoins; the last one closes it)


def settings_for(nodes: int) -> JobSettings:
    return JobSettings(
        job_id="hot-path",
        min_nodes=nodes - 1,  # the round after one member's loss closes once every other one is back
        max_nodes=nodes,
        node_unit=1,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=30.0,
        last_call_s=60.0,  # the first round closes when the last node joins (the maximum)
    )


def node_id(i: int) -> str:
    return f"node-{i:05d}"


def join_request(i: int, nodes: int, nproc: int) -> JoinRequest:
    return JoinRequest(
        node_id=node_id(i),
        host=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}",
        nproc=nproc,
        store_port=29500,
        min_nodes=nodes - 1,
        max_nodes=nodes,
    )


def heartbeat_body(job: Job, i: int, nproc: int, step: int) -> bytes:
    """A steady heartbeat as the agent sends it (agent.executor.heartbeats.heartbeat_request),
    JSON-encoded."""
    workers = [
        WorkerProgress(local_rank=r, pid=1000 + r, step=step, step_time_s=0.2 + r * 1e-3, compute_time_s=0.15)
        for r in range(nproc)
    ]
    req = HeartbeatRequest(
        node_id=node_id(i),
        round=job.rdzv.round,
        term=job.round_term,
        state=NodeState.RUNNING,
        workers=workers,
        ckpt_step=step - step % 5,
        persisted_step=step - step % 10,
        workers_started_age_s=30.0 + step,
        first_step_age_s=25.0 + step,
    )
    return req.model_dump_json(exclude_defaults=True).encode()


class World:
    """A leading service, its job of ``nodes`` running nodes, and each node's secret."""

    def __init__(self, nodes: int, nproc: int) -> None:
        self.nodes, self.nproc = nodes, nproc
        self.now = 1.0
        settings = ServerSettings(job=settings_for(nodes), token="t")
        self.service = MasterService(settings, clock=lambda: self.now)
        self.job = self.service.job = Job(self.service.settings.job, 0.0, "bench", term=1)
        self.secrets: dict[str, str] = {}
        self.wakes = self.persists = 0  # the wake-ups and store writes the service was asked for
        self._version = self.job.version
        notifier = self.service.notifier
        notify = notifier.notify

        def counted(*keys: object) -> None:
            self.wakes += 1
            notify(*keys)

        notifier.notify = counted  # type: ignore[method-assign]

    def mutate(self, action: Callable[[], object]) -> object:
        try:
            return action()
        finally:
            self.changed()

    def changed(self) -> None:
        """``MasterService.changed()``, counting a store write when durable state changed."""
        self.service.changed()
        self._count_persist()

    def tick(self) -> None:
        """``MasterService.tick()`` (the job's tick, its effects, the waiting reason), counted likewise."""
        self.service.tick()
        self._count_persist()

    def _count_persist(self) -> None:
        if self.job.version != self._version:
            self.persists += 1
            self._version = self.job.version

    def join_all(self) -> float:
        """Every node joins; CPU seconds per join."""
        began = time.process_time()
        for i in range(self.nodes):
            reply = self.mutate(lambda i=i: self.job.join(join_request(i, self.nodes, self.nproc), self.now))
            self.secrets[node_id(i)] = reply.node_secret
        return (time.process_time() - began) / self.nodes

    def heartbeat(self, body: bytes) -> CommandReply:
        req = HeartbeatRequest.model_validate_json(body)
        return self.job.heartbeat(req, self.now, self.secrets[req.node_id])


def measure_heartbeats(world: World, sweeps: int) -> dict[str, float]:
    """Median CPU per stage over ``sweeps`` sweeps of one heartbeat per node. Each stage runs over every
    node in a loop of its own (a clock read per call would cost about as much as some stages)."""
    job, service, nproc, n = world.job, world.service, world.nproc, world.nodes
    stages: dict[str, list[float]] = {
        "validate": [],
        "job": [],
        "changed": [],
        "reply": [],
        "steady": [],
        "gc": [],
    }
    clock = time.process_time
    for sweep in range(sweeps):
        world.now += 1.0
        now = world.now
        bodies = [heartbeat_body(job, i, nproc, 100 + sweep) for i in range(n)]
        secrets = [world.secrets[node_id(i)] for i in range(n)]
        gc.collect()
        with GcTimer() as steady:  # as the server runs them: one request at a time, all stages
            began = clock()
            for body, secret in zip(bodies, secrets, strict=True):
                reply = job.heartbeat(HeartbeatRequest.model_validate_json(body), now, secret)
                service.health.heartbeat(now)
                world.changed()
                for_client(reply, PROTOCOL_VERSION).model_dump_json()
            stages["steady"].append((clock() - began) / n * US)
        stages["gc"].append(steady.seconds / n * US)
        gc.disable()  # below, each stage over all nodes: their objects would trigger collections
        t0 = clock()
        reqs = [HeartbeatRequest.model_validate_json(body) for body in bodies]
        t1 = clock()
        replies = []
        for req, secret in zip(reqs, secrets, strict=True):  # what the route does: record, then changed()
            replies.append(job.heartbeat(req, now, secret))
            service.health.heartbeat(now)
            world.changed()
        t2 = clock()
        for _ in range(n):  # changed() alone (nothing changed), to split the loop above
            service.health.heartbeat(now)
            world.changed()
        t3 = clock()
        for reply in replies:
            for_client(reply, PROTOCOL_VERSION).model_dump_json()
        t4 = clock()
        del reqs, replies  # else the next sweep's heartbeats keep objects alive that the server frees
        gc.enable()
        world.tick()  # a tick a (fake) second: a longer gap would be a stall of the master's own
        changed = t3 - t2
        split = ("validate", "job", "changed", "reply")
        for key, total in zip(split, (t1 - t0, t2 - t1 - changed, changed, t4 - t3), strict=True):
            stages[key].append(total / n * US)
    return {key: statistics.median(values) for key, values in stages.items()}


class GcTimer:
    """CPU seconds the garbage collector ran inside the ``with`` block (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.process_time()
        else:
            self.seconds += time.process_time() - self._began

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def measure_ticks(world: World, ticks: int) -> tuple[float, float]:
    """Median CPU of a plain tick and of a tick that refreshes the aggregates."""
    plain, aggregate = [], []
    job = world.job
    for _ in range(ticks):
        world.now += 0.1
        refresh = world.now - job.aggregates_at >= 0.5
        began = time.process_time()
        world.tick()
        (aggregate if refresh else plain).append((time.process_time() - began) * US)
    return statistics.median(plain), statistics.median(aggregate)


async def measure_wakeups(world: World) -> tuple[bool, int, float, int, float]:
    """Every node long-polls /v1/watch; probes run and CPU when a waiting non-member is removed, then when a
    member dies."""
    job, service = world.job, world.service
    probes = 0

    def watch_probe(node: str, round_: int, term: int) -> Callable[[], CommandReply | None]:
        def probe() -> CommandReply | None:
            nonlocal probes
            probes += 1
            reply = job.watch(node, round_, world.secrets[node], term)
            return None if reply.command.value == "continue" else reply

        return probe

    # Keyed wake-ups need the poll to say whose answer it waits for (master.service.waiting).
    keyed = "key" in inspect.signature(service.long_poll).parameters
    polls = [
        asyncio.ensure_future(
            service.long_poll(
                watch_probe(node_id(i), job.rdzv.round, job.round_term),
                30.0,
                **({"key": node_id(i)} if keyed else {}),
            )
        )
        for i in range(world.nodes)
    ]
    await settle()
    extra = join_request(0, world.nodes, 1).model_copy(update={"node_id": "waiting-1", "host": "10.99.0.1"})
    reply = world.mutate(lambda: job.join(extra, world.now))
    world.secrets["waiting-1"] = reply.node_secret

    async def after(change: Callable[[], object]) -> tuple[int, float]:
        nonlocal probes
        await settle()
        probes = 0
        began = time.process_time()
        world.mutate(change)
        await settle()
        return probes, (time.process_time() - began) * 1e3

    other = await after(lambda: job.leave("waiting-1", "bench", world.now, world.secrets["waiting-1"]))
    member = node_id(world.nodes - 1)
    everyone = await after(lambda: job.leave(member, "bench", world.now, world.secrets[member]))
    for poll in polls:
        poll.cancel()
    await asyncio.gather(*polls, return_exceptions=True)
    return keyed, other[0], other[1], everyone[0], everyone[1]


async def settle() -> None:
    """Run the loop until no callback is ready (every woken long-poll has probed and waits again)."""
    loop = asyncio.get_running_loop()
    for _ in range(100):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined] - CPython's ready queue: idle when empty
            return


def measure_rejoins(world: World) -> float:
    """CPU per join while every member of the broken round rejoins (the round closes at the last)."""
    job, members = world.job, [n for n in world.job.rdzv.current.members if n in world.job.nodes]
    world.now += 1.0
    began = time.process_time()
    for node in members:
        index = int(node.rsplit("-", 1)[1])
        req = join_request(index, world.nodes, world.nproc)
        world.mutate(lambda req=req, node=node: job.join(req, world.now, world.secrets[node]))
    spent = time.process_time() - began
    assert job.rdzv.phase.value == "active", "the rejoin round did not close"
    return spent / len(members) * US


def run(nodes: int, nproc: int, sweeps: int, ticks: int) -> Figures:
    world = World(nodes, nproc)
    join_us = world.join_all() * US
    world.tick()
    assert world.job.rdzv.is_member(node_id(0)), "the round did not close"
    for i in range(nodes):  # first reports: workers started and stepping
        world.mutate(lambda i=i: world.heartbeat(heartbeat_body(world.job, i, nproc, 1)))
    world.now += 0.6
    world.tick()
    world.wakes = world.persists = 0
    stages = measure_heartbeats(world, sweeps)
    tick_us, aggregate_us = measure_ticks(world, ticks)
    steady_wakes, steady_persists = world.wakes, world.persists
    wakes = asyncio.run(measure_wakeups(world))
    rejoin_us = measure_rejoins(world)
    return Figures(
        nodes=nodes,
        nproc=nproc,
        join_us=join_us,
        validate_us=stages["validate"],
        job_heartbeat_us=stages["job"],
        changed_us=stages["changed"],
        reply_us=stages["reply"],
        heartbeat_total_us=stages["steady"],
        heartbeat_gc_us=stages["gc"],
        tick_us=tick_us,
        aggregate_tick_us=aggregate_us,
        steady_wakes=steady_wakes,
        steady_persists=steady_persists,
        keyed_polls=wakes[0],
        wake_other_probes=wakes[1],
        wake_other_ms=wakes[2],
        wake_all_probes=wakes[3],
        wake_all_ms=wakes[4],
        rejoin_us=rejoin_us,
    )


def report(rows: list[Figures]) -> str:
    headers = ["figure", *(f"{r.nodes:,} nodes" for r in rows)]
    lines = [
        ("join, per join (µs)", "join_us"),
        ("heartbeat: validate request (µs, gc off)", "validate_us"),
        ("heartbeat: Job.heartbeat (µs)", "job_heartbeat_us"),
        ("heartbeat: changed() (µs)", "changed_us"),
        ("heartbeat: reply for_client + dump (µs)", "reply_us"),
        ("heartbeat: the job's share in all, gc included (µs)", "heartbeat_total_us"),
        ("heartbeat: of which garbage collection (µs)", "heartbeat_gc_us"),
        ("tick (µs)", "tick_us"),
        ("tick with aggregates (µs)", "aggregate_tick_us"),
        ("steady heartbeats/ticks that woke long-polls", "steady_wakes"),
        ("steady heartbeats/ticks that persisted", "steady_persists"),
        ("long-polls keyed by node", "keyed_polls"),
        ("waiting non-member removed: probes run", "wake_other_probes"),
        ("waiting non-member removed: CPU (ms)", "wake_other_ms"),
        ("member dies: probes run", "wake_all_probes"),
        ("member dies: CPU (ms)", "wake_all_ms"),
        ("rejoin round, per join (µs)", "rejoin_us"),
    ]

    def cell(value: float | int | bool) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"

    return table(headers, [(name, *(cell(getattr(r, key)) for r in rows)) for name, key in lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1000,10000", help="comma-separated node counts (default 1000,10000)")
    p.add_argument("--nproc", type=int, default=8, help="workers per node in each heartbeat (default 8)")
    p.add_argument("--sweeps", type=int, default=5, help="heartbeats per node measured (default 5)")
    p.add_argument("--ticks", type=int, default=40, help="ticks measured (default 40)")
    add_json_option(p)
    args = p.parse_args(argv)
    rows = [run(int(n), args.nproc, args.sweeps, args.ticks) for n in args.nodes.split(",")]
    print(report(rows))
    write_json(args, "job_hot_path", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
