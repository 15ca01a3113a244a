"""Slow and hostile clients against a real ``elastic-master`` while two fake nodes heartbeat
(docs/security.md, "Slow and hostile clients"; the issue's check: 20,000 slow connections for 60 s).

Two parts:

- ``python -m bench.slow_clients attack --port P --connections N --seconds S [--sources K]``: one client
  process that holds ``N`` connections to ``127.0.0.1:P`` for ``S`` seconds, from ``127.0.0.2`` (or spread
  over ``127.0.0.2`` .. ``127.0.0.(K+1)``), each slot doing one slow thing again and again: connect and send
  nothing; trickle a request head a byte a second; one request outside ``/v1`` (a 404), then one byte of a
  next head; trickle a ``/ui/login`` body; an authenticated-looking heartbeat (a wrong token, 401 then 429)
  whose body trickles. A slot whose connection the master closed (a deadline, an eviction, ``503 busy``)
  reconnects after a pause. It prints one JSON line of counts when done.
- ``python -m bench.slow_clients run``: starts ``elastic-master`` (``--header-timeout 2``), joins two fake
  nodes over HTTP (from 127.0.0.1) that heartbeat every 0.5 s as training nodes of the job's round, starts
  ``--procs`` attack processes (one process cannot hold 20,000 sockets under a 20,000-file limit) once from
  one address and once spread over 16, and reports per run: heartbeats sent, answered 200, those answered
  later than :data:`ANSWER_TARGET_S`, the slowest answer, the master's RSS before and its peak; after the
  runs both nodes report success and the job must finish. Defaults are the issue's long version (20,000
  connections, 60 s); the suite runs a short one (tests/integration/test_slow_clients.py: 2,000 for 20 s,
  spread). The issue's target, checked in the last line: every heartbeat answered 200 within 1 s, the
  master's RSS at most 64 MiB over its start in each run, the job finished.

  python -m bench.slow_clients run                          # 20,000 connections for 60 s, 1 and 16 addresses
  python -m bench.slow_clients run --connections 4000 --seconds 20 --spread 16 --json /tmp/slow.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB_ID = "slow-clients"
#: Seconds between two bytes of a trickle, and before a slot reconnects.
TRICKLE_S = 1.0
RECONNECT_S = 1.0
HEARTBEAT_INTERVAL_S = 0.5
HEADER_TIMEOUT_S = 2.0
#: How long a fake node waits for a heartbeat's answer (an agent's request deadline is of this order).
HEARTBEAT_DEADLINE_S = 5.0
#: The issue's target: every heartbeat answered within this long, and the master's RSS growth at most this.
ANSWER_TARGET_S = 1.0
MAX_RSS_GROWTH_MIB = 64.0

KINDS = ("idle", "head", "next_head", "login_body", "wrong_token_body")


def _opening(kind: str) -> bytes:
    """What a slot of ``kind`` sends at once after connecting (then it trickles single bytes)."""
    if kind == "idle":
        return b""
    if kind == "head":
        return b"GET /v1/status HTTP/1.1\r\nHo"
    if kind == "next_head":
        return b"GET /no-such-page HTTP/1.1\r\nHost: m\r\n\r\nG"
    if kind == "login_body":
        form = b"content-type: application/x-www-form-urlencoded\r\n"
        return b"POST /ui/login HTTP/1.1\r\nHost: m\r\n" + form + b"content-length: 4096\r\n\r\nt"
    return (
        b"POST /v1/heartbeat HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " + b"w" * 32 + b"\r\n"
        b"X-Elastic-Job: " + JOB_ID.encode() + b"\r\ncontent-type: application/json\r\n"
        b"content-length: 4096\r\n\r\n{"
    )


@dataclass
class AttackCounts:
    """What one attack process saw."""

    connects: int = 0
    connect_errors: int = 0
    closed_by_master: int = 0
    busy: int = 0
    #: Slots per kind, and how many times the master closed a connection of each kind.
    kinds: dict[str, int] = field(default_factory=dict)
    closed_kinds: dict[str, int] = field(default_factory=dict)


async def _slot(port: int, source: str, kind: str, until: float, counts: AttackCounts) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            counts.connect_errors += 1
            await asyncio.sleep(RECONNECT_S)  # pacing a retry, not synchronisation
            continue
        counts.connects += 1
        try:
            writer.write(_opening(kind))
            while loop.time() < until:
                try:
                    data = await asyncio.wait_for(reader.read(4096), TRICKLE_S)
                except asyncio.TimeoutError:
                    writer.write(b"x")  # one more byte: the trickle
                    continue
                if not data:
                    counts.closed_by_master += 1
                    counts.closed_kinds[kind] = counts.closed_kinds.get(kind, 0) + 1
                    break
                if data.startswith(b"HTTP/1.1 503"):
                    counts.busy += 1
        except OSError:  # reset by the master
            counts.closed_by_master += 1
            counts.closed_kinds[kind] = counts.closed_kinds.get(kind, 0) + 1
        finally:
            writer.close()
        await asyncio.sleep(RECONNECT_S)


async def attack(port: int, connections: int, seconds: float, sources: list[str]) -> AttackCounts:
    """Hold ``connections`` slow connections to ``127.0.0.1:port`` for ``seconds``, from ``sources``."""
    counts = AttackCounts()
    until = asyncio.get_running_loop().time() + seconds
    slots = []
    for i in range(connections):
        kind = KINDS[i % len(KINDS)]
        counts.kinds[kind] = counts.kinds.get(kind, 0) + 1
        slots.append(_slot(port, sources[i % len(sources)], kind, until, counts))
    await asyncio.gather(*slots)
    return counts


def sources_for(spread: int, offset: int = 2) -> list[str]:
    """``127.0.0.<offset>`` .. ``127.0.0.<offset + spread - 1>``."""
    return [f"127.0.0.{offset + i}" for i in range(spread)]


# -- the run: a master, two fake nodes, attack processes -----------------------------------------------
@dataclass
class RunResult:
    """One run of :func:`run_once`."""

    connections: int
    seconds: float
    sources: int
    heartbeats: int
    answered_200: int
    other_answers: dict[str, int]
    #: Heartbeats answered later than :data:`ANSWER_TARGET_S` (200 or not).
    late_answers: int
    slowest_answer_s: float
    rss_before_mib: float
    rss_peak_mib: float
    attacks: list[dict]
    #: Whether the job finished (both nodes reported success, the master's outcome said so) after the
    #: runs of :func:`run`; None until then.
    job_finished: bool | None = None

    def target_met(self) -> bool:
        """Every heartbeat answered 200 within :data:`ANSWER_TARGET_S`, RSS growth within the bound, and
        the job finished."""
        return (
            self.heartbeats > 0
            and self.answered_200 == self.heartbeats
            and self.late_answers == 0
            and self.rss_peak_mib - self.rss_before_mib <= MAX_RSS_GROWTH_MIB
            and self.job_finished is True
        )


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class FakeNodes:
    """Two nodes joined over HTTP that heartbeat every :data:`HEARTBEAT_INTERVAL_S` in a thread, as nodes
    whose workers run the job's round; each heartbeat's status (or the error that ended it) and its time
    are recorded. :meth:`finish` reports success: the job ends."""

    def __init__(self, address: str, token: str) -> None:
        import httpx

        self.auth = {"Authorization": f"Bearer {token}", "X-Elastic-Job": JOB_ID}
        self.clients = [
            httpx.Client(base_url=f"http://{address}", headers=self.auth, timeout=HEARTBEAT_DEADLINE_S)
            for _ in range(2)
        ]
        self.secrets: list[str] = []
        self.round = 0
        for i, client in enumerate(self.clients):
            body = dict(node_id=f"n{i}", host="127.0.0.1", nproc=1, store_port=29501 + i)
            body |= dict(min_nodes=2, max_nodes=2)
            reply = client.post("/v1/join", json=body)
            reply.raise_for_status()
            self.secrets.append(reply.json()["node_secret"])
            self.round = reply.json()["round"]  # both nodes make the round: min_nodes = max_nodes = 2
        self.answers: dict[str, int] = {}
        self.late = 0
        self.slowest = 0.0
        self.rss_peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat_once(self, state: str = "running") -> list[dict]:
        """One heartbeat of each node; the replies answered 200."""
        replies = []
        for i, client in enumerate(self.clients):
            started = time.monotonic()
            try:
                reply = client.post(
                    "/v1/heartbeat",
                    json=dict(node_id=f"n{i}", round=self.round, state=state),
                    headers={"X-Elastic-Node-Secret": self.secrets[i]},
                )
                outcome = str(reply.status_code)
                if reply.status_code == 200:
                    replies.append(reply.json())
            except Exception as exc:  # a timeout or a dropped connection: recorded, the run goes on
                outcome = type(exc).__name__
            took = time.monotonic() - started
            self.slowest = max(self.slowest, took)
            self.late += took > ANSWER_TARGET_S
            self.answers[outcome] = self.answers.get(outcome, 0) + 1
        return replies

    def finish(self) -> bool:
        """Both nodes report that their workers succeeded: whether the master then says the job succeeded
        (its reply's outcome, and ``GET /v1/status``)."""
        replies = self.beat_once("succeeded")
        told = any((r.get("outcome") or {}).get("succeeded") for r in replies)
        status = self.clients[0].get("/v1/status")
        return told and status.status_code == 200 and bool((status.json()["outcome"] or {}).get("succeeded"))

    def start(self, master_pid: int | None = None) -> None:
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):  # the heartbeat period, as an agent's
                self.beat_once()
                if master_pid is not None:
                    self.rss_peak = max(self.rss_peak, _rss_mib(master_pid))

        self._thread = threading.Thread(target=loop, name="fake-nodes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating (:meth:`start` resumes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_DEADLINE_S * 3)

    def close(self) -> None:
        self.stop()
        for client in self.clients:
            client.close()


def attack_argv(port: int, connections: int, seconds: float, sources: list[str]) -> list[str]:
    """The command line of one attack process."""
    return [
        sys.executable, "-m", "bench.slow_clients", "attack", "--port", str(port),
        "--connections", str(connections), "--seconds", str(seconds), "--sources", ",".join(sources),
    ]  # fmt: skip


def run_once(
    port: int, master_pid: int, nodes: FakeNodes, connections: int, seconds: float, spread: int, procs: int
) -> RunResult:
    """One flood of ``connections`` from ``procs`` processes over ``spread`` addresses, while ``nodes``
    heartbeat."""
    nodes.answers, nodes.slowest, nodes.late = {}, 0.0, 0
    rss_before = _rss_mib(master_pid)
    nodes.rss_peak = rss_before
    sources = sources_for(spread)
    share = [connections // procs + (1 if i < connections % procs else 0) for i in range(procs)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    attackers = [
        subprocess.Popen(attack_argv(port, n, seconds, sources), env=env, stdout=subprocess.PIPE, text=True)
        for n in share
    ]
    nodes.start(master_pid)
    try:
        outputs = [proc.communicate(timeout=seconds + 60)[0] for proc in attackers]
    finally:
        nodes.stop()
        for proc in attackers:  # none is left behind, whatever happened
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    answers = dict(nodes.answers)
    return RunResult(
        connections=connections,
        seconds=seconds,
        sources=spread,
        heartbeats=sum(answers.values()),
        answered_200=answers.pop("200", 0),
        other_answers=answers,
        late_answers=nodes.late,
        slowest_answer_s=round(nodes.slowest, 3),
        rss_before_mib=round(rss_before, 1),
        rss_peak_mib=round(nodes.rss_peak, 1),
        attacks=[json.loads(out.strip().splitlines()[-1]) for out in outputs if out.strip()],
    )


def run(args: argparse.Namespace) -> list[RunResult]:
    """Start a master, then one run per ``args.spread`` (source addresses: 1 and 16 by default) of
    ``args.connections`` from ``args.procs`` processes for ``args.seconds``."""

    token = "slow-clients-bench-token-0123456789"
    with tempfile.TemporaryDirectory(prefix="slow-clients-") as folder:
        token_file, log_file = Path(folder) / "token", Path(folder) / "master.log"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        argv = [
            sys.executable, "-m", "master", "--host", "127.0.0.1", "--port", "0", "--job-id", JOB_ID,
            "--nnodes", "2", "--token-file", str(token_file), "--header-timeout", str(HEADER_TIMEOUT_S),
            "--heartbeat-timeout", "30",
        ]  # fmt: skip
        with open(log_file, "wb") as log:
            master = subprocess.Popen(
                argv,
                env=dict(os.environ, PYTHONPATH=str(REPO)),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"listening on 127\.0\.0\.1:(\d+)", log_file.read_text())):
                if time.monotonic() > deadline or master.poll() is not None:
                    raise RuntimeError(f"elastic-master did not start: {log_file.read_text()[-2000:]}")
                time.sleep(0.1)  # polling a starting process's log, with a deadline
            port = int(found.group(1))
            nodes = FakeNodes(f"127.0.0.1:{port}", token)
            try:
                results = [
                    run_once(port, master.pid, nodes, args.connections, args.seconds, spread, args.procs)
                    for spread in args.spread
                ]
                finished = nodes.finish()
                for result in results:
                    result.job_finished = finished
            finally:
                nodes.close()
        finally:
            master.terminate()
            try:
                master.wait(timeout=30)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait(timeout=30)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("attack", help="one attack process (prints its counts as JSON)")
    one.add_argument("--port", type=int, required=True)
    one.add_argument("--connections", type=int, required=True)
    one.add_argument("--seconds", type=float, required=True)
    one.add_argument("--sources", default="127.0.0.2", help="comma-separated source addresses")
    whole = commands.add_parser("run", help="a master, two fake nodes, the attack processes")
    whole.add_argument("--connections", type=int, default=20_000)
    whole.add_argument("--seconds", type=float, default=60.0)
    whole.add_argument("--procs", type=int, default=2, help="attack processes (10,000 sockets each at most)")
    whole.add_argument("--spread", type=int, nargs="+", default=[1, 16], help="source addresses per run")
    whole.add_argument("--json", default=None, metavar="FILE", help="also write the runs as JSON")
    args = parser.parse_args(argv)
    if args.command == "attack":
        counts = asyncio.run(attack(args.port, args.connections, args.seconds, args.sources.split(",")))
        print(json.dumps(asdict(counts)), flush=True)
        return
    results = run(args)
    columns = ["connections", "seconds", "sources", "heartbeats", "200", "other", f"> {ANSWER_TARGET_S:g} s"]
    columns += ["slowest s", "RSS before MiB", "RSS peak MiB", "growth MiB"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        print(
            f"| {r.connections} | {r.seconds:g} | {r.sources} | {r.heartbeats} | {r.answered_200} | "
            f"{r.other_answers or '-'} | {r.late_answers} | {r.slowest_answer_s} | {r.rss_before_mib} | "
            f"{r.rss_peak_mib} | {r.rss_peak_mib - r.rss_before_mib:.1f} |"
        )
    met = all(r.target_met() for r in results)
    print(
        f"Job finished: {'yes' if results and results[0].job_finished else 'no'}. Target (every heartbeat "
        f"answered 200 within {ANSWER_TARGET_S:g} s, RSS growth <= {MAX_RSS_GROWTH_MIB:g} MiB per run, the "
        f"job finished): {'met' if met else 'not met'}."
    )
    if args.json:
        runs = [asdict(r) for r in results]
        Path(args.json).write_text(json.dumps({"benchmark": "slow_clients", "runs": runs, "target_met": met}))


if __name__ == "__main__":
    main()
