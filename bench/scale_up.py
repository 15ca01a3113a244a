"""Scale-up admission: one node trains at world size 1, a second node is
started; time from the new node's start to its first completed step at world size 2.

elastic-run: an ``elastic-master`` daemon with default settings and agents with distinct ``--node-id``.
torchrun: ``--rdzv-backend=c10d --nnodes 1:2``, the first launcher hosts the store; measured twice: with
its default (the rendezvous TCP store shared with the workers) and with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (workers host their own store; "torchrun-noshare"). torchrun gets
``last_call_timeout=2`` (elastic-run's default last call) so that the first node starts alone after 2 s
instead of 30 s; the admission itself closes at max nodes and does not wait for the last call.
A run with no step at world size 2 within --timeout seconds of the new node's start is recorded as
"not admitted", with what the nodes were doing.

What the running node pays: "node 1 paused", the same definition for every tool, from node 1's own step
lines: its last step at world size 1 -> its first step at world size 2 (the time it did not train).
elastic-run-inprocess is elastic-run with the workload inside ``elastic.run`` (in-process recovery): node 1's
worker keeps its process when node 2 joins (its ``start`` line at world 2 has the pid of its last one at world
1: "node 1 PID unchanged") and node 2's rank gets the state from node 1, in memory. Its target: node 1 paused,
median <= 0.2 s.

    python bench/scale_up.py                 # 3 runs of each tool, alternated
    python bench/scale_up.py --runs 20       # as docs/benchmarks.md (torchrun: 3 runs, --torchrun-runs)
    python bench/scale_up.py --smoke
    python bench/scale_up.py --json scale_up.json   # also every run as JSON, with a per-tool summary
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from bench.node_loss import notable_lines  # noqa: E402

TARGET_RATIO = 0.5
INPROCESS_PAUSE_TARGET_S = 0.2  # elastic-run-inprocess, median node 1 paused when node 2 joins


@dataclass
class Outcome:
    tool: str
    admitted: bool
    note: str = ""
    to_start: float | None = None  # new node's start -> its worker of the world-2 round started
    to_step: float | None = None  # new node's start -> its first step at world 2
    pause: float | None = None  # old node: last step at world 1 -> first step at world 2
    # The old node's worker kept its process: the pid of its last ``start`` before node 2's start is that of
    # its first ``start`` at world 2 (None: unknown). ``survivor`` as in bench/common.py's tool_summary.
    survivor_pid_unchanged: bool | None = None

    @property
    def recovered(self) -> bool:
        """Admitted, as bench/common.py's tool_summary counts it."""
        return self.admitted


def one_run(tool: c.Tool, folder: Path, args) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    worker = ["--ckpt-dir", folder / "ckpt", "--step-time", args.step_time]
    conf = "" if tool.elastic else "last_call_timeout=2"
    with c.Group(folder) as group:
        cluster = c.Cluster(tool, group, "1:2", worker, rdzv_conf=conf)
        if not cluster.start():
            return Outcome(tool.name, False, "master did not start")
        old = cluster.start_node("node1", host_store=True)

        def trained_at_1() -> bool:
            return (
                len([e for e in old.events() if e["kind"] == "step" and e.get("world") == 1])
                >= args.steps_before
            )

        if not c.wait_until(trained_at_1, args.start_timeout, tick=group.track):
            return Outcome(tool.name, False, f"first node never trained {args.steps_before} steps alone")
        new = cluster.start_node("node2")
        t0 = new.started

        def at_world_2() -> dict | None:
            return c.first(new.events(), kind="step", world=2)

        step = c.wait_until(at_world_2, args.timeout, tick=group.track)
        start = c.first(new.events(), kind="start", world=2)
        if not step:
            olds = old.events()
            last = olds[-1] if olds else None
            doing = (
                f"first node's last worker event: {last['kind']} world={last.get('world')}" if last else ""
            )
            lines = "; ".join(notable_lines(old.output(), 3) + notable_lines(new.output(), 3))
            return Outcome(
                tool.name,
                False,
                f"no step at world 2 within {args.timeout:g}s ({doing}; new worker started: "
                f"{'yes' if start else 'no'}; logs: {lines or 'no error lines'})",
                start["t"] - t0 if start else None,
            )
        c.wait_until(lambda: c.first(old.events(), kind="step", world=2), 15, tick=group.track)
        olds = old.events()
        last1 = max((e["t"] for e in olds if e["kind"] == "step" and e.get("world") == 1), default=None)
        first2 = c.first(olds, kind="step", world=2)
        pause = first2["t"] - last1 if first2 and last1 else None
        # One worker per node: node 1's log holds its lines only, whichever rank it has at world 2.
        before = [e["pid"] for e in olds if e["kind"] == "start" and e["t"] < t0]
        after = c.first(olds, kind="start", world=2, t=lambda t: t > t0)
        same_pid = before[-1] == after["pid"] if before and after else None
        return Outcome(
            tool.name, True, "", start["t"] - t0 if start else None, step["t"] - t0, pause, same_pid
        )


def report(tools: list[c.Tool], results: list[Outcome], args) -> str:
    rows, medians = [], {}
    for tool in tools:
        mine = [r for r in results if r.tool == tool.name]
        ok = [r for r in mine if r.admitted]
        stat = c.Stat([r.to_step for r in ok])
        medians[tool.name] = stat.median
        rows.append(
            [
                tool.name,
                f"{len(ok)}/{len(mine)}",
                stat.fmt(2),
                c.Stat([r.to_start for r in ok if r.to_start is not None]).fmt(2),
                c.Stat([r.pause for r in ok if r.pause is not None]).fmt(2),
                c.pids_unchanged(mine),
            ]
        )
    out = [
        f"`--nnodes 1:2`, 1 worker per node; node 1 trains {args.steps_before} steps alone, then node 2 is "
        f"started; {args.runs} run(s) of each tool, alternated (torchrun with its default shared store, "
        f"which deadlocked in every run seen, at most {args.torchrun_runs}). Seconds from node 2's start; "
        f"no step at world size 2 within {args.timeout:g} s counts as not admitted.",
        "",
        c.table(
            [
                "tool",
                "admitted",
                "new node start -> its first step at world 2 (s)",
                "-> its worker up (s)",
                "node 1 paused (s)",
                "node 1 PID unchanged",
            ],
            rows,
        ),
        "",
        "Node 1 paused: node 1's last step at world size 1 -> its first step at world size 2, from its own "
        "step lines, for every tool (the time the running node did not train; it includes the compute of "
        f"that first step, >= `--step-time` {args.step_time:g} s, and the world-2 group's forming). Node 1 "
        "PID unchanged: its worker's `start` line at world size 2 has the pid of its last one before "
        "node 2's start.",
    ]
    el = medians.get("elastic-run")
    for base in ("torchrun-noshare", "torchrun"):
        if "elastic-run" in medians and base in medians:
            extra = ""
            if base == "torchrun-noshare":
                verdict = "n/a"
                if el is not None and medians[base]:
                    verdict = "met" if el / medians[base] <= TARGET_RATIO else "NOT met"
                extra = f" (target <= {TARGET_RATIO}x: {verdict})"
            out += ["", f"Ratio elastic-run / {base}: **{c.ratio(el, medians[base])}**{extra}."]
    if c.INPROCESS_TOOL in medians:
        out += inprocess_target([r for r in results if r.tool == c.INPROCESS_TOOL and r.admitted])
    out += c.before_after(medians, "torchrun-noshare", "median new node start -> its first step at world 2")
    bad = [r for r in results if not r.admitted]
    if bad:
        out += ["", "Runs that did not admit the new node:"] + [f"- {r.tool}: {r.note}" for r in bad]
    return "\n".join(out)


def inprocess_target(ok: list[Outcome]) -> list[str]:
    """The verdict of elastic-run-inprocess: node 1 paused (median) when node 2 joins."""
    stat = c.Stat([r.pause for r in ok if r.pause is not None])
    verdict = (
        "n/a" if stat.median is None else ("met" if stat.median <= INPROCESS_PAUSE_TARGET_S else "NOT met")
    )
    worst = f"{max(stat.values):.2f}" if stat.values else "n/a"
    return [
        "",
        f"Target {c.INPROCESS_TOOL} node 1 paused median <= {INPROCESS_PAUSE_TARGET_S:g} s: "
        f"{verdict} (median {stat.fmt(2)} s, max {worst} s).",
    ]


def summary(tools: list[c.Tool], results: list[Outcome]) -> dict[str, dict[str, object]]:
    """The JSON's per-tool figures: node 1 paused (``median_s``, ``p99_s``: the issue's "node joins" row),
    runs that admitted node 2 (``recovered``) and kept node 1's process (``survivor_pids_unchanged``), and
    new node start -> its first step at world 2 (``to_step_median_s``, ``to_step_p99_s``)."""
    out = c.tool_summary(tools, results, "pause")
    for name, admission in c.tool_summary(tools, results, "to_step").items():
        out[name]["to_step_median_s"] = admission["median_s"]
        out[name]["to_step_p99_s"] = admission["p99_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(
        __doc__.splitlines()[0],
        runs=3,
        tools=f"elastic-run,{c.INPROCESS_TOOL},{c.EXEC_TOOL},torchrun,torchrun-noshare",
    )
    p.add_argument("--steps-before", type=int, default=10, help="steps of node 1 alone before node 2 starts")
    p.add_argument("--step-time", type=float, default=0.05, help="workload --step-time")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds after node 2's start before giving up"
    )
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds for node 1 to train alone")
    p.add_argument(
        "--torchrun-runs",
        type=int,
        default=3,
        help="at most this many runs of torchrun with its default shared store, which waits out --timeout "
        "in every deadlocked run (default %(default)s)",
    )
    c.add_json_option(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.steps_before, args.timeout = 1, 3, 30.0
    tools = c.selected_tools(args)
    results = []
    with c.workdir(args.workdir) as root:
        for i, tool in c.alternate(tools, args.runs):
            if tool.name == "torchrun" and i >= args.torchrun_runs:
                continue
            c.log(f"scale-up run {i + 1}/{args.runs}: {tool.name}")
            r = one_run(tool, root / f"run{i}-{tool.name}", args)
            c.log(f"  -> {r}")
            results.append(r)
            c.cleanup(c.log)
    c.emit_report(args, "Scale-up admission", report(tools, results, args))
    c.write_json(args, "scale_up", results, tools=summary(tools, results))
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
