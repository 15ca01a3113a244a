"""The master side of bench/control_plane.py: its command line (https with ``--tls``), whether it offers the
stream, its CPU and open files, its event log, and what it does with connections that send nothing."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import ssl
import time
from datetime import datetime
from pathlib import Path

import psutil

from bench import common as c
from elastic.control.protocol import JOB_HEADER, STREAM_PATH, STREAM_UPGRADE
from elastic.control.tls import client_context

START_S = 60.0
HOST = "127.0.0.1"


def client_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """With ``--tls``: a client context trusting the run's CA (``args.tls_files``, bench/tls_certs.py)."""
    return client_context(str(args.tls_files.ca)) if args.tls_files else None


def master_argv(args: argparse.Namespace, port: int, job: str, token_file: Path, events: Path) -> list[str]:
    argv = c.master_argv(args.master_cmd) + [
        "--host",
        HOST,
        "--port",
        str(port),
        "--job-id",
        job,
        "--nnodes",
        str(args.nodes),
        "--token-file",
        str(token_file),
        "--heartbeat-interval",
        str(args.heartbeat_interval),
        "--heartbeat-timeout",
        str(args.heartbeat_timeout),
        "--header-timeout",
        str(args.header_timeout),
        "--event-log",
        str(events),
    ]
    if args.tls_files:  # --tls: https with the run's throwaway certificate
        argv += ["--tls-cert", str(args.tls_files.cert), "--tls-key", str(args.tls_files.key)]
    return argv


def offers_stream(port: int, token: str, job: str, tls: ssl.SSLContext | None = None) -> tuple[bool, int]:
    """Whether the master answers the stream upgrade with 101 (over TLS with ``tls``); (offered, the status
    it answered)."""
    head = (
        f"GET {STREAM_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: Upgrade\r\n"
        f"Upgrade: {STREAM_UPGRADE}\r\nAuthorization: Bearer {token}\r\n{JOB_HEADER}: {job}\r\n\r\n"
    )
    data = b""
    with (
        contextlib.suppress(OSError),
        socket.create_connection((HOST, port), timeout=10) as raw,
        tls.wrap_socket(raw, server_hostname=HOST) if tls else contextlib.nullcontext(raw) as sock,
    ):
        sock.sendall(head.encode())
        while b"\r\n" not in data and (chunk := sock.recv(256)):
            data += chunk
    parts = data.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return status == 101, status


def wait_listening(proc: c.Launched, port: int) -> str | None:
    """None once the master listens; why not otherwise."""
    if not c.wait_until(lambda: c.port_open(port) or not proc.alive(), START_S):
        return "the master did not listen"
    return None if proc.alive() else f"the master exited: {proc.output()[-500:]}"


def count_events(
    path: Path, kind: str, since: float = 0.0, until: float = float("inf"), master_log: Path | None = None
) -> int:
    """Events of ``kind`` between wall times ``since`` and ``until``, from a master's event log
    (``--event-log``) and from its own log (each event is logged as ``KIND: message``): the larger count,
    since the event log skips events when more happen between two of its writes than the stored state keeps
    (it says so: "events N-M are missing")."""
    logged = 0
    if master_log is not None and master_log.exists():
        marker = f"] {kind}: "
        for line in master_log.read_text(errors="replace").splitlines():
            if marker in line:
                with contextlib.suppress(ValueError):
                    # The line's first field: ISO 8601 UTC with milliseconds (2026-11-28T11:40:46.946Z).
                    at = datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")).timestamp()
                    logged += since <= at < until
    n = 0
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                n += event.get("kind") == kind and since <= event.get("time", 0) < until
    return max(n, logged)


def first_event_at(path: Path, kind: str, since: float = 0.0) -> float | None:
    """Wall time of the first event of ``kind`` at or after ``since`` in a master's event log, or None."""
    if not path.exists():
        return None
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("kind") == kind and event.get("time", 0) >= since:
                return float(event["time"])
    return None


async def master_cpu(pid: int, t0: float, t1: float) -> float:
    """The master's CPU seconds (user + system, its own process) between wall times t0 and t1."""
    proc = psutil.Process(pid)
    await asyncio.sleep(max(0.0, t0 - time.time()))
    c0 = sum(proc.cpu_times()[:2])
    await asyncio.sleep(max(0.0, t1 - time.time()))
    return sum(proc.cpu_times()[:2]) - c0


async def idle_connections(port: int, count: int, limit: float) -> tuple[float | None, int]:
    """Open ``count`` TCP connections that send nothing (not even a TLS hello: a master serving https closes
    them when its handshake times out); (seconds until the master closed the last one, or None if some were
    still open after ``limit``; how many it closed)."""
    t0 = time.monotonic()
    held = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            held.append(await asyncio.open_connection("127.0.0.1", port))

    async def closed(reader: asyncio.StreamReader) -> float:
        with contextlib.suppress(OSError):
            while await reader.read(4096):  # until EOF (after a 408 or 503, if the master sends one)
                pass
        return time.monotonic() - t0

    waits = [asyncio.create_task(closed(reader)) for reader, _ in held]
    done, pending = await asyncio.wait(waits, timeout=limit)
    for task in pending:
        task.cancel()
    for _, writer in held:
        writer.close()
    if pending or not done:
        return None, len(done)
    return max(t.result() for t in done), len(done)


def num_fds(pid: int) -> int | None:
    try:
        return psutil.Process(pid).num_fds()
    except psutil.Error:
        return None


async def scrape_gauge(port: int, token: str, name: str, tls: ssl.SSLContext | None = None) -> float | None:
    """The value of gauge ``name`` on the master's ``/metrics`` (None: not served, or no answer in 10 s)."""
    import httpx  # only for this scrape

    url = f"{'https' if tls else 'http'}://{HOST}:{port}/metrics"
    try:
        async with httpx.AsyncClient(trust_env=False, verify=tls or True, timeout=10.0) as client:
            reply = await client.get(url, headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError:
        return None
    for line in reply.text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            with contextlib.suppress(ValueError):
                return float(line.rsplit(" ", 1)[1])
    return None
