"""Numerical integrity end to end: a flipped bit, a NaN gradient and a loss spike are detected, the job
rolls back in process to the newest verified step and ends bitwise equal to a fault-free run, every sample
trained exactly once; a spike at the same step on every replay stops the job with exit code 3.

Each run starts tests/support/integrity_train.py (the example MLP under ``elastic.run`` with an
``elastic.Guard(parts=1)``: the whole state every step, so the bound is 1 step) under ``elastic-run
--standalone --nproc-per-node 3 --quiet``, OMP_NUM_THREADS=1, gloo on CPU, a fixed world of 3 replicas,
and injects one fault (``ELASTIC_TEST_INTEGRITY_FAULT``), chosen in turn and placed by a seeded random
generator:

- ``flip``: one bit (sign, exponent or mantissa, at random) of one weight of a random rank, after the
  optimizer step of a random step;
- ``nan``: a NaN in one gradient of a random rank after its all-reduce, before the update;
- ``spike``: the loss of a random step (past the spike rule's warm-up of 20 losses) times 100, every rank.

Per run (the JSON's ``runs``): ``fault``, ``step`` (where it was injected), ``rank``, ``bit``, ``detected``
(rank 0 printed a detection), ``steps_to_detect`` (the detection's step minus the fault's, plus 1: 1 means
found at the step it happened), ``kind`` and ``named`` (the ranks the verdict named; ``named_ok``: the
faulty rank alone for flip and nan, at 3 replicas), ``rolled_back_to``, ``exit_code``, ``bitwise_equal``
(``torch.equal`` of every tensor of the final weights against the fault-free run's) and
``samples_exactly_once`` (steps 1..N each logged by every rank, the newest line winning, no sample index
twice in an epoch). The JSON's ``recurring`` says whether a spike injected at the same step on every replay
ended the job with exit code 3 after exactly one rollback.

    python bench/integrity.py                  # 20 runs and the recurring one
    python bench/integrity.py --smoke          # one flip run
    python bench/integrity.py --runs 3 --json integrity.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402

SCRIPT = c.REPO / "tests" / "support" / "integrity_train.py"
DETECTED = re.compile(r"^\[rank0\]:integrity step=(\d+) kind=(\w+) ranks=([\d,]*) rollback_to=(\w+)$", re.M)
ROLLBACK_LINE = "integrity rollback in process"
FAULTS = ("flip", "nan", "spike")
WORLD = 3
#: The spike rule judges once 20 losses are in (elastic.integrity.rules.DEFAULT_WARMUP).
SPIKE_FROM = 22


@dataclass
class Run:
    fault: str
    step: int
    rank: int | None = None
    bit: int | None = None
    detected: bool = False
    steps_to_detect: int | None = None
    kind: str = ""
    named: list[int] = field(default_factory=list)
    named_ok: bool | None = None
    rolled_back_to: int | None = None
    exit_code: int | None = None
    bitwise_equal: bool | None = None
    samples_exactly_once: bool | None = None
    seconds: float | None = None


def train(work: Path, name: str, steps: int, fault: str = "", timeout: float = 600.0) -> tuple[int, str]:
    """One elastic-run job of ``steps`` steps with ``fault`` injected; its exit code and output."""
    samples = work / name / "samples"
    samples.mkdir(parents=True, exist_ok=True)
    env = c.bench_env(OMP_NUM_THREADS="1")
    if fault:
        env["ELASTIC_TEST_INTEGRITY_FAULT"] = fault
    argv = [
        sys.executable, "-m", "agent", "--standalone", "--nproc-per-node", str(WORLD), "--quiet", str(SCRIPT),
        "--steps", str(steps), "--final-weights", str(work / f"{name}.pt"), "--sample-log", str(samples),
    ]  # fmt: skip
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=c.REPO)
    except subprocess.TimeoutExpired as exc:
        c.cleanup()
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return 124, out
    return proc.returncode, proc.stdout + proc.stderr


def samples_once(folder: Path, steps: int) -> bool:
    """Every step 1..steps logged by each rank (its newest line wins), and no index twice in an epoch."""
    per_epoch: dict[int, list[str]] = {}
    files = list(folder.glob("rank*.log"))
    if len(files) != WORLD:
        return False
    for path in files:
        newest: dict[int, tuple[int, list[str]]] = {}
        for line in path.read_text().splitlines():
            step_text, epoch_text, *rows = line.split()
            newest[int(step_text)] = (int(epoch_text), rows)
        if sorted(newest) != list(range(1, steps + 1)):
            return False
        for epoch, rows in newest.values():
            per_epoch.setdefault(epoch, []).extend(rows)
    return all(len(rows) == len(set(rows)) for rows in per_epoch.values())


def bitwise_equal(a: Path, b: Path) -> bool:
    import torch

    if not a.exists() or not b.exists():
        return False
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def plan(index: int, steps: int, rng: random.Random) -> Run:
    """The ``index``-th run's fault: the kinds in turn, placed at random."""
    fault = FAULTS[index % len(FAULTS)]
    if fault == "spike":
        return Run(fault, rng.randint(SPIKE_FROM, steps - 2))
    run = Run(fault, rng.randint(3, steps - 2), rank=rng.randrange(WORLD))
    if fault == "flip":
        run.bit = rng.choice([31, rng.randint(23, 30), rng.randint(0, 22)])  # sign, exponent, mantissa
    return run


def fault_text(run: Run) -> str:
    if run.fault == "flip":
        return f"flip:{run.step}:{run.rank}:{run.bit}"
    if run.fault == "nan":
        return f"nan:{run.step}:{run.rank}"
    return f"spike:{run.step}"


def judge(run: Run, code: int, out: str, work: Path, name: str, steps: int, reference: Path) -> None:
    run.exit_code = code
    found = DETECTED.findall(out)
    if found:
        step, kind, ranks, target = found[0]
        run.detected = True
        run.steps_to_detect = int(step) - run.step + 1
        run.kind = kind
        run.named = [int(r) for r in ranks.split(",") if r]
        run.rolled_back_to = int(target) if target.isdigit() else None
        if run.fault in ("flip", "nan"):
            run.named_ok = run.named == [run.rank]
    run.bitwise_equal = code == 0 and bitwise_equal(work / f"{name}.pt", reference)
    run.samples_exactly_once = code == 0 and samples_once(work / name / "samples", steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="faulty runs (flip, nan, spike in turn)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--seed", type=int, default=0, help="seeds where each fault goes")
    p.add_argument("--no-recurring", action="store_true", help="skip the recurring-spike run")
    p.add_argument("--smoke", action="store_true", help="one faulty run, no recurring one: checks the script")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    c.add_json_option(p)
    args = p.parse_args()
    if args.smoke:
        args.runs, args.no_recurring = 1, True
    if args.steps < SPIKE_FROM + 2:
        p.error(f"--steps must be at least {SPIKE_FROM + 2} (the spike rule's warm-up)")
    rng = random.Random(args.seed)
    import time

    with c.workdir(args.workdir) as work:
        code, out = train(work, "clean", args.steps)
        if code != 0 or DETECTED.search(out):
            print(
                f"the fault-free run failed or had a detection (exit {code}):\n{out[-3000:]}", file=sys.stderr
            )
            return 1
        reference = work / "clean.pt"
        runs: list[Run] = []
        for i in range(args.runs):
            run = plan(i, args.steps, rng)
            name = f"run{i}"
            began = time.monotonic()
            code, out = train(work, name, args.steps, fault_text(run))
            run.seconds = round(time.monotonic() - began, 2)
            judge(run, code, out, work, name, args.steps, reference)
            runs.append(run)
            print(json.dumps(asdict(run)), flush=True)
        recurring: dict[str, object] = {}
        if not args.no_recurring:
            code, out = train(work, "recurring", args.steps, f"spikeall:{SPIKE_FROM}")
            recurring = {
                "step": SPIKE_FROM,
                "exit_code": code,
                "rollbacks": out.count(ROLLBACK_LINE) // WORLD,
                "stopped_for_good": code == 3 and out.count(ROLLBACK_LINE) == WORLD,
            }
            print(json.dumps({"recurring": recurring}), flush=True)
    rows = [
        [
            r.fault, r.step, "-" if r.rank is None else r.rank, "-" if r.bit is None else r.bit, r.detected,
            r.steps_to_detect, ",".join(map(str, r.named)) or "-", r.rolled_back_to, r.bitwise_equal,
            r.samples_exactly_once, r.seconds,
        ]
        for r in runs
    ]  # fmt: skip
    headers = ["fault", "step", "rank", "bit", "detected", "steps to detect", "named", "rolled back to",
               "bitwise equal", "samples once", "s"]  # fmt: skip
    good = sum(1 for r in runs if r.detected and r.bitwise_equal and r.samples_exactly_once)
    slowest = max((r.steps_to_detect or 0) for r in runs) if runs else "-"
    named = f"{sum(1 for r in runs if r.named_ok)}/{sum(1 for r in runs if r.named_ok is not None)}"
    summary = [
        c.table(headers, rows),
        "",
        f"{good}/{len(runs)} runs detected, rolled back and ended bitwise equal with every sample once; "
        f"odd rank named {named} (flip, nan); max steps to detect {slowest}.",
    ]
    if recurring:
        summary.append(
            f"Recurring spike at step {recurring['step']}: exit code {recurring['exit_code']} after "
            f"{recurring['rollbacks']} rollback(s)."
        )
    c.emit_report(args, "Integrity: detection and rollback", "\n".join(summary))
    if args.json:
        data: dict[str, object] = {
            "benchmark": "integrity",
            "command": c.command_line(),
            "runs": [asdict(r) for r in runs],
            "recurring": recurring,
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return 0 if good == len(runs) and (not recurring or recurring["stopped_for_good"]) else 1


if __name__ == "__main__":
    sys.exit(main())
