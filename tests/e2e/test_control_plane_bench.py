"""bench/control_plane.py runs end to end in a short version: 200 protocol-level fake nodes on one stream
connection each against a real ``elastic-master``, idle connections it must close, and a failover of 50
nodes between two masters on a private etcd; and the same with ``--tls`` (100 nodes): masters serving https
with the run's throwaway certificate, every fake node over TLS. Asserted: correctness, not speed: every
node assigned and served, one connection per node, no dead verdict (every fake node kept heartbeating), the
idle connections closed, every node served again by the standby, the JSON keys the issue names, every
master serving https exactly when asked, the master and the load generator pinned apart (the plain run's
master under a CPU quota where one can be set), nothing shed, no process or CPU limit left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bench_runs import run_bench

from bench.cp_machine import CPU_CGROUP_ROOT, cgroup_unusable

KEYS = {
    "nodes",
    "tls",
    "master_cpu_us_per_heartbeat",
    "heartbeats_served_per_s",
    "heartbeats_offered_per_s",
    "heartbeat_p99_ms",
    "last_join_to_all_assigned_ms",
    "false_dead_verdicts",
    "load_generator_cores",
    "idle_connections_closed_after_s",
    "failover_serve_s",
    "connections_per_node",
    "master_cpu_share",
    "core_speed_mloops",
    "placement",
    "valid",
    "targets",
    "load_generator_late_share",
    "heartbeats_shed_per_s",
    "overload_events",
}
FAILOVER_NODES, IDLE = 50, 20
MASTER_CPU = 0.5
HEADER_TIMEOUT_S = 2.0


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("tls", "nodes"), [(False, 200), (True, 100)], ids=["http", "tls"])
def test_control_plane_benchmark_short(tmp_path: Path, tls: bool, nodes: int) -> None:
    out, data = tmp_path / "report.md", tmp_path / "cp.json"
    # The plain run limits each master to half a core where a cgroup v1 cpu quota can be set (root).
    limited = not tls and cgroup_unusable() is None
    argv = [
        "bench/control_plane.py",
        *(["--master-cpu", str(MASTER_CPU)] if limited else []),
        *("--nodes", str(nodes), "--duration", "5", "--protocol", "stream", *(["--tls"] if tls else [])),
        *("--idle-connections", str(IDLE), "--header-timeout", str(HEADER_TIMEOUT_S)),
        *("--failover-nodes", str(FAILOVER_NODES), "--assign-timeout", "120"),
        *("--workdir", str(tmp_path / "work"), "--markdown-out", str(out), "--json", str(data)),
    ]
    proc, left = run_bench(argv, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(data.read_text())
    assert figures.keys() >= KEYS, sorted(KEYS - figures.keys())
    assert figures["nodes"] == nodes and figures["assigned_at_end"] == nodes
    assert figures["tls"] is tls, figures
    # The main run's master and both failover masters, each saying how it listened.
    listening = [
        line
        for log in sorted((tmp_path / "work").rglob("master*.log"))
        for line in log.read_text().splitlines()
        if "listening on" in line
    ]
    assert len(listening) == 3 and all(line.endswith("(https)") is tls for line in listening), listening
    assert figures["protocol"] == "stream" and figures["connections_per_node"] == 1.0, figures
    # Every heartbeat sent was answered 200; the slack between served and offered is for beats a loaded
    # machine skipped (one in flight when the next was due), not for refusals.
    assert figures["heartbeat_failures"] == {}, figures
    assert figures["heartbeats_served_per_s"] >= 0.9 * figures["heartbeats_offered_per_s"], figures
    assert figures["false_dead_verdicts"] == 0, figures
    # Below its saturation the master sheds nothing and reports no overload.
    assert figures["heartbeats_shed_per_s"] == 0 and figures["overload_events"] == 0, figures
    assert figures["pinned"] is (len(os.sched_getaffinity(0)) > 1), figures
    assert figures["master_cpu_limit"] == (MASTER_CPU if limited else None), figures
    assert not [p for p in Path(CPU_CGROUP_ROOT).glob("elastic-bench-*")], "the CPU limits were removed"
    assert figures["idle_connections_closed"] == IDLE, figures
    assert figures["idle_connections_closed_after_s"] is not None, figures
    assert figures["failover_nodes_served"] == FAILOVER_NODES, figures
    assert figures["failover_serve_s"] is not None and figures["failover_false_dead_verdicts"] == 0, figures
    report = out.read_text()
    assert "| master CPU per steady heartbeat" in report, report
    assert f"| failover (etcd store, {'TLS' if tls else 'no TLS'}, {FAILOVER_NODES} nodes)" in report, report
    assert "command: `python bench/control_plane.py" in report, report
    assert not left, f"processes left behind by bench/control_plane.py: {left}"
