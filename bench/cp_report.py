"""The table of bench/control_plane.py (figure | value | target: the control plane's targets) and its verdict:
what makes the run fail (correctness: nodes not assigned, false dead verdicts, idle connections never
closed, a failover that did not serve every node), never a speed figure."""

from __future__ import annotations

import argparse
from typing import Any

from bench import common as c

#: Beats the load generator may fire late (over fleet_beats.LATE_S) before the run is invalid: its own lag,
#: not the master's, would then shape the figures.
MAX_LATE_SHARE = 0.01
#: The load generator's CPU, as a share of the cores it was given, above which it may be the bottleneck.
MAX_LOAD_SHARE = 0.9


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
            "heartbeats shed (429 busy) / held back (retry_after_s) per s; overload events",
            f"{_f(out.get('heartbeats_shed_per_s'), ',.0f')} / "
            f"{_f(out.get('heartbeats_held_per_s'), ',.0f')}; "
            f"{out.get('overload_events', 'n/a')} (gauge "
            f"elastic_master_overloaded {_f(out.get('master_overloaded_gauge'), 'g')} after the window)"
            + (
                f" (quota exhausted in {100 * out['master_throttled_periods_share']:.0f} % of the periods)"
                if out.get("master_throttled_periods_share") is not None
                else ""
            ),
            "0 below saturation",
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


def validity(out: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether the run measured the master, not its load generator: (valid, why not)."""
    why = []
    late = out.get("load_generator_late_share")
    if late is not None and late > MAX_LATE_SHARE:
        why.append(
            f"the load generator fired {100 * late:.1f} % of the beats over 50 ms late "
            f"({out.get('load_generator_late_beats')} beats; more than {100 * MAX_LATE_SHARE:g} %)"
        )
    cores = len(out.get("load_generator_cores_set") or []) if out.get("pinned") else None
    used = out.get("load_generator_cores")
    if cores and used is not None and used > MAX_LOAD_SHARE * cores:
        why.append(f"the load generator used {used:.2f} of its {cores} core(s)")
    return not why, why


def check_targets(out: dict[str, Any]) -> dict[str, bool]:
    """Each target of the control plane (docs/benchmarks.md) that this run measured: met or not."""
    got: dict[str, bool] = {}
    if out.get("heartbeats_offered_per_s") is not None:
        got["all heartbeats served"] = (
            not out.get("heartbeat_failures") and out.get("heartbeat_served_share", 0.0) >= 0.99
        )
        p99 = out.get("heartbeat_p99_ms")
        got["p99 <= 50 ms"] = p99 is not None and p99 <= 50.0
    if "last_join_to_all_assigned_ms" in out:
        got["last join -> all assigned <= 1 s"] = out["last_join_to_all_assigned_ms"] <= 1000.0
    if "false_dead_verdicts" in out:
        got["0 false dead verdicts"] = out["false_dead_verdicts"] == 0
    if out.get("idle_connections"):
        closed = out.get("idle_connections_closed_after_s")
        got["idle connections closed <= 10 s"] = closed is not None and closed <= 10.0
    if "failover_nodes" in out:
        took = out.get("failover_serve_s")
        got["failover <= 5 s"] = took is not None and took <= 5.0
        got["0 dead verdicts after the takeover"] = out.get("failover_false_dead_verdicts") == 0
    return got


def saturation_report(out: dict[str, Any]) -> str:
    """The table of ``--saturation``: one row per step, then the half-rate run."""
    rows = []
    for step in [*out.get("saturation_steps", []), *([out["half_rate"]] if "half_rate" in out else [])]:
        rows.append(
            [
                f"{step['nodes']:,}"
                + (" (half the saturation rate)" if step is out.get("half_rate") else ""),
                f"{_f(step['served_per_s'], ',.0f')} / {_f(step.get('offered_per_s'), ',.0f')}",
                _f(step.get("p99_ms"), ".1f", " ms"),
                _f(step.get("master_cpu_us_per_heartbeat"), ".0f", " us"),
                _f(
                    None if step.get("master_cpu_share") is None else 100 * step["master_cpu_share"],
                    ".0f",
                    " %",
                ),
                _f(step.get("shed_per_s"), ",.0f"),
                str(step.get("false_dead_verdicts")),
                "yes" if step["valid"] else "NO: " + "; ".join(step["invalid_reasons"]),
            ]
        )
    sat = out.get("saturation_heartbeats_per_s")
    head = (
        f"Saturation point: **{sat:,.0f} heartbeats/s** served with p99 <= 50 ms "
        f"({out['saturation_nodes']:,} nodes at {out['heartbeat_interval_s']:g} s)"
        if sat is not None
        else "Saturation point: not found"
    )
    if out.get("saturation_note"):
        head += f"; {out['saturation_note']}"
    headers = [
        "nodes",
        "served / offered per s",
        "p99",
        "master CPU/hb",
        "of a core",
        "shed/s",
        "dead",
        "valid",
    ]
    return head + ".\n\n" + c.table(headers, rows)


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    wire = "https: every node over TLS" if out.get("tls") else "plain http"
    machine = (
        f"Core speed: **{_f(out.get('core_speed_mloops'), '.2f')} M loops/s** (bench/cp_machine.py's fixed "
        f"pure-Python loop on the master's core; compare your machine's). Placement: {out.get('placement')}."
    )
    valid = (
        "Valid: the load generator kept up."
        if out.get("valid", True)
        else "**INVALID RUN**: "
        + "; ".join(out.get("invalid_reasons", []))
        + " (the figures measure the load "
        "generator, not the master)."
    )
    if "saturation_steps" in out:
        return "\n".join([machine, "", saturation_report(out), "", valid])
    lines = [
        machine,
        valid,
        "",
        f"{out['nodes']:,} protocol-level fake nodes (bench/fake_fleet.py: raw asyncio sockets, "
        f"{out.get('load_generator_processes', args.procs)} processes) against one `elastic-master --nnodes "
        f"{out['nodes']}` (memory store, {wire}), "
        f"heartbeat interval {args.heartbeat_interval:g} s, timeout "
        f"{args.heartbeat_timeout:g} s, steady window {args.duration:g} s. Master CPU is its own process's "
        "(psutil user + system); the load generator's CPU is counted apart.",
        "",
        c.table(["figure", "value", "target"], rows(out)),
    ]
    missed = [name for name, met in out.get("targets", {}).items() if not met]
    lines += ["", "Targets: " + ("every one measured met" if not missed else "missed: " + "; ".join(missed))]
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
    for step in [*out.get("saturation_steps", []), *([out["half_rate"]] if "half_rate" in out else [])]:
        if step.get("false_dead_verdicts"):
            problems.append(f"{step['false_dead_verdicts']} false dead verdict(s) at {step['nodes']:,} nodes")
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
