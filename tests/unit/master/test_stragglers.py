"""Stragglers (master.job.stragglers, and through master.job.job with a fake clock): who is flagged, when the
flag is cleared, and how the job reports it."""

from __future__ import annotations

import pytest
from health_jobs import beat, join_all, make_job, progress

from elastic.control.protocol import WorkerProgress
from master.job.stragglers import Pace, StragglerTracker, assess, node_pace

pytestmark = pytest.mark.timeout(30)


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
