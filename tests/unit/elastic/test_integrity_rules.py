"""The integrity guard's pure rules on recorded series: spikes (median/MAD), non-finite values, the odd
replica's name, and the coverage of a rotating subset."""

from __future__ import annotations

import math
import random

import pytest

from elastic.integrity import rules


def noisy_loss_curve(steps: int = 10_000, seed: int = 0) -> list[float]:
    """A normal training run's loss, deterministic: a fast fall, then a slow one, 5 % Gaussian batch noise
    and now and then a batch 30 % harder than usual (what ordinary data does)."""
    rng = random.Random(seed)
    curve = []
    for t in range(steps):
        level = 0.3 + 2.0 * math.exp(-t / 300) + 0.5 * math.exp(-t / 4000)
        noise = 1 + 0.05 * rng.gauss(0, 1)
        bump = 1.3 if rng.random() < 0.01 else 1.0
        curve.append(level * noise * bump)
    return curve


def run_rule(curve: list[float], rule: rules.SpikeRule) -> list[int]:
    found = []
    for step, loss in enumerate(curve, start=1):
        if rule.judge(loss).spike:
            found.append(step)
        else:
            rule.accept(step, loss)
    return found


def test_a_noisy_normal_curve_of_10000_steps_has_no_spike():
    assert run_rule(noisy_loss_curve(), rules.SpikeRule()) == []


def test_a_100x_spike_is_caught_at_its_step_and_does_not_raise_the_bar_for_the_next():
    curve = noisy_loss_curve(3000)
    curve[1500] *= 100
    curve[1501] *= 3
    assert run_rule(curve, rules.SpikeRule()) == [1501, 1502]


def test_no_judgement_during_warm_up_and_falling_losses_are_never_spikes():
    rule = rules.SpikeRule(warmup=20)
    assert run_rule([5.0] * 19 + [500.0], rule) == []  # the 20th reading: only 19 in the window
    assert run_rule([5.0 - 0.001 * i for i in range(100)] + [0.01], rules.SpikeRule()) == []


def test_truncate_forgets_the_rolled_back_readings():
    rule = rules.SpikeRule(window=10, warmup=5)
    for step in range(1, 11):
        rule.accept(step, 1.0)
    for step in range(11, 16):
        rule.accept(step, 9.0)
    rule.truncate(10)
    assert len(rule) == 5 and rule.judge(5.0).spike  # back to a window of 1.0s (5 fell out at 15)


def test_a_bad_rule_is_refused():
    with pytest.raises(ValueError):
        rules.SpikeRule(window=10, warmup=20)


def test_non_finite():
    assert rules.non_finite(1.0, math.nan) and rules.non_finite(math.inf) and not rules.non_finite(0.0, -3.5)


@pytest.mark.parametrize(
    ("digests", "named"),
    [
        ([b"a", b"a", b"a"], ()),
        ([b"a", b"b", b"a"], (1,)),  # three replicas: the odd one out
        ([b"b", b"a", b"a", b"a"], (0,)),
        ([b"a", b"b"], (0, 1)),  # two: the pair
        ([b"a", b"a", b"b", b"b"], (0, 1, 2, 3)),  # no majority: everyone
        ([b"a", b"b", b"c"], (0, 1, 2)),
        ([b"a"], ()),
    ],
)
def test_odd_ones_out(digests, named):
    assert rules.odd_ones_out(digests) == named


def test_coverage_of_a_rotating_subset_is_the_oldest_part_check():
    cover = rules.Coverage(3)
    cover.checked(3)  # part 0
    cover.checked(4)  # part 1
    assert cover.covered_since is None  # part 2 never checked
    cover.checked(5)
    assert cover.covered_since == 3
    cover.checked(6)  # part 0 again
    assert cover.covered_since == 4
    cover.truncate(4)
    assert cover.covered_since is None  # 5 and 6 were rolled back
    assert rules.Coverage(1).part_of(17) == 0
