"""The table of bench/control_plane.py (figure | value | target: the control plane's targets) and its verdict:
what makes the run fail (correctness: nodes not assigned, false dead verdicts, idle connections never
closed, a failover that did not serve every node), never a speed figure."""

from __future__ import annotations

import argparse
from typing import Any

from bench import common as c


def _f(value: Any, fmt: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


def rows(out: dict[str, Any]) -> list[list[str]]:
    n = out["nodes"]
    served, offered = out.get("heartbeats_served_per_s"), out.get("heartbeats_offered_per_s")
    share = out.get("master_cpu_share")
    idle = out.get("idle_connections")
    idle_value = "not measured"
    if idle:
        closed = out.get("idle_connections_closed_after_s")
        idle_value = (
            f"{_f(closed, '.2f', ' s')} ({out.get('idle_connections_closed')}/{idle} closed; fleet served "
            f"{100 * out.get('idle_window_served_over_offered', 0):.1f} % meanwhile)"
        )
    failover = "skipped"
    if "failover_nodes" in out:
        failover = out.get("failover_error") or (
            f"{_f(out.get('failover_serve_s'), '.2f', ' s')} ({out.get('failover_nodes_served')}/"
            f"{out['failover_nodes']} nodes; first {_f(out.get('failover_first_served_s'), '.2f', ' s')}, "
            f"median {_f(out.get('failover_median_served_s'), '.2f', ' s')})"
        )
    window = out.get("steady_window_s")
    tls = "TLS" if out.get("tls") else "no TLS"
    return [
        [
            "connections per node",
            f"{_f(out.get('connections_per_node'), '.2f')} ({out.get('protocol', '?')}, {tls})",
            "1",
        ],
        [
            "master CPU per steady heartbeat",
            f"{_f(out.get('master_cpu_us_per_heartbeat'), '.0f', ' us')} "
            f"({_f(None if share is None else 100 * share, '.0f', ' %')} of a core)",
            "<= 100 us",
        ],
        [
            f"{n:,} fake nodes at {out['heartbeat_interval_s']:g} s heartbeats: served / offered per s",
            f"{_f(served, ',.0f')} / {_f(offered, ',.0f')}",
            f"{n / out['heartbeat_interval_s']:,.0f} / {n / out['heartbeat_interval_s']:,.0f}",
        ],
        [
            "heartbeat latency p99 (p50, max)",
            f"{_f(out.get('heartbeat_p99_ms'), '.1f', ' ms')} ({_f(out.get('heartbeat_p50_ms'), '.1f')}, "
            f"{_f(out.get('heartbeat_max_ms'), '.0f')})",
            "<= 50 ms",
        ],
        [
            "last join -> every node assigned",
            _f(out.get("last_join_to_all_assigned_ms"), ",.0f", " ms"),
            "<= 1,000 ms",
        ],
        [
            f"false dead verdicts (join, {_f(window, 'g', ' s')} window, idle connections)",
            f"{out.get('false_dead_verdicts', 'n/a')} ({out.get('rejoins', 'n/a')} rejoins, "
            f"{out.get('rounds_opened', 'n/a')} rounds opened after the first)",
            "0",
        ],
        ["idle connections without a token: closed after", idle_value, "<= 10 s, agents still served"],
        [
            f"failover (etcd store, {tls}, {out.get('failover_nodes', n):,} nodes): standby serves",
            failover,
            "<= 5 s",
        ],
        [
            "false dead verdicts after the takeover",
            f"{out.get('failover_false_dead_verdicts', 'n/a')} "
            f"({out.get('failover_rejoins', 'n/a')} rejoins)",
            "0",
        ],
        [
            "load generator (apart from the master)",
            f"{_f(out.get('load_generator_cores'), '.2f')} cores, "
            f"{out.get('load_generator_processes')} processes; "
            f"{out.get('load_generator_late_beats', 'n/a')} beats fired > 50 ms late "
            f"(max {_f(out.get('load_generator_late_max_ms'), '.0f', ' ms')})",
            "not the bottleneck",
        ],
    ]


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    wire = "https: every node over TLS" if out.get("tls") else "plain http"
    lines = [
        f"{out['nodes']:,} protocol-level fake nodes (bench/fake_fleet.py: raw asyncio sockets, "
        f"{out.get('load_generator_processes', args.procs)} processes) against one `elastic-master --nnodes "
        f"{out['nodes']}` (memory store, {wire}), "
        f"heartbeat interval {args.heartbeat_interval:g} s, timeout "
        f"{args.heartbeat_timeout:g} s, steady window {args.duration:g} s. Master CPU is its own process's "
        "(psutil user + system); the load generator's CPU is counted apart. Both share this machine's cores.",
        "",
        c.table(["figure", "value", "target"], rows(out)),
    ]
    problems = verdict(out)
    if problems:
        lines += ["", "Problems:"] + [f"- {p}" for p in problems]
    extra = {k: out[k] for k in ("errors", "heartbeat_failures", "failover_errors") if out.get(k)}
    if extra:
        lines += [
            "",
            "Errors seen by the fake nodes (counts): " + "; ".join(f"{k}: {v}" for k, v in extra.items()),
        ]
    return "\n".join(lines)


def verdict(out: dict[str, Any]) -> list[str]:
    """What went wrong, in words (empty: the run is correct, whatever its speed)."""
    problems = [out[k] for k in ("error", "failover_error") if out.get(k)]
    if out.get("false_dead_verdicts"):
        problems.append(f"{out['false_dead_verdicts']} node(s) declared dead although every node heartbeated")
    if out.get("failover_false_dead_verdicts"):
        problems.append(f"{out['failover_false_dead_verdicts']} node(s) declared dead after the takeover")
    if out.get("idle_connections") and out.get("idle_connections_closed_after_s") is None:
        problems.append(
            f"only {out.get('idle_connections_closed')}/{out['idle_connections']} idle connections closed"
        )
    if "failover_nodes" in out and not out.get("failover_error") and out.get("failover_serve_s") is None:
        problems.append(
            f"the standby served {out.get('failover_nodes_served')}/{out['failover_nodes']} nodes"
        )
    return problems
