"""What one API fuzz run found (bench/fuzz_engine.py): counts by operation and status, and the first few
failures, described."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from bench.fuzz_job import UI_LOGIN

FAILURES_KEPT = 20


@dataclass
class Tally:
    """Counts of one fuzz run and the first few failures, described."""

    requests: int = 0
    authorized: int = 0  # with the right token and job id
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    server_errors: int = 0
    crashes: int = 0
    failures: Counter = field(default_factory=Counter)  # by kind
    examples: list[str] = field(default_factory=list)
    masters: int = 0
    refusal_batches: int = 0
    refusals: Counter = field(default_factory=Counter)  # by kind
    state_checks: int = 0  # quiet snapshots compared with the one before a batch
    skipped_batches: int = 0
    flaky_runs: int = 0  # hypothesis runs ended early (see fuzz_engine.run_fuzz)

    def note(self, operation: str, status: int, authorized: bool) -> None:
        """Count one answer."""
        self.requests += 1
        self.authorized += authorized
        self.statuses[operation][status] += 1
        if status >= 500:
            self.server_errors += 1

    def fail(self, kind: str, text: str) -> None:
        """Count one failure of ``kind``; keep its description while fewer than FAILURES_KEPT are kept."""
        self.failures[kind] += 1
        if len(self.examples) < FAILURES_KEPT:
            self.examples.append(f"[{kind}] {text}")

    def successes(self, operation: str) -> int:
        """Answers that did what was asked: 2xx (and the login's redirect, its only success)."""
        return sum(
            n
            for status, n in self.statuses[operation].items()
            if 200 <= status < 300 or (operation == UI_LOGIN and status == 303)
        )

    def to_json(self) -> dict[str, Any]:
        """The counts, for ``--json``."""
        return {
            "requests": self.requests,
            "authorized": self.authorized,
            "unauthorized": self.requests - self.authorized,
            "statuses": {op: {str(s): n for s, n in sorted(c.items())} for op, c in self.statuses.items()},
            "server_errors": self.server_errors,
            "crashes": self.crashes,
            "failures": dict(self.failures),
            "examples": self.examples,
            "masters": self.masters,
            "refusal_batches": self.refusal_batches,
            "refusals": dict(self.refusals),
            "state_checks": self.state_checks,
            "skipped_batches": self.skipped_batches,
            "flaky_runs": self.flaky_runs,
        }
