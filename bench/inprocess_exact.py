"""In-process recovery is exact: 3 worker kills at a fixed world, then the final
weights are bitwise those of an uninterrupted run, every sample is trained once and no committed step is
redone.

Each run starts scripts/train_inprocess.py (the training inside ``elastic.run``) under ``elastic-run
--standalone --nproc-per-node 2 --stop-grace 2 --quiet``, OMP_NUM_THREADS=1, and SIGKILLs the rank-1 worker
3 times: once rank 0 printed step K (default K = 20, 45, 70 of 90 steps), the pid of rank 1's newest
``world`` line is killed; the next kill waits until the next world formed (a ``world`` line of both
ranks) and rank 0 stepped in it. One uninterrupted run with the same arguments (``--step-time 0``: the
timing does not change the result) gives the reference weights. Per run:

- recovered: the job exited 0 and rank 0 printed ``done step=N``, after all 3 kills;
- survivor PID unchanged: rank 0 printed 4 ``world`` lines (one per world), all with the same pid;
- replaced state equal: in every world both ranks printed the same ``state=`` hash (weights and optimizer
  state) and rank 1 had a new pid in each (it was replaced 3 times);
- steps redone: from the sample logs (``--sample-log``: one file per round, rank and process, one line
  per committed step), the (rank, step) pairs logged more than once, i.e. by more than one round (or
  twice by one). A committed step is never trained again, so 0 is expected;
- samples twice: taking for each (step, rank) the newest round's line, the sample indices that occur
  more than once within one epoch (0 expected); steps 1..N with no line at all are counted as missing;
- weights bitwise equal: ``torch.equal`` on every tensor of rank 0's ``--final-weights`` against the
  reference's.

Timing (informational): seconds from each kill until the next world's first step line of rank 0 shows
up in the launcher's output (polled every 10 ms), and until both ranks' ``world`` lines did.

    python bench/inprocess_exact.py                # 3 runs
    python bench/inprocess_exact.py --smoke        # 1 run of 45 steps
    python bench/inprocess_exact.py --json exact.json
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402

SCRIPT = c.REPO / "scripts" / "train_inprocess.py"
WORLD_LINE = re.compile(
    r"^\[rank\d+\]:world rank=(\d+) world=(\d+) round=(\d+) restart=(\d+) step=(\d+) pid=(\d+) "
    r"state=(\w+)$",
    re.M,
)
STEP_LINE = re.compile(r"^\[rank0\]:step=(\d+) loss=\S+ world=\d+$", re.M)
DONE_LINE = re.compile(r"^\[rank0\]:done step=(\d+)$", re.M)
SAMPLE_FILE = re.compile(r"round(\d+)-rank(\d+)-pid(\d+)\.log$")
WORLD = 2


@dataclass
class Outcome:
    tool: str
    recovered: bool
    note: str = ""
    exit_code: int | None = None
    done_step: int | None = None
    kills: int = 0  # SIGKILLs of rank 1 done
    worlds: int = 0  # worlds formed (rank 0's world lines)
    survivor_pid_unchanged: bool | None = None
    replaced_state_equal: bool | None = None
    rank1_pids: int = 0  # distinct rank-1 processes seen
    resumed_from: list[int] = field(default_factory=list)  # the step each world started from
    steps_redone: int | None = None
    steps_missing: int | None = None
    samples_twice: int | None = None
    weights_bitwise_equal: bool | None = None
    to_world_s: list[float] = field(default_factory=list)  # kill -> both ranks' world lines seen
    to_step_s: list[float] = field(default_factory=list)  # kill -> the new world's first step of rank 0
    median_to_step_s: float | None = None

    @property
    def exact(self) -> bool:
        """Every check passed: samples once, no committed step redone, final weights bitwise equal."""
        return bool(
            self.recovered
            and self.survivor_pid_unchanged
            and self.replaced_state_equal
            and self.steps_redone == 0
            and self.steps_missing == 0
            and self.samples_twice == 0
            and self.weights_bitwise_equal
        )


def worlds(output: str) -> list[dict]:
    """Every ``world`` line: one per rank each time its group formed."""
    keys = ("rank", "world", "round", "restart", "step", "pid")
    return [
        {**dict(zip(keys, map(int, m[:6]), strict=True)), "state": m[6]} for m in WORLD_LINE.findall(output)
    ]


def rank0_steps(output: str) -> list[int]:
    return [int(s) for s in STEP_LINE.findall(output)]


def script_args(folder: Path, steps: int, step_time: float) -> list[str]:
    return [
        str(SCRIPT),
        "--steps", str(steps),
        "--step-time", str(step_time),
        "--batch-size", "64",
        "--num-samples", "1024",
        "--sample-log", str(folder / "samples"),
        "--final-weights", str(folder / "final.pt"),
    ]  # fmt: skip


def launch(tool: c.Tool, group: c.Group, folder: Path, steps: int, step_time: float) -> c.Launched:
    folder.mkdir(parents=True, exist_ok=True)
    argv = tool.cmd(
        "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts", "3", "--stop-grace", "2", "--quiet",
        *script_args(folder, steps, step_time),
    )  # fmt: skip
    return group.launch(argv, "launcher", env=tool.environ(OMP_NUM_THREADS="1"))


def finished(proc: c.Launched, timeout: float) -> tuple[int | None, int | None]:
    """Wait for the job to end: its exit code (None: still running after ``timeout``) and rank 0's
    ``done step=N``."""
    c.wait_until(lambda: not proc.alive(), timeout, tick=proc.track)
    code = proc.popen.poll()
    done = DONE_LINE.findall(proc.output())
    return code, int(done[-1]) if done else None


def reference_run(tool: c.Tool, folder: Path, steps: int, timeout: float) -> tuple[Path | None, str]:
    """The uninterrupted run: its final weights, or None and why not."""
    with c.Group(folder) as group:
        proc = launch(tool, group, folder, steps, 0.0)
        code, done = finished(proc, timeout)
    if code != 0 or done != steps:
        return None, f"reference run: exit {code}, done step={done}: {_tail(proc.output())}"
    return folder / "final.pt", ""


def wait_for_world(
    proc: c.Launched, formed: int, timeout: float, t_kill: float
) -> tuple[float, float] | None:
    """After a kill: poll (10 ms) until each rank printed its ``formed``-th world line and rank 0 a step
    line after it; (kill -> world lines seen, kill -> step line seen), or None."""
    t_world = None
    deadline = c.time.monotonic() + timeout
    while c.time.monotonic() < deadline:
        proc.track()
        text = proc.output()
        now = c.time.time()
        lines = list(WORLD_LINE.finditer(text))
        per_rank = [[m for m in lines if m[1] == str(rank)] for rank in range(WORLD)]
        if t_world is None and all(len(mine) >= formed for mine in per_rank):
            t_world = now - t_kill
        if t_world is not None and STEP_LINE.search(text, per_rank[0][formed - 1].end()):
            return t_world, now - t_kill
        if not proc.alive():
            return None
        c.time.sleep(0.01)
    return None


def one_run(tool: c.Tool, folder: Path, args: argparse.Namespace, reference: Path | None) -> Outcome:
    out = Outcome(tool.name, False)
    with c.Group(folder) as group:
        proc = launch(tool, group, folder, args.steps, args.step_time)
        if not c.wait_until(lambda: len(worlds(proc.output())) >= WORLD, args.start_timeout, tick=proc.track):
            out.note = f"the first world did not form (exit {proc.popen.poll()}): {_tail(proc.output())}"
            return out
        for n, kill_step in enumerate(args.kill_steps):
            if (
                not c.wait_until(
                    lambda k=kill_step: max(rank0_steps(proc.output()), default=0) >= k or not proc.alive(),
                    args.timeout,
                    tick=proc.track,
                )
                or not proc.alive()
            ):
                out.note = f"kill {n + 1}: step {kill_step} not reached (exit {proc.popen.poll()})"
                break
            victim = max((w for w in worlds(proc.output()) if w["rank"] == 1), key=lambda w: w["round"])
            proc.track()
            ident = proc.known.get(victim["pid"])
            if ident is None or not c.sigkill(ident):
                out.note = f"kill {n + 1}: rank 1 (pid {victim['pid']}) not found among the job's processes"
                break
            t_kill = c.time.time()
            out.kills += 1
            seen = wait_for_world(proc, n + 2, args.timeout, t_kill)
            if seen is None:
                out.note = f"kill {n + 1}: no new world and step within {args.timeout:g} s"
                break
            out.to_world_s.append(round(seen[0], 4))
            out.to_step_s.append(round(seen[1], 4))
        out.exit_code, out.done_step = finished(proc, 5.0 if out.note else args.timeout)
    text = proc.output()
    out.recovered = (
        out.kills == len(args.kill_steps)
        and out.exit_code == 0
        and out.done_step == args.steps
        and not out.note
    )
    if not out.recovered and not out.note:
        out.note = f"exit {out.exit_code}, done step={out.done_step}: {_tail(text)}"
    formed = worlds(text)
    survivor = [w for w in formed if w["rank"] == 0]
    replaced = [w for w in formed if w["rank"] == 1]
    out.worlds = len(survivor)
    out.rank1_pids = len({w["pid"] for w in replaced})
    out.resumed_from = [w["step"] for w in survivor]
    expected = len(args.kill_steps) + 1
    out.survivor_pid_unchanged = out.worlds == expected and len({w["pid"] for w in survivor}) == 1
    rounds = sorted({w["round"] for w in formed})
    out.replaced_state_equal = (
        len(rounds) == expected
        and out.rank1_pids == expected
        and all(_pair_equal([w for w in formed if w["round"] == r]) for r in rounds)
    )
    out.steps_redone, out.steps_missing, out.samples_twice = sample_checks(folder / "samples", args.steps)
    if reference is not None and (folder / "final.pt").exists():
        out.weights_bitwise_equal = bitwise_equal(folder / "final.pt", reference)
    elif (folder / "final.pt").exists():
        out.weights_bitwise_equal = None  # no reference to compare with
    else:
        out.weights_bitwise_equal = False
    out.median_to_step_s = statistics.median(out.to_step_s) if out.to_step_s else None
    return out


def _pair_equal(pair: list[dict]) -> bool:
    """One world: both ranks' lines, at the same step, with the same state hash."""
    return (
        sorted(w["rank"] for w in pair) == list(range(WORLD))
        and len({w["state"] for w in pair}) == 1
        and len({w["step"] for w in pair}) == 1
    )


def sample_checks(folder: Path, steps: int) -> tuple[int, int, int]:
    """(steps redone, steps missing, samples twice) from the sample logs.

    Redone: (rank, step) pairs logged more than once (by more than one round, or twice by one). Missing:
    steps 1..``steps`` that no rank logged (a replaced rank may legitimately lack the line of a step its
    killed process completed but had not logged: the state came from the survivor). Twice: with the
    newest round's line for each (step, rank), sample indices beyond their first within one epoch."""
    logged: dict[tuple[int, int], list[tuple[int, int, list[str]]]] = {}  # (step, rank) -> [(round, ...)]
    for path in sorted(folder.glob("round*-rank*-pid*.log")):
        m = SAMPLE_FILE.search(path.name)
        round_number, rank = int(m[1]), int(m[2])
        for line in path.read_text().splitlines():
            step, epoch, *rows = line.split()
            logged.setdefault((int(step), rank), []).append((round_number, int(epoch), rows))
    redone = sum(len(lines) - 1 for lines in logged.values())
    missing = len(set(range(1, steps + 1)) - {s for s, _ in logged})
    by_epoch: dict[int, list[str]] = {}
    for lines in logged.values():
        _, epoch, rows = max(lines, key=lambda line: line[0])
        by_epoch.setdefault(epoch, []).extend(rows)
    twice = sum(len(rows) - len(set(rows)) for rows in by_epoch.values())
    return redone, missing, twice


def bitwise_equal(path: Path, reference: Path) -> bool:
    import torch  # only here: the launcher side of the benchmark does not need it

    mine, ref = torch.load(path), torch.load(reference)
    return mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def _count(values: list[bool | None]) -> str:
    return f"{sum(1 for v in values if v)}/{len(values)}"


def report(tool: c.Tool, results: list[Outcome], args: argparse.Namespace, reference_note: str) -> str:
    ok = [r for r in results if r.recovered]
    redone = [r.steps_redone for r in results if r.steps_redone is not None]
    twice = [r.samples_twice for r in results if r.samples_twice is not None]
    row = [
        tool.name,
        str(len(results)),
        _count([r.recovered for r in results]),
        _count([r.survivor_pid_unchanged for r in results]),
        _count([r.replaced_state_equal for r in results]),
        str(sum(redone)) if redone else "n/a",
        str(sum(twice)) if twice else "n/a",
        _count([r.weights_bitwise_equal for r in results]),
        c.Stat([s for r in ok for s in r.to_step_s]).fmt(2),
    ]
    kills = ", ".join(map(str, args.kill_steps))
    exact = sum(r.exact for r in results)
    verdict = "met" if results and exact == len(results) else "NOT met"
    out = [
        f"1 node x 2 workers, `elastic-run --standalone`, scripts/train_inprocess.py (`elastic.run`), "
        f"{args.steps} steps of batch 64 over 1024 samples, `--step-time {args.step_time:g}`; SIGKILL of the "
        f"rank-1 worker at rank-0 steps {kills}; {args.runs} run(s), each against one uninterrupted run "
        "(weights: `torch.equal` on every tensor). Steps redone and samples twice are totals over the runs; "
        "kill -> first step is over every kill of the recovered runs.",
        "",
        c.table(
            [
                "tool",
                "runs",
                "recovered",
                "survivor PID unchanged",
                "replaced state equal",
                "steps redone",
                "samples twice",
                "weights bitwise equal",
                "kill -> first step (s)",
            ],
            [row],
        ),
        "",
        f"Target: samples once, 0 steps redone, weights bitwise equal at fixed world "
        f"after {len(args.kill_steps)} kills: {verdict} ({exact}/{len(results)} runs).",
    ]
    if reference_note:
        out += ["", f"No reference weights: {reference_note}"]
    missing = [r for r in results if r.steps_missing]
    if missing:
        out += ["", "Runs with steps no rank logged: " + ", ".join(str(r.steps_missing) for r in missing)]
    failures = [r for r in results if not r.recovered]
    if failures:
        out += ["", "Runs that did not recover:"] + [f"- {r.note}" for r in failures]
    return "\n".join(out)


def summary(tool: c.Tool, results: list[Outcome]) -> dict[str, dict[str, object]]:
    """bench/common.py's per-tool summary (seconds: every kill -> first step of the recovered runs), plus
    the exactness counts."""
    out = c.tool_summary([tool], results, "median_to_step_s")
    every = [s for r in results if r.recovered for s in r.to_step_s]
    out[tool.name].update(
        median_s=statistics.median(every) if every else None,
        p99_s=c.nearest_rank(every, 99),
        replaced_state_equal=sum(1 for r in results if r.replaced_state_equal),
        steps_redone=sum(r.steps_redone or 0 for r in results),
        samples_twice=sum(r.samples_twice or 0 for r in results),
        weights_bitwise_equal=sum(1 for r in results if r.weights_bitwise_equal),
        exact=sum(1 for r in results if r.exact),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(__doc__.splitlines()[0], runs=3, tools=c.INPROCESS_TOOL)
    p.add_argument("--steps", type=int, default=90, help="training steps (default %(default)s)")
    p.add_argument(
        "--kill-steps",
        default="20,45,70",
        help="SIGKILL rank 1 once rank 0 printed each of these steps (default %(default)s)",
    )
    p.add_argument("--step-time", type=float, default=0.03, help="--step-time of the killed runs")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds each wait may take before giving up")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for the first world to form")
    c.add_json_option(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.steps, args.kill_steps = 1, 45, "10,22,34"
    args.kill_steps = [int(s) for s in args.kill_steps.split(",") if s.strip()]
    if args.kill_steps != sorted(set(args.kill_steps)) or not 0 < args.kill_steps[0] <= args.kill_steps[-1]:
        p.error("--kill-steps: increasing positive steps")
    if args.kill_steps[-1] >= args.steps - 2:
        p.error("--kill-steps: the last kill must come a few steps before --steps")
    if [t.strip() for t in args.tools.split(",") if t.strip()] != [c.INPROCESS_TOOL]:
        p.error(f"--tools: only {c.INPROCESS_TOOL} (the script runs elastic.run)")
    tool = c.Tool(c.INPROCESS_TOOL, c.elastic_tool(args.elastic_cmd).argv, elastic=True)
    results = []
    with c.workdir(args.workdir) as root:
        c.log(f"inprocess-exact: reference run ({args.steps} steps, no kills)")
        reference, reference_note = reference_run(tool, root / "reference", args.steps, args.start_timeout)
        c.cleanup(c.log)
        for i in range(args.runs):
            c.log(f"inprocess-exact run {i + 1}/{args.runs}: kills at {args.kill_steps}")
            r = one_run(tool, root / f"run{i}", args, reference)
            c.log(f"  -> {r}")
            results.append(r)
            c.cleanup(c.log)
    c.emit_report(args, "In-process recovery: exact", report(tool, results, args, reference_note))
    c.write_json(args, "inprocess_exact", results, tools=summary(tool, results))
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
