"""``--node-check``: judge the nodes' health-check figures before the first training round. Pure.

With the check on (``on`` or ``warn``), the first round that closes is a *check round*: its assignment has
``check=True`` and every agent runs ``python -m elastic.node_check`` as its node's single worker (world =
the nodes). That times a matmul on the local device and an allreduce within pairs of nodes, and each agent
reports the figures (:class:`~elastic.control.protocol.NodeCheckResult`) in a heartbeat. Once every member of
the round has reported, :func:`judge` gives one verdict per node:

* ``failed``: the node's own part failed (device setup, the matmul, the check process crashed, hung or
  timed out). A failure inside a collective (process-group init, pairing, allreduce) is the node's own
  only if no node failed locally: a node that breaks its part also breaks its peers' collectives, and
  they must not be blamed for it. If nobody failed locally, every node with a collective failure fails.
* ``slow``: its matmul (or allreduce) time exceeds ``factor`` times the lower median over the nodes.
* ``ok`` otherwise.

With ``on`` the failed and slow nodes are excluded from the job (their agents get ``exclude`` and exit
non-zero); with ``warn`` they are only reported. The job then opens the first training round. Nodes that
join later are not checked.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from elastic.control.protocol import NodeCheckResult, describe_figures, format_ms
from master.job.events import EventKind

#: Stages where a failure is the node's own (the others are collectives that a broken peer also breaks).
COLLECTIVE_STAGES = frozenset({"init", "pairing", "allreduce"})


@dataclass(frozen=True)
class Verdict:
    kind: str  # ok | slow | failed
    reason: str = ""

    @property
    def bad(self) -> bool:
        return self.kind != "ok"

    def describe(self) -> str:
        return self.kind if not self.reason else f"{self.kind}: {self.reason}"


def judge(results: Mapping[str, NodeCheckResult], factor: float) -> dict[str, Verdict]:
    """One verdict per node of ``results`` (see the module docstring for the rules)."""
    local_failures = sorted(n for n, r in results.items() if not r.ok and r.stage not in COLLECTIVE_STAGES)
    medians: dict[str, float] = {}
    for figure in ("matmul_s", "allreduce_s"):
        values = [getattr(r, figure) for r in results.values() if getattr(r, figure) is not None]
        values = [v for v in values if v > 0]
        if len(values) >= 2:
            medians[figure] = statistics.median_low(values)
    verdicts: dict[str, Verdict] = {}
    for node_id, r in results.items():
        if not r.ok and (r.stage not in COLLECTIVE_STAGES or not local_failures):
            verdicts[node_id] = Verdict(
                "failed", f"check failed at {r.stage or 'an unknown stage'}: {r.error}"
            )
            continue
        slow = []
        for figure, name in (("matmul_s", "matmul"), ("allreduce_s", "allreduce")):
            value, median = getattr(r, figure), medians.get(figure)
            if value is not None and median is not None and value > factor * median:
                ratio = value / median
                slow.append(f"{name} {format_ms(value)} is {ratio:.1f}x the median {format_ms(median)}")
        if slow:
            verdicts[node_id] = Verdict("slow", "; ".join(slow) + f" (--node-check-factor {factor:g})")
        elif not r.ok:
            blamed = ", ".join(local_failures)
            verdicts[node_id] = Verdict("ok", f"its {r.stage} failed because node(s) {blamed} failed")
        else:
            verdicts[node_id] = Verdict("ok")
    return verdicts


@dataclass
class NodeCheck:
    """The job's node-check state: which rounds were check rounds, results, verdicts, excluded nodes."""

    mode: str = "off"  # off | on | warn
    factor: float = 3.0
    done: bool = False
    rounds: set[int] = field(default_factory=set)
    results: dict[str, NodeCheckResult] = field(default_factory=dict)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    #: Excluded node id -> the line its agent is sent (and exits with).
    excluded: dict[str, str] = field(default_factory=dict)

    def covers(self, round_number: int) -> bool:
        """Whether ``round_number`` is (or, closing now while the check is pending, becomes) a check round."""
        if self.mode == "off":
            return False
        if not self.done and round_number not in self.rounds:
            self.rounds.add(round_number)
            self.results.clear()  # a check round repeated (a node died or left): every node checks again
        return round_number in self.rounds

    def record(self, node_id: str, round_number: int, result: NodeCheckResult) -> bool:
        """Keep a node's result of the running check round; False when it is late, of no check round, or
        already known (an agent repeats its result in every heartbeat until the verdict)."""
        if self.done or round_number not in self.rounds or self.results.get(node_id) == result:
            return False
        self.results[node_id] = result
        return True

    def complete(self, members: list[str]) -> bool:
        return not self.done and bool(members) and all(m in self.results for m in members)

    def decide(self, members: list[str]) -> list[tuple[EventKind, str]]:
        """Judge the members' results; record verdicts and exclusions; return event lines (kind, message)."""
        results = {m: self.results[m] for m in members if m in self.results}
        self.verdicts = judge(results, self.factor)
        self.done = True
        events: list[tuple[EventKind, str]] = []
        for node_id in members:
            verdict = self.verdicts.get(node_id)
            if verdict is None:
                continue
            figures = describe_figures(results[node_id])
            if not verdict.bad:
                note = f" ({verdict.reason})" if verdict.reason else ""
                events.append((EventKind.NODE_CHECK, f"node check: node {node_id} ok: {figures}{note}"))
            elif self.mode == "on":
                self.excluded[node_id] = (
                    f"node {node_id} was excluded from the job by the node check ({verdict.describe()}; "
                    f"{figures}); the job goes on without it"
                )
                events.append(
                    (
                        EventKind.NODE_EXCLUDED,
                        f"node check: node {node_id} excluded: {verdict.describe()}; {figures}",
                    )
                )
            else:
                events.append(
                    (
                        EventKind.NODE_CHECK,
                        f"node check: node {node_id} {verdict.describe()}; {figures} (warn only)",
                    )
                )
        return events

    # -- persistence ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "done": self.done,
            "rounds": sorted(self.rounds),
            "results": {n: r.model_dump() for n, r in self.results.items()},
            "verdicts": {n: [v.kind, v.reason] for n, v in self.verdicts.items()},
            "excluded": dict(self.excluded),
        }

    def restore(self, data: dict | None) -> None:
        if not data:
            return
        self.done = bool(data.get("done"))
        self.rounds = set(data.get("rounds", []))
        self.results = {n: NodeCheckResult(**r) for n, r in data.get("results", {}).items()}
        self.verdicts = {n: Verdict(k, reason) for n, (k, reason) in data.get("verdicts", {}).items()}
        self.excluded = dict(data.get("excluded", {}))
