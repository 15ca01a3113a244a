"""Node loss: 2 fake nodes x 1 worker on this machine; SIGKILL one whole
node (its launcher's process group and every descendant, as if the machine died); time until the survivor
completes a step at world size 1. With ``--fault sigstop`` the whole node gets SIGSTOP instead: it vanishes
without closing its sockets, so only the master's heartbeat timeout tells it is gone, and a survivor
blocked in a collective with it must be released; the stopped processes are SIGKILLed when the run ends.

elastic-run: an ``elastic-master`` daemon (default settings: heartbeat 1 s, timeout 4 s, last call 2 s) and
two agents with distinct ``--node-id``. torchrun: ``--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT
--nnodes 1:2``, two launchers; the first one hosts the c10d store (``is_host=1``) and is the survivor, so
that torchrun has a fair chance. Node 2 (rank 1) is killed in both cases. A run in which the survivor has
not trained at world size 1 within --timeout seconds is recorded as "did not recover", with what the
survivor was doing (its last lines).

elastic-run-inprocess is elastic-run with the workload inside ``elastic.run`` (in-process recovery): the
survivor's worker keeps its process, so "survivor PID unchanged" (the pid of the survivor's last ``start``
line before the kill equals that of its first one after) is true there, and its old worker is never gone. Its
target: kill -> survivor step at world 1 median <= 1 s, max <= 1.5 s; with ``--fault sigstop``: stop ->
survivor step at world 1 median <= heartbeat timeout + 1 s (5 s with the defaults).

    python bench/node_loss.py                # 3 runs of each tool, alternated
    python bench/node_loss.py --smoke
    python bench/node_loss.py --fault sigstop   # the node vanishes (SIGSTOP) instead of dying
    python bench/node_loss.py --json node_loss.json   # also every run as JSON (bench/figures.py)
"""

from __future__ import annotations

import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402

HEARTBEAT_TIMEOUT_S = 4.0  # the master's default, which the target is relative to
INPROCESS_TARGET_S = (1.0, 1.5)  # elastic-run-inprocess, median and max kill -> step at world 1
# elastic-run-inprocess under --fault sigstop: median stop -> step at world 1 <= heartbeat timeout + this.
INPROCESS_STOP_MARGIN_S = 1.0
FAULTS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
# Lines of the survivor's log worth quoting when it does not recover (what it was waiting on).
_NOTABLE = re.compile(
    r"(Error\b|error:|timed out|timeout|Connection closed|Connection reset|declared dead|round_opened|"
    r"job_failed|Restarting)",
    re.I,
)


@dataclass
class Outcome:
    tool: str
    recovered: bool
    note: str = ""
    worker_gone: float | None = None  # kill -> the survivor's old worker process ended (crash or stopped)
    to_start: float | None = None  # kill -> survivor's new worker started
    to_step: float | None = None  # kill -> survivor's first step at world 1
    lost: int | None = None
    restarts: int | None = None  # TORCHELASTIC_RESTART_COUNT of the survivor's new worker
    survivor_pid_unchanged: bool | None = None  # the survivor's worker kept its process (None: unknown)
    fault: str = "sigkill"  # what node 2 got: sigkill (it died) or sigstop (it vanished, sockets open)


def notable_lines(text: str, limit: int = 6) -> list[str]:
    """Distinct error and state lines of a log (traceback frames and code lines, which are indented,
    are skipped), the last ``limit`` of them, shortened."""
    seen, out = set(), []
    for line in text.splitlines():
        raw = re.sub(r"^(\[rank\d+\]: ?)+", "", line)
        if "BENCH" in line or raw[:1].isspace() or not _NOTABLE.search(raw):
            continue
        key = re.sub(r"\d+", "#", raw)[:120]
        if key not in seen:
            seen.add(key)
            out.append(raw.strip()[:160])
    return out[-limit:]


def one_run(tool: c.Tool, folder: Path, args) -> Outcome:
    outcome = _one_run(tool, folder, args)
    outcome.fault = args.fault
    return outcome


def _one_run(tool: c.Tool, folder: Path, args) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    worker = ["--ckpt-dir", folder / "ckpt", "--step-time", args.step_time]
    # The group's close SIGKILLs every process it started and every descendant it saw (stopped ones too).
    with c.Group(folder) as group:
        cluster = c.Cluster(tool, group, "1:2", worker, rdzv_conf=args.torchrun_rdzv_conf)
        if not cluster.start():
            return Outcome(tool.name, False, "master did not start")
        survivor = cluster.start_node("node1", host_store=True)
        victim = cluster.start_node("node2")

        def trained_at_2() -> bool:
            steps = [e for e in survivor.events() if e["kind"] == "step" and e.get("world") == 2]
            return len(steps) >= args.steps_before

        if not c.wait_until(trained_at_2, args.start_timeout, tick=group.track):
            return Outcome(tool.name, False, f"never trained {args.steps_before} steps at world size 2")
        survivor.track()
        starts = [e for e in survivor.events() if e["kind"] == "start"]
        old_worker = survivor.known.get(starts[-1]["pid"]) if starts else None
        t_kill = victim.signal_tree(FAULTS[args.fault])
        if args.fault == "sigkill":
            victim.reap(5)  # a stopped node never exits: it is SIGKILLed below, once measured
        gone: list[float] = []

        def tick() -> None:
            group.track()
            if old_worker and not gone and c.same_process(old_worker) is None:
                gone.append(c.time.time())

        def at_world_1() -> dict | None:
            return c.first(survivor.events(), kind="step", world=1, t=lambda t: t > t_kill)

        step = c.wait_until(at_world_1, args.timeout, tick=tick)
        # The logs as they were at the end of the wait: not what the survivor said once the stopped node
        # was SIGKILLed (its sockets reset) below.
        survivor_log = survivor.output()
        events, victim_events = c.parse_events(survivor_log), victim.events()
        survivor_alive = survivor.alive()
        if args.fault == "sigstop":
            victim.kill()  # SIGKILL works on stopped processes: nothing of the vanished node is left
        start = c.first(events, kind="start", t=lambda t: t > t_kill)
        # The last step the job completed before the kill, as either node printed it.
        both = events + victim_events
        last_before = max((e["step"] for e in both if e["kind"] == "step" and e["t"] < t_kill), default=0)
        failed = gone[0] - t_kill if gone else None
        # One worker per node: the survivor's log holds its lines only, whichever rank it had.
        same_pid = start["pid"] == starts[-1]["pid"] if start and starts else None
        if not step:
            state = "survivor still running" if survivor_alive else "survivor exited"
            last = [e for e in events if e["t"] > t_kill]
            tail = "; ".join(notable_lines(survivor_log)) or "no error lines"
            what = f"{last[-1]['kind']} at +{last[-1]['t'] - t_kill:.1f}s" if last else "no worker output"
            return Outcome(
                tool.name,
                False,
                f"no step at world 1 within {args.timeout:g}s ({state}; last worker event after the kill: "
                f"{what}; survivor log: {tail})",
                failed,
                start["t"] - t_kill if start else None,
                survivor_pid_unchanged=same_pid,
            )
        lost = last_before - start["resumed"] if start else None
        return Outcome(
            tool.name,
            True,
            "",
            failed,
            start["t"] - t_kill if start else None,
            step["t"] - t_kill,
            lost,
            step.get("restart"),
            same_pid,
        )


def report(tools: list[c.Tool], results: list[Outcome], args) -> str:
    rows, medians, stats = [], {}, {}
    for tool in tools:
        mine = [r for r in results if r.tool == tool.name]
        ok = [r for r in mine if r.recovered]
        stat = stats[tool.name] = c.Stat([r.to_step for r in ok])
        medians[tool.name] = stat.median
        rows.append(
            [
                tool.name,
                f"{len(ok)}/{len(mine)}",
                stat.fmt(2),
                c.Stat([r.worker_gone for r in mine if r.worker_gone is not None]).fmt(2),
                c.Stat([r.to_start for r in mine if r.to_start is not None]).fmt(2),
                c.Stat([float(r.lost) for r in ok if r.lost is not None]).fmt(0),
                ", ".join(str(r.restarts) for r in ok) or "n/a",
                c.pids_unchanged(mine),
            ]
        )
    target = HEARTBEAT_TIMEOUT_S + 2
    fault, what = fault_words(args.fault)
    out = [
        f"2 fake nodes x 1 worker, `--nnodes 1:2`; node 2 (its launcher and all its processes) {fault} "
        f"after {args.steps_before} steps at world size 2; {args.runs} run(s) of each tool, alternated. "
        f"Seconds from the {what}; no step at world size 1 within {args.timeout:g} s counts as not "
        "recovered.",
        "",
        c.table(
            [
                "tool",
                "recovered",
                f"{what} -> survivor step at world 1 (s)",
                f"{what} -> survivor's old worker gone (s)",
                f"{what} -> survivor's new worker up (s)",
                "steps lost",
                "restart count after",
                "survivor PID unchanged",
            ],
            rows,
        ),
        "",
        "Steps lost: the workload checkpoints on rank 0 only, after each step; when the killed node held "
        "rank 0, a step the survivor (rank 1) had completed but rank 0 had not yet saved is lost. Restart "
        "count after: `TORCHELASTIC_RESTART_COUNT` of the survivor's new worker, per run (0 = the node loss "
        "was not counted against `--max-restarts`).",
    ]
    el, tr = medians.get("elastic-run"), medians.get("torchrun")
    if "elastic-run" in medians:
        verdict = "n/a" if el is None else ("met" if el <= target else "NOT met")
        out += [
            "",
            f"Target elastic-run <= heartbeat timeout + 2 s = {target:g} s: {verdict} "
            f"(median {c.Stat([el] if el is not None else []).fmt(2)} s).",
        ]
    if "elastic-run" in medians and "torchrun" in medians:
        speedup = "n/a" if not el or tr is None else f"{tr / el:.1f}x"
        out += [
            f"torchrun / elastic-run (target >= 10x): **{speedup}**"
            + ("" if tr is not None else " (torchrun never recovered within the timeout)")
        ]
    if c.INPROCESS_TOOL in stats:
        if args.fault == "sigstop":
            out += inprocess_stop_target(stats[c.INPROCESS_TOOL])
        else:
            out += inprocess_target(stats[c.INPROCESS_TOOL])
    out += c.before_after(medians, "torchrun", f"median {what} -> survivor step at world 1")
    bad = [r for r in results if not r.recovered]
    if bad:
        out += ["", "Runs that did not recover:"] + [f"- {r.tool}: {r.note}" for r in bad]
    return "\n".join(out)


def fault_words(fault: str) -> tuple[str, str]:
    """How the report says what node 2 got, and the word for that moment in its columns."""
    if fault == "sigstop":
        return (
            "SIGSTOPped (it vanishes: its sockets stay open, so only the master's heartbeat timeout of "
            f"{HEARTBEAT_TIMEOUT_S:g} s tells it is gone; its processes are SIGKILLed when the run ends)",
            "stop",
        )
    return "SIGKILLed", "kill"


def inprocess_stop_target(stat: c.Stat) -> list[str]:
    """The verdict of elastic-run-inprocess when the node vanishes (SIGSTOP): median stop -> survivor step
    at world 1 <= the heartbeat timeout + 1 s (the survivor's blocked collective released in time)."""
    target = HEARTBEAT_TIMEOUT_S + INPROCESS_STOP_MARGIN_S
    verdict = "n/a" if stat.median is None else ("met" if stat.median <= target else "NOT met")
    worst = f"{max(stat.values):.2f}" if stat.values else "n/a"
    return [
        "",
        f"Target {c.INPROCESS_TOOL} median stop -> survivor step at world 1 <= heartbeat timeout + "
        f"{INPROCESS_STOP_MARGIN_S:g} s = {target:g} s: {verdict} (median {stat.fmt(2)} s, max {worst} s).",
    ]


def inprocess_target(stat: c.Stat) -> list[str]:
    """The verdict of elastic-run-inprocess: median and max kill -> survivor step at world 1."""
    med_target, max_target = INPROCESS_TARGET_S
    verdict = "n/a"
    if stat.values:
        verdict = "met" if stat.median <= med_target and max(stat.values) <= max_target else "NOT met"
    worst = f"{max(stat.values):.2f}" if stat.values else "n/a"
    return [
        "",
        f"Target {c.INPROCESS_TOOL} median <= {med_target:g} s and max <= {max_target:g} s: "
        f"{verdict} (median {stat.fmt(2)} s, max {worst} s).",
    ]


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(
        __doc__.splitlines()[0], runs=3, tools=f"elastic-run,{c.INPROCESS_TOOL},{c.EXEC_TOOL},torchrun"
    )
    p.add_argument("--steps-before", type=int, default=10, help="steps at world 2 before the kill")
    p.add_argument("--step-time", type=float, default=0.05, help="workload --step-time")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds after the kill before giving up")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds to reach world size 2")
    p.add_argument("--torchrun-rdzv-conf", default="", help="extra torchrun --rdzv-conf items (k=v,...)")
    p.add_argument(
        "--fault",
        choices=sorted(FAULTS),
        default="sigkill",
        help="what node 2 gets: sigkill (it dies, its sockets close) or sigstop (it vanishes with its "
        "sockets open until the heartbeat timeout; SIGKILLed at the end of the run) (default %(default)s)",
    )
    c.add_json_option(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.steps_before, args.timeout = 1, 3, 30.0
    tools = c.selected_tools(args)
    results = []
    with c.workdir(args.workdir) as root:
        for i, tool in c.alternate(tools, args.runs):
            c.log(f"node-loss run {i + 1}/{args.runs} ({args.fault}): {tool.name}")
            r = one_run(tool, root / f"run{i}-{tool.name}", args)
            c.log(f"  -> {r}")
            results.append(r)
            c.cleanup(c.log)
    title = "Node loss" if args.fault == "sigkill" else "Node loss: the node vanishes (SIGSTOP)"
    c.emit_report(args, title, report(tools, results, args))
    c.write_json(args, "node_loss", results, tools=c.tool_summary(tools, results, "to_step"))
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
