"""One process of the protocol-level load generator of bench/control_plane.py: fake nodes ``lo..hi-1`` of a
job, each doing what an agent does, over one ``elastic-stream/1`` connection (or, with ``"stream": false``,
the three HTTP connections of an agent without it): join, long-poll ``round`` until assigned, heartbeat
every interval, and once assigned keep a ``watch`` long-poll pending; over TLS (trusting the CA file
``"tls_ca"``) when the masters serve https. No torch, no workers: the master cannot tell them from agents.

Heartbeats: bench/fleet_beats.py (one timer for every node of the process, a fixed schedule per node).

The parent drives it over stdin/stdout, one JSON object per line each way (:meth:`Fleet.handle`):
``progress``, ``window`` (count heartbeats sent in ``[t0, t1)`` and this process's CPU time over it),
``report``, ``failover`` (from time ``t``, note when each node's heartbeat is answered again), ``stop``.

    python -m bench.fake_fleet    # then on stdin: {"lo": 0, "hi": 100, "addresses": ["127.0.0.1:29400"], ...}
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fleet_beats import Beats, Window  # noqa: E402
from bench.fleet_wire import Link, WireError  # noqa: E402
from elastic.control.tls import client_context  # noqa: E402

#: Seconds a long-poll asks the master to hold it (the cap is 30).
LONG_POLL_S = 25.0


def raise_nofile(at_least: int = 0) -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (thousands of sockets per process); the new soft limit. With
    ``at_least`` above the hard limit, and the privilege to (root), the hard limit goes up to it first: the
    processes started afterwards (the master) inherit it, as an operator's ``ulimit -n`` would give them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and at_least > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, at_least), at_least))
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (ValueError, OSError):
            pass  # not root (or above fs.nr_open): the master then says how many agents it can serve
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # Linux's fs.nr_open by default
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Node:
    """One fake node: its identity, its credentials, its assignment."""

    def __init__(self, index: int) -> None:
        self.id = f"fake-{index}"
        self.index = index
        self.secret: str | None = None
        self.round = 0
        self.term: int | None = None
        self.beat = b""  # the heartbeat call, encoded; rebuilt when the node's state changes
        self.beating = False
        self.running = False  # holds an assignment (its "workers" run)
        self.must_rejoin = False  # the master forgot this node or told it to rejoin
        self.rejoins = 0
        self.joined_at: float | None = None  # the first join's reply (the first round's figures)
        self.assigned_at: float | None = None  # the first assignment
        self.back_at: float | None = None  # first heartbeat answered 200 after the failover mark
        self.hold_until = 0.0  # no heartbeat before: an overloaded master shed the last (fleet_beats.py)

    def set_state(self, link: Link) -> None:
        body: dict[str, Any] = {"node_id": self.id, "round": self.round, "state": "waiting"}
        if self.running:
            body["state"] = "running"
            body["workers"] = [{"local_rank": 0, "pid": 100000 + self.index, "status": "running"}]
            if self.term is not None:
                body["term"] = self.term
        self.beat = link.encode("heartbeat", self.secret, None, body)


class Fleet:
    """Nodes ``lo..hi-1`` in this process, and what they measured."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.interval = float(cfg["interval"])
        self.nnodes = int(cfg["nnodes"])
        self.nodes = [Node(i) for i in range(cfg["lo"], cfg["hi"])]
        self.links: dict[str, Link] = {}
        self.gate = asyncio.Semaphore(int(cfg.get("join_concurrency", 64)))
        self.beats = Beats(self.interval, float(cfg.get("jitter", 0.02)))
        self.errors: Counter = Counter()  # outside heartbeats: join, round, watch troubles
        self.samples: dict[str, str] = {}  # "op: status" -> the first such reply, for the report
        self.join_first: float | None = None
        self.stopping = False
        # One context for every node of the process, as the agent's (it trusts only the masters' CA).
        self.tls = client_context(cfg["tls_ca"]) if cfg.get("tls_ca") else None

    def link(self, node: Node) -> Link:
        link = self.links.get(node.id)
        if link is None:
            cfg = self.cfg
            link = Link(
                cfg["addresses"], cfg["token"], cfg["job"], stream=cfg["stream"], timeout=10.0, tls=self.tls
            )
            self.links[node.id] = link
        return link

    async def run(self, node: Node) -> None:
        """Join, follow the rounds; join again whenever the master forgets the node or says "rejoin" (as the
        agent does: a false verdict costs a rejoin and a new round, which the report shows)."""
        try:
            await self._join(node)
            self.beats.add(node, self.link(node))
            while True:
                await self._follow(node)
                node.rejoins += 1
                node.running = node.must_rejoin = False
                node.set_state(self.link(node))
                await self._join(node)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must show up in the report, not kill the fleet
            self.errors[f"crash: {exc!r}"[:120]] += 1

    async def _retry_pause(self) -> None:
        await asyncio.sleep(random.uniform(0.5, 1.0) * self.interval)

    async def _join(self, node: Node) -> None:
        body = {
            "node_id": node.id,
            "host": "127.0.0.1",
            "nproc": 1,
            "store_port": 20000 + node.index % 40000,
            "min_nodes": self.nnodes,
            "max_nodes": self.nnodes,
        }
        async with self.gate:
            self.join_first = self.join_first or time.time()
            while True:
                try:
                    status, reply = await self.link(node).call("join", node.secret, body=body)
                except WireError:
                    self.errors["join: lost"] += 1
                    await self._retry_pause()
                    continue
                if status == 200:
                    break
                self.errors[f"join: {status}"] += 1
                if status < 500 and status not in (408, 409, 429):
                    raise RuntimeError(f"join refused: {status} {reply}")
                await self._retry_pause()
        node.joined_at = node.joined_at or time.time()
        node.secret = reply["node_secret"]
        node.must_rejoin = False  # a verdict on the previous incarnation, answered before this join
        node.set_state(self.link(node))

    async def _follow(self, node: Node) -> None:
        """The round long-poll until assigned, then a watch long-poll kept pending; returns when the node
        must join again."""
        link = self.link(node)
        while not node.running:
            query = {"node_id": node.id, "after": node.round, "timeout": LONG_POLL_S}
            status, reply = await self._long_poll(link, "round", node, query)
            if status == 200 and reply.get("status") == "assigned":
                node.round = reply["assignment"]["round"]
                node.term = reply["assignment"].get("term")
                node.assigned_at = node.assigned_at or time.time()
                node.running = True
                node.set_state(link)
            elif status == 200 and reply.get("status") == "finished":
                raise RuntimeError("the job finished")
            elif status == 404 or node.must_rejoin:
                return  # unknown_node: declared dead while waiting
        while not node.must_rejoin:
            query = {"node_id": node.id, "round": node.round, "timeout": LONG_POLL_S}
            if node.term is not None:
                query["term"] = node.term
            t = time.monotonic()
            status, reply = await self._long_poll(link, "watch", node, query)
            if status == 404 or (status == 200 and reply.get("command") == "rejoin"):
                return
            if status == 200 and reply.get("command") != "continue":
                self.errors[f"watch: {reply.get('command')}"] += 1
            if time.monotonic() - t < 0.5 * self.interval:
                await asyncio.sleep(self.interval)  # answered at once: do not spin

    async def _long_poll(self, link: Link, op: str, node: Node, query: dict) -> tuple[int, Any]:
        try:
            status, reply = await link.call(op, node.secret, query)
        except WireError:
            if not self.stopping:
                self.errors[f"{op}: lost"] += 1
            await self._retry_pause()
            return 0, None
        if status != 200:
            self.errors[f"{op}: {status}"] += 1
            self.samples.setdefault(f"{op}: {status}", str(reply)[:300])
            await self._retry_pause()
        return status, reply

    # -- the parent's commands -------------------------------------------------------------------------
    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kind = cmd["cmd"]
        if kind == "progress":
            joined = [n.joined_at for n in self.nodes if n.joined_at is not None]
            assigned = [n.assigned_at for n in self.nodes if n.assigned_at is not None]
            return {
                "nodes": len(self.nodes),
                "joined": len(joined),
                "assigned": len(assigned),
                "join_first": self.join_first,
                "join_last": max(joined, default=None),
                "assigned_last": max(assigned, default=None),
                "running": sum(n.running for n in self.nodes),
                "rejoins": sum(n.rejoins for n in self.nodes),
                "errors": dict(self.errors + self.beats.commands),
                "samples": {**self.samples, **self.beats.samples},
                "connections": sum(len(link.conns) for link in self.links.values()),
                "cpu_s": cpu_s(),
            }
        if kind == "window":
            window = self.beats.window = Window(cmd["t0"], cmd["t1"])
            loop = asyncio.get_running_loop()
            for at in (cmd["t0"], cmd["t1"]):
                loop.call_later(max(0.0, at - time.time()), lambda: window.cpu.append(cpu_s()))
            return {"ok": True}
        if kind == "report":
            w = self.beats.window
            return {
                "offered": w.offered,
                "sent": w.sent,
                "served": w.served,
                "statuses": dict(w.statuses),
                "hist": {str(k): v for k, v in w.hist.items()},
                "cpu_s": w.cpu[1] - w.cpu[0] if len(w.cpu) == 2 else None,
                "late": w.late,
                "slow": w.slow,
                "late_max": w.late_max,
                "held": w.held,
            }
        if kind == "failover":
            self.beats.failover_at = cmd["t"]
            for node in self.nodes:
                node.back_at = None
            return {"ok": True}
        if kind == "failover_report":
            back = [n.back_at for n in self.nodes if n.back_at is not None]
            return {"back": len(back), "back_last": max(back, default=None), "back_times": back}
        if kind == "stop":
            self.stopping = True
            return {"ok": True, "cpu_s": cpu_s()}
        return {"error": f"unknown command {kind}"}


async def main() -> int:
    """Read the configuration (the first line on stdin), run the nodes, answer commands until ``stop``."""
    raise_nofile()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    fleet = Fleet(json.loads(await reader.readline()))
    tasks = [asyncio.create_task(fleet.run(node)) for node in fleet.nodes]
    tasks.append(asyncio.create_task(fleet.beats.run()))
    while line := await reader.readline():
        cmd = json.loads(line)
        sys.stdout.write(json.dumps(fleet.handle(cmd)) + "\n")
        sys.stdout.flush()
        if cmd["cmd"] == "stop":
            break
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for link in fleet.links.values():
        link.close()
    await asyncio.sleep(0.1)  # the beats in flight see their connections closed and end
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
