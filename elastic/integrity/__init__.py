"""Numerical integrity: a corrupted replica, a NaN or a loss spike caught within a step, and rolled back.

Promises: :class:`Guard` checks each optimizer step, on every data-parallel rank together, for a
non-finite loss or gradient, a loss spike against the recent window, and replicas whose state differs
(an exact xxh3_128 digest of each replica's parameters and optimizer state, compared with one small
all_gather; with three or more replicas the odd one is named, with two the pair). Its cost is bounded
by a share of the step time (default 1 %): past it a rotating subset of the state is checked each step,
and the detection bound in steps is logged. It tracks the newest *verified* saved step (docs/integrity.md).
Every rank reaches the same :class:`Verdict`, so every rank acts on it at the same step.

Raises: :class:`IntegrityFault` from :meth:`Guard.after_step` on a detection; :func:`elastic.run` catches
it and rolls every rank back in process to the newest verified step (``elastic.load(step=...)``), the
sampler with it. A hand-written loop catches it itself (or lets the process end and be restarted).

Owns: the detection rules (:mod:`elastic.integrity.rules`, pure), the state digest and its collective
(:mod:`elastic.integrity.digests`) and the guard (:mod:`elastic.integrity.guard`). Importing this package
imports no torch; the names below resolve on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.lazy import lazy_exports

_LAZY_ATTRS: dict[str, str] = {"Guard": "guard", "Verdict": "guard", "IntegrityFault": "guard"}
__all__ = ["Guard", "IntegrityFault", "Verdict"]

if TYPE_CHECKING:
    from elastic.integrity.guard import Guard, IntegrityFault, Verdict


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_ATTRS, __all__)
