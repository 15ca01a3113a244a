"""Unit tests of node liveness (``master.job.liveness.Liveness``) with a fake clock."""

from __future__ import annotations

import pytest

from master.job.liveness import Liveness

pytestmark = pytest.mark.timeout(10)

TIMEOUT = 4.0


def test_unknown_node_has_no_age_and_is_not_dead():
    live = Liveness(TIMEOUT)
    assert not live.knows("a")
    assert live.age("a", 100.0) is None
    assert live.dead(100.0) == []


def test_age_is_time_since_the_last_heartbeat():
    live = Liveness(TIMEOUT)
    live.beat("a", 10.0)
    assert live.knows("a")
    assert live.age("a", 10.0) == 0.0
    assert live.age("a", 12.5) == 2.5
    live.beat("a", 12.0)
    assert live.age("a", 12.5) == 0.5
    assert live.age("a", 11.0) == 0.0, "a clock that reads earlier than the beat never gives a negative age"


def test_dead_only_after_more_than_the_timeout_without_a_heartbeat():
    live = Liveness(TIMEOUT)
    live.beat("a", 0.0)
    assert live.dead(TIMEOUT) == [], "exactly the timeout is not yet dead"
    assert live.dead(TIMEOUT + 0.001) == ["a"]
    live.beat("a", TIMEOUT + 1.0)
    assert live.dead(TIMEOUT + 1.0) == [], "a heartbeat revives the verdict"
    assert live.knows("a"), "a dead verdict does not forget the node by itself"


def test_dead_lists_only_overdue_nodes_oldest_first():
    live = Liveness(TIMEOUT)
    live.beat("c", 2.0)
    live.beat("a", 1.0)
    live.beat("b", 3.0)
    live.beat("fresh", 9.0)
    assert live.dead(10.0) == ["a", "c", "b"]


def test_forget_removes_a_node():
    live = Liveness(TIMEOUT)
    live.beat("a", 0.0)
    live.beat("b", 0.0)
    live.forget("a")
    live.forget("never-seen")  # no error
    assert not live.knows("a")
    assert live.age("a", 1.0) is None
    assert live.dead(100.0) == ["b"]


def test_grace_gives_every_node_a_full_timeout_from_now():
    live = Liveness(TIMEOUT)
    live.beat("a", 0.0)
    live.beat("b", 5.0)
    assert live.dead(50.0) == ["a", "b"]

    live.grant_grace(50.0)  # e.g. a master that just took over
    assert live.age("a", 50.0) == 0.0 and live.age("b", 51.0) == 1.0
    assert live.dead(50.0 + TIMEOUT) == []
    assert live.dead(50.0 + TIMEOUT + 0.001) == ["a", "b"]


def test_grace_suppresses_verdicts_until_it_ends_even_for_nodes_seen_after_it():
    live = Liveness(TIMEOUT)
    live.grant_grace(0.0)
    live.beat("late", 0.0)
    live.beat("later", 1.0)
    assert live.dead(TIMEOUT - 0.001) == []
    assert live.dead(TIMEOUT + 0.5) == ["late"]
    live.beat("late", TIMEOUT + 0.5)
    assert live.dead(TIMEOUT + 1.5) == ["later"]


def test_a_suspect_is_dead_at_its_earlier_deadline_unless_it_beats():
    live = Liveness(TIMEOUT)
    for node_id in "abc":
        live.beat(node_id, 0.0)
    live.suspect("a", 1.0, 2.0)
    live.suspect("b", 1.0, 2.0)
    live.suspect("c", 1.0, 10.0)  # never later than the timeout
    live.suspect("zz", 1.0, 2.0)  # unknown: ignored
    assert live.suspected("a") and not live.suspected("zz")
    live.beat("b", 2.5)  # alive after all: the suspicion is lifted
    assert not live.suspected("b")
    assert live.dead(3.0) == []
    assert live.dead(3.001) == ["a"]
    assert live.dead(TIMEOUT + 0.001) == ["a", "c"]
    assert live.dead(2.5 + TIMEOUT + 0.001) == ["a", "c", "b"]


def test_a_grace_period_lifts_suspicions():
    live = Liveness(TIMEOUT)
    live.beat("a", 0.0)
    live.suspect("a", 0.0, 1.0)
    live.grant_grace(0.5)
    assert not live.suspected("a")
    assert live.dead(0.5 + TIMEOUT) == []


def test_a_takeover_grace_lasts_while_inherited_nodes_keep_coming_back_up_to_its_cap():
    live = Liveness(TIMEOUT)
    for node_id in ("a", "b", "c", "d"):
        live.beat(node_id, 0.0)
    live.grant_grace(10.0)  # ends at 14 unless the inherited nodes keep coming back
    live.beat("a", 13.0)  # -> 17
    live.beat("a", 16.9)  # a second beat of a node already back extends nothing
    live.beat("b", 16.5)  # -> 20.5
    assert live.dead(20.4) == []
    live.beat("c", 20.0)  # -> 24, but capped at three timeouts after the takeover: 22
    assert live.dead(22.0 - 0.001) == []
    assert live.dead(22.0 + 0.001) == ["d", "b", "a"]  # d never came back; a and b stopped beating


def test_a_takeover_grace_ends_one_timeout_after_the_last_inherited_node_came_back():
    live = Liveness(TIMEOUT)
    for node_id in ("a", "b"):
        live.beat(node_id, 0.0)
    live.grant_grace(10.0)
    live.beat("a", 11.0)  # -> 15
    live.beat("a", 14.5)
    assert live.dead(15.0 - 0.001) == []
    assert live.dead(15.0 + 0.001) == ["b"]
    live.beat("b", 30.0)  # back after the grace ended: an ordinary heartbeat, no grace
    assert live.dead(30.0 + TIMEOUT - 0.001) == ["a"]
