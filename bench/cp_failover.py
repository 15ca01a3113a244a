"""The failover part of bench/control_plane.py: a private etcd, two ``elastic-master`` daemons on it, the
fake fleet given both addresses (the leader's first); once every node is assigned and heartbeating, the
leader is SIGKILLed (a crash: its etcd lease must expire, TTL 3 s) and we measure when the standby has
answered a heartbeat of every node, then watch for dead verdicts (none is right: every node kept trying).
With ``--tls`` both masters serve https and the figure is the TLS one (the fleet reconnects with a
handshake); the etcd connection stays plain."""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench import common as c
from bench.cp_master import (
    HOST,
    client_tls,
    count_events,
    first_event_at,
    master_argv,
    offers_stream,
    wait_listening,
)
from bench.failover import private_etcd
from bench.fleet_driver import Fleet
from elastic.control.protocol import API_PREFIX, JOB_HEADER

TOKEN = "bench-control-plane-token"


class _CpuMeter:
    """CPU seconds (user + system) of processes since this meter was made; a process gone counts 0."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids
        self._procs: dict[int, psutil.Process] = {}
        self._start = self._now()

    def _now(self) -> list[float]:
        out = []
        for pid in self._pids:
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                out.append(sum(proc.cpu_times()[:2]))
            except psutil.Error:
                out.append(0.0)
        return out

    def seconds(self) -> list[float]:
        return [round(max(0.0, b - a), 2) for a, b in zip(self._start, self._now(), strict=True)]


def leading(port: int, job: str, tls: ssl.SSLContext | None = None) -> bool:
    """Whether the master on ``port`` answers ``/v1/info`` (a standby answers 503); https with ``tls``."""
    headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: job}
    url = f"{'https' if tls else 'http'}://{HOST}:{port}{API_PREFIX}/info"
    try:
        reply = httpx.get(url, headers=headers, timeout=5.0, trust_env=False, verify=tls or True)
        return reply.status_code == 200
    except httpx.TransportError:
        return False


async def failover_run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The failover figures (``failover_*`` keys; ``failover_serve_s`` None when it did not happen)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = args.failover_nodes
    out: dict[str, Any] = {"failover_nodes": n, "failover_serve_s": None}
    try:
        etcd = private_etcd(folder)
    except (RuntimeError, OSError) as exc:  # no etcd binary, or it did not come up
        return {**out, "failover_error": f"etcd: {exc}"}
    try:
        with c.Group(folder) as group:
            out.update(await _with_etcd(args, folder, group, f"etcd://{etcd.endpoint}", n))
    finally:
        etcd.stop()
    return out


async def _with_etcd(
    args: argparse.Namespace, folder: Path, group: c.Group, store: str, n: int
) -> dict[str, Any]:
    job, token_file = f"cpf-{uuid.uuid4().hex[:6]}", folder / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    sized = argparse.Namespace(**{**vars(args), "nodes": n})
    ports = [c.free_port(), c.free_port()]
    events = [folder / f"events-{i}.jsonl" for i in (0, 1)]
    for path in events:
        path.unlink(missing_ok=True)  # a --workdir used before
    masters = []
    for i in (0, 1):
        argv = master_argv(sized, ports[i], job, token_file, events[i]) + ["--store", store]
        masters.append(group.launch(argv, f"master-{i}"))
        args.placement.master(masters[i].pid)  # its core, and its own CPU limit with --master-cpu
        if why := wait_listening(masters[i], ports[i]):
            return {"failover_error": why}
    tls = client_tls(args)
    lead = c.wait_until(lambda: [i for i in (0, 1) if leading(ports[i], job, tls)] or None, 60.0)
    if not lead:
        return {"failover_error": "no master led within 60 s"}
    lead = lead[0]
    stream, _ = offers_stream(ports[lead], TOKEN, job, tls)
    cfg = {
        "addresses": [f"{HOST}:{ports[lead]}", f"{HOST}:{ports[1 - lead]}"],
        "token": TOKEN,
        "job": job,
        "stream": stream and args.protocol != "http",
        "interval": args.heartbeat_interval,
        "nnodes": n,
        "join_concurrency": args.join_concurrency,
        "tls_ca": str(args.tls_files.ca) if args.tls_files else None,
    }
    c.log(f"failover: {n} fake nodes, masters on {ports} (leader {lead}), {store}, TLS {bool(tls)}")
    fleet = await Fleet.start(cfg, n, args.procs, folder)
    try:
        return await _kill_and_watch(args, fleet, masters, events, lead, n)
    except (RuntimeError, OSError, asyncio.TimeoutError) as exc:  # the fleet or a master broke down
        return {"failover_error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        await fleet.close()


async def _kill_and_watch(
    args: argparse.Namespace, fleet: Fleet, masters: list[c.Launched], events: list[Path], lead: int, n: int
) -> dict[str, Any]:
    state = await fleet.wait_assigned(n, args.assign_timeout)
    if state["assigned"] < n:
        return {"failover_error": f"{state['assigned']}/{n} assigned with the etcd store ({state['errors']})"}
    out: dict[str, Any] = {
        "failover_last_join_to_all_assigned_ms": 1e3 * (state["assigned_last"] - state["join_last"])
    }
    await asyncio.sleep(3 * args.heartbeat_interval)  # steady before the crash
    masters[lead].kill_tree()
    killed = time.time()
    c.log(f"failover: leader (master-{lead}) SIGKILLed")
    await fleet.mark_failover(killed)
    deadline = time.monotonic() + args.failover_watch + 60.0
    back: list[float] = []
    standby = masters[1 - lead]
    cpu = _CpuMeter([standby.pid] + [p.pid for p in fleet.procs])
    # Seconds after the kill, nodes served, CPU seconds of the standby and of the load generator since.
    timeline: list[tuple[float, int, float, float]] = []
    while time.monotonic() < deadline:
        back = await fleet.failover_back()
        used = cpu.seconds()
        timeline.append((round(time.time() - killed, 2), len(back), used[0], sum(used[1:])))
        if len(back) >= n:
            break
        await asyncio.sleep(0.2)
    out["failover_timeline"] = timeline
    took = [t - killed for t in back]
    out.update(
        failover_nodes_served=len(took),
        failover_serve_s=max(took) if len(took) >= n else None,
        failover_first_served_s=min(took, default=None),
        failover_median_served_s=statistics.median(took) if took else None,
    )
    c.log(f"failover: {len(took)}/{n} nodes served again, last after {max(took, default=0):.2f} s")
    await asyncio.sleep(args.failover_watch)  # a node the standby forgot would be declared dead by now
    elected = first_event_at(events[1 - lead], "master_takeover", since=killed)
    out["failover_elected_s"] = None if elected is None else elected - killed  # the rest is the reconnects
    out["failover_false_dead_verdicts"] = count_events(
        events[1 - lead], "node_dead", since=killed, master_log=standby.log
    )
    out["failover_dead_before_kill"] = count_events(events[lead], "node_dead", master_log=masters[lead].log)
    out["failover_standby_alive"] = standby.alive()
    final = await fleet.progress()
    out["failover_errors"], out["failover_rejoins"] = final["errors"], final["rejoins"]
    return out
