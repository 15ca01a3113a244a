"""Launch overhead: launch -> first completed training step, standalone, 1 node.

Times are split at the workload's own lines: launch -> first worker started (launcher start-up, rendezvous,
spawn, interpreter start and ``import torch``), -> all workers initialized the process group, -> first
step completed on every rank.

    python bench/launch.py                   # 5 runs of each tool, alternated, 2 workers
    python bench/launch.py --smoke
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402


@dataclass
class Outcome:
    tool: str
    ok: bool
    note: str = ""
    to_start: float | None = None
    to_init: float | None = None
    to_step: float | None = None
    exit_s: float | None = None  # last step -> launcher exited


def one_run(tool: c.Tool, folder: Path, args) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    extra = ["--rdzv-backend=c10d"] if tool.name.startswith("torchrun") else []
    argv = tool.cmd(
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        *extra,
        str(c.WORKLOAD),
        "--ckpt-dir",
        str(folder / "ckpt"),
        "--steps",
        str(args.steps),
        "--step-time",
        "0",
    )
    with c.Group(folder) as group:
        proc = group.launch(argv, "launcher", env=tool.environ())
        t0 = proc.started

        def done() -> bool:
            steps = {e["rank"] for e in proc.events() if e["kind"] == "step" and e["step"] == 1}
            return len(steps) == args.nproc

        if not c.wait_until(done, args.timeout, tick=proc.track):
            return Outcome(tool.name, False, f"no first step on all ranks within {args.timeout:g}s")
        rc = proc.reap(args.timeout)
        t_exit = c.time.time()
        events = proc.events()
        starts = [e["t"] for e in events if e["kind"] == "start"]
        inits = [e["t"] for e in events if e["kind"] == "init"]
        steps = [e["t"] for e in events if e["kind"] == "step" and e["step"] == 1]
        last = max(e["t"] for e in events if e["kind"] in ("step", "done"))
        note = "" if rc == 0 else f"launcher exit code {rc}"
        return Outcome(
            tool.name,
            rc == 0,
            note,
            min(starts) - t0,
            max(inits) - t0,
            max(steps) - t0,
            t_exit - last if rc is not None else None,
        )


def report(tools: list[c.Tool], results: list[Outcome], args) -> str:
    rows, medians = [], {}
    for tool in tools:
        mine = [r for r in results if r.tool == tool.name]
        ok = [r for r in mine if r.ok]
        stat = c.Stat([r.to_step for r in ok])
        medians[tool.name] = stat.median
        rows.append(
            [
                tool.name,
                f"{len(ok)}/{len(mine)}",
                stat.fmt(2),
                c.Stat([r.to_start for r in ok]).fmt(2),
                c.Stat([r.to_init for r in ok]).fmt(2),
                c.Stat([r.exit_s for r in ok if r.exit_s is not None]).fmt(2),
            ]
        )
    out = [
        f"Standalone, 1 node x {args.nproc} workers, {args.steps} steps without sleep; {args.runs} run(s) "
        "of each tool, alternated. Seconds from the launcher's start.",
        "",
        c.table(
            [
                "tool",
                "ok",
                "launch -> first step (s)",
                "-> first worker up (s)",
                "-> pg initialized (s)",
                "last step -> launcher exit (s)",
            ],
            rows,
        ),
    ]
    if "elastic-run" in medians and "torchrun" in medians:
        out += [
            "",
            f"Ratio elastic-run / torchrun: **{c.ratio(medians['elastic-run'], medians['torchrun'])}**.",
        ]
    bad = [r for r in results if not r.ok]
    if bad:
        out += ["", "Failed runs:"] + [f"- {r.tool}: {r.note}" for r in bad]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(__doc__.splitlines()[0], runs=5)
    p.add_argument("--nproc", type=int, default=2, help="workers (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run counts as failed")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs = 1
    tools = c.selected_tools(args)
    results = []
    with c.workdir(args.workdir) as root:
        for i, tool in c.alternate(tools, args.runs):
            c.log(f"launch run {i + 1}/{args.runs}: {tool.name}")
            r = one_run(tool, root / f"run{i}-{tool.name}", args)
            c.log(f"  -> {r}")
            results.append(r)
            c.cleanup(c.log)
    c.emit_report(args, "Launch overhead", report(tools, results, args))
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
