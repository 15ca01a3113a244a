"""What nodes find wrong and report once: damaged checkpoint copies and the integrity guard's findings.

Pure: no I/O. A node's heartbeat carries its findings (``HeartbeatRequest.ckpt_corrupt``, each an
``elastic.control.protocol.Finding``) until a heartbeat that carried them is answered, so a finding whose id
the node's previous heartbeat carried is no news (:func:`fresh`); after a master failover one may be recorded
twice, never lost (soft state).

- A damaged checkpoint copy (found by a restore or a persist): event ``checkpoint_corrupt``.
- An integrity detection (``found_by`` 'integrity', docs/integrity.md): global rank 0 and every rank the
  verdict names report the same detection, so :class:`Findings` records event ``integrity_detected`` once
  per detection (its step, kind, and whether it recurred), and ``integrity_rolled_back`` once per rollback.
  A NaN or spike that recurred at the same step after a rollback is data, not hardware: the judgement says
  :attr:`Judged.stop`, a final outcome (exit 3) naming the step and its sample indices. A mismatch that names
  a strict minority of the replicas (three or more) names *the odd replica*: the judgement says
  :attr:`Judged.odd` for the node that holds it, once per detection; the job counts those (durably:
  :meth:`master.job.flapping.FlapCounter.note_suspect`) and excludes a node named ``--suspect-count`` times
  within ``--suspect-window`` as suspect hardware (exit 4).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic.control.protocol import Finding, IntegrityFinding, Outcome
from elastic.exit_codes import ExitCode
from master.job.events import EventKind

#: Integrity detections and rollbacks remembered to record each once (every named rank reports it).
RECENT = 256
#: Sample indices an event or an outcome names at most (the rest counted).
SAMPLES_SHOWN = 32

_WHAT = {
    "non_finite": "a NaN or infinity in the loss or gradients",
    "mismatch": "the replicas' digests differ",
    "spike": "a loss spike",
}


@dataclass(frozen=True)
class News:
    """One event to record: its kind, line and data."""

    kind: EventKind
    message: str
    data: dict[str, Any]


@dataclass
class Judged:
    """What a heartbeat's findings mean for the job: ``events`` to record; ``stop``: the job fails for good
    (a recurring NaN or spike); ``odd``: the reporting node holds the odd replica of a mismatch."""

    events: list[News] = field(default_factory=list)
    stop: Outcome | None = None
    odd: bool = False
    #: Rollbacks first seen: (step of the detection, verified step rolled back to), each charged once
    #: against the restart budget (master.job.accounting.RestartBudget.charge_rollback).
    rollbacks: list[tuple[int, int]] = field(default_factory=list)


def fresh(seen: frozenset[str], reports: Iterable[Finding]) -> list[Finding]:
    """The findings whose id is not in ``seen`` (the ids the node's previous heartbeat carried)."""
    return [found for found in reports if found.id not in seen]


def is_odd(finding: IntegrityFinding) -> bool:
    """Whether ``finding`` names the reporting node's worker as the odd replica: a mismatch whose named
    ranks are a strict minority (``odd``; with two replicas, or no majority, the pair is named: nobody is
    odd)."""
    return finding.kind == "mismatch" and finding.named_here and finding.odd


def _samples(samples: Sequence[int]) -> str:
    shown = ", ".join(map(str, samples[:SAMPLES_SHOWN]))
    more = f" and {len(samples) - SAMPLES_SHOWN} more" if len(samples) > SAMPLES_SHOWN else ""
    return f"samples [{shown}{more}]" if samples else "samples unknown (no ElasticSampler in the state)"


def describe(step: int, finding: IntegrityFinding) -> str:
    """What the guard found, in words: ``step S: <what> (rank(s) [..] of W)``."""
    what = _WHAT.get(finding.kind, finding.kind)
    if finding.kind == "mismatch":
        who = f"odd rank(s) {finding.ranks}" if finding.odd else f"ranks {finding.ranks} (no majority)"
        what = f"{what}: {who} of {finding.world_size}"
    elif finding.ranks:
        what = f"{what} on rank(s) {finding.ranks}"
    return f"step {step}: {what}"


class Findings:
    """Records each finding once (soft state: the integrity detections and rollbacks seen lately, and which
    nodes were already counted as holding the odd replica of one)."""

    def __init__(self) -> None:
        self._recent: deque[tuple[Any, ...]] = deque()
        self._seen: set[tuple[Any, ...]] = set()

    def _first(self, key: tuple[Any, ...]) -> bool:
        """True the first time ``key`` is seen (of the last :data:`RECENT`)."""
        if key in self._seen:
            return False
        self._seen.add(key)
        self._recent.append(key)
        if len(self._recent) > RECENT:
            self._seen.discard(self._recent.popleft())
        return True

    def judge(self, node_id: str, reports: Iterable[Finding]) -> Judged:
        """What ``node_id``'s new findings (:func:`fresh`) mean (:class:`Judged`)."""
        judged = Judged()
        for found in reports:
            if found.integrity is None:
                where = f" ({found.file})" if found.file else ""
                message = (
                    f"node {node_id}: a copy of the checkpoint of step {found.step}{where} failed its digest "
                    f"check at {found.found_by or 'restore'} and was not used: {found.detail}"
                )
                data = {"step": found.step, "found_by": found.found_by, "file": found.file}
                judged.events.append(News(EventKind.CHECKPOINT_CORRUPT, message, data))
                continue
            self._integrity(node_id, found.step, found.integrity, judged)
        return judged

    def _integrity(self, node_id: str, step: int, finding: IntegrityFinding, judged: Judged) -> None:
        key = (step, finding.kind, finding.recurring, finding.rolled_back_to)
        line = describe(step, finding)
        data: dict[str, Any] = {"step": step, "kind": finding.kind, "ranks": list(finding.ranks)}
        if finding.rolled_back_to is not None:
            if self._first(key):
                data["rolled_back_to"] = finding.rolled_back_to
                message = (
                    f"integrity: rolled back in process to verified step {finding.rolled_back_to} ({line})"
                )
                judged.events.append(News(EventKind.INTEGRITY_ROLLED_BACK, message, data))
                judged.rollbacks.append((step, finding.rolled_back_to))
            return
        if is_odd(finding) and self._first((node_id, *key)):
            judged.odd = True
        if not self._first(key):
            return
        data.update(world_size=finding.world_size, recurring=finding.recurring)
        if finding.samples:
            data["samples"] = list(finding.samples[:SAMPLES_SHOWN])
        recurring = " again after a rollback: data, not hardware" if finding.recurring else ""
        judged.events.append(News(EventKind.INTEGRITY_DETECTED, f"integrity: {line}{recurring}", data))
        if finding.recurring and finding.kind in ("non_finite", "spike"):
            summary = (
                f"deterministic (recurring integrity fault): {line} recurred at the same step after a "
                f"rollback ({_samples(finding.samples)}); it is the data or the model, not the hardware: fix "
                "it and start the job again"
            )
            judged.stop = Outcome(succeeded=False, exit_code=ExitCode.FAILED_FOR_GOOD, summary=summary)


def persist_news(node_id: str, before: str, error: str, persisted_step: int | None) -> News | None:
    """The event when a node's checkpoint persists start failing (``error`` after none, ``before``) or
    recover; None otherwise: never one per step, so that a failing disk does not write the store at every
    heartbeat."""
    if error and not before:
        return News(EventKind.PERSIST_FAILED, f"node {node_id}: checkpoint persist failed: {error}", {})
    if before and not error:
        message = f"node {node_id}: checkpoints persist again (persisted step {persisted_step})"
        return News(EventKind.PERSIST_RECOVERED, message, {})
    return None
