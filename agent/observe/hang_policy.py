"""The adaptive hang bound: how long a worker may go without progress, learned from its own steps.

Without ``--hang-timeout`` a worker is hung when it makes no progress for

    bound = max(k x p99(its last N step durations), floor)

(:class:`AdaptiveHangPolicy`: k = 3, floor = 2 s, N = 200) once it has *warmed up*: at least W = 10 step
durations are known. What counts, exactly:

* **Steps.** A step is an ``elastic.report(step)`` or, for scripts that never call it, an optimizer step
  seen by the global optimizer-step hook (:mod:`elastic.autoprogress`). A step duration is the time between
  two step reports divided by the steps they advanced. The first step (start-up, compilation, the first
  collective) has no duration: it is never in the window. The p99 is the nearest-rank one, so in a full
  window the 2 slowest durations are outliers that do not count (an evaluation pause folded into one step).
* **Signs of life.** A forward pass (the global forward hook) counts as progress against the same bound:
  while an evaluation runs forward passes, its worker is not hung however long the evaluation takes; a
  worker that runs neither forward passes nor optimizer steps (a Python loop, a stuck collective) is.
* **Checkpoint saves.** From a save's start (``save`` report: ``elastic.save``, ``torch.save``) to its end
  (``saved`` or ``ckpt`` report, or the next step) only the fallback bound applies, measured from the
  save's start; the save's time is taken out of the duration of the interval that contains it (an
  interval whose save had not ended by the next step adds none: before this, no interval with a save did,
  so a job that flash-saves every step never warmed up), and the idle clock restarts at the save's end.
  A *stopped* process keeps the adaptive bound during a save (it saves nothing), and gets the floor
  during the warm-up after its first step; one in disk sleep gets the fallback (:mod:`agent.observe.hang`).
* **Warm-up.** Before W durations are known (the first steps, a slow compilation) only the fallback bound
  applies: :data:`agent.settings.DEFAULT_HANG_TIMEOUT_S` (600 s), the timeout of releases before this one.
* Workers without any step are judged on their process state only (stopped or in disk sleep for the
  fallback bound), as with a fixed timeout.

:func:`verdict_limit` is the pure rule: a function of one rank's recorded clock, unit-tested on recorded
series (tests/unit/agent/test_hang_policy.py) and replayed over 10,000 steps by ``bench/hangs.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveHangPolicy:
    """The adaptive rule's constants (documented in docs/failures.md, "Hang verdicts")."""

    #: The bound is ``k`` times the p99 step duration...
    k: float = 3.0
    #: ...and never below ``floor_s`` (a 50 ms step's jitter must not trip it).
    floor_s: float = 2.0
    #: Step durations needed before an adaptive verdict (W); the first step is never one.
    warmup_steps: int = 10
    #: Step durations kept (N): the p99 is over the last ``window`` steps.
    window: int = 200
    quantile: float = 0.99
    #: The bound before warm-up and during a checkpoint save (seconds).
    fallback_s: float = 600.0


DEFAULT_POLICY = AdaptiveHangPolicy()


@dataclass(frozen=True)
class RankClock:
    """What the agent knows of one worker's progress (monotonic seconds; None: never seen)."""

    last_step_at: float | None  # the last step advance; None: no step yet
    durations: Sequence[float] = ()  # recent step durations, oldest first (saves and the first step excluded)
    alive_at: float | None = None  # the last sign of life (a forward pass)
    saving_since: float | None = None  # a checkpoint save in progress began then
    resumed_at: float | None = None  # the last save ended then


@dataclass(frozen=True)
class Limit:
    """How long ``clock``'s worker may go without progress from ``since``, and why (for the verdict)."""

    since: float  # the idle clock starts here (the last progress of any kind)
    limit_s: float
    rule: str  # e.g. "adaptive bound 2s = max(3 x p99 step 0.052s, floor 2s)"
    adaptive: bool  # False: the fallback bound (warm-up, a save in progress)


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty): an observed value, never interpolated,
    so a window of 200 ignores its 2 largest values at q = 0.99."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def adaptive_bound(durations: Sequence[float], policy: AdaptiveHangPolicy = DEFAULT_POLICY) -> float | None:
    """``max(k x p99(last N durations), floor)``; None before warm-up (fewer than W durations)."""
    recent = list(durations)[-policy.window :]
    if len(recent) < policy.warmup_steps:
        return None
    return max(policy.k * quantile(recent, policy.quantile), policy.floor_s)


def verdict_limit(clock: RankClock, policy: AdaptiveHangPolicy = DEFAULT_POLICY) -> Limit | None:
    """The progress limit that applies to ``clock`` now; None: not judged on progress (no step yet)."""
    if clock.last_step_at is None:
        return None
    if clock.saving_since is not None:
        return Limit(
            max(clock.saving_since, clock.last_step_at),
            policy.fallback_s,
            f"a checkpoint save in progress: bound {policy.fallback_s:g}s",
            False,
        )
    since = max(t for t in (clock.last_step_at, clock.alive_at, clock.resumed_at) if t is not None)
    bound = adaptive_bound(clock.durations, policy)
    if bound is None:
        known = min(len(clock.durations), policy.window)
        return Limit(
            since,
            policy.fallback_s,
            f"warming up ({known}/{policy.warmup_steps} step times): bound {policy.fallback_s:g}s",
            False,
        )
    p99 = quantile(list(clock.durations)[-policy.window :], policy.quantile)
    rule = f"adaptive bound {bound:.3g}s = max({policy.k:g} x p99 step {p99:.3g}s, floor {policy.floor_s:g}s)"
    return Limit(since, bound, rule, True)
