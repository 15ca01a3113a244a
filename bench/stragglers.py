"""Straggler policy: a node slowed 1.5x, under ``--straggler-policy report`` (today) and ``evict``.

Two parts:

* **Replay** (pure, in simulated time): recorded step times of this machine under load
  (``bench/data/step_times_loaded.json``, made by ``--record``) go through the master's real decision code
  (:class:`master.job.stragglers.StragglerTracker` with its policy, ``StragglerWatch``), each node's figure
  being the median of its last 20 steps as its agent reports it, judged after every step (the master
  judges every 0.5 s: at least as often as a step, so this is the harsher test). The recorded load is a
  function of time, carried by steps of 0.2 s (:func:`carried`). Checked: 10,000 steps of the recorded load
  plus a 3x outlier every 200 steps on a random node give 0 evictions; a node slowed 1.5x for good (each
  node in turn, on 30 stretches of the recording) is evicted within 20 steps (median, max and count).
* **Real jobs**: an ``elastic-master`` and 3 ``elastic-run`` agents (fake nodes on this machine, gloo
  workers of scripts/train_script.py, which calls ``elastic.track_ddp``), ``--nnodes 2:3``,
  ``--straggler-factor 1.35``; ``healthy`` (no slow node: the reference rate), ``report`` and ``evict`` with
  one node slowed 1.5x: its compute time per step 1.5x the healthy nodes' as the healthy run measured it
  (its sleep is the others' plus half their compute time). Figures: steps until the eviction (the job's
  step when the master removed the node; the node is slow from the first step), the step rate before and after
  (steps/s of global rank 0, polled from ``/v1/status``), and the seconds from the eviction until the
  rate over 5 s is back within 5 % of the healthy rate.

    python bench/stragglers.py                        # replay + the three real runs
    python bench/stragglers.py --smoke                # replay + a short evict run
    python bench/stragglers.py --json stragglers.json
    python bench/stragglers.py --record bench/data/step_times_loaded.json   # re-record the series
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from elastic.control.job_settings import DEFAULT_STRAGGLER_WINDOW  # noqa: E402
from master.job.stragglers import Pace, StragglerPolicy, StragglerTracker  # noqa: E402

SERIES = c.REPO / "bench" / "data" / "step_times_loaded.json"
TRAIN_SCRIPT = c.REPO / "scripts" / "train_script.py"
#: The agent's window: a worker's figure is the median of its last this many steps (agent.observe.channel).
RECENT_STEPS = 20
#: --straggler-factor of the replay and the runs: below 1.5, so that a node 1.5x as slow is flagged; above
#: the recorded load's own differences between nodes (at 1.3 its slow phases cost 1 node in 10,000 steps).
FACTOR = 1.35
SLOWDOWN = 1.5
OUTLIER = 3.0  # the replay's outliers: one step this many times as long ...
OUTLIER_EVERY = 200  # ... every this many steps, on a random node
TARGET_STEPS = 20  # a node slowed 1.5x is evicted within this many steps
RECOVERY_TARGET_S = 30.0  # ... and the rate is back within 5 % of the healthy rate within this many seconds


# -- replay -------------------------------------------------------------------------------------------------
@dataclass
class Replay:
    """One replay: the evictions as ``(step, node)`` and the steps at which each node was first flagged."""

    steps: int
    evictions: list[tuple[int, str]] = field(default_factory=list)
    flagged_at: dict[str, int] = field(default_factory=dict)


def replay(
    series: Mapping[str, Sequence[float]],
    *,
    factor: float = FACTOR,
    window: int = DEFAULT_STRAGGLER_WINDOW,
    mode: str = "evict",
    min_nodes: int = 2,
    spares: int = 0,
) -> Replay:
    """Run the master's straggler decision over per-node compute-time series (all of one length), in lock
    step: after each step every node's figure is the median of its last :data:`RECENT_STEPS` times, and
    the tracker judges them with each node's step count. An evicted node leaves the job."""
    tracker = StragglerTracker(factor, StragglerPolicy(mode, window, 600.0, min_nodes))
    recent: dict[str, deque[float]] = {n: deque(maxlen=RECENT_STEPS) for n in series}
    length = min(len(s) for s in series.values())
    result = Replay(length)
    now = 0.0
    for step in range(length):
        for node in recent:
            recent[node].append(series[node][step])
        now += max(series[node][step] for node in recent)
        paces = {n: Pace(max(times), statistics.median(times)) for n, times in recent.items()}
        tracker.update(paces, now, dict.fromkeys(recent, step + 1), len(recent), spares)
        for node in tracker.flagged:
            result.flagged_at.setdefault(node, step + 1)
        for eviction in tracker.take_evictions():
            result.evictions.append((step + 1, eviction.node_id))
            del recent[eviction.node_id]
    return result


#: Recorded steps left out at the start: the processes' warm-up (first allocations, lazy imports), not load.
WARMUP_STEPS = 50


def load_series(path: Path = SERIES) -> dict[str, list[float]]:
    """The recorded series: ``{node: [seconds per step, ...]}``, its warm-up left out."""
    nodes = json.loads(path.read_text())["nodes"]
    return {n: [float(t) for t in times[WARMUP_STEPS:]] for n, times in nodes.items()}


def carried(times: Sequence[float], steps: int, step_s: float, offset: int = 0) -> list[float]:
    """``steps`` steps of ``step_s`` seconds that carry the recorded load ``times`` (seconds per recorded
    step, read from ``offset`` and cycled): the load is a function of wall time, so a step lasts ``step_s``
    times the mean slowdown (recorded time / the recording's median) of the recorded steps that fall in
    its stretch of the recording's time line. A load phase of 0.7 s is then 0.7 s long at any step time."""
    median = statistics.median(times)
    out, i, spent = [], offset % len(times), 0.0  # spent: seconds of recorded step i already used
    for _ in range(steps):
        want, weighted = step_s, 0.0  # recorded seconds still to cover, and their slowdown x seconds
        while want > 1e-12:
            left = times[i] - spent
            take = min(left, want)
            weighted += take * times[i] / median
            want -= take
            spent += take
            if spent >= times[i] - 1e-12:
                i, spent = (i + 1) % len(times), 0.0
        out.append(weighted)
    return out


def noisy_run(
    recorded: Mapping[str, Sequence[float]], steps: int, seed: int = 0, step_s: float = 0.2
) -> dict[str, list[float]]:
    """``steps`` steps of ``step_s`` seconds per node carrying the recorded load (:func:`carried`; each node
    its own recorded series, from its own offset), with a :data:`OUTLIER` x step on a random node every
    :data:`OUTLIER_EVERY` steps."""
    rng = random.Random(seed)
    out: dict[str, list[float]] = {}
    for i, (node, times) in enumerate(recorded.items()):
        out[node] = carried(times, steps, step_s, offset=i * len(times) // max(1, len(recorded)))
    nodes = list(out)
    for step in range(OUTLIER_EVERY - 1, steps, OUTLIER_EVERY):
        node = rng.choice(nodes)
        out[node][step] *= OUTLIER
    return out


def slowed(
    run: Mapping[str, Sequence[float]], node: str, since: int, by: float = SLOWDOWN
) -> dict[str, list[float]]:
    """``run`` with ``node``'s steps from ``since`` on ``by`` times as long."""
    out = {n: list(times) for n, times in run.items()}
    out[node] = [t * by if s >= since else t for s, t in enumerate(out[node])]
    return out


def replay_checks(steps: int = 10_000, trials: int = 30) -> dict[str, object]:
    """The replay's figures: false evictions over ``steps`` noisy steps; and over ``trials`` runs (each
    node in turn slowed 1.5x from step 100, the recorded load read from another offset each time) the
    steps from the slowdown to its eviction, and evictions of the other nodes."""
    recorded = load_series()
    false = replay(noisy_run(recorded, steps))
    latencies: list[int] = []
    missed = wrong = 0
    for trial in range(trials):
        run = noisy_run(recorded, 400, seed=trial)
        shift = trial * 37  # another stretch of the recording for every trial
        run = {n: times[shift:] + times[:shift] for n, times in run.items()}
        victim = sorted(run)[trial % len(run)]
        caught = replay(slowed(run, victim, since=100))
        evicted = [s - 100 for s, n in caught.evictions if n == victim]
        wrong += len([n for _, n in caught.evictions if n != victim])
        if evicted:
            latencies.append(evicted[0])
        else:
            missed += 1
    return {
        "steps": steps,
        "series": str(SERIES.relative_to(c.REPO)),
        "recorded_steps": min(len(t) for t in recorded.values()),
        "step_s": 0.2,
        "false_evictions": len(false.evictions),
        "trials": trials,
        "slow_node_evicted_after_steps_median": statistics.median(latencies) if latencies else None,
        "slow_node_evicted_after_steps_max": max(latencies) if latencies else None,
        "slow_node_within_20_steps": sum(1 for s in latencies if s <= TARGET_STEPS),
        "slow_node_missed": missed,
        "other_evictions_with_slow_node": wrong,
    }


# -- recording ----------------------------------------------------------------------------------------------
#: A recorded step: a small CPU training step (a few ms) and this sleep, about 25 ms in all: short, so that
#: the recording resolves the load's phases finely in time (:func:`carried` turns it into longer steps).
RECORD_SLEEP_S = 0.02


def _record_node(steps: int, queue: multiprocessing.Queue) -> None:
    """One fake node: a small CPU training step (forward, backward, SGD) plus a sleep, timed."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 64), torch.randn(128, 1)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(RECORD_SLEEP_S)
        times.append(round(time.perf_counter() - t0, 5))  # the warm-up too: load_series leaves it out
    queue.put(times)


def record(path: Path, steps: int, nodes: int = 3) -> None:
    """Record ``nodes`` concurrent fake nodes' step times on this machine (under whatever load it has)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_record_node, args=(steps, queue)) for _ in range(nodes)]
    for proc in procs:
        proc.start()
    series = {f"node-{i}": queue.get() for i in range(nodes)}
    for proc in procs:
        proc.join()
    data = {
        "what": f"seconds per step of {nodes} concurrent fake nodes (a small CPU MLP step + "
        f"{RECORD_SLEEP_S} s sleep), recorded by bench/stragglers.py --record on a loaded machine",
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": c.machine_note(),
        "nodes": series,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) + "\n")


# -- real jobs ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One real job of :data:`NODES` fake nodes under one policy."""

    policy: str
    slow: bool
    ok: bool = True
    note: str = ""
    steps_until_eviction: int | None = None  # the job's step when the master removed the slow node
    flagged_steps: int | None = None  # the eviction event's "for N steps" (steps flagged before it)
    slow_ratio: float | None = None  # the eviction event's ratio to the median
    evicted_agent_exit: int | None = None
    rate_before: float | None = None  # steps/s before the eviction (for report: from 5 s on to the end)
    compute_s: float | None = None  # median compute time per step of the healthy nodes (from /v1/status)
    slow_sleep_s: float | None = None  # the slow node's --step-time
    rate_after: float | None = None  # steps/s from the new round's first step to the end
    recovered_s: float | None = None  # eviction -> the rate over 5 s within 5 % of the healthy rate
    timeline: list[list[float]] = field(default_factory=list)  # [[seconds, step], ...]


NODES = 3


def _status(address: str, job: str, token: str) -> dict | None:
    import httpx

    from elastic.control.protocol import API_PREFIX, JOB_HEADER

    headers = {"Authorization": f"Bearer {token}", JOB_HEADER: job}
    try:
        reply = httpx.get(f"http://{address}{API_PREFIX}/status", headers=headers, timeout=5)
        return reply.json() if reply.status_code == 200 else None
    except httpx.HTTPError:
        return None


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rate(timeline: Sequence[Sequence[float]], start: float, end: float) -> float | None:
    """Steps per second between ``start`` and ``end`` (seconds of the timeline)."""
    inside = [(t, s) for t, s in timeline if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def real_run(policy: str, slow: bool, folder: Path, args: argparse.Namespace) -> Run:
    """One job: master + :data:`NODES` agents; with ``slow`` the last node sleeps 1.5x as long per step."""
    folder.mkdir(parents=True, exist_ok=True)
    run = Run(policy, slow)
    port, job, token = c.free_port(), f"bench-{policy}-{time.time_ns() % 10**6}", "bench-straggler-token"
    (folder / "token").write_text(token + "\n")
    events_file = folder / "events.jsonl"
    master = c.master_argv() + [
        *("--host", "127.0.0.1", "--port", str(port), "--job-id", job, "--nnodes", f"2:{NODES}"),
        *("--token-file", str(folder / "token"), "--heartbeat-interval", "0.5", "--last-call", "1"),
        *("--straggler-factor", str(FACTOR), "--straggler-policy", policy, "--event-log", str(events_file)),
    ]
    address = f"127.0.0.1:{port}"
    with c.Group(folder) as group:
        group.launch(master, "master")
        if not c.wait_until(lambda: c.port_open(port), 60):
            run.ok, run.note = False, "the master did not listen within 60 s"
            return run
        agents = {}
        for i in range(NODES):
            sleep = args.step_time
            if slow and i == NODES - 1:
                # 1.5x the healthy node's compute time (its sleep plus its CPU work, measured by the healthy
                # run): sleep + 0.5 x compute. 1.5x the sleep alone would be less, by the CPU work's share.
                compute = args.healthy_compute or args.step_time
                sleep = run.slow_sleep_s = args.step_time + (SLOWDOWN - 1) * compute
            argv = c.elastic_tool().cmd(
                *("--nnodes", f"2:{NODES}", "--nproc-per-node", "1", "--master", address, "--job-id", job),
                *("--token-file", str(folder / "token"), "--node-id", f"node-{i}"),
                *("--ckpt-dir", str(folder / "ckpt"), "--stop-grace", "2", str(TRAIN_SCRIPT)),
                *("--steps", "1000000", "--ckpt-every", "50", "--step-time", f"{sleep:.4f}"),
                *("--batch-size", "32"),
            )
            agents[f"node-{i}"] = group.launch(argv, f"node-{i}", env=c.bench_env(OMP_NUM_THREADS="1"))
        timeline: list[list[float]] = []
        computes: list[float] = []
        t0: float | None = None
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            status = _status(address, job, token)
            steps = [n["step"] for n in (status or {}).get("nodes", []) if n.get("step") is not None]
            computes += [
                n["compute_time_s"]
                for n in (status or {}).get("nodes", [])
                if n.get("compute_time_s") is not None and n["node_id"] != f"node-{NODES - 1}"
            ]
            now = time.time()
            if steps:
                t0 = now if t0 is None else t0
                timeline.append([round(now - t0, 3), max(steps)])
                if now - t0 >= args.duration:
                    break
            time.sleep(0.25)  # polling the status: there is no event to wait on
        run.timeline = timeline
        run.compute_s = statistics.median(computes) if computes else None
        if t0 is None:
            run.ok, run.note = False, f"no step within {args.timeout:g} s"
            return run
        events = _events(events_file)
        slow_agent = agents[f"node-{NODES - 1}"]
        run.evicted_agent_exit = slow_agent.popen.poll()
        evicted = next((e for e in events if e["kind"] == "straggler_evicted"), None)
        end = timeline[-1][0]
        if evicted is None:
            run.rate_before = _rate(timeline, 5.0, end)
            if policy != "report" and slow:
                run.ok, run.note = False, "no eviction"
            return run
        at = evicted["time"] - t0
        run.steps_until_eviction = int(max((s for t, s in timeline if t <= at), default=0))
        message = evicted["message"]
        flagged = _number_after(message, "for ", " steps")
        run.flagged_steps = int(flagged) if flagged is not None else None
        ratio = _number_after(message, ", ", "x the median")
        run.slow_ratio = float(ratio) if ratio is not None else None
        run.rate_before = _rate(timeline, 0.0, at)  # from the first step: the node is slow from the start
        back = next(
            (e["time"] - t0 for e in events if e["kind"] == "first_step" and e["time"] > evicted["time"]),
            None,
        )
        if back is not None:
            run.rate_after = _rate(timeline, back, end)
            healthy = args.healthy_rate
            if healthy:
                for t, _ in timeline:
                    r = _rate(timeline, t, t + 5.0) if t >= at and t + 5.0 <= end else None
                    if r is not None and r >= 0.95 * healthy:
                        run.recovered_s = round(t - at, 2)
                        break
        return run


def _number_after(text: str, before: str, after: str):  # noqa: ANN202 - int | float | None
    """The number right before ``after`` in ``text`` (preceded by ``before``)."""
    end = text.find(after)
    if end < 0:
        return None
    start = text.rfind(before, 0, end)
    value = text[start + len(before) : end].strip() if start >= 0 else ""
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return None


# -- report -------------------------------------------------------------------------------------------------
def _fmt(value: object, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def report(checks: dict[str, object], runs: list[Run], args: argparse.Namespace) -> str:
    out = [
        f"Replay of the master's decision over `{checks['series']}` ({checks['recorded_steps']} recorded "
        f"steps per node, cycled), `--straggler-factor {FACTOR}`, `--straggler-window "
        f"{DEFAULT_STRAGGLER_WINDOW}`: **{checks['false_evictions']} evictions** over {checks['steps']} "
        f"steps with a {OUTLIER:g}x outlier every {OUTLIER_EVERY} steps on a random node (target 0); a node "
        f"slowed {SLOWDOWN}x (each node in turn, {checks['trials']} trials) evicted a median "
        f"**{checks['slow_node_evicted_after_steps_median']} steps** after its slowdown began (max "
        f"{checks['slow_node_evicted_after_steps_max']}; "
        f"{checks['slow_node_within_20_steps']}/{checks['trials']} within {TARGET_STEPS}; target <= "
        f"{TARGET_STEPS}), other nodes evicted meanwhile: "
        f"{checks['other_evictions_with_slow_node']}. Steps of 0.2 s carry the recorded load in time.",
    ]
    if runs:
        slow_sleep = _fmt(next((r.slow_sleep_s for r in runs if r.slow_sleep_s), None), 3)
        rows = [
            [
                r.policy + ("" if r.slow else " (no slow node)"),
                "ok" if r.ok else f"failed: {r.note}",
                _fmt(r.steps_until_eviction),
                _fmt(r.slow_ratio),
                _fmt(r.evicted_agent_exit),
                _fmt(r.rate_before),
                _fmt(r.rate_after),
                _fmt(r.recovered_s, 1),
            ]
            for r in runs
        ]
        out += [
            "",
            f"Real jobs: {NODES} fake nodes x 1 gloo worker (scripts/train_script.py, `elastic.track_ddp`), "
            f"`--step-time {args.step_time}` (the slow node's: the healthy nodes' compute time x {SLOWDOWN}, "
            f"{slow_sleep} s), `--nnodes 2:{NODES}`, "
            f"{args.duration:g} s of training each; step rates are steps/s of the job.",
            "",
            c.table(
                [
                    "policy",
                    "run",
                    "steps until eviction",
                    "slow node's ratio",
                    "its agent's exit",
                    "rate before (steps/s)",
                    "rate after",
                    "back within 5 % of healthy (s)",
                ],
                rows,
            ),
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="replay + one short evict run")
    p.add_argument("--replay-only", action="store_true", help="only the replay (no processes)")
    p.add_argument("--steps", type=int, default=10_000, help="replay steps (default %(default)s)")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of training per real run")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a real run may take in all")
    p.add_argument("--step-time", type=float, default=0.2, help="a healthy node's sleep per step (seconds)")
    p.add_argument("--record", default=None, metavar="FILE", help="record a new step-time series and exit")
    p.add_argument("--record-steps", type=int, default=1500, help="steps per node to record")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    c.add_json_option(p)
    args = p.parse_args(argv)
    if args.record:
        record(Path(args.record), args.record_steps)
        return 0
    if args.smoke:
        args.steps, args.duration = 2000, 15.0
    checks = replay_checks(args.steps)
    c.log(f"replay: {checks}")
    runs: list[Run] = []
    args.healthy_rate = args.healthy_compute = None
    if not args.replay_only:
        plan = [("evict", True)] if args.smoke else [("healthy", False), ("report", True), ("evict", True)]
        with c.workdir(args.workdir) as root:
            for i, (policy, slow) in enumerate(plan):
                name = "report" if policy == "healthy" else policy
                c.log(f"real run {i + 1}/{len(plan)}: {policy}")
                run = real_run(name, slow, root / f"run{i}-{policy}", args)
                if policy == "healthy":
                    run.policy = "report"
                    args.healthy_rate, args.healthy_compute = run.rate_before, run.compute_s
                c.log(f"  -> { ({k: v for k, v in asdict(run).items() if k != 'timeline'}) }")
                runs.append(run)
                c.cleanup(c.log)
    body = report(checks, runs, args)
    c.emit_report(args, "Straggler policy", body)
    if args.json:
        data = {"benchmark": "stragglers", "command": c.command_line(), "replay": checks}
        data["runs"] = [asdict(r) for r in runs]  # type: ignore[misc]
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
