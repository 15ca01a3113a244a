"""Unit tests of the health checks' pure parts: hang verdicts (agent.hang), the straggler report
(master.stragglers, and through master.job), node-check verdicts (master.node_check, and the check round
through master.job with a fake clock), the status table, and the worker-side compute-time report."""

from __future__ import annotations

import importlib
import json
import socket
import tempfile
import time
from pathlib import Path

import job_calls as calls
import psutil
import pytest

from agent.channel import ProgressChannel, RankProgress
from agent.hang import Hang, HangWatch, WorkerObservation, hung_workers
from elastic.contract import Progress
from elastic.job_settings import JobSettings, SettingsError
from elastic.protocol import (
    Command,
    HeartbeatRequest,
    JobStatus,
    JoinRequest,
    NodeCheckResult,
    NodeState,
    NodeStatus,
    WorkerProgress,
)
from master.job import Job
from master.job_errors import NodeExcludedError
from master.node_check import judge
from master.rendezvous import Phase
from master.status_view import render_status
from master.stragglers import Pace, StragglerTracker, assess, node_pace

pytestmark = pytest.mark.timeout(30)

# ``elastic.report`` is the function (``elastic`` re-exports it); the module is looked up by name.
report_module = importlib.import_module("elastic.report")

T = 10.0  # hang timeout of the verdict tests


# -- hang verdicts ------------------------------------------------------------------------------------
def obs(rank: int, step: int | None, advanced_at: float, status: str = psutil.STATUS_SLEEPING, since=None):
    return WorkerObservation(rank, step, advanced_at, status, since)


def test_a_worker_without_a_new_step_for_the_timeout_is_hung():
    hangs = hung_workers(100.0, T, [obs(0, 7, 89.0), obs(1, 7, 95.0)])

    assert [(h.local_rank, h.cause) for h in hangs] == [(0, "no_progress")]
    assert "no step for 11.0s (last step 7" in hangs[0].reason


def test_the_verdict_comes_exactly_at_the_timeout_not_before():
    assert hung_workers(99.99, T, [obs(0, 1, 90.0)]) == []
    assert len(hung_workers(100.0, T, [obs(0, 1, 90.0)])) == 1


def test_a_worker_that_never_reported_a_step_is_not_judged_on_progress():
    assert hung_workers(1e6, T, [obs(0, None, 0.0)]) == []


def test_a_stopped_worker_is_hung_after_the_timeout_even_without_steps():
    stopped = obs(0, None, 0.0, psutil.STATUS_STOPPED, since=50.0)

    assert hung_workers(59.0, T, [stopped]) == []
    (hang,) = hung_workers(60.0, T, [stopped])
    assert hang.cause == "stopped" and "stopped for 10.0s" in hang.reason


def test_disk_sleep_and_tracing_stop_count_as_stuck():
    hangs = hung_workers(
        100.0,
        T,
        [
            obs(0, None, 0.0, psutil.STATUS_DISK_SLEEP, 80.0),
            obs(1, None, 0.0, psutil.STATUS_TRACING_STOP, 85.0),
        ],
    )
    assert [(h.local_rank, h.cause) for h in hangs] == [(0, "disk_sleep"), (1, "stopped")]


def test_the_stopped_worker_is_named_first_even_before_its_own_timeout():
    # Rank 1 was SIGSTOPped; rank 0 stalled in the next all-reduce a moment earlier, so it crosses the
    # timeout first. The stopped rank is the cause and must lead the verdict.
    hangs = hung_workers(
        100.0, T, [obs(0, 12, 89.5), obs(1, 12, 90.5, psutil.STATUS_STOPPED, since=91.0), obs(2, 13, 99.0)]
    )
    assert [h.local_rank for h in hangs] == [1, 0]
    assert hangs[0].cause == "stopped" and "while its peers stalled" in hangs[0].reason


def test_the_longest_stalled_worker_leads_among_equals():
    hangs = hung_workers(100.0, T, [obs(0, 3, 85.0), obs(1, 3, 80.0), obs(2, 3, 85.0)])
    assert [h.local_rank for h in hangs] == [1, 0, 2]


def test_a_zero_timeout_turns_verdicts_off():
    assert hung_workers(1e9, 0.0, [obs(0, 1, 0.0), obs(1, None, 0.0, psutil.STATUS_STOPPED, 0.0)]) == []


def test_hang_watch_sees_a_stopped_process_and_forgets_a_continued_one(tmp_path: Path):
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        # Wait until the interpreter is up: while it loads from disk it may be in disk sleep, which the
        # watch (rightly) counts as stuck and would remember as the first sighting.
        assert child.stdout.readline().strip() == b"ready"
        watch = HangWatch(timeout_s=5.0)
        progress = {0: RankProgress(step=3, advanced_at=time.monotonic())}
        assert watch.check(time.monotonic(), progress, {0: child.pid}) == []
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # the kernel stops it asynchronously
        now = time.monotonic()
        (first,) = watch.observe(now, progress, {0: child.pid})
        assert first.status == psutil.STATUS_STOPPED and first.stuck_since == now
        # Later checks keep the first sighting: the stop is measured from there.
        (hang,) = watch.check(now + 5.0, progress, {0: child.pid})
        assert hang.cause == "stopped"
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() == psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (again,) = watch.observe(now + 6.0, progress, {0: child.pid})
        assert again.stuck_since is None
    finally:
        child.kill()
        child.wait()


def test_a_worker_that_finished_training_is_not_judged_on_progress():
    watch = HangWatch(timeout_s=1.0)
    import os

    done = RankProgress(step=9, advanced_at=0.0, done=True)
    assert watch.check(1e6, {0: done}, {0: os.getpid()}) == []
    assert isinstance(watch.check(1e6, {0: RankProgress(step=9, advanced_at=0.0)}, {0: os.getpid()})[0], Hang)


# -- progress channel and worker-side reports -----------------------------------------------------------
def wait_for(predicate, what: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # datagrams are received by the channel's own thread


def test_the_channel_keeps_compute_times_and_the_done_flag():
    channel = ProgressChannel()
    try:
        channel.reset(1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        for message in (
            {"r": 0, "k": "step", "step": 1},
            {"r": 0, "k": "step", "step": 2, "b": 0.25},
            {"r": 0, "k": "step", "step": 3, "b": 0.75},
            {"r": 0, "k": "done", "step": 3},
        ):
            sock.sendto(json.dumps(message).encode(), channel.path)
        wait_for(lambda: channel.snapshot()[0].done, "the done report")
        progress = channel.snapshot()[0]
        assert progress.step == 3 and progress.compute_time_s == 0.5
        sock.close()
    finally:
        channel.close()


def test_a_step_report_carries_the_step_time_minus_the_collective_wait(monkeypatch):
    sent: list[Progress] = []
    monkeypatch.setattr(report_module, "_send", sent.append)
    monkeypatch.setattr(report_module, "_last", None)
    monkeypatch.setattr(report_module, "_tracking", False)
    clock = iter([100.0, 101.0, 103.0])
    monkeypatch.setattr(report_module.time, "monotonic", lambda: next(clock))

    report_module.report(1)
    report_module.add_comm_wait(0.25)  # what elastic.track_ddp's hook adds during step 2
    report_module.report(2)
    report_module.add_comm_wait(0.5)
    report_module.report(4)  # two steps at once: per step

    assert sent[0].compute_s is None
    assert sent[1].compute_s == pytest.approx(0.75)
    assert sent[2].compute_s == pytest.approx(0.75)


def test_the_first_report_arms_a_stack_dump_only_when_the_agent_names_a_file(monkeypatch):
    path = Path(tempfile.mkdtemp()) / "round1" / "rank0" / "stack.txt"
    monkeypatch.setenv(report_module.STACK_FILE_ENV, str(path))
    registered = []
    monkeypatch.setattr(report_module.faulthandler, "register", lambda *a, **k: registered.append(k))
    monkeypatch.setattr(report_module, "_armed", False)
    report_module._arm_stack_dump()
    assert path.exists() and registered and registered[0]["all_threads"] is True
    report_module._stack_file.close()


# -- stragglers -----------------------------------------------------------------------------------------
def test_a_node_twice_as_slow_as_the_lower_median_is_a_straggler():
    result = assess({"a": Pace(0.1), "b": Pace(0.21)}, factor=2.0)
    assert result.flagged == {"b"} and result.metric == "step time" and result.median_s == 0.1


def test_compute_times_are_compared_when_every_node_has_them():
    # Synchronous training: equal step times, but b computes 5x as long (a waits for it).
    paces = {"a": Pace(0.5, 0.1), "b": Pace(0.5, 0.5), "c": Pace(0.5, 0.11)}
    result = assess(paces, factor=2.0)
    assert result.flagged == {"b"} and result.metric == "compute time"


def test_no_verdict_with_fewer_than_two_measured_nodes():
    assert assess({"a": Pace(5.0), "b": Pace(None)}, factor=2.0).flagged == frozenset()


def test_a_flagged_node_is_cleared_only_below_the_hysteresis_band():
    tracker = StragglerTracker(factor=2.0)
    events = tracker.update({"a": Pace(0.1), "b": Pace(0.3)})
    assert [kind for kind, _ in events] == ["straggler"]
    assert (
        "node b is a straggler: step time 0.300s per step, 3.0x the median 0.100s of 2 nodes" in events[0][1]
    )
    assert tracker.update({"a": Pace(0.1), "b": Pace(0.19)}) == []  # inside the band: still flagged
    assert tracker.flagged == {"b"}
    events = tracker.update({"a": Pace(0.1), "b": Pace(0.15)})
    assert [kind for kind, _ in events] == ["straggler_cleared"] and tracker.flagged == frozenset()


def test_a_node_pace_is_its_slowest_worker():
    pace = node_pace(
        [
            WorkerProgress(local_rank=0, step_time_s=0.2, compute_time_s=0.1),
            WorkerProgress(local_rank=1, step_time_s=0.3, compute_time_s=0.05),
        ]
    )
    assert pace == Pace(0.3, 0.1)


# -- the job: stragglers and the node check --------------------------------------------------------------
def make_job(**overrides) -> Job:
    values: dict = dict(
        job_id="job-1",
        min_nodes=2,
        max_nodes=3,
        last_call_s=1.0,
        join_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=4.0,
    )
    values.update(overrides)
    return Job(JobSettings(**values), now=0.0)


def join_all(job: Job, now: float, *node_ids: str) -> None:
    for i, node_id in enumerate(node_ids):
        calls.join(
            job,
            JoinRequest(
                node_id=node_id,
                host=f"10.0.0.{i + 1}",
                nproc=1,
                store_port=29500 + i,
                min_nodes=job.settings.min_nodes,
                max_nodes=job.settings.max_nodes,
            ),
            now,
        )
    job.tick(now)
    assert job.rdzv.phase is Phase.ACTIVE


def beat(job: Job, node_id: str, now: float, **fields):
    values: dict = dict(node_id=node_id, round=job.rdzv.round, state=NodeState.RUNNING)
    values.update(fields)
    return calls.heartbeat(job, HeartbeatRequest(**values), now)


def progress(step_time: float, compute: float | None = None) -> list[WorkerProgress]:
    return [WorkerProgress(local_rank=0, step=5, step_time_s=step_time, compute_time_s=compute)]


def test_the_job_flags_a_straggler_in_status_and_events():
    job = make_job()
    join_all(job, 0.0, "a", "b", "c")
    beat(job, "a", 1.0, workers=progress(0.5, 0.1))
    beat(job, "b", 1.0, workers=progress(0.5, 0.1))
    beat(job, "c", 1.0, workers=progress(0.5, 0.45))
    assert not any(n.straggler for n in job.status(1.0).nodes), "judged in tick(), not per heartbeat"

    job.tick(1.0)  # the server's periodic tick computes the job-wide aggregates
    rows = {n.node_id: n for n in job.status(1.0).nodes}
    assert [n for n, row in rows.items() if row.straggler] == ["c"]
    assert rows["c"].step_time_s == 0.5 and rows["c"].compute_time_s == 0.45
    straggler_events = [e.message for e in job.events if e.kind == "straggler"]
    assert len(straggler_events) == 1 and "node c is a straggler: compute time 0.450s" in straggler_events[0]

    beat(job, "c", 2.0, workers=progress(0.5, 0.1))
    job.tick(2.0)
    assert [e.kind for e in job.events][-1] == "straggler_cleared"
    assert not any(n.straggler for n in job.status(2.0).nodes)


def check(ok: bool = True, matmul: float | None = 0.01, allreduce: float | None = 0.002, **fields):
    return NodeCheckResult(ok=ok, matmul_s=matmul, allreduce_s=allreduce, device="cpu", **fields)


def test_judge_fails_a_local_failure_and_forgives_the_peers_it_broke():
    verdicts = judge(
        {
            "a": check(ok=False, stage="allreduce", error="Connection closed by peer", allreduce=None),
            "b": check(),
            "c": check(ok=False, stage="matmul", error="RuntimeError: injected", matmul=None, allreduce=None),
        },
        factor=3.0,
    )
    assert (
        verdicts["c"].kind == "failed"
        and "check failed at matmul: RuntimeError: injected" in verdicts["c"].reason
    )
    assert verdicts["a"].kind == "ok" and "because node(s) c failed" in verdicts["a"].reason
    assert verdicts["b"].kind == "ok"


def test_judge_fails_collective_failures_when_nobody_failed_locally():
    verdicts = judge(
        {
            "a": check(ok=False, stage="init", error="timeout"),
            "b": check(ok=False, stage="init", error="timeout"),
        },
        factor=3.0,
    )
    assert {v.kind for v in verdicts.values()} == {"failed"}


def test_judge_flags_a_node_slower_than_the_factor():
    verdicts = judge(
        {"a": check(matmul=0.010), "b": check(matmul=0.012), "c": check(matmul=0.040)}, factor=3.0
    )
    assert (
        verdicts["c"].kind == "slow" and "matmul 40.0 ms is 3.3x the median 12.0 ms" in verdicts["c"].reason
    )
    assert verdicts["a"].kind == verdicts["b"].kind == "ok"


def run_check_round(job: Job, now: float, results: dict[str, NodeCheckResult]) -> dict:
    replies = {}
    for node_id in results:
        assert calls.next_round(job, node_id, 0).assignment.check  # the agents learn their check round
    for node_id, result in results.items():
        replies[node_id] = beat(job, node_id, now, node_check=result)
    return replies


def test_the_first_round_is_a_check_round_and_excluded_nodes_are_told_and_left_out():
    job = make_job(node_check="on")
    join_all(job, 0.0, "a", "b", "c")
    reply = calls.next_round(job, "a", 0)
    assert reply.assignment.check is True and reply.assignment.round == 1

    replies = run_check_round(
        job,
        1.0,
        {"a": check(), "b": check(), "c": check(ok=False, stage="matmul", error="RuntimeError: bad")},
    )
    assert replies["a"].command is Command.CONTINUE  # b and c had not reported yet
    assert replies["c"].command is Command.EXCLUDE
    assert "node c was excluded from the job by the node check" in replies["c"].outcome.summary
    assert replies["c"].outcome.exit_code == 1
    assert calls.watch(job, "c", 1).command is Command.EXCLUDE
    with pytest.raises(NodeExcludedError):
        calls.join(
            job, JoinRequest(node_id="c", host="h", nproc=1, store_port=1, min_nodes=2, max_nodes=3), 2.0
        )
    # The others rejoin: the training round has only a and b, and is no check round.
    assert beat(job, "a", 1.5).command is Command.REJOIN
    join_all(job, 2.0, "a", "b")
    assignment = calls.next_round(job, "b", 1).assignment
    assert assignment.check is False and assignment.members == ["a", "b"] and assignment.restart_count == 0
    status = {n.node_id: n for n in job.status(2.0).nodes}
    assert status["c"].state == "excluded" and status["c"].node_check_verdict.startswith(
        "failed: check failed"
    )
    assert status["a"].node_check.matmul_s == 0.01 and status["a"].node_check_verdict == "ok"
    assert [e.kind for e in job.events if e.kind in ("node_check", "node_excluded")] == [
        "node_check",
        "node_check",
        "node_excluded",
    ]


def test_with_warn_a_failed_node_is_only_reported():
    job = make_job(node_check="warn", min_nodes=2, max_nodes=2)
    join_all(job, 0.0, "a", "b")
    run_check_round(job, 1.0, {"a": check(), "b": check(ok=False, stage="matmul", error="boom")})
    assert job.node_check.excluded == {}
    join_all(job, 2.0, "a", "b")
    assert calls.next_round(job, "a", 1).assignment.members == ["a", "b"]
    assert any("(warn only)" in e.message and "node b failed" in e.message for e in job.events)


def test_a_check_that_leaves_too_few_nodes_fails_the_job():
    job = make_job(node_check="on", min_nodes=2, max_nodes=2)
    join_all(job, 0.0, "a", "b")
    run_check_round(job, 1.0, {"a": check(), "b": check(ok=False, stage="crash", error="segfault")})
    assert job.outcome is not None and not job.outcome.succeeded
    assert "1 left, at least 2 needed" in job.outcome.summary


def test_a_node_lost_during_the_check_round_repeats_the_check_with_the_others():
    job = make_job(node_check="on")
    join_all(job, 0.0, "a", "b", "c")
    assert calls.next_round(job, "a", 0).assignment.check
    beat(job, "a", 1.0, node_check=check())
    calls.leave(job, "c", "preempted", 1.5)
    join_all(job, 2.0, "a", "b")
    assignment = calls.next_round(job, "a", 1).assignment
    assert assignment.check and assignment.members == ["a", "b"]
    assert job.node_check.results == {}  # a's result of the abandoned round does not count
    run_check_round(job, 3.0, {"a": check(), "b": check()})
    assert job.node_check.done and beat(job, "a", 3.5).command is Command.REJOIN


def test_node_check_state_survives_a_master_takeover():
    job = make_job(node_check="on", min_nodes=2, max_nodes=2)
    join_all(job, 0.0, "a", "b")
    calls.next_round(job, "a", 0)
    run_check_round(job, 1.0, {"a": check(), "b": check()})
    restored = Job.restore(job.settings, json.loads(json.dumps(job.snapshot())), now=5.0)
    assert restored.node_check.done and restored.node_check.verdicts["a"].kind == "ok"


def test_settings_reject_a_bad_node_check_mode_and_factors():
    with pytest.raises(SettingsError, match="--node-check must be one of off, on, warn"):
        JobSettings(job_id="j", node_check="maybe")
    with pytest.raises(SettingsError, match="--straggler-factor must be > 1"):
        JobSettings(job_id="j", straggler_factor=1.0)


# -- status table ----------------------------------------------------------------------------------------
def test_the_status_table_shows_step_time_and_flags_and_the_check_figures():
    def row(node_id, rank, **fields) -> NodeStatus:
        values: dict = dict(
            node_id=node_id,
            rank=rank,
            state="running",
            heartbeat_age_s=0.3,
            restarts=0,
            round=2,
            host="h",
            nproc=1,
        )
        values.update(fields)
        return NodeStatus(**values)

    job = JobStatus(
        job_id="j",
        master_id="m",
        phase="training",
        round=2,
        world_size=2,
        nnodes=2,
        restart_count=0,
        max_restarts=3,
        nodes=[
            row("a", 0, step_time_s=0.5, compute_time_s=0.1, node_check=check(), node_check_verdict="ok"),
            row("b", 1, step_time_s=0.5, compute_time_s=0.45, straggler=True),
            row(
                "c",
                None,
                state="excluded",
                node_check=check(ok=False, stage="matmul", matmul=None, allreduce=None),
                node_check_verdict="failed: check failed at matmul: boom",
            ),
        ],
    )
    head, columns, *rows = render_status(job).splitlines()
    assert columns.split() == [
        "NODE", "RANK", "STATE", "HEARTBEAT", "AGE", "RESTARTS", "ROUND", "WORLD", "STEP", "TIME", "FLAGS"
    ]  # fmt: skip
    assert rows[0].split() == ["a", "0", "running", "0.3s", "0", "2", "2", "0.500s(0.100s)"]
    assert rows[1].split() == ["b", "1", "running", "0.3s", "0", "2", "2", "0.500s(0.450s)", "straggler"]
    assert rows[2].split() == ["c", "-", "excluded", "0.3s", "0", "2", "-", "-", "check-failed"]
    assert rows[3] == "node check a: ok; matmul 10.0 ms on cpu, allreduce 2.0 ms"
    assert rows[4] == "node check c: failed: check failed at matmul: boom; no figures"
