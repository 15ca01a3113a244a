"""Rendezvous latency and master load.

Part 1, real agents: N launchers with 1 worker each on this machine (N = 2, 4, 8, 16), ``--nnodes N``;
the worker only initializes the gloo process group, prints, and leaves (workload ``--init-only``). Time
from launching the N launchers to the last worker having initialized its process group. elastic-run: an
``elastic-master`` daemon is started first and waited for (it is the job's long-lived service); its own
start-up is shown separately. torchrun: c10d, the first launcher hosts the store (``is_host=1``), all N are
launched at once.

Part 2, protocol-level fake nodes (no torch, one asyncio process speaking HTTP/1.1 to a real
``elastic-master --nnodes N``, default heartbeat 1 s / timeout 4 s): every fake node does what an agent
does (join, long-poll ``/v1/round``, heartbeat every second while waiting and running, long-poll
``/v1/watch`` once assigned). Measured: join phase; time from the last join reply to the last assignment
received (round closed and fanned out); a steady window with every node heartbeating at the default 1 s
(achieved heartbeats/s, latency, master CPU); a closed-loop heartbeat burst (heartbeats/s sustained and
master CPU time per heartbeat, from psutil ``cpu_times`` of the master process); and whether any node was
declared dead on the way (a false verdict: every fake node kept heartbeating).

    python bench/rendezvous.py                           # both parts, default sizes
    python bench/rendezvous.py --sizes 2,4 --fake-sizes 100
    python bench/rendezvous.py --smoke
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from elastic.control.protocol import NODE_SECRET_HEADER  # noqa: E402


# -- part 1: real agents ------------------------------------------------------------------------------------
@dataclass
class RealOutcome:
    tool: str
    n: int
    ok: bool
    note: str = ""
    total: float | None = None  # launchers started -> last worker initialized the process group
    master_start: float | None = None  # elastic-run only: master daemon start -> listening


def real_run(tool: c.Tool, n: int, folder: Path, timeout: float) -> RealOutcome:
    folder.mkdir(parents=True, exist_ok=True)
    worker = ["--ckpt-dir", folder / "ckpt", "--init-only"]
    with c.Group(folder) as group:
        cluster = c.Cluster(tool, group, str(n), worker, max_restarts=0)
        t_master = time.time()
        if not cluster.start():
            return RealOutcome(tool.name, n, False, "master did not start")
        master_start = time.time() - t_master if cluster.elastic else None
        nodes = []
        t0 = time.time()
        for i in range(n):
            name = f"node{i + 1}"
            nodes.append(group.launch(cluster.node_argv(name, host_store=i == 0), name, env=tool.environ()))

        def inits() -> list[float]:
            return [e["t"] for p in nodes for e in p.events() if e["kind"] == "init"]

        done = c.wait_until(lambda: len(inits()) >= n, timeout, interval=0.1, tick=group.track)
        if not done:
            return RealOutcome(
                tool.name, n, False, f"{len(inits())}/{n} workers initialized after {timeout:g}s"
            )
        total = max(inits()) - t0
        for p in nodes:  # let the job finish normally (not measured), then everything is killed anyway
            p.reap(15)
        return RealOutcome(tool.name, n, True, "", total, master_start)


def real_report(tools: list[c.Tool], sizes: list[int], results: list[RealOutcome], runs: int) -> str:
    rows = []
    for n in sizes:
        meds = {}
        row: list[object] = [n]
        for tool in tools:
            mine = [r for r in results if r.tool == tool.name and r.n == n]
            ok = [r for r in mine if r.ok]
            stat = c.Stat([r.total for r in ok])
            meds[tool.name] = stat.median
            row.append(f"{stat.fmt(2)} [{len(ok)}/{len(mine)}]")
        if "elastic-run" in meds and "torchrun" in meds:
            row.append(c.ratio(meds["elastic-run"], meds["torchrun"]))
        rows.append(row)
    headers = ["nodes"] + [f"{t.name}: launch -> all workers in pg (s) [ok]" for t in tools]
    if {"elastic-run", "torchrun"} <= {t.name for t in tools}:
        headers.append("ratio elastic-run / torchrun")
    master = [r.master_start for r in results if r.master_start is not None]
    out = [
        f"N launchers x 1 worker, `--nnodes N`, worker = init_process_group + barrier; {runs} run(s) per "
        "size and tool, alternated.",
        "",
        c.table(headers, rows),
    ]
    if master:
        out += [
            "",
            f"elastic-master daemon start-up (started first, not included above): {c.Stat(master).fmt(2)} s.",
        ]
    bad = [r for r in results if not r.ok]
    if bad:
        out += ["", "Failed runs:"] + [f"- {r.tool}, N={r.n}: {r.note}" for r in bad]
    return "\n".join(out)


# -- part 2: protocol-level fake nodes -------------------------------------------------------------------
class Http:
    """One keep-alive HTTP/1.1 connection (a tiny client: the load generator must stay cheap)."""

    def __init__(self, port: int, headers: str) -> None:
        self.port, self.headers = port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def call(
        self, method: str, path: str, body: dict | None = None, headers: str = ""
    ) -> tuple[int, bytes]:
        """``headers``: more header lines (``Name: value\r\n`` each) for this request only."""
        for attempt in (0, 1):
            try:
                if self.writer is None:
                    await self.open()
                return await self._call(method, path, body, headers)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _call(self, method: str, path: str, body: dict | None, headers: str) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else b""
        ctype = "Content-Type: application/json\r\n" if body is not None else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{self.headers}{headers}{ctype}"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        self.writer.write(head.encode() + data)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


@dataclass
class FakeOutcome:
    n: int
    ok: bool
    note: str = ""
    join_phase: float | None = None  # first join sent -> last join reply
    join_cpu: float | None = None  # master CPU seconds from the first join to the round closed (or giving up)
    last_join_to_closed: float | None = None  # last join reply -> last assignment received
    steady_rate: float | None = None  # heartbeats/s achieved with every node at the default interval
    steady_p99_ms: float | None = None
    steady_cpu_pct: float | None = None  # master CPU, % of one core
    steady_cpu_per_hb_us: float | None = None
    burst_rate: float | None = None  # closed loop
    burst_cpu_per_hb_us: float | None = None
    burst_p99_ms: float | None = None
    client_cpu_per_hb_us: float | None = None  # the load generator's own CPU per burst heartbeat
    errors: int = 0
    dead: int = 0  # nodes the master declared dead although they kept heartbeating
    rounds: int = 0  # rounds opened in all (1 = no spurious re-round)


@dataclass
class _Shared:
    periodic: bool = True
    stop: bool = False
    hb_times: list[tuple[float, float]] = field(default_factory=list)  # (sent, latency)
    errors: int = 0
    round: int = 0


async def _fake(n: int, port: int, job: str, token: str, master_pid: int, args) -> FakeOutcome:
    headers = f"Authorization: Bearer {token}\r\nX-Elastic-Job: {job}\r\n"
    shared = _Shared()
    join_sent: dict[int, float] = {}
    join_done: dict[int, float] = {}
    assigned: dict[int, float] = {}
    state: dict[int, str] = {}
    gate = asyncio.Semaphore(args.join_concurrency)
    interval = 1.0
    secrets: dict[int, str] = {}  # each fake node's secret from its join, sent as an agent sends it

    def own(i: int) -> str:
        return f"{NODE_SECRET_HEADER}: {secrets.get(i, '')}\r\n"

    def hb_body(i: int) -> dict:
        running = state.get(i) == "running"
        return {
            "node_id": f"fake-{i}",
            "round": shared.round if running else 0,
            "state": "running" if running else "waiting",
            "workers": [{"local_rank": 0, "pid": 1000 + i, "status": "running"}] if running else [],
        }

    async def heartbeat(conn: Http, i: int) -> None:
        t = time.perf_counter()
        status, _ = await conn.call("POST", "/v1/heartbeat", hb_body(i), own(i))
        shared.hb_times.append((time.time(), time.perf_counter() - t))
        if status != 200:
            shared.errors += 1

    async def follow(b: Http, i: int) -> None:
        """Long-poll for the assignment, then (as the agent does) watch for commands until stopped."""
        while not shared.stop:
            status, body = await b.call("GET", f"/v1/round?node_id=fake-{i}&after=0&timeout=30", None, own(i))
            reply = json.loads(body) if status == 200 else {}
            if reply.get("status") == "assigned":
                assigned[i] = time.time()
                shared.round = reply["assignment"]["round"]
                state[i] = "running"
                break
            if status != 200 or reply.get("status") == "finished":
                shared.errors += 1
                return
        while not shared.stop:
            if not args.watch:
                await asyncio.sleep(interval)
                continue
            status, body = await b.call(
                "GET", f"/v1/watch?node_id=fake-{i}&round={shared.round}&timeout=30", None, own(i)
            )
            if status != 200 or json.loads(body).get("command") != "continue":
                shared.errors += 1
                await asyncio.sleep(interval)

    async def node(i: int) -> None:
        a, b = Http(port, headers), Http(port, headers)
        try:
            async with gate:
                await a.open()
                await b.open()
                join_sent[i] = time.time()
                status, body = await a.call(
                    "POST",
                    "/v1/join",
                    {
                        "node_id": f"fake-{i}",
                        "host": "127.0.0.1",
                        "nproc": 1,
                        "store_port": 20000 + i,
                        "min_nodes": n,
                        "max_nodes": n,
                    },
                )
                join_done[i] = time.time()
            if status != 200:
                shared.errors += 1
                return
            secrets[i] = json.loads(body)["node_secret"]

            async def beat_forever() -> None:
                await asyncio.sleep(random.uniform(0, interval))
                while not shared.stop:
                    if shared.periodic:
                        try:
                            await heartbeat(a, i)
                        except (ConnectionError, asyncio.IncompleteReadError, OSError):
                            shared.errors += 1
                    await asyncio.sleep(interval)

            beats = asyncio.create_task(beat_forever())
            try:
                await follow(b, i)
            finally:
                beats.cancel()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            if not shared.stop:
                shared.errors += 1
        finally:
            a.close()
            b.close()

    master = psutil.Process(master_pid)
    me = psutil.Process()
    cpu = lambda: sum(master.cpu_times()[:2])  # noqa: E731 - user + system
    my_cpu = lambda: sum(me.cpu_times()[:2])  # noqa: E731
    join_cpu0 = cpu()
    tasks = [asyncio.create_task(node(i)) for i in range(n)]
    t_start = time.time()
    deadline = t_start + args.fake_timeout
    while len(assigned) < n and time.time() < deadline:
        if all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.05)
    out = FakeOutcome(n, len(assigned) == n)
    out.join_cpu = cpu() - join_cpu0
    if not out.ok:
        out.note = f"{len(assigned)}/{n} assigned, {len(join_done)} joined, errors {shared.errors}"
    else:
        out.join_phase = max(join_done.values()) - min(join_sent.values())
        out.last_join_to_closed = max(assigned.values()) - max(join_done.values())
        await asyncio.sleep(2 * interval)  # every node reports RUNNING once (wakes the watchers)

        # steady: every node at the default interval
        shared.hb_times.clear()
        c0, t0 = cpu(), time.time()
        await asyncio.sleep(args.window)
        c1, t1 = cpu(), time.time()
        window = [lat for sent, lat in list(shared.hb_times) if t0 <= sent <= t1]
        out.steady_rate = len(window) / (t1 - t0)
        out.steady_cpu_pct = 100 * (c1 - c0) / (t1 - t0)
        out.steady_cpu_per_hb_us = 1e6 * (c1 - c0) / max(1, len(window))
        out.steady_p99_ms = 1e3 * _p99(window)

        # burst: closed loop, the periodic heartbeats paused
        shared.periodic = False
        await asyncio.sleep(0.5)
        conns = [Http(port, headers) for _ in range(args.burst_concurrency)]
        for conn in conns:
            await conn.open()
        latencies: list[float] = []
        end = time.time() + args.window
        counter = iter(range(10**9))

        async def blast(conn: Http) -> None:
            while time.time() < end:
                i = next(counter) % n
                t = time.perf_counter()
                status, _ = await conn.call("POST", "/v1/heartbeat", hb_body(i), own(i))
                latencies.append(time.perf_counter() - t)
                if status != 200:
                    shared.errors += 1

        c0, t0, m0 = cpu(), time.time(), my_cpu()
        await asyncio.gather(*(blast(conn) for conn in conns))
        c1, t1, m1 = cpu(), time.time(), my_cpu()
        out.client_cpu_per_hb_us = 1e6 * (m1 - m0) / max(1, len(latencies))
        for conn in conns:
            conn.close()
        out.burst_rate = len(latencies) / (t1 - t0)
        out.burst_cpu_per_hb_us = 1e6 * (c1 - c0) / max(1, len(latencies))
        out.burst_p99_ms = 1e3 * _p99(latencies)
        shared.periodic = True
        await asyncio.sleep(interval)

    status_conn = Http(port, headers)
    with_status = await status_conn.call("GET", "/v1/status")
    status_conn.close()
    shared.stop = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if with_status[0] == 200:
        job_status = json.loads(with_status[1])
        out.dead = n - len(job_status["nodes"])
        out.rounds = job_status["round"]
    out.errors = shared.errors
    return out


def _p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100)[98]


def fake_run(n: int, folder: Path, args) -> FakeOutcome:
    folder.mkdir(parents=True, exist_ok=True)
    with c.Group(folder) as group:
        port = c.free_port()
        job = f"fake-{n}"
        token_file = folder / "token"
        argv = c.master_argv(args.master_cmd) + [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--job-id",
            job,
            "--nnodes",
            str(n),
            "--token-file",
            str(token_file),
        ]
        master = group.launch(argv, "master", env=c.bench_env())
        if not c.wait_until(lambda: c.port_open(port) or not master.alive(), 60):
            return FakeOutcome(n, False, "master did not start")
        if not master.alive():
            return FakeOutcome(n, False, f"master exited: {master.output()[-300:]}")
        token = token_file.read_text().strip()
        return asyncio.run(_fake(n, port, job, token, master.pid, args))


def fake_report(results: list[FakeOutcome], args) -> str:
    rows = []
    for r in results:
        if not r.ok:
            rows.append([r.n, "FAILED: " + r.note, f"{r.join_cpu:.1f}"] + [""] * 10)
            continue
        rows.append(
            [
                r.n,
                f"{r.join_phase:.2f}",
                f"{r.join_cpu:.1f}",
                f"{1e3 * r.last_join_to_closed:.0f}",
                f"{r.steady_rate:.0f} / {r.n}",
                f"{r.steady_p99_ms:.1f}",
                f"{r.steady_cpu_pct:.0f}%",
                f"{r.steady_cpu_per_hb_us:.0f}",
                f"{r.burst_rate:.0f}",
                f"{r.burst_cpu_per_hb_us:.0f}",
                f"{r.burst_p99_ms:.1f}",
                f"{r.client_cpu_per_hb_us:.0f}",
                f"{r.dead} / {r.rounds} / {r.errors}",
            ]
        )
    return "\n".join(
        [
            "Fake nodes (asyncio, raw HTTP/1.1, one process) against one `elastic-master --nnodes N` with "
            f"default heartbeat settings; join concurrency {args.join_concurrency}, windows of "
            f"{args.window:g} s, burst concurrency {args.burst_concurrency}. The load generator shares the "
            "2 cores with the master.",
            "",
            c.table(
                [
                    "N",
                    "join phase (s)",
                    "master CPU to close (s)",
                    "last join -> all assigned (ms)",
                    "steady hb/s achieved / offered",
                    "steady p99 (ms)",
                    "master CPU steady",
                    "master CPU/hb steady (us)",
                    "burst hb/s",
                    "master CPU/hb burst (us)",
                    "burst p99 (ms)",
                    "load generator CPU/hb (us)",
                    "dead / rounds / errors",
                ],
                rows,
            ),
            "",
            "dead = nodes declared dead although every fake node kept heartbeating (false verdicts); "
            "rounds = rounds opened in all (1 means the first round held); errors = non-200 replies or "
            "dropped connections.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = c.base_parser(__doc__.splitlines()[0], runs=2)
    p.add_argument("--sizes", default="2,4,8,16", help="real-agent node counts (default %(default)s)")
    p.add_argument("--fake-sizes", default="100,500,1000", help="fake node counts (default %(default)s)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per real-agent run")
    p.add_argument("--fake-timeout", type=float, default=180.0, help="seconds for a fake round to close")
    p.add_argument("--window", type=float, default=5.0, help="seconds of each heartbeat window")
    p.add_argument("--join-concurrency", type=int, default=100, help="joins in flight at once")
    p.add_argument("--burst-concurrency", type=int, default=32, help="connections of the heartbeat burst")
    p.add_argument(
        "--master-cmd", default=None, help="elastic-master command line (default: python -m master)"
    )
    p.add_argument(
        "--no-watch",
        dest="watch",
        action="store_false",
        help="fake nodes do not long-poll /v1/watch (diagnosis)",
    )
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-fake", action="store_true")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    fake_sizes = [int(s) for s in args.fake_sizes.split(",") if s]
    if args.smoke:
        args.runs, sizes, fake_sizes, args.window = 1, [2], [20], 1.0
    tools = c.selected_tools(args)
    parts = []
    with c.workdir(args.workdir) as root:
        if not args.skip_real:
            results = []
            for i in range(args.runs):
                for n in sizes:
                    for tool in tools:
                        c.log(f"rendezvous run {i + 1}/{args.runs}: {tool.name}, {n} agents")
                        r = real_run(tool, n, root / f"real{i}-{tool.name}-{n}", args.timeout)
                        c.log(f"  -> {r}")
                        results.append(r)
                        c.cleanup(c.log)
            parts.append("### Real agents\n\n" + real_report(tools, sizes, results, args.runs))
        if not args.skip_fake:
            fakes = []
            for n in fake_sizes:
                c.log(f"fake nodes: {n}")
                r = fake_run(n, root / f"fake-{n}", args)
                c.log(f"  -> {r}")
                fakes.append(r)
                c.cleanup(c.log)
            parts.append("### Protocol-level fake nodes (elastic-master only)\n\n" + fake_report(fakes, args))
    c.emit_report(args, "Rendezvous latency", "\n\n".join(parts))
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
