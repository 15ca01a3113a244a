"""Hang verdicts (agent.observe.hang): which workers are hung, why, and in which order, from their
observations
and a fake clock."""

from __future__ import annotations

import psutil
import pytest

from agent.observe.channel import RankProgress
from agent.observe.hang import Hang, HangWatch, WorkerObservation, hung_workers

pytestmark = pytest.mark.timeout(30)

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


def test_a_worker_that_finished_training_is_not_judged_on_progress():
    watch = HangWatch(timeout_s=1.0)
    import os

    done = RankProgress(step=9, advanced_at=0.0, done=True)
    assert watch.check(1e6, {0: done}, {0: os.getpid()}) == []
    assert isinstance(watch.check(1e6, {0: RankProgress(step=9, advanced_at=0.0)}, {0: os.getpid()})[0], Hang)
