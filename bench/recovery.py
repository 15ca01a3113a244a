"""Worker-crash recovery: 1 node x 2 workers, standalone, --max-restarts 3.

Each run starts the workload, waits for step S, SIGKILLs the rank-1 worker and measures the time from the
kill to the first step completed after the restart (rank 0's line), split into kill -> new worker started
(its first line), -> process group initialized, -> step done; and the steps lost (last step completed
before the crash minus the step the restart resumed from). A run that shows no step within --timeout
seconds of the kill is recorded as "did not recover" and killed.

elastic-run runs under an ``elastic-master --event-log`` daemon on 127.0.0.1 (``--nnodes 1``), and each run's
recovery phases from the event log are compared with the benchmark's own timings (within max(10 %, 30 ms); the
mapping: bench/phases.py). ``--no-event-log`` runs it ``--standalone`` instead, without the comparison.

elastic-run-inprocess is elastic-run with the workload inside ``elastic.run`` (in-process recovery): rank 0
keeps its process, so "survivor PID unchanged" (the pid of rank 0's last ``start`` line before the kill equals
that of its first one after) is true there; its ``start`` lines come at each formation of the group, so
"worker up" is when the re-formed group called ``train``. Its target: a median kill -> first step <= 0.15 s.

    python bench/recovery.py                 # 5 runs of each tool, alternated
    python bench/recovery.py --runs 20       # the figures docs/benchmarks.md quotes
    python bench/recovery.py --smoke
    python bench/recovery.py --json recovery.json   # also every run as JSON (bench/figures.py)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from bench import phases as ph  # noqa: E402

TARGET_RATIO = 0.3
INPROCESS_TARGET_S = 0.15  # elastic-run-inprocess, median kill -> first step


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
    kill_at: float | None = None  # seconds from the launch to the kill
    timeline: list | None = None  # [[seconds from the launch, step], ...] of rank 0 (bench/figures.py)
    phases: dict | None = None  # the recovery's phases from the master's event log (elastic-run)
    phase_check: list | None = None  # those against this run's own timings (bench.phases.compare)
    survivor_pid_unchanged: bool | None = None  # rank 0 kept its process across the kill (None: unknown)


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
    tool: c.Tool,
    folder: Path,
    kill_step: int,
    step_time: float,
    start_timeout: float,
    timeout: float,
    event_log: bool = True,
) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "events.jsonl" if tool.elastic and event_log else None
    with c.Group(folder) as group:
        t_launch = c.time.time()
        if log_path is not None:  # the same job under a daemon master that writes the event log
            worker = ["--ckpt-dir", folder / "ckpt", "--step-time", step_time]
            cluster = c.Cluster(tool, group, "1", worker, nproc=2, master_args=["--event-log", log_path])
            if not cluster.start():
                return Outcome(tool.name, False, "elastic-master did not start")
            proc = cluster.start_node("node1")
        else:
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
        durations = checked = None
        if log_path is not None:
            durations, checked = _phase_check(proc, log_path, start["restart"], t_kill, timeout)
        events = proc.events()
        before = [e["step"] for e in events if e["kind"] == "step" and e["rank"] == 0 and e["t"] < start["t"]]
        # rank 0's process before the kill (its last start line) against its first start line after it
        started = [e["pid"] for e in events if e["kind"] == "start" and e["rank"] == 0 and e["t"] < t_kill]
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
            t_kill - t_launch,
            c.step_timeline(events, 0, t_launch),
            durations,
            checked,
            started[-1] == start["pid"] if started else None,
        )


def _phase_check(
    proc: c.Launched, log_path: Path, restart: object, t_kill: float, timeout: float
) -> tuple[dict | None, list | None]:
    """The recovery's phases from the event log, and their comparison with this run's own timings: when
    the restarted workers were created (read now, while they run) and when every rank stepped."""
    pids = [e["pid"] for e in proc.events() if e["kind"] == "start" and e["restart"] == restart]
    created = [ph.process_created_at(pid) for pid in pids]

    def logged() -> tuple[dict, dict] | None:
        stepped: dict[int, float] = {}
        for e in proc.events():
            if e["kind"] == "step" and e["restart"] == restart and e["t"] > t_kill:
                stepped.setdefault(e["rank"], e["t"])
        durations = ph.recovery_durations(log_path)
        return (durations, stepped) if durations and len(stepped) == len(pids) else None

    found = c.wait_until(logged, min(timeout, 30.0), tick=proc.track)  # the next heartbeat reports it
    if not found:
        return None, None
    durations, stepped = found
    if not pids or None in created:
        return durations, None
    return durations, ph.compare(durations, max(created) - t_kill, max(stepped.values()) - t_kill)


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
                c.pids_unchanged(mine),
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
                "survivor PID unchanged",
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
    if c.INPROCESS_TOOL in medians:
        inproc = medians[c.INPROCESS_TOOL]
        verdict = "n/a" if inproc is None else ("met" if inproc <= INPROCESS_TARGET_S else "NOT met")
        shown = "n/a" if inproc is None else f"{inproc:.3f}"
        out += [
            "",
            f"Target {c.INPROCESS_TOOL} median kill -> first step <= {INPROCESS_TARGET_S:g} s: "
            f"{verdict} (median {shown} s).",
        ]
    out += c.before_after(medians, "torchrun", "median kill -> first step")
    out += phase_report(tools, results)
    failures = [r for r in results if not r.recovered]
    if failures:
        out += ["", "Runs that did not recover:"] + [f"- {r.tool}: {r.note}" for r in failures]
    return "\n".join(out)


def phase_report(tools: list[c.Tool], results: list[Outcome]) -> list[str]:
    """The event log's recovery phases per tool, and how they agree with the runs' own timings."""
    logged = [r for r in results if r.recovered and r.phases]
    if not logged:
        return []
    rows = []
    for tool in tools:
        mine = [r for r in logged if r.tool == tool.name]
        if mine:
            medians = [c.Stat([r.phases[p] for r in mine]).fmt(3) for p in (*ph.PHASES, "total")]
            rows.append([tool.name, *medians])
    checks = [r for r in logged if r.phase_check]
    agreement = []
    for i, (name, _, own, checked) in enumerate(ph.MAPPING):
        agreeing = sum(r.phase_check[i]["agrees"] for r in checks)
        worst = max(
            (abs(r.phase_check[i]["event_log"] - r.phase_check[i]["bench"]) for r in checks), default=0
        )
        agreement.append(
            [
                f"{name} vs {own}" + ("" if checked else " (not checked)"),
                c.Stat([r.phase_check[i]["event_log"] for r in checks]).fmt(3),
                c.Stat([r.phase_check[i]["bench"] for r in checks]).fmt(3),
                f"{worst * 1000:.0f}",
                f"{agreeing}/{len(checks)}",
            ]
        )
    return [
        "",
        "Recovery phases from the master's event log (`--event-log`; docs/observability.md), median (min-max)"
        " seconds:",
        "",
        c.table(["tool", *ph.PHASES, "total"], rows),
        "",
        "The event log against the benchmark's own timings (kill; the kernel's creation time of the new "
        f"workers; their first step lines), agreeing within max({ph.TOLERANCE_REL:.0%}, "
        f"{ph.TOLERANCE_ABS * 1000:.0f} ms), per phase and in total (the mapping: bench/phases.py):",
        "",
        c.table(
            ["event log vs benchmark", "event log (s)", "benchmark (s)", "worst diff (ms)", "agree"],
            agreement,
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(
        __doc__.splitlines()[0], runs=5, tools=f"elastic-run,{c.INPROCESS_TOOL},{c.EXEC_TOOL},torchrun"
    )
    p.add_argument("--kill-step", type=int, default=10, help="SIGKILL rank 1 once rank 0 completed this step")
    p.add_argument("--step-time", type=float, default=0.05, help="workload --step-time")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds after the kill before giving up")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds to reach the kill step")
    p.add_argument(
        "--no-event-log",
        action="store_true",
        help="run elastic-run --standalone, without the event log's phases (bench/phases.py)",
    )
    c.add_json_option(p)
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
                event_log=not args.no_event_log,
            )
            c.log(f"  -> {r}")
            results.append(r)
            c.cleanup(c.log)
    c.emit_report(
        args, "Worker-crash recovery", report(tools, results, args.runs, args.kill_step, args.timeout)
    )
    c.write_json(args, "recovery", results, tools=c.tool_summary(tools, results, "to_step"))
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
