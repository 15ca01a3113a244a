"""The checkpoint fence's decision (agent.checkpoints.fence.decide, advanced): job incarnations order
submissions, rounds order the writers of one submission (a resubmitted job's rounds start at 1
again, and its persists were dropped as "superseded" by the earlier submission's round 2)."""

from __future__ import annotations

from agent.checkpoints.fence import Fence, advanced, decide

OLD, NEW = "0000000000000001-aaaaaaaa", "0000000000000002-bbbbbbbb"


def test_a_new_submission_supersedes_an_older_one_whatever_the_rounds() -> None:
    first = decide(1, 41, 2, 40, NEW, OLD)  # round 1 of the resubmission after round 2 of the first run
    assert (first.publish, first.move_latest) == (True, True)
    assert advanced(Fence(2, OLD), 1, NEW) == Fence(1, NEW), "the fence now names the new submission"


def test_a_new_submission_moves_latest_even_to_an_older_step() -> None:
    restarted = decide(1, 10, 2, 40, NEW, OLD)  # e.g. --ckpt-reset: the new run's state is the job's now
    assert (restarted.publish, restarted.move_latest) == (True, True)


def test_a_writer_of_an_older_submission_is_superseded_whatever_its_round() -> None:
    late = decide(9, 90, 1, 41, OLD, NEW)
    assert (late.publish, late.move_latest) == (False, False)
    assert "superseded by a newer submission" in late.why and NEW in late.why


def test_within_one_submission_rounds_order_writers_as_before() -> None:
    deposed = decide(1, 50, 2, 40, NEW, NEW)
    assert (deposed.publish, deposed.move_latest) == (False, False)
    assert "superseded by round 2" in deposed.why
    assert decide(2, 41, 2, 40, NEW, NEW).move_latest
    older_step = decide(3, 30, 2, 40, NEW, NEW)
    assert (older_step.publish, older_step.move_latest) == (True, False), "latest never moves back"
    assert advanced(Fence(2, NEW), 3, NEW) == Fence(3, NEW)
    assert advanced(Fence(2, NEW), 2, NEW) is None, "the same round: the fence stays"


def test_without_incarnations_rounds_alone_decide() -> None:
    # An older master sends none: the decision of the previous release.
    assert not decide(1, 41, 2, 40).publish
    assert decide(2, 41, 2, 40).move_latest
    # A writer without one against a fence that has one (an older agent): rounds alone, too.
    assert not decide(1, 41, 2, 40, "", NEW).publish
    assert decide(3, 41, 2, 40, "", NEW).publish
    assert advanced(Fence(2, NEW), 3, "") == Fence(3, NEW), "the fence keeps its incarnation"


def test_a_fence_written_before_incarnations_is_superseded_by_a_writer_with_one() -> None:
    upgraded = decide(1, 41, 2, 40, NEW, "")
    assert (upgraded.publish, upgraded.move_latest) == (True, True)
    assert advanced(Fence(2, ""), 1, NEW) == Fence(1, NEW)
