"""Worker-crash recovery (issue 7 item 1, issue 8 target): 1 node x 2 workers, standalone, --max-restarts 3.

Each run starts the workload, waits for step S, SIGKILLs the rank-1 worker and measures the time from the
kill to the first step completed after the restart (rank 0's line), split into kill -> new worker started
(its first line), -> process group initialized, -> step done; and the steps lost (last step completed
before the crash minus the step the restart resumed from). A run that shows no step within --timeout
seconds of the kill is recorded as "did not recover" and killed.

    python bench/recovery.py                 # 5 runs of each tool, alternated
    python bench/recovery.py --runs 20       # issue 8's check
    python bench/recovery.py --smoke
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402

TARGET_RATIO = 0.3


@dataclass
class Outcome:
    tool: str
    recovered: bool
    note: str = ""
    to_start: float | None = None
    to_init: float | None = None
    to_step: float | None = None
    lost: int | None = None
    restarts: int | None = None  # TORCHELASTIC_RESTART_COUNT of the attempt that trained again


def launch_argv(tool: c.Tool, ckpt: Path, step_time: float) -> list[str]:
    extra = ["--rdzv-backend=c10d"] if tool.name.startswith("torchrun") else []
    return tool.cmd(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        *extra,
        str(c.WORKLOAD),
        "--ckpt-dir",
        str(ckpt),
        "--step-time",
        str(step_time),
    )


def one_run(
    tool: c.Tool, folder: Path, kill_step: int, step_time: float, start_timeout: float, timeout: float
) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    with c.Group(folder) as group:
        proc = group.launch(launch_argv(tool, folder / "ckpt", step_time), "launcher", env=tool.environ())

        def reached() -> dict | None:
            return c.first(proc.events(), kind="step", rank=0, step=lambda s: s >= kill_step)

        if not c.wait_until(reached, start_timeout, tick=proc.track):
            return Outcome(tool.name, False, f"never reached step {kill_step} (exit {proc.popen.poll()})")
        victim = c.first(proc.events(), kind="start", rank=1)
        proc.track()
        ident = proc.known.get(victim["pid"]) if victim else None
        if ident is None:
            return Outcome(tool.name, False, "rank-1 worker not found among the launcher's descendants")
        t_kill = c.time.time()
        c.sigkill(ident)

        def restarted() -> tuple[dict, dict | None, dict | None] | None:
            events = proc.events()
            starts = [
                i for i, e in enumerate(events) if e["kind"] == "start" and e["rank"] == 0 and e["t"] > t_kill
            ]
            if not starts:
                return None
            later = events[starts[0] :]
            step = c.first(later, kind="step", rank=0)
            if step is None:
                return None
            return events[starts[0]], c.first(later, kind="init", rank=0), step

        found = c.wait_until(lambda: restarted() or (not proc.alive() and "exited"), timeout, tick=proc.track)
        if not found or found == "exited":
            why = f"launcher exited with {proc.popen.returncode}" if found else f"no step within {timeout:g}s"
            return Outcome(tool.name, False, f"{why}; {_after_kill(proc.events(), t_kill)}")
        start, init, step = found
        events = proc.events()
        before = [e["step"] for e in events if e["kind"] == "step" and e["rank"] == 0 and e["t"] < start["t"]]
        lost = (max(before) if before else 0) - start["resumed"]
        return Outcome(
            tool.name,
            True,
            "",
            start["t"] - t_kill,
            init["t"] - t_kill if init else None,
            step["t"] - t_kill,
            lost,
            step.get("restart"),
        )


def _after_kill(events: list[dict], t_kill: float) -> str:
    """What the workers did after the kill, for a run that did not recover."""
    after = [e for e in events if e["t"] > t_kill]
    starts = [e for e in after if e["kind"] == "start"]
    if not starts:
        return "no new worker started"
    parts = []
    for restart in sorted({e["restart"] for e in starts}):
        started = [e for e in starts if e["restart"] == restart]
        inits = [e for e in after if e["kind"] == "init" and e["restart"] == restart]
        parts.append(
            f"restart {restart}: {len(started)} worker(s) started at +{started[0]['t'] - t_kill:.1f}s, "
            + (f"{len(inits)} initialized the process group" if inits else "none got past init_process_group")
        )
    return "; ".join(parts)


def _counts(values: list[int | None]) -> str:
    """``1: 4, 2: 1`` (how many runs needed how many restarts)."""
    found = sorted({v for v in values if v is not None})
    return ", ".join(f"{v}: {values.count(v)}" for v in found) or "n/a"


def report(tools: list[c.Tool], results: list[Outcome], runs: int, kill_step: int, timeout: float) -> str:
    rows = []
    medians: dict[str, float | None] = {}
    for tool in tools:
        mine = [r for r in results if r.tool == tool.name]
        ok = [r for r in mine if r.recovered]
        step = c.Stat([r.to_step for r in ok])
        medians[tool.name] = step.median
        rows.append(
            [
                tool.name,
                f"{len(ok)}/{len(mine)}",
                step.fmt(2),
                c.Stat([r.to_start for r in ok]).fmt(2),
                c.Stat([r.to_init for r in ok if r.to_init is not None]).fmt(2),
                c.Stat([float(r.lost) for r in ok]).fmt(0),
                _counts([r.restarts for r in ok]),
            ]
        )
    out = [
        f"1 node x 2 workers, standalone, `--max-restarts 3`; SIGKILL of the rank-1 worker at step "
        f"{kill_step}; {runs} run(s) of each tool, alternated. Seconds from the kill; a run with no step "
        f"within {timeout:g} s of the kill counts as not recovered.",
        "",
        c.table(
            [
                "tool",
                "recovered",
                "kill -> first step (s)",
                "kill -> worker up (s)",
                "kill -> pg init (s)",
                "steps lost",
                "restarts used (value: runs)",
            ],
            rows,
        ),
    ]
    base = medians.get("torchrun")
    el = medians.get("elastic-run")
    if "torchrun" in medians and "elastic-run" in medians:
        verdict = "n/a"
        if el is not None and base:
            verdict = "met" if el / base <= TARGET_RATIO else "NOT met"
        out += [
            "",
            f"Ratio elastic-run / torchrun (median kill -> first step): **{c.ratio(el, base)}** "
            f"(target <= {TARGET_RATIO}x: {verdict}).",
        ]
    out += c.before_after(medians, "torchrun", "median kill -> first step")
    failures = [r for r in results if not r.recovered]
    if failures:
        out += ["", "Runs that did not recover:"] + [f"- {r.tool}: {r.note}" for r in failures]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(__doc__.splitlines()[0], runs=5, tools=f"elastic-run,{c.EXEC_TOOL},torchrun")
    p.add_argument("--kill-step", type=int, default=10, help="SIGKILL rank 1 once rank 0 completed this step")
    p.add_argument("--step-time", type=float, default=0.05, help="workload --step-time")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds after the kill before giving up")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds to reach the kill step")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.kill_step = 1, 3
    tools = c.selected_tools(args)
    results = []
    with c.workdir(args.workdir) as root:
        for i, tool in c.alternate(tools, args.runs):
            c.log(f"recovery run {i + 1}/{args.runs}: {tool.name}")
            r = one_run(
                tool,
                root / f"run{i}-{tool.name}",
                args.kill_step,
                args.step_time,
                args.start_timeout,
                args.timeout,
            )
            c.log(f"  -> {r}")
            results.append(r)
            c.cleanup(c.log)
    c.emit_report(
        args, "Worker-crash recovery", report(tools, results, args.runs, args.kill_step, args.timeout)
    )
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
