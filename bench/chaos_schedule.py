"""The chaos harness's seeded schedule: which faults, when, with which parameters (bench/chaos.py).

The schedule is computed before the run from the seed alone and printed first, so a seed replays the same
faults at the same times. Targets (which node, which worker) are drawn as fractions in [0, 1) and mapped
onto the live nodes, sorted by name, when the fault is injected.

Node counts are planned here too, so that the kinds that change membership stay within ``--nnodes 2:4``
deterministically: a node loss or a partition needs two live nodes (one survives and holds the checkpoint
in memory; a cut-off node counts as lost until the cut heals), a preemption three (the job keeps its
minimum), a spare join fewer than four planned nodes (a replacement that is still pending counts).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

#: Every kind, in the issue's order. The cheap ones need nothing but signals and new processes.
CHEAP_KINDS = (
    "worker_kill",
    "worker_stop",
    "node_loss",
    "preemption",
    "spare_join",
    "master_kill",
    "master_term",
    "etcd_kill",
    "etcd_stop",
)
#: Kinds that need root (an nft rule that drops a node's packets).
ROOT_KINDS = ("partition",)
MIN_NODES, MAX_NODES = 2, 4
#: One injection in PAIR_EVERY is two faults at once.
PAIR_EVERY = 10


@dataclass
class Fault:
    """One fault of an injection: its kind and its drawn parameters."""

    kind: str
    target: float  # a fraction: which of the live nodes (sorted) and which of its workers
    #: worker_stop: seconds stopped; etcd_stop: seconds stopped; node_loss: seconds to the replacement.
    duration_s: float = 0.0
    #: worker_stop: the stop ends in SIGKILL instead of SIGCONT.
    kill_after: bool = False


@dataclass
class Injection:
    """One or two faults at ``at`` seconds after the job's first step."""

    at: float
    faults: list[Fault] = field(default_factory=list)

    def line(self) -> str:
        parts = []
        for f in self.faults:
            extra = ""
            if f.kind == "worker_stop":
                extra = f" {f.duration_s:.1f}s then {'SIGKILL' if f.kill_after else 'SIGCONT'}"
            elif f.kind in ("node_loss", "etcd_stop", "partition"):
                extra = f" {f.duration_s:.1f}s"
            parts.append(f"{f.kind}(target={f.target:.3f}{extra})")
        return f"t={self.at:7.1f}s  " + " + ".join(parts)


def draw(rng: random.Random, kind: str) -> Fault:
    """The issue's fixed parameters for ``kind``."""
    fault = Fault(kind, rng.random())
    if kind == "worker_stop":
        fault.duration_s = rng.uniform(2.0, 10.0)
        fault.kill_after = rng.random() < 1 / 3
    elif kind == "node_loss":
        fault.duration_s = rng.uniform(5.0, 30.0)
    elif kind == "etcd_stop":
        fault.duration_s = rng.uniform(2.0, 8.0)
    elif kind == "partition":
        fault.duration_s = rng.uniform(5.0, 20.0)
    return fault


class _Plan:
    """The planned node count over time (live now, and replacements pending until a time)."""

    def __init__(self, start_nodes: int) -> None:
        self.live = start_nodes
        self.pending: list[float] = []  # when each pending replacement joins

    def advance(self, now: float) -> None:
        self.live += sum(1 for t in self.pending if t <= now)
        self.pending = [t for t in self.pending if t > now]

    def eligible(self, kind: str) -> bool:
        if kind in ("node_loss", "partition"):
            return self.live >= MIN_NODES
        if kind == "preemption":
            return self.live > MIN_NODES
        if kind == "spare_join":
            return self.live + len(self.pending) < MAX_NODES
        return True

    def apply(self, fault: Fault, now: float) -> None:
        if fault.kind in ("node_loss", "partition"):  # a cut-off node is back when the cut heals
            self.live -= 1
            self.pending.append(now + fault.duration_s)
        elif fault.kind == "preemption":
            self.live -= 1
        elif fault.kind == "spare_join":
            self.live += 1


def schedule(
    seed: int, duration: float, interval: float, kinds: tuple[str, ...], start_nodes: int = 3
) -> list[Injection]:
    """One injection every ``interval`` s from ``interval`` to ``duration``; the first ``len(kinds)`` are
    one of each kind in a seeded order (coverage does not depend on the seed), then kinds are drawn with
    equal weight among those the node plan allows; one injection in :data:`PAIR_EVERY` is a pair."""
    rng = random.Random(seed)
    plan = _Plan(start_nodes)
    first = list(kinds)
    rng.shuffle(first)
    out: list[Injection] = []
    at = interval
    while at <= duration:
        plan.advance(at)
        injection = Injection(round(at, 3))
        count = 2 if out and len(out) >= len(kinds) and rng.randrange(PAIR_EVERY) == 0 else 1
        for _ in range(count):
            if first:
                kind = next((k for k in first if plan.eligible(k)), None)
                if kind is not None:
                    first.remove(kind)
            else:
                allowed = [
                    k for k in kinds if plan.eligible(k) and k not in {f.kind for f in injection.faults}
                ]
                kind = rng.choice(allowed) if allowed else None
            if kind is None:
                kind = "worker_kill"  # every other kind is ruled out by the node plan right now
            fault = draw(rng, kind)
            plan.apply(fault, at)
            injection.faults.append(fault)
        out.append(injection)
        at += interval
    return out


def as_json(injections: list[Injection]) -> list[dict]:
    return [asdict(i) for i in injections]
