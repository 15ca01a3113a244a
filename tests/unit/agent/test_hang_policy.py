"""The adaptive hang bound (agent.observe.hang_policy) on recorded series, through the real progress channel
(real datagram bookkeeping, simulated receive times) and the real verdict (agent.observe.hang)."""

from __future__ import annotations

import math
import os
import random
import time

import psutil
import pytest

from agent.observe.channel import ProgressChannel
from agent.observe.hang import HangWatch, hung_workers, observe_progress
from agent.observe.hang_policy import (
    DEFAULT_POLICY,
    AdaptiveHangPolicy,
    RankClock,
    adaptive_bound,
    quantile,
    verdict_limit,
)
from bench import hangs
from elastic.contract import Progress, ProgressKind

AUTO, STEP, LIFE = ProgressKind.AUTO, ProgressKind.STEP, ProgressKind.LIFE


@pytest.fixture
def channel():
    ch = ProgressChannel()
    ch.reset(1)
    yield ch
    ch.close()


def replay(
    ch: ProgressChannel, durations: list[float], kind: ProgressKind = AUTO, start: float = 100.0
) -> float:
    """Feed steps 1..len+1 with the given durations between them; return the last step's time."""
    t = start
    ch.record(0, kind, 1, now=t)
    for i, d in enumerate(durations, start=2):
        t += d
        ch.record(0, kind, i, now=t)
    return t


def hung(ch: ProgressChannel, now: float, status: str = psutil.STATUS_RUNNING, stuck_since=None):
    obs = observe_progress(now, 0, ch.snapshot()[0], status, stuck_since, DEFAULT_POLICY)
    return hung_workers(now, DEFAULT_POLICY.fallback_s, [obs])


def test_the_p99_is_nearest_rank_so_a_full_window_ignores_its_two_largest_values() -> None:
    values = [0.05] * 198 + [5.0, 9.0]
    assert quantile(values, 0.99) == 0.05
    assert quantile([*values[:-1], 0.06], 0.99) == 0.06 or quantile([*values[1:], 5.0], 0.99) == 5.0
    assert quantile([1.0], 0.99) == 1.0


def test_no_adaptive_verdict_before_warm_up_and_the_first_step_has_no_duration(channel) -> None:
    last = replay(channel, [0.05] * (DEFAULT_POLICY.warmup_steps - 1))
    p = channel.snapshot()[0]
    assert len(p.durations) == DEFAULT_POLICY.warmup_steps - 1  # start -> step 1 is not a duration
    limit = verdict_limit(RankClock(p.advanced_at, tuple(p.durations)))
    assert limit is not None and not limit.adaptive and limit.limit_s == DEFAULT_POLICY.fallback_s
    assert hung(channel, last + 100) == []
    channel.record(0, AUTO, DEFAULT_POLICY.warmup_steps + 1, now=last + 0.05)
    assert hung(channel, last + 0.05 + DEFAULT_POLICY.floor_s)[0].cause == "no_progress"


def test_a_steady_50ms_series_is_bounded_by_the_floor_and_a_slow_one_by_k_times_its_p99(channel) -> None:
    assert adaptive_bound([0.05] * 50) == DEFAULT_POLICY.floor_s
    assert adaptive_bound([1.0] * 50) == pytest.approx(3.0)
    last = replay(channel, [1.0] * 50)
    assert hung(channel, last + 2.9) == []
    verdict = hung(channel, last + 3.0)
    assert verdict and "adaptive bound 3s = max(3 x p99 step 1s, floor 2s)" in verdict[0].reason
    assert verdict[0].reason.startswith("no progress for 3.0s (last step 51;")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_noisy_series_with_rare_spikes_give_no_verdict_while_steps_continue(channel, seed) -> None:
    rng = random.Random(seed)
    # 0.3 s steps, log-normal jitter, and one step in 200 three times slower (a data-loader hiccup).
    durations = [0.3 * math.exp(rng.gauss(0, 0.25)) * (3 if rng.random() < 0.005 else 1) for _ in range(3000)]
    t = 100.0
    channel.record(0, AUTO, 1, now=t)
    for i, d in enumerate(durations, start=2):
        # A heartbeat check just before each step arrives: the longest gap the rule ever sees.
        assert hung(channel, t + d - 1e-6) == [], (i, d)
        t += d
        channel.record(0, AUTO, i, now=t)
    bound = adaptive_bound(channel.snapshot()[0].durations)
    assert bound is not None and 3 * 0.3 < bound < 3 * 0.3 * math.exp(3 * 0.25) * 3
    # The rule's limit, by design: one gap beyond k x p99 (and the floor) without any sign of life is a hang.
    assert hung(channel, t + bound)


def test_forward_passes_extend_the_deadline_and_a_loop_without_them_is_hung(channel) -> None:
    last = replay(channel, [0.05] * 20)
    # An evaluation: forward passes every 0.25 s for 30 s, no optimizer step.
    for k in range(1, 121):
        channel.record(0, LIFE, 21, now=last + 0.25 * k)
        assert hung(channel, last + 0.25 * k + 0.2) == []
    eval_end = last + 30.0
    assert hung(channel, eval_end + 1.9) == []
    # Then nothing: neither forward passes nor steps (a Python loop) is hung at the bound.
    assert hung(channel, eval_end + DEFAULT_POLICY.floor_s)[0].cause == "no_progress"


def test_a_checkpoint_save_suspends_the_bound_until_it_ends_and_adds_no_duration(channel) -> None:
    # (Its time is taken out of the interval that contains it: the step's own work stays a duration.)
    last = replay(channel, [0.05] * 20, kind=STEP)
    channel.record(0, ProgressKind.SAVE, 21, now=last + 0.01)
    assert hung(channel, last + 60.0) == []  # a 60 s save (to slow storage)
    assert hung(channel, last + DEFAULT_POLICY.fallback_s + 0.01)  # a save that never ends: the fallback
    channel.record(0, ProgressKind.CKPT, 21, now=last + 60.0)  # elastic.save's report ends it
    assert hung(channel, last + 60.0 + 1.9) == []
    assert hung(channel, last + 60.0 + DEFAULT_POLICY.floor_s)
    channel.record(0, STEP, 22, now=last + 60.05)
    assert max(channel.snapshot()[0].durations) < 1.0  # the interval with the save is not a step time


def test_a_job_that_saves_every_step_warms_up_on_its_steps_without_the_saves(channel) -> None:
    now = 100.0
    channel.record(0, STEP, 1, now=now)
    for step in range(2, 40):  # each step: 0.15 s of work, then a 0.05 s flash save
        channel.record(0, ProgressKind.SAVE, step - 1, now=now + 0.15)
        channel.record(0, ProgressKind.CKPT, step - 1, now=now + 0.20)
        now += 0.20
        channel.record(0, STEP, step, now=now)
    durations = list(channel.snapshot()[0].durations)
    assert len(durations) == 38 and max(durations) == pytest.approx(0.15)
    limit = verdict_limit(RankClock(now, tuple(durations)))
    assert limit is not None and limit.adaptive and limit.limit_s == DEFAULT_POLICY.floor_s
    assert hung(channel, now + DEFAULT_POLICY.floor_s), "a hang between saves: the adaptive bound"


def test_a_process_stopped_during_a_save_gets_the_adaptive_bound_and_disk_sleep_the_fallback(channel) -> None:
    last = replay(channel, [0.05] * 20, kind=STEP)
    channel.record(0, ProgressKind.SAVE, 21, now=last + 0.01)
    stopped_at = last + 0.02
    past_bound = stopped_at + DEFAULT_POLICY.floor_s + 0.01
    (verdict,) = hung(channel, past_bound, psutil.STATUS_STOPPED, stuck_since=stopped_at)
    assert verdict.cause == "stopped", "a stopped process saves nothing"
    assert hung(channel, past_bound, psutil.STATUS_DISK_SLEEP, stuck_since=stopped_at) == []  # a slow write


def test_a_worker_kept_in_process_keeps_its_bound_across_rounds_a_new_one_warms_up(channel) -> None:
    channel.reset(2)
    for rank in (0, 1):
        t = 100.0
        channel.record(rank, STEP, 1, now=t)
        for step in range(2, 22):
            t += 0.05
            channel.record(rank, STEP, step, now=t)
    channel.reset(2, kept=[0, 1])
    channel.forget_durations([1])  # local rank 1's worker was not kept after all: a new process
    after = channel.snapshot()
    assert len(after[0].durations) == 20 and after[0].step is None, "a new round: its steps start again"
    assert list(after[1].durations) == []
    channel.record(0, STEP, 22, now=200.0)
    limit = verdict_limit(RankClock(200.0, tuple(channel.snapshot()[0].durations)))
    assert limit is not None and limit.adaptive, "no second warm-up after an in-process recovery"


def test_a_process_stopped_in_its_warm_up_gets_the_floor_before_its_first_step_the_fallback(channel) -> None:
    last = replay(channel, [0.05] * 3, kind=STEP)  # 3 step times: still warming up
    late = last + DEFAULT_POLICY.floor_s + 0.1
    assert hung(channel, late) == [], "progress: the fallback while warming up"
    (verdict,) = hung(channel, late, psutil.STATUS_STOPPED, stuck_since=last + 0.05)
    assert verdict.cause == "stopped"
    fresh = ProgressChannel()
    fresh.reset(1)
    try:  # no step yet (start-up, a debugger attached early): the fallback
        obs = observe_progress(late, 0, fresh.snapshot()[0], psutil.STATUS_STOPPED, 100.0, DEFAULT_POLICY)
        assert hung_workers(late, DEFAULT_POLICY.fallback_s, [obs]) == []
    finally:
        fresh.close()


def test_explicit_steps_win_over_the_optimizer_hook_count(channel) -> None:
    channel.record(0, AUTO, 1, now=10.0)  # the optimizer stepped before the script reported
    channel.record(0, STEP, 1001, now=10.01)  # a resumed run
    channel.record(0, AUTO, 2, now=10.06)  # now only a sign of life
    p = channel.snapshot()[0]
    assert (p.step, p.explicit, p.alive_at, list(p.durations)) == (1001, True, 10.06, [])
    channel.record(0, STEP, 1002, now=10.11)
    assert channel.snapshot()[0].durations[-1] == pytest.approx(0.1)


def test_a_stopped_worker_is_judged_on_its_own_bound_and_named_as_stopped(channel) -> None:
    last = replay(channel, [0.05] * 20)
    stopped_at = last + 0.03
    assert hung(channel, last + 1.5, psutil.STATUS_STOPPED, stopped_at) == []
    verdict = hung(channel, last + 2.0, psutil.STATUS_STOPPED, stopped_at)
    assert verdict[0].cause == "stopped" and "its process has been stopped" in verdict[0].reason


def test_an_explicit_timeout_keeps_the_fixed_rule(channel) -> None:
    last = replay(channel, [0.05] * 20)
    watch = HangWatch(5.0)
    assert watch.check(last + 4.9, channel.snapshot(), {0: os.getpid()}) == []
    assert "--hang-timeout 5s" in watch.check(last + 5.0, channel.snapshot(), {0: os.getpid()})[0].reason
    adaptive = HangWatch(None)
    assert adaptive.check(last + 2.0, channel.snapshot(), {0: os.getpid()})[0].cause == "no_progress"
    assert HangWatch(0).check(last + 1e6, channel.snapshot(), {0: os.getpid()}) == []


def test_datagrams_sent_by_the_hooks_reach_the_channel(channel) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for kind, step in ((AUTO, 1), (AUTO, 2), (LIFE, 2), (ProgressKind.SAVE, 2)):
            s.sendto(Progress(local_rank=0, kind=kind, step=step).encode(), channel.path)
    deadline = time.monotonic() + 10
    while channel.snapshot()[0].saving_since is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the receiver thread's state, bounded
    p = channel.snapshot()[0]
    assert (p.step, p.explicit, p.alive_at is not None, p.saving_since is not None) == (2, False, True, True)


def test_short_bench_no_false_verdict_and_detection_within_the_target() -> None:
    for explicit in (False, True):
        result = hangs.run(hangs.Scenario(steps=1500, eval_every=250, save_every=500, explicit=explicit))
        assert result.false_verdicts == 0, result.first_false
        assert result.stop_detect_s <= result.target_s and result.loop_detect_s <= result.target_s
        assert result.fixed_detect_s > 590


def test_a_tighter_policy_is_honoured() -> None:
    policy = AdaptiveHangPolicy(k=2.0, floor_s=0.5, warmup_steps=3)
    assert adaptive_bound([0.1, 0.2], policy) is None
    assert adaptive_bound([0.1, 0.2, 0.4], policy) == pytest.approx(0.8)
