"""The master's control plane at scale: N protocol-level fake nodes against one real
``elastic-master``, the load generator apart (bench/fake_fleet.py processes, their CPU reported).

Main run (memory store): a master ``--nnodes N``; every fake node opens ONE connection (the
``elastic-stream/1`` upgrade of docs/protocol.md, or with ``--protocol http`` the three keep-alive HTTP
connections of an agent without the stream: the "before"), joins, long-polls its round until assigned,
heartbeats every interval and keeps a watch long-poll pending. Measured:

- last join -> all assigned: the last join reply to the last node holding its assignment;
- a steady window (``--duration``): heartbeats offered (due) and served (answered 200), their latency, the
  master's own CPU (psutil, user + system) per heartbeat served and as a share of one core;
- idle connections: ``--idle-connections`` TCP connections that send nothing, while the fleet heartbeats:
  when the master closes them (its ``--header-timeout``), and whether the fleet was still served meanwhile;
- false dead verdicts: ``node_dead`` events in the master's event log and its own log (every fake node
  kept heartbeating; one the master forgets joins again, as an agent does).

Failover run (unless ``--skip-failover``): a private etcd, two masters on it, the fleet on both addresses;
the leader is SIGKILLed and ``failover_serve_s`` is the time until the standby has answered a heartbeat of
every node; dead verdicts after the takeover are counted.

With ``--tls`` the masters serve https (a throwaway CA and a certificate for 127.0.0.1 made in the work
folder by bench/tls_certs.py) and every fake node connects over TLS trusting that CA, in both runs; the
figures (``"tls": true``) are then the TLS ones.

The machine (bench/cp_machine.py): a core-speed micro-benchmark first (compare machines by it); the master
pinned to one core, the load generator (and etcd) to the others; with ``--master-cpu CORES`` each master in
a cgroup v1 CPU quota of its own (root). The run is marked invalid when the load generator fired over 1 % of
its beats more than 50 ms late (or used nearly all its cores): its lag, not the master's, would shape the
figures. Shed heartbeats (an overloaded master's ``429 busy``), those held back by their ``retry_after_s``,
the ``master_overloaded`` events and the ``elastic_master_overloaded`` gauge are reported. ``--saturation``
steps the fleet size instead, to the highest heartbeat rate served with p99 <= 50 ms, and measures master
CPU per heartbeat at half of it.

    python bench/control_plane.py --nodes 10000 --json cp10k.json
    python bench/control_plane.py --nodes 10000 --master-cpu 0.4 --json F       # the headroom target
    python bench/control_plane.py --saturation --master-cpu 0.4 --json sat.json # the saturation point
    python bench/control_plane.py --nodes 1000 --protocol http --skip-failover   # the HTTP baseline
    python bench/control_plane.py --quick                                       # 200 nodes, short windows
    python bench/control_plane.py --nodes 10000 --tls --json cp10k-tls.json     # masters serving https
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from bench.cp_machine import CpuLimit, Placement, cgroup_unusable, core_speed  # noqa: E402
from bench.cp_master import (  # noqa: E402
    HOST,
    client_tls,
    count_events,
    idle_connections,
    master_argv,
    master_cpu,
    num_fds,
    offers_stream,
    scrape_gauge,
    wait_listening,
)
from bench.cp_report import check_targets, report, validity, verdict  # noqa: E402
from bench.fake_fleet import raise_nofile  # noqa: E402
from bench.fleet_driver import Fleet  # noqa: E402
from master.service.settings import DEFAULT_HEADER_TIMEOUT_S  # noqa: E402


async def main_run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": args.nodes, "heartbeat_interval_s": args.heartbeat_interval}
    folder.mkdir(parents=True, exist_ok=True)
    with c.Group(folder) as group:
        port, job, token_file = c.free_port(), f"cp-{uuid.uuid4().hex[:6]}", folder / "token"
        events = folder / "events.jsonl"
        events.unlink(missing_ok=True)  # a --workdir used before
        master = group.launch(master_argv(args, port, job, token_file, events), "master")
        limit = args.placement.master(master.pid)
        why = wait_listening(master, port)
        if why:
            return {**out, "error": why}
        token = args.token = token_file.read_text().strip()
        stream, status = offers_stream(port, token, job, client_tls(args))
        if args.protocol == "stream" and not stream:
            return {**out, "error": f"the master answered the stream upgrade with {status}, not 101"}
        stream = stream and args.protocol != "http"
        out["protocol"] = "stream" if stream else "http"
        cfg = {
            "addresses": [f"{HOST}:{port}"],
            "token": token,
            "job": job,
            "stream": stream,
            "interval": args.heartbeat_interval,
            "nnodes": args.nodes,
            "join_concurrency": args.join_concurrency,
            "tls_ca": str(args.tls_files.ca) if args.tls_files else None,
        }
        over = out["protocol"] + (" over TLS" if args.tls_files else "")
        c.log(f"{args.nodes} fake nodes, {over}, {args.procs} load-generator processes")
        fleet = await Fleet.start(cfg, args.nodes, args.procs, folder)
        try:
            await measure(args, fleet, master.pid, port, out, limit)
        except (RuntimeError, OSError, asyncio.TimeoutError) as exc:  # the fleet or the master broke down
            out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            out["master_open_files_end"] = num_fds(master.pid)
            stopped = time.time()  # the fleet's connections close now: suspicions and verdicts are right
            await fleet.close()
        counted: dict[str, Any] = {"until": stopped, "master_log": master.log}
        out["false_dead_verdicts"] = count_events(events, "node_dead", **counted)
        out["suspects"] = count_events(events, "node_suspect", **counted)
        out["rounds_opened"] = count_events(events, "round_opened", **counted)
        out["overload_events"] = count_events(events, "master_overloaded", **counted)
    return out


async def measure(
    args: argparse.Namespace, fleet: Fleet, pid: int, port: int, out: dict[str, Any], limit: CpuLimit | None
) -> None:
    n, interval = args.nodes, args.heartbeat_interval
    state = await fleet.wait_assigned(n, args.assign_timeout)
    out["join_errors"] = state["errors"]
    if state["assigned"] < n:
        out["error"] = f"{state['assigned']}/{n} nodes assigned after {args.assign_timeout:g} s ({state})"
        return
    out["join_phase_s"] = state["join_last"] - state["join_first"]
    out["last_join_to_all_assigned_ms"] = 1e3 * (state["assigned_last"] - state["join_last"])
    c.log(f"all assigned, {out['last_join_to_all_assigned_ms']:.0f} ms after the last join")
    await asyncio.sleep(2 * interval)  # every node heartbeats "running" once: the master's state settles
    out["connections_per_node"] = (await fleet.progress())["connections"] / n
    out["master_open_files"] = num_fds(pid)
    t0 = time.time() + 0.5
    t1 = t0 + args.duration
    throttled = limit.throttled() if limit is not None else {}
    cpu, fig = await asyncio.gather(master_cpu(pid, t0, t1), fleet.window(t0, t1, grace=2 * interval + 1))
    out["master_overloaded_gauge"] = await scrape_gauge(
        port, args.token, "elastic_master_overloaded", client_tls(args)
    )
    if limit is not None:  # periods (of the whole window and its grace) in which the quota ran out
        after = limit.throttled()
        periods = after.get("nr_periods", 0) - throttled.get("nr_periods", 0)
        out["master_throttled_periods_share"] = (
            (after.get("nr_throttled", 0) - throttled.get("nr_throttled", 0)) / periods if periods else 0.0
        )
    out.update(
        steady_window_s=fig.seconds,
        heartbeats_offered_per_s=fig.offered / fig.seconds,
        heartbeats_sent_per_s=fig.sent / fig.seconds,
        heartbeats_served_per_s=fig.served / fig.seconds,
        heartbeat_failures=fig.statuses,
        heartbeat_p50_ms=fig.p50_ms,
        heartbeat_p99_ms=fig.p99_ms,
        heartbeat_max_ms=fig.max_ms,
        master_cpu_share=cpu / fig.seconds,
        master_cpu_us_per_heartbeat=1e6 * cpu / max(1, fig.served),
        load_generator_cores=fig.load_cpu_s / fig.seconds,
        load_generator_late_beats=fig.late,
        load_generator_late_max_ms=fig.late_max_ms,
        load_generator_late_share=fig.late / max(1, fig.offered),
        heartbeats_shed_per_s=fig.statuses.get("429", 0) / fig.seconds,
        heartbeats_held_per_s=fig.held / fig.seconds,
        heartbeat_served_share=fig.served / max(1, fig.offered),
        slow_heartbeats_by_second={str(k - int(t0)): v for k, v in fig.slow.items()},
        load_generator_processes=len(fleet.procs),
    )
    c.log(
        f"steady: {fig.served}/{fig.offered} served, p99 {fig.p99_ms or 0:.1f} ms, master "
        f"{1e6 * cpu / max(1, fig.served):.0f} us/hb, {fig.late} beats fired late by the load generator"
    )
    if args.idle_connections:
        t0 = time.time() + 0.2
        idle, fig = await asyncio.gather(
            idle_connections(port, args.idle_connections, args.header_timeout + 10.0),
            fleet.window(t0, t0 + args.header_timeout + 1.0, grace=2 * interval + 1),
        )
        out["idle_connections"] = args.idle_connections
        out["idle_connections_closed_after_s"], out["idle_connections_closed"] = idle
        out["idle_window_served_over_offered"] = fig.served / max(1, fig.offered)
    final = await fleet.progress()
    out["errors"], out["error_samples"] = final["errors"], final["samples"]
    out["assigned_at_end"] = final["assigned"]
    out["running_at_end"], out["rejoins"] = final["running"], final["rejoins"]


def procs_for(nodes: int) -> int:
    """Load-generator processes for ``nodes`` fake nodes: one per 2,500, at most 8."""
    return max(1, min(8, -(-nodes // 2500)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=None, help="fake nodes (default 10000; 200 with --quick)")
    p.add_argument("--duration", type=float, default=None, help="seconds of the steady window (default 300)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="the master's (and nodes') interval")
    p.add_argument("--heartbeat-timeout", type=float, default=4.0, help="the master's heartbeat timeout")
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="the master's --header-timeout (default: the master's own)",
    )
    p.add_argument("--procs", type=int, default=None, help="load-generator processes (default: 1 per 2,500)")
    p.add_argument("--protocol", choices=("auto", "stream", "http"), default="auto", help="stream if offered")
    p.add_argument("--join-concurrency", type=int, default=64, help="joins in flight per process")
    p.add_argument(
        "--assign-timeout", type=float, default=300.0, help="seconds for every node to be assigned"
    )
    p.add_argument("--idle-connections", type=int, default=200, help="idle TCP connections opened (0: none)")
    p.add_argument("--tls", action="store_true", help="masters serve https (a throwaway CA); nodes use TLS")
    p.add_argument("--skip-failover", action="store_true", help="no etcd, no standby, no SIGKILL")
    p.add_argument("--skip-main", action="store_true", help="the failover run only")
    p.add_argument("--failover-nodes", type=int, default=None, help="fake nodes of the failover run")
    p.add_argument("--failover-watch", type=float, default=None, help="seconds watched after the takeover")
    p.add_argument("--quick", action="store_true", help="200 nodes, 5 s windows, 50 idle connections")
    p.add_argument(
        "--master-cpu",
        type=float,
        default=None,
        metavar="CORES",
        help="limit each master to this share of one core (a cgroup v1 cpu quota; root), e.g. 0.4",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin the master and the load generator apart")
    p.add_argument("--master-core", type=int, default=None, help="the master's core (default: the first)")
    p.add_argument(
        "--saturation",
        action="store_true",
        help="instead of the main run: step the fleet size (--saturation-steps) to the highest heartbeat "
        "rate served with p99 <= 50 ms, then measure master CPU per heartbeat at half that rate",
    )
    p.add_argument(
        "--saturation-steps",
        default="2500,5000,7500,10000,15000,20000,30000",
        help="fleet sizes of --saturation, in order (comma-separated)",
    )
    p.add_argument("--saturation-window", type=float, default=20.0, help="seconds of each step's window")
    p.add_argument("--master-cmd", default=None, help="elastic-master command (default: python -m master)")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as one JSON object")
    args = p.parse_args(argv)
    # `is None`, not `or`: --nodes 0 is an error below, not a 10,000-node run.
    args.nodes = (200 if args.quick else 10000) if args.nodes is None else args.nodes
    args.duration = (5.0 if args.quick else 300.0) if args.duration is None else args.duration
    if args.quick:
        args.idle_connections = min(args.idle_connections, 50)
    for name in ("nodes", "duration", "heartbeat_interval", "heartbeat_timeout", "header_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.master_cpu is not None:
        if not 0.01 <= args.master_cpu <= 64:
            p.error("--master-cpu must be between 0.01 and 64 (cores)")
        if why := cgroup_unusable():
            p.error(why)
    try:
        args.saturation_steps = sorted({int(n) for n in args.saturation_steps.split(",") if n.strip()})
    except ValueError:
        p.error("--saturation-steps takes comma-separated node counts, e.g. 2500,5000,10000")
    if not args.saturation_steps or args.saturation_steps[0] <= 0:
        p.error("--saturation-steps needs positive node counts")
    if args.tls and importlib.util.find_spec("cryptography") is None:
        p.error("--tls makes its certificates with the cryptography package: pip install -e '.[test]'")
    args.tls_files = None  # run(): the CA, certificate and key with --tls
    args.fixed_procs = args.procs
    args.procs = args.procs or procs_for(args.nodes)
    if args.failover_nodes is not None and args.failover_nodes <= 0:
        p.error("--failover-nodes must be positive")
    args.failover_nodes = args.failover_nodes or args.nodes
    if args.failover_watch is None:
        args.failover_watch = args.heartbeat_timeout + 2 * args.heartbeat_interval
    return args


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from bench.cp_failover import failover_run  # etcd's launcher, only when needed

    if args.tls:
        from bench.tls_certs import local_server_files  # cryptography: only with --tls

        args.tls_files = local_server_files(root / "tls")
    placement = args.placement
    machine = {
        "core_speed_mloops": core_speed(placement.master_cores),
        "master_cpu_limit": args.master_cpu,
        "pinned": placement.pinned,
        "master_cores": sorted(placement.master_cores),
        "load_generator_cores_set": sorted(placement.load_cores),
        "placement": placement.describe(),
    }
    c.log(
        f"core speed {machine['core_speed_mloops']:.2f} M loops/s (bench/cp_machine.py); "
        + placement.describe()
    )
    placement.enter()
    try:
        if args.saturation:
            return {**machine, **(await saturation_run(args, root)), "tls": args.tls}
        out: dict[str, Any] = {"nodes": args.nodes, "heartbeat_interval_s": args.heartbeat_interval}
        if not args.skip_main:
            out = await main_run(args, root / "main")
            c.cleanup(c.log)
            placement.close()
        if not args.skip_failover:
            out.update(await failover_run(args, root / "failover"))
    finally:
        placement.close()
    out.update(machine, tls=args.tls)
    return out


async def saturation_run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Step the fleet size (a fresh master and fleet each step, ``--saturation-window`` seconds) until a
    step misses p99 <= 50 ms or serves under 99 % of what it was offered: the saturation point is the
    highest heartbeat rate a step served within both; then one run at half that rate gives the master's CPU
    per heartbeat there."""
    steps: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    for n in args.saturation_steps:
        step = await _step(args, root, n, f"sat-{n}")
        steps.append(step)
        c.log(
            f"saturation step {n:,} nodes: {step['served_per_s']:,.0f}/s served, p99 {step['p99_ms']} ms, "
            f"{'within' if step['within'] else 'beyond'} the target"
        )
        if not step["within"]:
            break
        best = step
    out: dict[str, Any] = {"saturation_steps": steps, "nodes": args.saturation_steps[-1]}
    out["heartbeat_interval_s"] = args.heartbeat_interval
    if best is None:
        out["error"] = f"even {args.saturation_steps[0]:,} nodes missed the target; step lower"
        return out
    out["saturation_heartbeats_per_s"] = best["served_per_s"]
    out["saturation_nodes"] = best["nodes"]
    if best is steps[-1]:
        out["saturation_note"] = "every step met the target: the saturation point is higher still"
    half = max(1, round(best["served_per_s"] * args.heartbeat_interval / 2))
    out["half_rate"] = await _step(args, root, half, "half")
    return out


async def _step(args: argparse.Namespace, root: Path, nodes: int, name: str) -> dict[str, Any]:
    sized = argparse.Namespace(
        **{
            **vars(args),
            "nodes": nodes,
            "duration": args.saturation_window,
            "idle_connections": 0,
            "procs": args.fixed_procs or procs_for(nodes),
        }
    )
    got = await main_run(sized, root / name)
    c.cleanup(c.log)
    args.placement.close()
    served, p99 = got.get("heartbeats_served_per_s") or 0.0, got.get("heartbeat_p99_ms")
    valid, why = validity(got)
    return {
        "nodes": nodes,
        "served_per_s": served,
        "offered_per_s": got.get("heartbeats_offered_per_s"),
        "p99_ms": None if p99 is None else round(p99, 1),
        "master_cpu_us_per_heartbeat": got.get("master_cpu_us_per_heartbeat"),
        "master_cpu_share": got.get("master_cpu_share"),
        "false_dead_verdicts": got.get("false_dead_verdicts"),
        "shed_per_s": got.get("heartbeats_shed_per_s"),
        "valid": valid,
        "invalid_reasons": why,
        "error": got.get("error"),
        "within": (
            not got.get("error")
            and p99 is not None
            and p99 <= 50.0
            and served >= 0.99 * (got.get("heartbeats_offered_per_s") or 0.0)
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.placement = Placement(not args.no_pin, args.master_cpu, args.master_core)
    # The master holds one connection per node plus the idle ones the run opens, and some files.
    fleet = max(args.nodes, *(args.saturation_steps if args.saturation else [0]))
    raise_nofile(at_least=2 * (fleet + args.idle_connections) + 4096)
    with c.workdir(args.workdir) as root:
        out = asyncio.run(run(args, root))
    out["command"] = c.command_line()
    out["valid"], out["invalid_reasons"] = validity(out)
    out["targets"] = check_targets(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    c.emit_report(args, "Control plane at scale", report(out, args))
    problems = verdict(out)
    for line in problems:
        c.log(f"FAILED: {line}")
    return c.finish(1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
