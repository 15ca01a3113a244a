"""Hot spares: a node lost (SIGKILL of its whole process tree, or SIGSTOP: it vanishes) -> the job back at
full world size and stepping, with a hot spare, side by side with today's behaviour without one, in the
same run.

* ``spare``: ``--nnodes 2:2``, two members and a third agent beyond the maximum (a hot spare: registered,
  heartbeating, its warm-start zygote has imported torch). Each run loses one member (alternately the
  node of rank 0, which also hosts the workers' store, and the node of rank 1); the next round closes as
  soon as the survivor is back, with the spare in the lost node's rank. Measured: the fault -> the
  survivor's first step at world size 2 in the re-formed world. A new spare is then started and waited for
  (it is not part of the figure) before the next run.
* ``no-spare`` (today without a spare): ``--nnodes 1:2``, two members. The fault -> the survivor's first
  step at world size 1 (the job shrinks), and -> the first step back at world size 2 with a replacement
  agent started at the fault (a cold node: the agent starts, its zygote imports torch, it joins, the
  master's growth last call ends, the world re-forms).

The workload is bench/workload.py inside ``elastic.run`` (in-process recovery: survivors keep their
processes; a new rank receives the newest committed step from a live peer's memory). Steps lost: the
newest step completed before the fault minus the step the re-formed world resumed from. The master runs
with its default liveness settings (heartbeat 1 s, timeout 4 s): a SIGSTOPped node is noticed only by the
heartbeat timeout, so the target there is relative to it.

Targets: SIGKILL with a spare: p50 <= 1.0 s, max <= 2 s over 20 runs; SIGSTOP with a spare:
p50 <= heartbeat timeout + 1 s.

    python bench/spares.py                          # 20 runs of each, SIGKILL
    python bench/spares.py --fault sigstop --runs 5
    python bench/spares.py --smoke                  # 1 run of each
    python bench/spares.py --json spares.json
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.checkpoints.shm_folder import DEFAULT_ROOT, folder_name  # noqa: E402
from bench import common as c  # noqa: E402

HEARTBEAT_TIMEOUT_S = 4.0  # the master's default, which the SIGSTOP target is relative to
SPARE_TARGET_S = (1.0, 2.0)  # SIGKILL with a spare: p50 and max
STOP_MARGIN_S = 1.0  # SIGSTOP with a spare: p50 <= heartbeat timeout + this
FAULTS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
SCENARIOS = ("spare", "no-spare")


@dataclass
class Outcome:
    scenario: str
    run: int
    fault: str
    recovered: bool
    note: str = ""
    victim_rank: int | None = None  # node rank of the lost node
    to_full: float | None = None  # fault -> first step back at world size 2
    to_shrunk: float | None = None  # no-spare: fault -> survivor's first step at world size 1
    steps_lost: int | None = None
    survivor_pid_unchanged: bool | None = None
    spare_rank: int | None = None  # spare: the node rank the spare took (== victim_rank when it works)


class Job:
    """One elastic-master job on this machine and its agents (fake nodes), reused over the runs. Use as a
    context manager inside the run's :class:`bench.common.Group`: on exit it removes the shared-memory
    folders its SIGKILLed agents could not remove themselves (a lost machine takes its memory with it)."""

    def __init__(self, group: c.Group, nnodes: str, args) -> None:
        tool = c.elastic_inprocess_tool(args.elastic_cmd)
        worker = ["--ckpt-dir", group.folder / "ckpt", "--step-time", args.step_time]
        if args.state_mb:
            worker += ["--state-mb", args.state_mb]
        self.cluster = c.Cluster(tool, group, nnodes, worker, max_restarts=1000)
        self.count = 0

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.group.close()  # every agent is gone before its folder is removed
        for folder in Path(DEFAULT_ROOT).glob(folder_name(self.cluster.job, "x")[:-1] + "*"):
            shutil.rmtree(folder, ignore_errors=True)

    def start(self) -> bool:
        return self.cluster.start()

    def add_node(self) -> c.Launched:
        self.count += 1
        return self.cluster.start_node(f"node{self.count}")

    def status(self) -> dict | None:
        cl = self.cluster
        token = cl.token_file.read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "X-Elastic-Job": cl.job}
        try:
            reply = httpx.get(f"http://127.0.0.1:{cl.port}/v1/status", headers=headers, timeout=5)
            return reply.json() if reply.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def ranks(self) -> dict[str, int]:
        """Node rank of each member of the running round ({} while none runs)."""
        status = self.status() or {}
        if status.get("phase") != "training":
            return {}
        return {n["node_id"]: n["rank"] for n in status.get("nodes", []) if n.get("rank") is not None}


def after(proc: c.Launched, t: float, **match: object) -> dict | None:
    return c.first(proc.events(), t=lambda v: v > t, **match)


def stepping(proc: c.Launched, world: int, since: float) -> dict | None:
    """The first step at ``world`` of a world that formed (``init``) on ``proc`` after ``since``."""
    init = after(proc, since, kind="init", world=world)
    return after(proc, init["t"], kind="step", world=world) if init else None


def last_step(procs: list[c.Launched], before: float) -> int:
    return max(
        (e["step"] for p in procs for e in p.events() if e["kind"] == "step" and e["t"] < before), default=0
    )


def run_spare(job: Job, members: dict[str, c.Launched], spare: c.Launched, i: int, args) -> Outcome:
    ranks = job.ranks()
    victim_rank = i % 2
    victim_id = next((n for n, r in ranks.items() if r == victim_rank), None)
    if victim_id is None or victim_id not in members:
        return Outcome("spare", i, args.fault, False, f"no member of rank {victim_rank}: {ranks}")
    victim = members.pop(victim_id)
    (survivor,) = members.values()
    pid_before = [e["pid"] for e in survivor.events() if e["kind"] == "start"][-1]
    t_fault = victim.signal_tree(FAULTS[args.fault])
    done = cast(
        "dict | None", c.wait_until(lambda: stepping(survivor, 2, t_fault), args.timeout, interval=0.01)
    )
    lost_before = last_step([survivor, victim], t_fault)
    victim.kill()  # a stopped node too (SIGKILL works on stopped processes)
    if not done:
        return Outcome("spare", i, args.fault, False, f"no step at world 2 within {args.timeout:g}s")
    start = after(survivor, t_fault, kind="start")
    spare_start = after(spare, t_fault, kind="start")
    return Outcome(
        "spare",
        i,
        args.fault,
        True,
        victim_rank=victim_rank,
        to_full=done["t"] - t_fault,
        # A step whose line came out after the fault may be committed: never negative.
        steps_lost=max(0, lost_before - start["resumed"]) if start else None,
        survivor_pid_unchanged=start is not None and start["pid"] == pid_before,
        spare_rank=spare_start.get("rank") if spare_start else None,
    )


def run_no_spare(job: Job, members: dict[str, c.Launched], i: int, args) -> tuple[Outcome, c.Launched]:
    ranks = job.ranks()
    victim_rank = i % 2
    victim_id = next((n for n, r in ranks.items() if r == victim_rank), None)
    if victim_id is None or victim_id not in members:
        raise RuntimeError(f"no member of rank {victim_rank}: {ranks}")
    victim = members.pop(victim_id)
    (survivor,) = members.values()
    pid_before = [e["pid"] for e in survivor.events() if e["kind"] == "start"][-1]
    t_fault = victim.signal_tree(FAULTS[args.fault])
    replacement = job.add_node()  # a cold node, started at the fault
    shrunk = cast(
        "dict | None", c.wait_until(lambda: stepping(survivor, 1, t_fault), args.timeout, interval=0.01)
    )
    lost_before = last_step([survivor, victim], t_fault)
    victim.kill()
    since = shrunk["t"] if shrunk else t_fault
    full = cast(
        "dict | None", c.wait_until(lambda: stepping(survivor, 2, since), args.timeout + 120, interval=0.01)
    )
    start = after(survivor, t_fault, kind="start")
    out = Outcome(
        "no-spare",
        i,
        args.fault,
        bool(full),
        "" if full else "not back at world 2 in time",
        victim_rank=victim_rank,
        to_full=full["t"] - t_fault if full else None,
        to_shrunk=shrunk["t"] - t_fault if shrunk else None,
        # A step whose line came out after the fault may be committed: never negative.
        steps_lost=max(0, lost_before - start["resumed"]) if start else None,
        survivor_pid_unchanged=start is not None and start["pid"] == pid_before,
    )
    return out, replacement


def wait_spare(job: Job, node: c.Launched, timeout: float) -> bool:
    name = node.name
    return bool(c.wait_until(lambda: name in ((job.status() or {}).get("spares") or []), timeout))


def wait_world(job: Job, members: list[c.Launched], timeout: float, since: float) -> bool:
    return bool(c.wait_until(lambda: any(stepping(m, 2, since) for m in members), timeout))


def scenario_spare(root: Path, args) -> list[Outcome]:
    results: list[Outcome] = []
    (root / "spare").mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(c.Group(root / "spare"))
        job = stack.enter_context(Job(group, "2:2", args))
        if not job.start():
            return [Outcome("spare", 0, args.fault, False, "master did not start")]
        t0 = c.time.time()
        members = {n.name: n for n in (job.add_node(), job.add_node())}
        if not wait_world(job, list(members.values()), args.start_timeout, t0):
            return [Outcome("spare", 0, args.fault, False, "never reached world size 2")]
        spare = job.add_node()
        for i in range(args.runs):
            if not wait_spare(job, spare, args.start_timeout):
                results.append(Outcome("spare", i, args.fault, False, f"{spare.name} never became a spare"))
                break
            survivor = next(iter(members.values()))
            # A few steps at world 2 first, in the world the spare waits beside.
            c.wait_until(partial(_steps_since, survivor, args.steps_before), args.start_timeout)
            r = run_spare(job, members, spare, i, args)
            c.log(f"  spare run {i + 1}/{args.runs}: {r}")
            results.append(r)
            if not r.recovered:
                break
            members[spare.name] = spare
            spare = job.add_node()
    return results


def _steps_since(proc: c.Launched, count: int) -> bool:
    """The newest world of ``proc`` has ``count`` steps at world size 2."""
    events = proc.events()
    inits = [e for e in events if e["kind"] == "init"]
    if not inits:
        return False
    since = inits[-1]["t"]
    return sum(1 for e in events if e["kind"] == "step" and e["world"] == 2 and e["t"] > since) >= count


def scenario_no_spare(root: Path, args) -> list[Outcome]:
    results: list[Outcome] = []
    (root / "no-spare").mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        group = stack.enter_context(c.Group(root / "no-spare"))
        job = stack.enter_context(Job(group, "1:2", args))
        if not job.start():
            return [Outcome("no-spare", 0, args.fault, False, "master did not start")]
        t0 = c.time.time()
        members = {n.name: n for n in (job.add_node(), job.add_node())}
        if not wait_world(job, list(members.values()), args.start_timeout, t0):
            return [Outcome("no-spare", 0, args.fault, False, "never reached world size 2")]
        for i in range(args.runs):
            survivor = next(iter(members.values()))
            c.wait_until(partial(_steps_since, survivor, args.steps_before), args.start_timeout)
            try:
                r, replacement = run_no_spare(job, members, i, args)
            except RuntimeError as exc:
                results.append(Outcome("no-spare", i, args.fault, False, str(exc)))
                break
            c.log(f"  no-spare run {i + 1}/{args.runs}: {r}")
            results.append(r)
            if not r.recovered:
                break
            members[replacement.name] = replacement
    return results


def figures(results: list[Outcome], scenario: str, attr: str) -> c.Stat:
    return c.Stat(
        [getattr(r, attr) for r in results if r.scenario == scenario and getattr(r, attr) is not None]
    )


def report(results: list[Outcome], args) -> str:
    what = "kill" if args.fault == "sigkill" else "stop"
    rows = []
    for scenario in SCENARIOS:
        mine = [r for r in results if r.scenario == scenario]
        ok = [r for r in mine if r.recovered]
        full = figures(results, scenario, "to_full")
        rows.append(
            [
                scenario,
                f"{len(ok)}/{len(mine)}",
                full.fmt(2),
                f"{max(full.values):.2f}" if full.values else "n/a",
                figures(results, scenario, "to_shrunk").fmt(2) if scenario == "no-spare" else "-",
                c.Stat([float(r.steps_lost) for r in ok if r.steps_lost is not None]).fmt(0),
                c.pids_unchanged(mine),
                (
                    f"{sum(1 for r in ok if r.spare_rank == r.victim_rank)}/{len(ok)}"
                    if scenario == "spare"
                    else "-"
                ),
            ]
        )
    spare = figures(results, "spare", "to_full")
    if args.fault == "sigkill" and args.state_mb:
        # A large state: the restore's own target for its bytes on top (1.5 x loopback TCP moving them,
        # plus the digest over them: bench/checkpoint.py's peer row), measured in this run.
        p50 = SPARE_TARGET_S[0] + args.restore_allowance_s
        met = spare.median is not None and spare.median <= p50
        target = (
            f"Target (spare, SIGKILL, {args.state_mb:g} MB of state): p50 <= {SPARE_TARGET_S[0]:g} s + "
            f"1.5 x loopback TCP ({args.loopback_s:.3f} s) + digest ({args.digest_s:.3f} s) = {p50:.2f} s"
        )
    elif args.fault == "sigkill":
        p50, top = SPARE_TARGET_S
        met = spare.median is not None and spare.median <= p50 and max(spare.values) <= top
        target = f"Target (spare, SIGKILL): p50 <= {p50:g} s and max <= {top:g} s"
    else:
        p50 = HEARTBEAT_TIMEOUT_S + STOP_MARGIN_S
        met = spare.median is not None and spare.median <= p50
        target = f"Target (spare, SIGSTOP): p50 <= heartbeat timeout + {STOP_MARGIN_S:g} s = {p50:g} s"
    worst = f"{max(spare.values):.2f}" if spare.values else "n/a"
    out = [
        f"One job per scenario on this machine, 1 worker per node (bench/workload.py inside `elastic.run`), "
        f"{args.runs} run(s) each; per run one member {'SIGKILLed' if what == 'kill' else 'SIGSTOPped'} "
        f"(alternately node rank 0, the store host, and node rank 1) after {args.steps_before} steps at "
        "world size 2. spare: `--nnodes 2:2` + 1 spare agent; no-spare: `--nnodes 1:2`, a cold replacement "
        "agent started at the fault. Seconds from the fault."
        + (f" Each worker's state: the example model plus {args.state_mb:g} MB." if args.state_mb else ""),
        "",
        c.table(
            [
                "scenario",
                "recovered",
                f"{what} -> stepping at world 2 (s)",
                "max (s)",
                f"{what} -> stepping at world 1 (s)",
                "steps lost",
                "survivor PID unchanged",
                "spare took the lost rank",
            ],
            rows,
        ),
        "",
        f"{target}: {'met' if met else 'NOT met'} (median {spare.fmt(2)} s, max {worst} s).",
    ]
    base = figures(results, "no-spare", "to_full")
    if spare.median and base.median:
        out.append(f"Back at full size, no-spare / spare: {base.median / spare.median:.1f}x.")
    bad = [r for r in results if not r.recovered]
    if bad:
        out += ["", "Runs that did not recover:"] + [f"- {r.scenario} run {r.run}: {r.note}" for r in bad]
    return "\n".join(out)


def restore_references(nbytes: int) -> tuple[float, float]:
    """Seconds loopback TCP takes to move ``nbytes``, and the checkpoint digest (xxh3) over them: the
    references of the peer restore's target (bench/checkpoint.py), best of 3."""
    from bench import ckpt_replication
    from elastic.checkpoint import digest

    tcp = min(ckpt_replication.loopback_seconds(nbytes) for _ in range(3))
    data = bytearray(b"\x01") * nbytes
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        digest.hasher().update(data)
        best = min(best, time.perf_counter() - began)
    return tcp, best


def summary(results: list[Outcome]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for scenario in SCENARIOS:
        mine = [r for r in results if r.scenario == scenario]
        values = [r.to_full for r in mine if r.recovered and r.to_full is not None]
        out[scenario] = {
            "runs": len(mine),
            "recovered": sum(1 for r in mine if r.recovered),
            "median_s": statistics.median(values) if values else None,
            "max_s": max(values) if values else None,
            "p99_s": c.nearest_rank(values, 99),
            "survivor_pids_unchanged": sum(1 for r in mine if r.survivor_pid_unchanged),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(__doc__.splitlines()[0], runs=20, tools="elastic-run-inprocess")
    p.add_argument("--steps-before", type=int, default=5, help="steps at world 2 before each fault")
    p.add_argument("--step-time", type=float, default=0.05, help="workload --step-time")
    p.add_argument(
        "--state-mb",
        type=float,
        default=0,
        help="MB of extra state per worker beside the example model (workload --state-mb; e.g. 1000)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds after the fault before giving up")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds for a node to start")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: spare, no-spare")
    p.add_argument(
        "--fault",
        choices=sorted(FAULTS),
        default="sigkill",
        help="what the lost node gets: sigkill (it dies) or sigstop (it vanishes) (default %(default)s)",
    )
    c.add_json_option(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.steps_before, args.timeout = 1, 2, 60.0
    args.loopback_s = args.digest_s = args.restore_allowance_s = 0.0
    if args.state_mb:
        args.loopback_s, args.digest_s = restore_references(int(args.state_mb * 1e6))
        args.restore_allowance_s = 1.5 * args.loopback_s + args.digest_s
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    results: list[Outcome] = []
    with c.workdir(args.workdir) as root:
        if "spare" in wanted:
            c.log(f"spares: {args.runs} run(s) with a spare ({args.fault})")
            results += scenario_spare(root, args)
            c.cleanup(c.log)
        if "no-spare" in wanted:
            c.log(f"spares: {args.runs} run(s) without a spare ({args.fault})")
            results += scenario_no_spare(root, args)
            c.cleanup(c.log)
    title = "Hot spares" if args.fault == "sigkill" else "Hot spares: the node vanishes (SIGSTOP)"
    c.emit_report(args, title, report(results, args))
    figures_by_scenario = summary(results)
    if args.state_mb:  # the large-state target's references, measured in this run
        for scenario in figures_by_scenario.values():
            scenario.update(state_mb=args.state_mb, loopback_tcp_s=args.loopback_s, digest_s=args.digest_s)
    c.write_json(args, "spares", results, tools=figures_by_scenario)
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
