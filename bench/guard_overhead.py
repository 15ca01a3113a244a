"""What the integrity guard (``elastic.Guard``, docs/integrity.md) costs per step, per model size, side by
side with the guard off in the same processes, and whether normal training trips it.

A world of ``--world`` gloo processes on this machine (``OMP_NUM_THREADS=1``, no agent: the guard is used
from a hand-written loop, as any script may), each a DDP replica with SGD and momentum (replicated optimizer
state, in the digest) and steps with no sleep (``--step-time 0``). Per model size:

- ``example``: the example script's MLP (scripts/train_script.py), batch 32;
- ``1gb``: one ``Linear(16384, 16384)`` (268 M float32 parameters, 1 GiB; with momentum 2 GiB of state),
  batch 8.

Blocks of ``--block`` steps alternate guard off and guard on (A B A B), after a warm-up of each; the guard
keeps its default budget (1 % of the step time), so for a large state it checks a rotating subset of parts,
one part a step, and its detection bound in steps is reported (``parts``). Reported: the median step time
off and on, the overhead in percent of the step time off (target: at most 1 %), the bound. The guard's
call is inside the timed step: its digest, its non-finite gradient check and its one small collective.

``--false-steps N`` (default 10,000): then N steps of the example model with the guard on, counting its
detections (target: 0 over normal training).

    python bench/guard_overhead.py                     # both sizes, then 10,000 steps
    python bench/guard_overhead.py --smoke             # tiny: checks the script
    python bench/guard_overhead.py --json guard.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402

#: Model sizes: (layer widths or the one square layer's side, batch size).
SIZES = {"example": "example", "1gb": 16384}
TARGET_PCT = 1.0


def worker(args: argparse.Namespace) -> None:
    """One rank: the blocks, then the false-detection run; rank 0 prints one JSON line per figure."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import elastic

    elastic.init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    results: dict[str, object] = {"size": args.size}

    def build(size: str) -> tuple[nn.Module, int, int]:
        torch.manual_seed(0)
        if size == "example":
            sys.path.insert(0, str(c.REPO / "scripts"))
            import train_script

            return train_script.make_model(0), train_script.IN_FEATURES, 32
        side = int(size) if size.isdigit() else SIZES[size]
        return nn.Linear(int(side), int(side), bias=False), int(side), 8

    model, features, batch = build(args.size)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, features, generator=gen)
    out_features = next(reversed(list(model.parameters()))).shape[0]
    y = torch.randn(batch, out_features, generator=gen)
    guard = elastic.Guard(raise_on_detection=False)
    step = 0

    def one_step(checked: bool) -> float:
        nonlocal step
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        step += 1
        if checked:
            guard.after_step(step, loss, ddp, optimizer)
        return time.perf_counter() - began

    off: list[float] = []
    on: list[float] = []
    for _ in range(args.warmup):  # the allocator, DDP's buckets, the guard's calibration (its second call)
        one_step(False)
    for _ in range(args.warmup):
        one_step(True)
    for block in range(2 * args.blocks):
        checked = block % 2 == 1
        times = [one_step(checked) for _ in range(args.block)]
        (on if checked else off).extend(times)
    results.update(
        bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        parts=guard.parts,
        step_off_s=statistics.median(off),
        step_on_s=statistics.median(on),
        detections=guard.detections,
    )
    if args.false_steps and args.size == "example":
        before = guard.detections
        began = time.perf_counter()
        for _ in range(args.false_steps):
            one_step(True)
        results.update(
            false_steps=args.false_steps,
            false_detections=guard.detections - before,
            false_run_s=time.perf_counter() - began,
        )
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    elastic.destroy_process_group()


@dataclass
class SizeResult:
    """One model size's figures (the JSON's ``runs``)."""

    size: str
    bytes: int
    parts: int
    step_off_s: float
    step_on_s: float
    detections: int
    overhead_pct: float = 0.0
    met: bool = False
    false_steps: int | None = None
    false_detections: int | None = None
    false_run_s: float | None = None


def run_size(args: argparse.Namespace, size: str, false_steps: int) -> SizeResult:
    port = c.free_port()
    procs = []
    for rank in range(args.world):
        env = c.bench_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        argv = [sys.executable, __file__, "--worker", "--size", size, "--block", str(args.block)]
        argv += ["--blocks", str(args.blocks), "--warmup", str(args.warmup)]
        argv += ["--false-steps", str(false_steps)]
        procs.append(
            subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=args.timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank of size {size} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    result = SizeResult(**json.loads(line.removeprefix("RESULT ")))
    result.overhead_pct = round(100 * (result.step_on_s - result.step_off_s) / result.step_off_s, 2)
    result.met = result.overhead_pct <= TARGET_PCT
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="example,1gb", help="comma-separated: example, 1gb, or a layer side")
    p.add_argument("--world", type=int, default=2, help="replicas (processes)")
    p.add_argument("--block", type=int, default=0, help="steps per block (default: 200 example, 5 others)")
    p.add_argument("--blocks", type=int, default=4, help="blocks of each (off, on), alternated")
    p.add_argument("--warmup", type=int, default=3, help="steps before the blocks, of each")
    p.add_argument("--false-steps", type=int, default=10_000, help="example-model steps counting detections")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per size")
    p.add_argument("--smoke", action="store_true", help="tiny: the example and a 256-wide layer, few steps")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", default="example", help=argparse.SUPPRESS)
    c.add_json_option(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.sizes, args.blocks, args.warmup, args.false_steps, args.block = "example,256", 2, 3, 50, 5
    results: list[SizeResult] = []
    for size in args.sizes.split(","):
        block = args.block or (200 if size == "example" else 5)
        results.append(
            run_size(argparse.Namespace(**{**vars(args), "block": block}), size, false_steps(args, size))
        )
        print(json.dumps(asdict(results[-1])), flush=True)
    rows = [
        [
            r.size, f"{r.bytes / 2**20:.1f}", r.parts, f"{r.step_off_s * 1e3:.2f}",
            f"{r.step_on_s * 1e3:.2f}", f"{r.overhead_pct:+.2f}", "met" if r.met else "NOT met",
        ]
        for r in results
    ]  # fmt: skip
    headers = ["model", "parameters MiB", "parts (detection bound, steps)", "step, guard off (ms)",
               "step, guard on (ms)", "overhead %", f"<= {TARGET_PCT:g} %"]  # fmt: skip
    lines = [
        f"{args.world} replicas (gloo, CPU, `OMP_NUM_THREADS=1`), DDP + SGD with momentum, no sleep in the "
        f"step; blocks of guard off and on alternated ({args.blocks} of each), medians of the steps' times; "
        "the guard at its default budget (1 % of the step time).",
        "",
        c.table(headers, rows),
    ]
    for r in results:
        if r.false_steps:
            lines += [
                "",
                f"False detections over {r.false_steps} steps of normal training ({r.size} model, guard on): "
                f"{r.false_detections} (target 0), in {r.false_run_s or 0:.1f} s.",
            ]
    c.emit_report(args, "Integrity guard: overhead per model size", "\n".join(lines))
    if args.json:
        data = {
            "benchmark": "guard_overhead",
            "command": c.command_line(),
            "runs": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    # A smoke run checks the script, not the machine's speed: only a false detection fails it.
    ok = all((r.met or args.smoke) and not r.false_detections for r in results)
    return 0 if ok else 1


def false_steps(args: argparse.Namespace, size: str) -> int:
    """The false-detection run goes with the example model only."""
    return args.false_steps if size == "example" else 0


if __name__ == "__main__":
    sys.exit(main())
