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

    python bench/control_plane.py --nodes 10000 --json cp10k.json
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
from bench.cp_master import (  # noqa: E402
    HOST,
    client_tls,
    count_events,
    idle_connections,
    master_argv,
    master_cpu,
    num_fds,
    offers_stream,
    wait_listening,
)
from bench.cp_report import report, verdict  # noqa: E402
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
        why = wait_listening(master, port)
        if why:
            return {**out, "error": why}
        token = token_file.read_text().strip()
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
            await measure(args, fleet, master.pid, port, out)
        except (RuntimeError, OSError, asyncio.TimeoutError) as exc:  # the fleet or the master broke down
            out["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            out["master_open_files_end"] = num_fds(master.pid)
            stopped = time.time()  # the fleet's connections close now: suspicions and verdicts are right
            await fleet.close()
        counted = {"until": stopped, "master_log": master.log}
        out["false_dead_verdicts"] = count_events(events, "node_dead", **counted)
        out["suspects"] = count_events(events, "node_suspect", **counted)
        out["rounds_opened"] = count_events(events, "round_opened", **counted)
    return out


async def measure(args: argparse.Namespace, fleet: Fleet, pid: int, port: int, out: dict[str, Any]) -> None:
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
    cpu, fig = await asyncio.gather(master_cpu(pid, t0, t1), fleet.window(t0, t1, grace=2 * interval + 1))
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
        slow_heartbeats_by_second={str(k - int(t0)): v for k, v in fig.slow.items()},
        load_generator_processes=len(fleet.procs),
    )
    c.log(f"steady: {fig.served}/{fig.offered} served, master {1e6 * cpu / max(1, fig.served):.0f} us/hb")
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
    if args.tls and importlib.util.find_spec("cryptography") is None:
        p.error("--tls makes its certificates with the cryptography package: pip install -e '.[test]'")
    args.tls_files = None  # run(): the CA, certificate and key with --tls
    args.procs = args.procs or max(1, min(8, -(-args.nodes // 2500)))
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
    out: dict[str, Any] = {"nodes": args.nodes, "heartbeat_interval_s": args.heartbeat_interval}
    if not args.skip_main:
        out = await main_run(args, root / "main")
        c.cleanup(c.log)
    if not args.skip_failover:
        out.update(await failover_run(args, root / "failover"))
    out["tls"] = args.tls
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_nofile()
    with c.workdir(args.workdir) as root:
        out = asyncio.run(run(args, root))
    out["command"] = c.command_line()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    c.emit_report(args, "Control plane at scale", report(out, args))
    problems = verdict(out)
    for line in problems:
        c.log(f"FAILED: {line}")
    return c.finish(1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
