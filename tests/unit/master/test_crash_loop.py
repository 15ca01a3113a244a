"""The crash-loop stop (``master.job.crash_loop``): a deterministic failure stops the job at once with exit
code 3 instead of spending the restart budget. First the pure decision on recorded series of failures, then
the job as the master drives it on a fake clock (failover included), then what the agent reports.
"""

from __future__ import annotations

import json

import job_calls as calls
import pytest
from job_builders import HB_TIMEOUT, beat, join, make_job, running

from agent.executor.loop import worker_failure
from agent.observe.channel import RankProgress
from agent.workers.errors_file import exception_type, known_error
from agent.workers.types import FailureInfo
from elastic.control.job_settings import JobSettings, SettingsError
from elastic.control.protocol import FailureKind, FailurePhase, NodeState, WorkerFailure
from elastic.exit_codes import ExitCode
from master.job.crash_loop import (
    CrashLoop,
    CrashLoopPolicy,
    FailureSeen,
    Signature,
    normalise,
    signature_of,
)
from master.job.job import Job

pytestmark = pytest.mark.timeout(10)

POLICY = CrashLoopPolicy(stop_on_startup_error=True, window_s=600.0)
VALUE_ERROR = Signature("steady", "ValueError: bad batch at step #")
SIGKILL = Signature("steady", "signal SIGKILL")


def series(policy: CrashLoopPolicy, *failures: FailureSeen, suspected: bool = False) -> list[bool]:
    """Judge ``failures`` in order, as the job does on each round's first failure: stop or not, each."""
    loop = CrashLoop(policy)
    return [loop.judge(seen, peer_suspected=suspected).stop for seen in failures]


def seen(sig: Signature, at: float, round_: int, committed=None, reached=None, known="") -> FailureSeen:
    return FailureSeen(sig, at, round_, committed, reached, known)


# -- the decision on recorded series ----------------------------------------------------------------------
def test_the_same_failure_twice_with_no_step_committed_between_stops():
    stops = series(POLICY, seen(VALUE_ERROR, 10.0, 1, reached=1), seen(VALUE_ERROR, 14.0, 2, reached=1))
    assert stops == [False, True]


def test_a_step_committed_between_two_same_failures_charges_the_second():
    stops = series(
        POLICY,
        seen(VALUE_ERROR, 10.0, 1, committed=None, reached=1),
        seen(VALUE_ERROR, 20.0, 2, committed=1, reached=1),
        seen(VALUE_ERROR, 30.0, 3, committed=5, reached=5),
    )
    assert stops == [False, False, False], "each failure followed progress: a new series"


def test_sigkill_twice_at_steady_state_with_steps_between_is_charged():
    stops = series(POLICY, seen(SIGKILL, 100.0, 1, reached=40), seen(SIGKILL, 160.0, 2, reached=95))
    assert stops == [False, False]


def test_kills_from_outside_at_start_up_with_no_progress_are_charged_however_often_they_come():
    """A scheduler, an operator or a chaos test killing a worker again and again before its first step (a
    SIGTERM per checkpoint save in tests/e2e/test_ckpt_faults_e2e.py) says nothing about the worker's code:
    charged each time, never a crash loop; a crash signal the worker raises itself is one."""
    for name in ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"):
        sig = Signature("startup", f"signal {name}")
        assert sig.from_outside
        assert series(POLICY, *(seen(sig, 10.0 * i, i) for i in range(1, 5))) == [False] * 4, name
    segv = Signature("startup", "signal SIGSEGV")
    assert not segv.from_outside
    assert series(POLICY, seen(segv, 10.0, 1), seen(segv, 20.0, 2)) == [False, True]
    assert not Signature("startup", "signal SIGTERM: RuntimeError: boom").from_outside, "it left an error"


def test_a_single_sigkill_never_stops_the_job():
    assert series(POLICY, seen(SIGKILL, 100.0, 1, reached=40)) == [False]


def test_a_known_start_up_error_stops_at_its_first_occurrence():
    sig = Signature("startup", "ModuleNotFoundError: No module named 'foo'")
    loop = CrashLoop(POLICY)
    decision = loop.judge(seen(sig, 1.0, 1, known="import"))
    assert decision.stop
    assert "known start-up error (import) at start-up" in decision.reason


def test_a_known_error_after_steps_waits_for_its_repeat_but_shm_before_any_commit_stops_at_once():
    missing = Signature("steady", "FileNotFoundError: [Errno #] No such file or directory: 'shard-#.bin'")
    assert series(POLICY, seen(missing, 1.0, 1, reached=7, known="missing_file")) == [False]
    shm = Signature("steady", "CheckpointError: not enough shared memory for the checkpoint of step #")
    assert series(POLICY, seen(shm, 1.0, 1, reached=1, known="shm_too_small")) == [True], "its first save"
    assert series(POLICY, seen(shm, 1.0, 1, committed=50, reached=60, known="shm_too_small")) == [False]


def test_with_the_settings_off_every_failure_is_charged_as_before():
    off = CrashLoopPolicy(stop_on_startup_error=False, window_s=0.0)
    sig = Signature("startup", "ModuleNotFoundError: No module named 'foo'")
    failures = [seen(sig, float(t), t, known="import") for t in range(1, 5)]
    assert series(off, *failures) == [False] * 4
    only_known_off = CrashLoopPolicy(stop_on_startup_error=False, window_s=600.0)
    assert series(only_known_off, *failures[:2]) == [False, True], "the repeat rule still applies"


def test_failures_further_apart_than_the_window_are_charged():
    stops = series(POLICY, seen(VALUE_ERROR, 0.0, 1, reached=1), seen(VALUE_ERROR, 600.5, 2, reached=1))
    assert stops == [False, False]


def test_different_failures_or_phases_are_no_loop():
    other_phase = Signature("startup", VALUE_ERROR.what)
    other_error = Signature("steady", "KeyError: 'x'")
    stops = series(
        POLICY,
        seen(VALUE_ERROR, 1.0, 1, reached=1),
        seen(other_phase, 2.0, 2),
        seen(other_error, 3.0, 3, reached=1),
        seen(VALUE_ERROR, 4.0, 4, reached=1),
    )
    assert stops == [False, False, False, False]


def test_a_repeat_while_a_peers_connection_is_closed_is_charged():
    """It probably followed that node's loss, which refunds it (a membership change)."""
    failures = (seen(VALUE_ERROR, 1.0, 1, reached=1), seen(VALUE_ERROR, 2.0, 2, reached=1))
    assert series(POLICY, *failures, suspected=True) == [False, False]


def test_a_refunded_failure_leaves_the_series():
    loop = CrashLoop(POLICY)
    assert not loop.judge(seen(VALUE_ERROR, 1.0, 1, reached=1)).stop
    loop.forget(1)
    assert not loop.judge(seen(VALUE_ERROR, 2.0, 2, reached=1)).stop, "the first was no failure of its own"
    assert loop.judge(seen(VALUE_ERROR, 3.0, 3, reached=1)).stop


def test_normalise_replaces_what_varies_between_runs_of_the_same_fault():
    one = "RuntimeError: worker pid 4242 at 0x7f3a9c001230 lost 10.0.0.7:29500 (/tmp/tmpab12cd34/x.pt, 1.5s)"
    two = "RuntimeError: worker pid 77 at 0x7f00000000ff lost 10.0.0.9:41000 (/tmp/tmpzz99yy88/x.pt, 0.2s)"
    assert normalise(one) == normalise(two)
    assert (
        normalise("ModuleNotFoundError: No module named 'foo'")
        == "ModuleNotFoundError: No module named 'foo'"
    )
    assert normalise("ValueError: a") != normalise("ValueError: b")


def test_signature_of_a_report():
    boom = WorkerFailure(
        rank=3,
        local_rank=1,
        exit_code=1,
        message="ValueError: bad batch at step 2",
        phase=FailurePhase.STEADY,
    )
    assert signature_of(boom) == Signature("steady", "ValueError: bad batch at step #")
    kill = WorkerFailure(rank=0, local_rank=0, exit_code=None, signal="SIGKILL")
    assert signature_of(kill) == Signature("", "signal SIGKILL"), "an older agent sends no phase"
    hang = WorkerFailure(rank=0, local_rank=0, message="no step for 601.0s", kind=FailureKind.HANG)
    assert signature_of(hang).what == "hang"


# -- the job, as the master drives it -------------------------------------------------------------------
def failure(message: str, phase: FailurePhase, step: int | None = None, **fields) -> WorkerFailure:
    return WorkerFailure(rank=0, local_rank=0, exit_code=1, message=message, phase=phase, step=step, **fields)


IMPORT_ERROR = failure(
    "ModuleNotFoundError: No module named 'foo'",
    FailurePhase.STARTUP,
    exception="ModuleNotFoundError",
    known_error="import",
)


def test_an_import_error_stops_the_job_at_once_with_exit_code_3():
    job = make_job(max_restarts=3)
    running(job, 0.0, "a", "b")
    reply = beat(job, "a", 1.0, state=NodeState.FAILED, failure=IMPORT_ERROR)

    outcome = job.outcome
    assert outcome is not None and outcome.exit_code == ExitCode.FAILED_FOR_GOOD
    assert reply.command == "stop" and reply.outcome == outcome
    assert "deterministic (crash loop)" in outcome.summary
    assert "ModuleNotFoundError: No module named 'foo'" in outcome.summary
    assert job.restart_count == 0, "nothing charged: no restart happens"
    kinds = [e.kind for e in job.events]
    assert kinds[-3:] == ["worker_failed", "crash_loop", "job_failed"]
    event = job.events[-2]
    assert event.data == {
        "phase": "startup",
        "signature": IMPORT_ERROR.message,
        "count": 1,
        "known_error": "import",
    }
    assert job.status(1.0).crash_loop.startswith(
        "deterministic (crash loop): rank 0 (local rank 0 on node a)"
    )
    assert beat(job, "b", 1.1).outcome == outcome, "every agent learns the same outcome"


def test_a_recurring_error_is_charged_once_then_stops_the_job():
    job = make_job(max_restarts=3)
    running(job, 0.0, "a", "b")
    boom = failure("ValueError: bad batch at step 2", FailurePhase.STEADY, step=1, exception="ValueError")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=boom)
    assert job.outcome is None and job.restart_count == 1
    assert job.status(1.0).crash_loop == ""
    join(job, 2.0, "a", "b")
    beat(job, "b", 3.0, state=NodeState.FAILED, failure=boom)  # another rank, the same fault

    assert job.outcome is not None and job.outcome.exit_code == ExitCode.FAILED_FOR_GOOD
    assert "the same failure 2 times" in job.outcome.summary
    assert job.restart_count == 1


def test_a_single_sigkill_is_charged_once_and_the_job_goes_on():
    job = make_job(max_restarts=3)
    running(job, 0.0, "a", "b")
    kill = WorkerFailure(
        rank=1, local_rank=1, exit_code=None, signal="SIGKILL", phase=FailurePhase.STEADY, step=9
    )
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=kill)
    join(job, 2.0, "a", "b")
    assert job.outcome is None and job.restart_count == 1
    assert "crash_loop" not in [e.kind for e in job.events]


def test_the_series_survives_a_master_failover():
    job = make_job(max_restarts=3)
    running(job, 0.0, "a", "b")
    boom = failure("ValueError: bad batch at step 2", FailurePhase.STEADY, step=1)
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=boom)
    stored = json.loads(json.dumps(job.snapshot()))  # as the store keeps it
    assert stored["crash_loop"]["series"]["count"] == 1

    again = calls.restored(job, Job.restore(job.settings, stored, 1.5, "m2", term=2))
    join(again, 2.0, "a", "b")
    beat(again, "a", 3.0, state=NodeState.FAILED, failure=boom)
    assert again.outcome is not None and again.outcome.exit_code == ExitCode.FAILED_FOR_GOOD
    verdict = again.status(3.0).crash_loop
    restored = Job.restore(job.settings, json.loads(json.dumps(again.snapshot())), 4.0, "m3", term=3)
    assert restored.status(4.0).crash_loop == verdict, "the verdict is durable"


def test_a_failure_that_followed_a_peers_loss_does_not_count_towards_a_loop():
    job = make_job(min_nodes=1, max_nodes=3, max_restarts=3)
    running(job, 0.0, "a", "b", "c")
    peer_gone = failure("RuntimeError: Connection closed by peer", FailurePhase.STEADY, step=3)
    beat(job, "a", 0.5, state=NodeState.FAILED, failure=peer_gone)
    join(job, 0.6, "a", "b")  # c is dead: it never comes back
    job.tick(HB_TIMEOUT + 0.1)
    assert job.restart_count == 0, "refunded: a membership change"
    beat(job, "a", 5.0, state=NodeState.FAILED, failure=peer_gone)
    assert job.outcome is None and job.restart_count == 1


def test_the_settings_turn_the_rules_off():
    job = make_job(max_restarts=3, stop_on_startup_error=False, crash_loop_window_s=0.0)
    running(job, 0.0, "a", "b")
    beat(job, "a", 1.0, state=NodeState.FAILED, failure=IMPORT_ERROR)
    join(job, 2.0, "a", "b")
    beat(job, "a", 3.0, state=NodeState.FAILED, failure=IMPORT_ERROR)
    assert job.outcome is None and job.restart_count == 2, "charged as before"
    with pytest.raises(SettingsError, match="--crash-loop-window"):
        JobSettings(job_id="j", crash_loop_window_s=-1.0)


# -- what the agent reports --------------------------------------------------------------------------------
def progress(*steps: int | None) -> dict[int, RankProgress]:
    ranks = {}
    for local_rank, step in enumerate(steps):
        ranks[local_rank] = RankProgress()
        ranks[local_rank].step = step
    return ranks


@pytest.mark.parametrize(
    ("steps", "phase", "step"),
    [
        ((None, None), FailurePhase.STARTUP, None),
        ((None, 4), FailurePhase.FIRST_STEP, None),  # local rank 0 failed in its first step
        ((4, None), FailurePhase.STEADY, 4),  # its own steps decide, not how far its peer got
        ((5, 9), FailurePhase.STEADY, 5),
    ],
)
def test_the_agent_reports_the_phase_from_the_failed_workers_steps(steps, phase, step):
    info = FailureInfo(0, 0, 1, None, "ModuleNotFoundError: No module named 'foo'")
    report = worker_failure(info, FailureKind.CRASH, progress(*steps))
    assert (report.phase, report.step) == (phase, step)
    assert (report.exception, report.known_error) == ("ModuleNotFoundError", "import")


def test_a_killed_worker_is_reported_without_exception_or_known_error():
    info = FailureInfo(0, 1, None, "SIGKILL", "killed by SIGKILL", generic=True)
    report = worker_failure(info, FailureKind.CRASH, progress(3, 3))
    assert report.model_dump(exclude_unset=True) == {
        "rank": 1,
        "local_rank": 0,
        "exit_code": None,
        "signal": "SIGKILL",
        "message": "",
        "kind": FailureKind.CRASH,
        "phase": FailurePhase.STEADY,
        "step": 3,
    }


@pytest.mark.parametrize(
    ("message", "kind", "exception"),
    [
        ("ModuleNotFoundError: No module named 'foo'", "import", "ModuleNotFoundError"),
        ("ImportError: cannot import name 'x' from 'y'", "import", "ImportError"),
        ("SyntaxError: invalid syntax", "syntax", "SyntaxError"),
        ("IndentationError: unexpected indent", "syntax", "IndentationError"),
        (
            "FileNotFoundError: [Errno 2] No such file or directory: 'data.bin'",
            "missing_file",
            "FileNotFoundError",
        ),
        ("python3: can't open file '/w/train.py': [Errno 2] No such file or directory", "missing_file", ""),
        (
            "elastic.errors.CheckpointError: not enough shared memory for the checkpoint of step 1: it needs",
            "shm_too_small",
            "CheckpointError",
        ),
        ("torch.distributed.DistBackendError: NCCL error", "", "DistBackendError"),
        ("RuntimeError: injected failure", "", "RuntimeError"),
        ("killed", "", ""),
    ],
)
def test_the_agent_recognises_known_start_up_errors(message, kind, exception):
    assert (known_error(message), exception_type(message)) == (kind, exception)
