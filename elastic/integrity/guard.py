"""The integrity guard: after each optimizer step, one verdict that every rank reaches together.

Order of one guarded step, on every rank::

    loss = ...forward...; loss.backward(); optimizer.step()
    guard.after_step(step, loss, model, optimizer)     # raises IntegrityFault on a detection
    elastic.save(state, step); guard.saved(step)       # only a step that passed is saved

:meth:`Guard.after_step` checks locally (loss and gradients finite, this rank's digest of the part of
the state due at this step), then exchanges one small row per rank (:func:`~elastic.integrity.digests.
exchange`), so every rank judges the same table: a non-finite value on any rank, the mean loss a spike
(:class:`~elastic.integrity.rules.SpikeRule`), or digests that differ (the odd ranks named by
:func:`~elastic.integrity.rules.odd_ones_out`).

**Verified steps.** A saved step ``s`` is verified once the checks of step ``s`` passed, the loss of step
``s + 1`` (computed from the weights of step ``s``) was neither non-finite nor a spike, and every part of
the digest was checked and agreed at ``s`` or later. :attr:`Guard.verified_step` is the newest saved one;
a detection's :attr:`Verdict.rollback_to` the newest one still trustworthy after it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic import errors
from elastic.integrity import digests, rules

log = logging.getLogger(__name__)

#: Default share of the step time the replica digest may cost (a rotating subset past it).
DEFAULT_BUDGET = 0.01

# Verdict kinds, most serious first (one verdict names the first that applies).
NON_FINITE = "non_finite"
MISMATCH = "mismatch"
SPIKE = "spike"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one guarded step, identical on every rank.

    ``kind``: '' when the step passed, else :data:`NON_FINITE` (a NaN or infinity in a loss or gradient),
    :data:`MISMATCH` (the replicas' digests differ) or :data:`SPIKE` (the mean loss far above the recent
    window). ``ranks``: the ranks named (the odd replica(s), or the ranks that saw a non-finite value).
    ``rollback_to``: the newest verified step to go back to (None: none is saved yet). ``recurring``: the
    same non-finite value or spike was found at this step before a rollback already: data, not hardware.
    """

    step: int
    kind: str = ""
    ranks: tuple[int, ...] = ()
    loss: float = 0.0
    limit: float = float("inf")
    rollback_to: int | None = None
    recurring: bool = False
    parts: int = 1

    @property
    def ok(self) -> bool:
        """True when the step passed every check."""
        return not self.kind

    def describe(self) -> str:
        """One line for a log or an event."""
        if self.ok:
            return f"step {self.step}: passed"
        what = {
            NON_FINITE: f"a non-finite loss or gradient on rank(s) {list(self.ranks)}",
            MISMATCH: f"replica digests differ: odd rank(s) {list(self.ranks)}",
            SPIKE: f"loss spike: {self.loss:.6g} above the limit {self.limit:.6g}",
        }[self.kind]
        target = (
            "no verified step to roll back to"
            if self.rollback_to is None
            else (f"newest verified step {self.rollback_to}")
        )
        return f"step {self.step}: {what}; {target}" + (" (recurring)" if self.recurring else "")


class IntegrityFault(errors.ElasticRunError):  # noqa: N818 - a finding, raised to leave the step
    """Raised by :meth:`Guard.after_step` on a detection (on every rank at once); ``verdict`` says what
    and where to roll back to. :func:`elastic.run` catches it and rolls back in process."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.describe())
        self.verdict = verdict


@dataclass
class _Step:
    clean: bool  # this step's own checks passed
    next_loss_ok: bool = False  # the next step's loss was finite and no spike


class Guard:
    """Checks each step's numerical integrity across the data-parallel replicas (module doc).

    Args:
        budget: share of the step time the replica digest may cost (default 1 %); when the whole state
            costs more, a rotating subset of parts is checked, one part a step, and the detection bound in
            steps is logged once the step time is known (the second step).
        parts: a fixed number of parts instead (1: the whole state every step); overrides ``budget``.
        window, warmup, spike_mads, spike_ratio: the spike rule (:class:`~elastic.integrity.rules.
            SpikeRule`): a loss above the last ``window`` losses' median by more than ``spike_mads``
            scaled MADs and ``spike_ratio`` of the median, judged once ``warmup`` losses are in.
        check_grads: check the gradients for non-finite values (call :meth:`after_step` before
            ``zero_grad``).
        raise_on_detection: raise :class:`IntegrityFault` on a detection (else only return the verdict).
    """

    def __init__(
        self,
        *,
        budget: float = DEFAULT_BUDGET,
        parts: int | None = None,
        window: int = rules.DEFAULT_WINDOW,
        warmup: int = rules.DEFAULT_WARMUP,
        spike_mads: float = rules.DEFAULT_SPIKE_MADS,
        spike_ratio: float = rules.DEFAULT_SPIKE_RATIO,
        check_grads: bool = True,
        raise_on_detection: bool = True,
    ) -> None:
        if not 0 < budget <= 1 or (parts is not None and parts < 1):
            raise ValueError("budget must be in (0, 1] and parts >= 1")
        self.budget, self.check_grads, self.raise_on_detection = budget, check_grads, raise_on_detection
        self._fixed_parts = parts
        self._spikes = rules.SpikeRule(window, warmup, spike_mads, spike_ratio)
        self._coverage = rules.Coverage(parts or 1)
        self._calibrated = parts is not None
        self._digest: digests.StateDigest | None = None
        self._steps: dict[int, _Step] = {}
        self._saved: list[int] = []
        self._found: dict[int, str] = {}  # step -> kind of an earlier non-finite/spike detection there
        self._last_call: float | None = None
        self.detections = 0
        self.last_verdict: Verdict | None = None

    @property
    def parts(self) -> int:
        """Parts the state is cut into: a corrupted replica is detected within this many steps."""
        return self._coverage.parts

    # -- the step ---------------------------------------------------------------------------------
    def after_step(
        self,
        step: int,
        loss: float | torch.Tensor,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> Verdict:
        """Check step ``step`` (after ``optimizer.step()``, before ``zero_grad``) on every rank together.

        Args:
            step: the optimizer steps completed, this one included.
            loss: this rank's loss of the step (its forward pass, before the update).
            model: the replica (a DDP wrapper or the module itself).
            optimizer: its optimizer, whose state is in the digest (replicated under data parallelism).

        Returns:
            The :class:`Verdict`, the same on every rank.

        Raises:
            IntegrityFault: on a detection, with ``raise_on_detection`` (the default).
        """
        now = time.perf_counter()
        step_s = None if self._last_call is None else now - self._last_call
        module = getattr(model, "module", model)  # DDP keeps the replica in .module
        if (
            self._digest is None
            or self._digest.model is not module
            or self._digest.optimizer is not optimizer
        ):
            self._digest = digests.StateDigest(module, optimizer)
        value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
        flags = digests.FLAG_LOSS_NON_FINITE if rules.non_finite(value) else 0
        if self.check_grads and digests.non_finite_grads(module):
            flags |= digests.FLAG_GRADS_NON_FINITE
        part = self._coverage.part_of(step)
        mine = self._digest.compute(part, self.parts)
        reports = digests.exchange(digests.Report(mine, flags, value, self._proposal(step_s)))
        verdict = self._judge(step, reports)
        self._calibrate(reports)
        self.last_verdict = verdict
        self._last_call = time.perf_counter()
        if verdict.ok:
            return verdict
        self.detections += 1
        log.error("integrity guard: %s", verdict.describe())
        if self.raise_on_detection:
            raise IntegrityFault(verdict)
        return verdict

    def _proposal(self, step_s: float | None) -> int:
        if self._fixed_parts is not None or self._calibrated or step_s is None or self._digest is None:
            return self.parts
        took, covered = self._digest.last_seconds, self._digest.last_bytes
        if covered <= 0:
            return 1
        return digests.parts_for(self._digest.total_bytes(), took / covered, step_s, self.budget)

    def _calibrate(self, reports: list[digests.Report]) -> None:
        """Once every rank proposed a number of parts from a measured step, take the largest (all ranks
        must hash the same part at the same step) and log the detection bound."""
        proposed = max(r.parts for r in reports)
        if self._calibrated or self._last_call is None:
            return
        self._calibrated = True
        if proposed != self.parts:
            self._coverage = rules.Coverage(proposed)
        if _rank() == 0 and self._digest is not None:
            total = self._digest.total_bytes()
            how = (
                "the whole state every step: a corrupted replica is detected within 1 step"
                if self.parts == 1
                else f"a rotating subset of {self.parts} parts: a corrupted replica is detected within "
                f"{self.parts} steps"
            )
            log.warning(
                "integrity guard: %.1f MiB of parameters and optimizer state, budget %.2g%% of the step; %s",
                total / 2**20,
                self.budget * 100,
                how,
            )

    def _judge(self, step: int, reports: list[digests.Report]) -> Verdict:
        bad = tuple(rank for rank, r in enumerate(reports) if r.flags)
        losses = [r.loss for r in reports]
        mean = sum(losses) / len(losses)
        odd = rules.odd_ones_out([r.digest for r in reports])
        spike = self._spikes.judge(mean)
        loss_ok = not rules.non_finite(mean) and not any(
            r.flags & digests.FLAG_LOSS_NON_FINITE for r in reports
        )
        loss_ok = loss_ok and not spike.spike
        previous = self._steps.get(step - 1)
        if previous is not None:
            previous.next_loss_ok = loss_ok
        kind, ranks = "", tuple[int, ...]()
        if bad:
            kind, ranks = NON_FINITE, bad
        elif odd:
            kind, ranks = MISMATCH, odd
        elif spike.spike:
            kind = SPIKE
        if not kind:
            self._spikes.accept(step, mean)
            self._coverage.checked(step)
            self._steps[step] = _Step(clean=True)
            self._prune()
            return Verdict(step, loss=mean, limit=spike.limit, parts=self.parts)
        recurring = kind in (NON_FINITE, SPIKE) and self._found.get(step) in (NON_FINITE, SPIKE)
        if kind in (NON_FINITE, SPIKE):
            self._found[step] = kind
        self._steps[step] = _Step(clean=False)
        return Verdict(
            step, kind, ranks, mean, spike.limit, self.verified_step, recurring=recurring, parts=self.parts
        )

    # -- saved and verified steps -----------------------------------------------------------------
    def saved(self, step: int) -> None:
        """Note that a checkpoint of ``step`` was saved (``elastic.save``): a candidate verified step."""
        if not self._saved or step > self._saved[-1]:
            self._saved.append(step)

    def _verified(self, step: int) -> bool:
        checked, covered = self._steps.get(step), self._coverage.covered_since
        return (
            checked is not None
            and checked.clean
            and checked.next_loss_ok
            and covered is not None
            and covered >= step
        )

    @property
    def verified_step(self) -> int | None:
        """The newest saved step that is verified (module doc); None while there is none."""
        for step in reversed(self._saved):
            if self._verified(step):
                return step
        return None

    def rolled_back(self, step: int) -> None:
        """Forget what the guard learned after ``step``: the job went back to it (:func:`elastic.run` calls
        it; call it after a rollback of your own)."""
        self._spikes.truncate(step)
        self._coverage.truncate(step)
        self._saved = [s for s in self._saved if s <= step]
        self._steps = {s: v for s, v in self._steps.items() if s <= step}
        self._last_call = None

    def _prune(self) -> None:
        """Keep the records a verified step may still need: those from the newest verified step on."""
        newest = self.verified_step
        if newest is None or len(self._steps) < 4 * self.parts + 16:
            return
        self._steps = {s: v for s, v in self._steps.items() if s >= newest}
        self._saved = [s for s in self._saved if s >= newest]
        self._found = {s: k for s, k in self._found.items() if s >= newest}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
