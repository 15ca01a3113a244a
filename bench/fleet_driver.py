"""The parent side of the load generator: starts the bench/fake_fleet.py processes (each a slice of the
nodes), sends each the same command and merges their answers.

Every process carries the benchmark's ``BENCH_RUN_TAG`` (bench/common.py), so a run that dies leaves
nothing behind that :func:`bench.common.cleanup` would not find; :meth:`Fleet.close` kills them by PID."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common as c
from bench.fleet_beats import quantile

#: Seconds a fake-fleet process gets to answer one command.
ANSWER_S = 30.0
#: Longest answer line (the failover report lists a time per node).
ANSWER_BYTES = 1 << 24


@dataclass
class WindowFigures:
    """The merged figures of one heartbeat window."""

    seconds: float
    offered: int
    sent: int
    served: int
    statuses: dict[str, int]
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    load_cpu_s: float  # the load generator's CPU seconds over the window, all processes
    late: int  # beats the load generator fired more than fleet_beats.LATE_S late (its own lag)
    late_max_ms: float
    slow: dict[int, int]  # second (epoch, as sent) -> beats answered after fleet_beats.SLOW_S
    held: int = 0  # beats not sent: their node waited the retry_after_s of a beat the master shed


class Fleet:
    """``procs`` fake-fleet processes sharing ``nodes`` nodes of one job."""

    def __init__(self, procs: list[asyncio.subprocess.Process], logs: list[Any]) -> None:
        self.procs, self.logs = procs, logs

    @classmethod
    async def start(cls, cfg: dict[str, Any], nodes: int, procs: int, folder: Path) -> Fleet:
        """``cfg``: what every process shares (addresses, token, job, stream, interval, nnodes)."""
        procs = max(1, min(procs, nodes))
        started, logs = [], []
        for k in range(procs):
            mine = dict(cfg, lo=k * nodes // procs, hi=(k + 1) * nodes // procs)
            log = open(folder / f"fleet-{k}.log", "wb")  # noqa: SIM115 - closed in close()
            logs.append(log)
            started.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "bench.fake_fleet",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    cwd=c.REPO,
                    env=c.bench_env(),
                    start_new_session=True,
                    limit=ANSWER_BYTES,
                )
            )
            started[-1].stdin.write((json.dumps(mine) + "\n").encode())  # the token stays out of ps
        return cls(started, logs)

    async def ask(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``cmd`` to every process; their answers, in process order."""
        line = (json.dumps(cmd) + "\n").encode()
        for proc in self.procs:
            proc.stdin.write(line)
        answers = []
        for k, proc in enumerate(self.procs):
            raw = await asyncio.wait_for(proc.stdout.readline(), ANSWER_S)
            if not raw:
                tail = Path(self.logs[k].name).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"fake-fleet process {k} exited: {tail}")
            answers.append(json.loads(raw))
        return answers

    async def progress(self) -> dict[str, Any]:
        """Joined and assigned nodes, first join sent, last join answered, last assignment, errors."""
        answers = await self.ask({"cmd": "progress"})

        def extreme(key: str, pick) -> float | None:
            values = [a[key] for a in answers if a[key] is not None]
            return pick(values) if values else None

        errors: Counter = Counter()
        samples: dict[str, str] = {}
        for a in answers:
            errors.update(a["errors"])
            samples.update(a["samples"])
        return {
            "joined": sum(a["joined"] for a in answers),
            "assigned": sum(a["assigned"] for a in answers),
            "join_first": extreme("join_first", min),
            "join_last": extreme("join_last", max),
            "assigned_last": extreme("assigned_last", max),
            "running": sum(a["running"] for a in answers),
            "rejoins": sum(a["rejoins"] for a in answers),
            "errors": dict(errors),
            "samples": samples,
            "connections": sum(a["connections"] for a in answers),
            "cpu_s": sum(a["cpu_s"] for a in answers),
        }

    async def wait_assigned(self, nodes: int, timeout: float) -> dict[str, Any]:
        """Poll until every node holds its assignment (or ``timeout``); the last progress."""
        deadline = time.monotonic() + timeout
        while True:
            state = await self.progress()
            if state["assigned"] >= nodes or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.2)

    async def window(self, t0: float, t1: float, grace: float) -> WindowFigures:
        """Count the heartbeats sent in ``[t0, t1)`` (answers awaited ``grace`` seconds more)."""
        await self.ask({"cmd": "window", "t0": t0, "t1": t1})
        await asyncio.sleep(max(0.0, t1 + grace - time.time()))
        answers = await self.ask({"cmd": "report"})
        hist: Counter = Counter()
        statuses: Counter = Counter()
        slow: Counter = Counter()
        for a in answers:
            slow.update({int(k): v for k, v in a["slow"].items()})
            hist.update({int(k): v for k, v in a["hist"].items()})
            statuses.update(a["statuses"])
        return WindowFigures(
            seconds=t1 - t0,
            offered=sum(a["offered"] for a in answers),
            sent=sum(a["sent"] for a in answers),
            served=sum(a["served"] for a in answers),
            statuses=dict(statuses),
            p50_ms=quantile(hist, 0.5),
            p99_ms=quantile(hist, 0.99),
            max_ms=quantile(hist, 1.0),
            load_cpu_s=sum(a["cpu_s"] or 0.0 for a in answers),
            late=sum(a["late"] for a in answers),
            late_max_ms=1e3 * max(a["late_max"] for a in answers),
            slow=dict(sorted(slow.items())),
            held=sum(a.get("held", 0) for a in answers),
        )

    async def mark_failover(self, t: float) -> None:
        await self.ask({"cmd": "failover", "t": t})

    async def failover_back(self) -> list[float]:
        """When each node's heartbeat was answered again after the mark (nodes not back are missing)."""
        return [t for a in await self.ask({"cmd": "failover_report"}) for t in a["back_times"]]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ask({"cmd": "stop"}), 10.0)
        for proc in self.procs:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 10.0)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for log in self.logs:
            log.close()
