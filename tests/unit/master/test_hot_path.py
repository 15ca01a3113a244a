"""The job's hot path stays O(changes), not O(nodes): what one steady heartbeat, one tick, one
dead verdict and one join of a restart round make the job do is the same at 100 and at 2,000 nodes.

Work is counted, not timed: the Python lines the job runs for one call (``sys.settrace``). A loop over the
nodes anywhere in the call (the members' list built to ask whether a node is one, a scan of every heartbeat
age for verdicts, the members still expected back listed at every join) runs lines per node, so its count
grows with the node count. A steady heartbeat also changes no durable state and wakes no long-poll.
"""

from __future__ import annotations

import gc
import json
import sys
from collections import Counter
from collections.abc import Callable

import job_calls as calls
import pytest
from job_builders import HB_TIMEOUT, beat, crash, join, make_job, running

from elastic.control.protocol import Command, HeartbeatRequest, NodeState, WorkerProgress
from master.job.flapping import FlapCounter, FlapPolicy
from master.job.job import Job
from master.job.progress import StepFloor
from master.job.rendezvous import Phase

pytestmark = pytest.mark.timeout(60)

SMALL, LARGE = 100, 2000
#: The node whose calls are counted: neither the first nor the last of either job.
PROBE = "n00050"


def ids(nodes: int) -> list[str]:
    return [f"n{i:05d}" for i in range(nodes)]


def world(nodes: int) -> Job:
    """A running job of ``nodes`` members (8 workers each) and one more node that waits (the round is full).
    Two nodes are enough for a round: the joins of a restart round all take the same path."""
    job = make_job(min_nodes=2, max_nodes=nodes, max_restarts=5)
    running(job, 0.0, *ids(nodes), nproc=8)
    join(job, 0.0, "waiting")
    return job


def steady(job: Job, node_id: str, step: int = 10) -> HeartbeatRequest:
    """What a node's agent reports while training: 8 workers' progress, checkpoints, replication."""
    workers = [
        WorkerProgress(local_rank=r, pid=100 + r, step=step, step_time_s=0.2, compute_time_s=0.1)
        for r in range(8)
    ]
    return HeartbeatRequest(
        node_id=node_id,
        round=job.rdzv.round,
        term=job.round_term,
        state=NodeState.RUNNING,
        workers=workers,
        ckpt_step=step,
        persisted_step=step,
        workers_started_age_s=5.0,
        first_step_age_s=4.0,
        replicas=2,
        replication_port=7000,
    )


def lines_run(action: Callable[[], object]) -> int:
    """The Python lines run by ``action()`` (every frame it enters, the job's and the libraries').

    The cyclic collector is run before and held off during ``action()``: a collection that falls inside
    it would run the finalizers of objects earlier tests left behind, and their lines would be counted."""
    count = 0

    def tracer(frame, event: str, arg: object):
        nonlocal count
        count += event == "line"
        return tracer

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        action()
    finally:
        sys.settrace(previous)
        if was_enabled:
            gc.enable()
    return count


def per_size(measure: Callable[[Job], int]) -> dict[int, int]:
    return {nodes: measure(world(nodes)) for nodes in (SMALL, LARGE)}


def test_a_steady_heartbeat_does_the_same_work_at_100_and_2000_nodes():
    def measure(job: Job) -> int:
        for node_id in ids(len(job.rdzv.current.members)):  # every node's first progress report
            calls.heartbeat(job, steady(job, node_id, step=1), 1.0)
        calls.heartbeat(job, steady(job, PROBE), 1.5)
        req = steady(job, PROBE, step=11)
        reply = None

        def call() -> None:
            nonlocal reply
            reply = calls.heartbeat(job, req, 2.0)
            job.take_effects()

        lines = lines_run(call)
        assert reply.command is Command.CONTINUE and len(reply.peers) == 2
        return lines

    lines = per_size(measure)
    assert lines[SMALL] == lines[LARGE], f"lines run per heartbeat by node count: {lines}"


def test_a_tick_and_a_dead_verdict_do_the_same_work_at_100_and_2000_nodes():
    """A tick between two aggregate refreshes costs O(1), and a verdict O(verdicts): the waiting node
    that stopped heartbeating is found without looking at every node's last heartbeat."""

    def measure(job: Job) -> tuple[int, int]:
        for node_id in ids(len(job.rdzv.current.members)):
            beat(job, node_id, HB_TIMEOUT - 0.5)
        job.tick(HB_TIMEOUT - 0.1)  # the aggregates are refreshed; nobody is overdue yet
        quiet = lines_run(lambda: job.tick(HB_TIMEOUT))
        assert "waiting" in job.nodes
        job.take_effects()
        verdict = lines_run(lambda: job.tick(HB_TIMEOUT + 0.1))  # "waiting" was last heard at 0.0
        assert "waiting" not in job.nodes and job.rdzv.phase is Phase.ACTIVE, "no member was lost"
        effects = job.take_effects()
        assert effects.wake_only == frozenset({"waiting"}), "only the removed node's long-polls wake"
        return quiet, verdict

    lines = per_size(measure)
    assert lines[SMALL] == lines[LARGE], f"lines run by (a quiet tick, a verdict tick): {lines}"


def test_a_join_of_a_restart_round_does_the_same_work_at_100_and_2000_nodes():
    """After a failure every member rejoins; each join must not look at every member still expected
    (the round closes once all are back: O(N) joins, not O(N^2) work)."""

    def measure(job: Job) -> int:
        beat(job, "n00000", 1.0, state=NodeState.FAILED, failure=crash())
        assert job.rdzv.phase is Phase.OPEN
        members = ids(len(job.rdzv.current.members))
        for node_id in members[:50]:
            join(job, 1.1, node_id, nproc=8)
        lines = lines_run(lambda: join(job, 1.1, PROBE, nproc=8))
        for node_id in members[51:]:
            join(job, 1.1, node_id, nproc=8)
        assert job.rdzv.phase is Phase.ACTIVE, "every member came back: the round closed"
        return lines

    lines = per_size(measure)
    assert lines[SMALL] == lines[LARGE], f"lines run per rejoin by node count: {lines}"


def test_a_steady_heartbeat_keeps_none_of_its_requests_objects():
    """Objects a heartbeat leaves alive are what the garbage collector goes through again and again: a
    10,000-node job keeping its workers' report objects would hold 170,000 of them, replaced every
    second. Counted with gc.freeze(): only objects made after it are listed by gc.get_objects()."""
    job = world(SMALL)
    members = ids(SMALL)
    for node_id in members:
        calls.heartbeat(job, steady(job, node_id, step=1), 1.0)
    job.take_effects()
    gc.collect()
    gc.freeze()
    try:
        for node_id in members:  # the same pace, the next step: what a steady heartbeat reports
            calls.heartbeat(job, steady(job, node_id, step=2), 2.0)
            job.take_effects()
        gc.collect()
        kept = Counter(type(o).__name__ for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert sum(kept.values()) < 10, f"objects kept by {SMALL} heartbeats: {kept.most_common(5)}"
    assert job.nodes[PROBE].step == 2


def test_steady_heartbeats_of_a_large_job_neither_persist_nor_wake():
    job = world(LARGE)
    members = ids(LARGE)
    for node_id in members:  # the first progress reports: the round's "every member stepped" event
        calls.heartbeat(job, steady(job, node_id, step=0), 0.5)
    job.take_effects()
    for second in range(1, 4):
        for node_id in members:
            calls.heartbeat(job, steady(job, node_id, step=second), float(second))
            effects = job.take_effects()
            assert not (effects.wake or effects.persist or effects.events), effects
        job.tick(second + 0.6)  # with the aggregates: the committed step moves, soft state only
        effects = job.take_effects()
        assert not (effects.wake or effects.persist or effects.events), effects
        assert job.committed_step == second


def test_a_tick_after_many_losses_looks_only_at_the_losses_that_leave_the_window():
    """A mass loss leaves one flap counter per node for the whole window; each tick drops the counters
    that left it without reading all the others."""

    def measure(nodes: int) -> int:
        flaps = FlapCounter(FlapPolicy(limit=3, window_s=60.0, cooldown_s=60.0))
        for i in range(5):
            flaps.note(f"early-{i}", 0.0)
        for i in range(nodes):
            flaps.note(f"n{i:05d}", 10.0 + i / nodes)
        lines = lines_run(lambda: flaps.expired(60.5))
        assert len(flaps.losses) == nodes, "the 5 early ones left the window, no other"
        return lines

    lines = {nodes: measure(nodes) for nodes in (SMALL, LARGE)}
    assert lines[SMALL] == lines[LARGE], f"lines run per tick by counters held: {lines}"


# -- the committed step's floor (master.job.progress) -----------------------------------------------------
def test_the_floor_is_the_smallest_step_once_every_member_reported_one():
    floor = StepFloor()
    floor.reset(["a", "b", "c"])
    floor.report("a", 10)
    floor.report("b", 20)
    assert floor.floor() is None, "c has not reported"
    floor.report("c", 15)
    floor.report("stranger", 1)  # not a member: ignored
    assert floor.floor() == 10
    floor.report("a", 30)  # the lowest moves up: recomputed
    assert floor.floor() == 15
    floor.report("c", 5)  # a lower report (a restored checkpoint) counts too
    assert floor.floor() == 5
    floor.report("c", 40)
    assert floor.floor() == 20
    floor.lose("stranger")
    assert floor.floor() == 20
    floor.lose("b")
    assert floor.floor() is None, "a lost member holds no step of this round any more"
    floor.reset(["a"])
    assert floor.floor() is None
    floor.report("a", 50)
    assert floor.floor() == 50


def test_the_committed_step_waits_for_every_member_and_survives_a_removal_before_it():
    job = make_job(min_nodes=2, max_nodes=3)
    running(job, 0.0, "a", "b", "c")
    for node_id, step in (("a", 5), ("b", 7)):
        calls.heartbeat(job, steady(job, node_id, step), 1.0)
    job.tick(1.0)
    assert job.committed_step is None, "c holds no checkpoint yet"
    calls.heartbeat(job, steady(job, "c", 6), 1.2)
    calls.leave(job, "c", "preempted", 1.3)  # counted before c goes: every member held step 5
    assert job.committed_step == 5
    assert job.rdzv.phase is Phase.OPEN


# -- the benchmark (bench/job_hot_path.py), a short run ---------------------------------------------------
def test_the_hot_path_benchmark_writes_its_figures(tmp_path, capsys):
    from bench import job_hot_path

    out = tmp_path / "hot.json"
    assert job_hot_path.main(["--nodes", "40,80", "--sweeps", "1", "--ticks", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"]
    assert [r["nodes"] for r in rows] == [40, 80]
    for row in rows:
        assert row["steady_wakes"] == 0 and row["steady_persists"] == 0, row
        assert row["wake_all_probes"] == row["nodes"], "a member's loss reaches every pending watch"
        assert row["heartbeat_total_us"] > 0 and row["rejoin_us"] > 0
    assert "heartbeat: the job's share in all" in capsys.readouterr().out
