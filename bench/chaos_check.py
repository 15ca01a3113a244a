"""The chaos harness's accounting and final check, from the workers' step logs and the master's event
log (bench/chaos.py; the log format is bench/chaos_train.py's).

* **Surviving lineage**: for each step, the lines of the newest round that logged it (a step redone after
  a rollback is logged again by a later round, and that one stands).
* **Samples exactly once**: in the lineage, every step has a line of every rank of its round, and every
  finished epoch's samples occur exactly once.
* **Redone steps**: a (round, step) logged by a round whose lineage did not keep it: work done twice.
  (A rank logs a step's samples just before the gradients' all-reduce: a step that completed has the line
  of every rank.)
* **Steps lost**: a step flash-saved by every rank of its round (its ``saved`` lines), then dropped because
  a later round resumed from an earlier step. Redone steps that were not saved everywhere are badput, not
  lost.
* **Badput buckets**: the master's recovery phases (``first_step`` events of ``--event-log``:
  ``detect`` -> detection (not a scale-up's: the world trains while the joined node waits),
  ``rendezvous`` -> rendezvous, ``restart`` -> re-form, ``first_step`` -> restore), the redone steps at
  the fault-free step time, the time below the minimum node count (waiting for nodes, taken out of
  rendezvous) and the rest (other). They sum to the wall time.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BUCKETS = ("detection", "rendezvous", "re_form", "restore", "redone_steps", "waiting_for_nodes", "other")
PHASE_BUCKET = {
    "detect": "detection",
    "rendezvous": "rendezvous",
    "restart": "re_form",
    "first_step": "restore",
}


@dataclass
class StepLine:
    round: int
    step: int
    epoch: int
    world: int
    rank: int
    t: float
    rows: list[int]


@dataclass
class Resume:
    round: int
    step: int
    world: int
    rank: int
    t: float


@dataclass
class Logs:
    steps: list[StepLine] = field(default_factory=list)  # samples contributed (before the all-reduce)
    saves: list[Resume] = field(default_factory=list)  # a step flash-saved (same fields as a resume)
    resumes: list[Resume] = field(default_factory=list)


def read_logs(folder: Path) -> Logs:
    logs = Logs()
    for path in sorted(folder.glob("pid*.log")):
        for line in path.read_text().splitlines():
            parts = line.split()
            try:
                if parts and parts[0] in ("resume", "saved"):
                    r, s, w, k = map(int, parts[1:5])
                    (logs.resumes if parts[0] == "resume" else logs.saves).append(
                        Resume(r, s, w, k, float(parts[5]))
                    )
                elif len(parts) >= 6:
                    r, s, e, w, k = map(int, parts[:5])
                    logs.steps.append(StepLine(r, s, e, w, k, float(parts[5]), [int(x) for x in parts[6:]]))
            except (ValueError, IndexError):
                continue  # a line cut by a SIGKILL mid-write
    return logs


@dataclass
class Lineage:
    """The surviving lineage and what the logs say about it."""

    final_step: int
    samples_exactly_once: bool
    problems: list[str]
    redone_steps: int
    steps_lost: int
    finished_epochs: int


def lineage(logs: Logs, final_step: int, num_samples: int, batch: int) -> Lineage:
    by_step: dict[int, dict[int, list[StepLine]]] = defaultdict(lambda: defaultdict(list))
    for line in logs.steps:
        by_step[line.step][line.round].append(line)
    problems: list[str] = []
    kept: dict[int, list[StepLine]] = {}
    redone = 0
    for step in range(1, final_step + 1):
        rounds = by_step.get(step)
        if not rounds:
            problems.append(f"step {step}: no line")
            continue
        newest = max(rounds)
        redone += len(rounds) - 1
        lines = rounds[newest]
        world = lines[0].world
        if sorted(line.rank for line in lines) != list(range(world)):
            problems.append(
                f"step {step}: round {newest} logged ranks {sorted(x.rank for x in lines)} of {world}"
            )
        kept[step] = lines
    redone += sum(len(r) for s, r in by_step.items() if s > final_step)  # trained past the end: redone
    per_epoch = num_samples // batch
    finished = final_step // per_epoch
    for epoch in range(finished):
        rows: list[int] = []
        for step in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1):
            rows += [i for line in kept.get(step, []) for i in line.rows if line.epoch == epoch]
        if len(rows) != per_epoch * batch or len(set(rows)) != len(rows):
            problems.append(
                f"epoch {epoch}: {len(rows)} samples, {len(set(rows))} distinct of {per_epoch * batch}"
            )
    return Lineage(final_step, not problems, problems[:20], redone, steps_lost(logs), finished)


def steps_lost(logs: Logs) -> int:
    """Steps saved by every rank of their round and then dropped by a later round's resume."""
    saved_by: dict[tuple[int, int], set[int]] = defaultdict(set)
    worlds: dict[tuple[int, int], int] = {}
    for line in logs.saves:
        saved_by[(line.round, line.step)].add(line.rank)
        worlds[(line.round, line.step)] = line.world
    complete = sorted((r, s) for (r, s), ranks in saved_by.items() if len(ranks) == worlds[(r, s)])
    resumes: dict[int, int] = {}
    for res in logs.resumes:
        resumes[res.round] = max(resumes.get(res.round, 0), res.step)
    lost: set[int] = set()
    for round_, step in resumes.items():
        lost |= {s for r, s in complete if r < round_ and s > step}
    return len(lost)


def step_time(logs: Logs, world: int, before: float) -> float | None:
    """The fault-free median step time at ``world``: rank 0's step intervals before ``before`` (the first
    fault), within one round."""
    lines = sorted(
        (x for x in logs.saves if x.rank == 0 and x.world == world and x.t < before), key=lambda x: x.t
    )
    gaps = [
        b.t - a.t
        for a, b in zip(lines, lines[1:], strict=False)
        if a.round == b.round and b.step == a.step + 1
    ]
    return statistics.median(gaps[1:] or gaps) if gaps else None


def rank0_timeline(logs: Logs) -> list[Resume]:
    """Rank 0's saved steps in time order: when each step was done."""
    return sorted((x for x in logs.saves if x.rank == 0), key=lambda x: x.t)


def recovery_s(timeline: list[Resume], at: float, until: float) -> float | None:
    """Seconds from a fault at ``at`` to the first step of a round newer than the one running then, when
    such a round stepped before ``until`` (the next injection), else to the next step at all (a fault the
    job rode through); None: no step after it at all (unrecovered)."""
    running = max((x.round for x in timeline if x.t <= at), default=-1)
    newer = next((x for x in timeline if x.t > at and x.round > running), None)
    if newer is not None and newer.t <= until:
        return newer.t - at
    nxt = next((x for x in timeline if x.t > at), None)
    return None if nxt is None else nxt.t - at


def degraded_s(timeline: list[Resume], full_world: int) -> float:
    return sum(b.t - a.t for a, b in zip(timeline, timeline[1:], strict=False) if b.world < full_world)


def read_phases(paths: list[Path]) -> dict[str, float]:
    """Summed recovery phases of every finished recovery in the masters' event logs."""
    total = dict.fromkeys(PHASE_BUCKET, 0.0)
    seen: set[tuple] = set()
    for event in read_events(paths):
        if event.get("kind") != "first_step" or not event.get("durations"):
            continue
        key = (event.get("round"), event.get("term"), json.dumps(event["durations"], sort_keys=True))
        if key in seen:  # a standby that took over re-reads nothing, but be safe with two files
            continue
        seen.add(key)
        for phase, value in event["durations"].items():
            # A scale-up's detection (a joined node waiting for the last call) is no lost time: the
            # world trains until the verdict (master.job.accounting.goodput_of leaves it out too).
            if phase in total and not (phase == "detect" and event.get("cause") == "scale_up"):
                total[phase] += float(value)
    return total


def read_events(paths: list[Path]) -> Iterator[dict]:
    """Every event of the masters' event logs ``paths`` (missing files and cut lines skipped)."""
    for path in paths:
        if not path.exists():
            continue
        for text in path.read_text().splitlines():
            try:
                event = json.loads(text)
            except ValueError:
                continue  # a line cut by a SIGKILL mid-write
            if isinstance(event, dict):
                yield event


#: The master's events that exclude a node from the job (its agent then exits 4, ExitCode.NODE_UNHEALTHY).
EXCLUSION_KINDS = frozenset(
    {"node_flapping_excluded", "node_suspect_excluded", "straggler_evicted", "node_excluded"}
)


def exclusions(paths: list[Path]) -> dict[str, str]:
    """The nodes the masters' event logs say were excluded from the job, each with the event's message."""
    found: dict[str, str] = {}
    for event in read_events(paths):
        if event.get("kind") in EXCLUSION_KINDS and isinstance(event.get("node"), str):
            found[event["node"]] = str(event.get("message", event["kind"]))
    return found


def badput(
    wall_s: float, good_s: float, phases: dict[str, float], redone_s: float, below_min_s: float
) -> dict[str, float]:
    """The named buckets, summing to ``wall_s - good_s``; ``other`` is what nothing else explains."""
    out = dict.fromkeys(BUCKETS, 0.0)
    for phase, bucket in PHASE_BUCKET.items():
        out[bucket] += phases.get(phase, 0.0)
    out["waiting_for_nodes"] = min(below_min_s, out["rendezvous"])
    out["rendezvous"] -= out["waiting_for_nodes"]
    out["redone_steps"] = redone_s
    out["other"] = wall_s - good_s - sum(v for k, v in out.items() if k != "other")
    return {k: round(v, 3) for k, v in out.items()}
