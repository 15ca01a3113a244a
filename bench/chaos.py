"""Chaos: a fault of a random kind every ``--interval`` seconds for ``--duration`` seconds, against a job
of 3-4 fake nodes (``--nnodes 2:4``) with two etcd-backed masters; then goodput with named badput buckets,
and a final check that nothing was lost and the weights equal a fault-free run's (a first version).

The job: ``elastic-run`` agents on this machine (``--nproc-per-node`` workers each, the adaptive hang bound,
default heartbeat 1 s / timeout 4 s, etcd lease TTL 3 s) running bench/chaos_train.py (ElasticSampler with
a constant global batch, gradients reduced as fixed-point integers so the weights are exact at any world
size, a flash save every step; ``--mode inprocess`` inside ``elastic.run``, ``--mode restart`` with
process restarts). Two ``elastic-master`` daemons share one private etcd; the nodes share one
``--ckpt-dir`` (shared storage) and each has a ``TMPDIR`` of its own (its machine's /tmp).

The schedule (bench/chaos_schedule.py) is drawn from ``--seed`` before the run and printed first: the first
injections are one of each kind in a seeded order, then kinds are drawn with equal weight; one in ten is a
pair. Kinds: worker SIGKILL; worker SIGSTOP for 2-10 s then SIGCONT (or SIGKILL, one in three); node loss
(agent and workers SIGKILLed) with a replacement node 5-30 s later; preemption (the agent SIGTERMed); a
spare node joining; the leading master SIGKILLed or SIGTERMed (restarted as the standby); etcd SIGKILLed and
restarted; etcd SIGSTOPped for 2-8 s; a node cut off from the others and the masters for 5-20 s (an nft rule
drops every packet its sockets send, matched by the node's own group id; this needs root: without it a run
with this kind is refused, exit 2).

After ``--duration`` every pending follow-up runs at once (stopped processes continue, replacements join),
the job is told its last step (a stop file, a few steps ahead) and must exit 0. An agent that exits non-zero
on its own (the job failed, a node gave up) ends the fault phase at once. Then:

- goodput = kept steps x the fault-free median step time at full world (rank 0's steps before the first
  fault) / wall time (the harness's start of the agents -> the last agent's exit);
- badput buckets (bench/chaos_check.py) summing to the wall time, ``degraded_world_s``, recovery seconds
  per fault (p50/p99 by kind: from the fault to the first step of the next round);
- the final check (the exit status: 0 passed, 1 failed): the job exited 0, samples exactly once in the
  surviving lineage, the final weights ``torch.equal`` to one fault-free run at world size 1, nothing
  leaked (processes, /dev/shm folders of the job, temp files of nodes that ended normally); the issue's
  targets (faults, 0 unrecovered, 0 steps lost, goodput) are reported beside it. docs/chaos.md has the
  definitions.

    python bench/chaos.py --duration 600 --mode inprocess --json chaos.json
    python bench/chaos.py --mode restart --duration 90 --interval 10 --seed 7 --kinds cheap  # the suite's
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import chaos_check as chk  # noqa: E402
from bench import chaos_schedule as sch  # noqa: E402
from bench import common as c  # noqa: E402
from elastic.control.protocol import API_PREFIX, JOB_HEADER  # noqa: E402
from elastic.exit_codes import ExitCode  # noqa: E402

SCRIPT = c.REPO / "bench" / "chaos_train.py"
TOKEN = "chaos-bench-token"
BATCH, NUM_SAMPLES = 24, 480
STEP_LINE = re.compile(r"^(?:\[rank0\]:)?step=(\d+) world=(\d+)$", re.M)
#: Group id of node K: NODE_GID_BASE + K.
NODE_GID_BASE = 47000
#: Goodput targets of a 30-minute run.
GOODPUT_TARGET = {"inprocess": 0.95, "restart": 0.90}
#: Steps between the stop file's number and the newest step seen when it is written.
STOP_MARGIN = 10


@dataclass
class Result:
    """The JSON's top level (the fields the chaos targets name) plus details."""

    mode: str
    seed: int
    duration_s: float
    interval_s: float
    nproc_per_node: int
    goodput: float | None = None
    faults: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    unrecovered: int = 0
    steps_lost: int = 0
    redone_steps: int = 0
    kept_steps: int = 0
    samples_exactly_once: bool = False
    weights_equal: bool = False
    leaked: int = 0
    exit_ok: bool = False
    passed: bool = False
    wall_s: float = 0.0
    fault_free_step_s: float | None = None
    degraded_world_s: float = 0.0
    badput_s: dict[str, float] = field(default_factory=dict)
    recovery_s: dict[str, dict[str, float | None]] = field(default_factory=dict)
    restarts_charged: int | None = None
    master_goodput_ratio: float | None = None
    #: The leading master's elastic_badput_seconds_total by bucket, read from /metrics at the end.
    master_badput_s: dict[str, float] = field(default_factory=dict)
    agent_exit_codes: dict[str, int | None] = field(default_factory=dict)
    #: Nodes the master excluded (flapping, a straggler evicted, suspect hardware), whose agent exited 4 as
    #: designed: the job goes on without them and the harness starts a replacement, as a platform would.
    excluded: list[dict] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    kept_stack_dumps: int = 0
    targets: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    injected: list[dict] = field(default_factory=list)
    schedule: list[dict] = field(default_factory=list)


class Node:
    """One fake node: an elastic-run agent with its own TMPDIR (its "machine"); the checkpoint folder is
    shared by every node, as a multi-node job's ``--ckpt-dir`` on shared storage (docs/checkpointing.md): a
    lost node's memory copies go with it, what was persisted does not."""

    def __init__(self, name: str, proc: c.Launched, tmp: Path, gid: int) -> None:
        self.name, self.proc, self.tmp, self.gid = name, proc, tmp, gid
        self.ended: str = ""  # "", "killed", "preempted", or "exit N" (it exited by itself, N != 0)
        self.cut = ""  # the nft table that cuts it off, while it is cut off

    def workers(self, step_log: Path) -> list[psutil.Process]:
        """Its live worker processes: descendants that write a step log."""
        logged = {int(p.stem[3:]) for p in step_log.glob("pid*.log")}
        return sorted((p for p in self.proc.track() if p.pid in logged), key=lambda p: p.pid)


class Cluster:
    """etcd, two masters and the nodes; every process started in the run's group."""

    def __init__(self, args: argparse.Namespace, group: c.Group, folder: Path) -> None:
        self.args, self.group, self.folder = args, group, folder
        self.job = f"chaos-{uuid.uuid4().hex[:8]}"
        self.token_file = folder / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.step_log = folder / "steps"
        self.stop_file = folder / "stop"
        sys.path.insert(0, str(c.REPO / "tests" / "support"))
        from etcd_server import EtcdServer  # type: ignore[import-not-found]  # the tests' etcd launcher

        self.etcd = EtcdServer(folder / "etcd").start()
        self.ports = [c.free_port(), c.free_port()]
        self.masters: list[c.Launched | None] = [None, None]
        self.master_runs = 0
        self.nodes: dict[str, Node] = {}
        self.node_count = 0
        self.tables: set[str] = set()  # nft tables of cuts not healed yet
        self.cuts = "partition" in args.kinds.split(",")
        self.machines = Path(tempfile.mkdtemp(prefix="chaos-"))  # removed by run()

    def event_logs(self) -> list[Path]:
        return [self.folder / f"events-{i}.jsonl" for i in (0, 1)]

    def start_master(self, i: int) -> None:
        argv = c.master_argv() + [
            "--host", "127.0.0.1", "--port", str(self.ports[i]), "--job-id", self.job, "--nnodes", "2:4",
            "--token-file", str(self.token_file), "--store", f"etcd://{self.etcd.endpoint}",
            "--max-restarts", "100000", "--event-log", str(self.event_logs()[i]),
            # As under a supervisor that restarts it: a master brought back while etcd is stopped or
            # restarting waits for etcd (finding 11), where it exited and left the job without a master.
            "--store-wait", "60",
        ]  # fmt: skip
        self.master_runs += 1
        self.masters[i] = self.group.launch(argv, f"master-{i}-{self.master_runs}")

    def info(self, i: int) -> int:
        try:
            headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: self.job}
            url = f"http://127.0.0.1:{self.ports[i]}{API_PREFIX}/info"
            return httpx.get(url, headers=headers, timeout=2.0, trust_env=False).status_code
        except httpx.HTTPError:
            return 0

    def leader(self) -> int | None:
        return next((i for i in (0, 1) if self.info(i) == 200), None)

    def metrics(self) -> str:
        lead = self.leader()
        if lead is None:
            return ""
        try:
            url = f"http://127.0.0.1:{self.ports[lead]}/metrics"
            headers = {"Authorization": f"Bearer {TOKEN}", JOB_HEADER: self.job}
            return httpx.get(url, headers=headers, timeout=5.0, trust_env=False).text
        except httpx.HTTPError:
            return ""

    def start_node(self) -> Node:
        name = f"node-{self.node_count}"
        # Its own group id (uid stays 0): a partition's nft rule drops the packets of its sockets by gid.
        gid = NODE_GID_BASE + self.node_count
        self.node_count += 1
        # Short: the agent binds unix sockets in its TMPDIR (108 bytes at most), a test's folder is long.
        tmp = self.machines / name
        (tmp / "tmp").mkdir(parents=True, exist_ok=True)
        # setpriv needs root: only when partitions are asked for (they need root anyway).
        as_gid = ["setpriv", f"--regid={gid}", "--clear-groups", "--"] if self.cuts else []
        argv = [
            *as_gid, *c.elastic_tool().argv,
            "--nnodes", "2:4", "--nproc-per-node", str(self.args.nproc_per_node),
            "--master", ",".join(f"127.0.0.1:{p}" for p in self.ports), "--job-id", self.job,
            "--token-file", str(self.token_file), "--node-id", name, "--ckpt-dir", str(self.folder / "ckpt"),
            *(["--hang-timeout", str(self.args.hang_timeout)] if self.args.hang_timeout is not None else []),
            "--stop-grace", "2",
            str(SCRIPT), "--mode", self.args.mode, "--stop-file", str(self.stop_file),
            "--step-time", str(self.args.step_time), "--batch-size", str(BATCH),
            "--num-samples", str(NUM_SAMPLES), "--step-log", str(self.step_log),
            "--final-weights", str(self.folder / "final.pt"),
        ]  # fmt: skip
        env = c.bench_env(TMPDIR=str(tmp / "tmp"), OMP_NUM_THREADS="1")
        node = Node(name, self.group.launch(argv, name, env=env), tmp / "tmp", gid)
        self.nodes[name] = node
        return node

    def cut(self, node: Node) -> str:
        """Drop every packet the node's sockets send (by its group id): it keeps running, cut off from the
        other nodes and the masters (a TCP peer sees no data and no acknowledgement). Returns the table."""
        table = f"chaos_{self.job.replace('-', '_')}_{node.name.replace('-', '_')}"
        rules = (
            f"table inet {table} {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n"
            f"  meta skgid {node.gid} drop\n }}\n}}\n"
        )
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)
        self.tables.add(table)
        node.cut = table
        return table

    def heal(self, table: str) -> None:
        if table in self.tables:
            subprocess.run(["nft", "delete", "table", "inet", table], check=False, timeout=30)
            self.tables.discard(table)
        for node in self.nodes.values():
            if node.cut == table:
                node.cut = ""

    def exited_nodes(self) -> list[tuple[str, int]]:
        """Nodes the harness did not end whose agent exited with a non-zero code (marked ended), except
        those the master excluded (see :meth:`excluded_nodes`)."""
        out = []
        for node in self.nodes.values():
            code = node.proc.popen.poll()
            if not node.ended and code not in (None, 0) and not self._excluded(node, code):
                node.ended = f"exit {code}"
                out.append((node.name, code))
        return out

    def excluded_nodes(self) -> list[tuple[str, str]]:
        """Nodes whose agent exited 4 (ExitCode.NODE_UNHEALTHY) because the master excluded them, each with
        the master's event (marked ended): the policy at work, not a failure of the job."""
        out = []
        for node in self.nodes.values():
            code = node.proc.popen.poll()
            if not node.ended and code is not None and (why := self._excluded(node, code)):
                node.ended = f"excluded: {why}"
                out.append((node.name, why))
        return out

    def _excluded(self, node: Node, code: int) -> str | None:
        if code != ExitCode.NODE_UNHEALTHY:
            return None
        return chk.exclusions(self.event_logs()).get(node.name)

    def live(self) -> list[Node]:
        return [
            n for n in sorted(self.nodes.values(), key=lambda n: n.name) if not n.ended and n.proc.alive()
        ]

    def rank0_output(self) -> str:
        return "".join(n.proc.output() for n in self.nodes.values())

    def newest_step(self) -> tuple[int, int]:
        """(newest step, its world) that rank 0 printed on any node."""
        found = [(int(s), int(w)) for s, w in STEP_LINE.findall(self.rank0_output())]
        return max(found, default=(0, 0))


class Injector:
    """Runs the schedule's faults and their follow-ups (timed actions) against a :class:`Cluster`."""

    def __init__(self, cluster: Cluster, result: Result) -> None:
        self.cl, self.result = cluster, result
        self.actions: list[tuple[float, int, str, Callable[[], None]]] = []
        self.counter = 0
        self.below_min: list[tuple[float, float]] = []
        self._below_since: float | None = None

    def later(self, at: float, what: str, action: Callable[[], None]) -> None:
        self.counter += 1
        heapq.heappush(self.actions, (at, self.counter, what, action))

    def due(self, now: float, everything: bool = False) -> None:
        while self.actions and (everything or self.actions[0][0] <= now):
            _, _, _, action = heapq.heappop(self.actions)
            action()

    def note_nodes(self, now: float) -> None:
        # A node cut off from the others is live but no member the job can use: the master counts the
        # time as waiting for nodes too.
        below = len([n for n in self.cl.live() if not n.cut]) < sch.MIN_NODES
        if below and self._below_since is None:
            self._below_since = now
        elif not below and self._below_since is not None:
            self.below_min.append((self._below_since, now))
            self._below_since = None

    def pick_node(self, fault: sch.Fault) -> Node | None:
        live = [n for n in self.cl.live() if not n.cut]
        return live[int(fault.target * len(live))] if live else None

    def inject(self, fault: sch.Fault, now: float) -> str:
        """Inject one fault; returns what was done (the injected record's ``what``)."""
        kind = fault.kind
        if kind in ("worker_kill", "worker_stop"):
            node = self.pick_node(fault)
            workers = node.workers(self.cl.step_log) if node else []
            if node is None or not workers:
                return "no live worker"
            victim = workers[int(fault.target * 997) % len(workers)]
            if kind == "worker_kill":
                victim.send_signal(signal.SIGKILL)
                return f"SIGKILL worker {victim.pid} of {node.name}"
            victim.send_signal(signal.SIGSTOP)
            end = signal.SIGKILL if fault.kill_after else signal.SIGCONT
            ident = (victim.pid, victim.create_time())
            self.later(now + fault.duration_s, "worker end", lambda: _signal(ident, end))
            return f"SIGSTOP worker {victim.pid} of {node.name} for {fault.duration_s:.1f}s then {end.name}"
        if kind == "node_loss":
            node = self.pick_node(fault)
            if node is None:
                return "no live node"
            node.proc.kill_tree()
            node.ended = "killed"
            self.later(now + fault.duration_s, "replacement", lambda: None if self.cl.start_node() else None)
            return f"SIGKILL {node.name} (agent and workers), replacement in {fault.duration_s:.1f}s"
        if kind == "preemption":
            node = self.pick_node(fault)
            if node is None:
                return "no live node"
            os.kill(node.proc.pid, signal.SIGTERM)
            node.ended = "preempted"
            return f"SIGTERM {node.name}"
        if kind == "partition":
            node = self.pick_node(fault)
            if node is None:
                return "no live node"
            table = self.cl.cut(node)
            self.later(now + fault.duration_s, "heal", lambda: self.cl.heal(table))
            return f"cut {node.name} off (nft table {table}) for {fault.duration_s:.1f}s"
        if kind == "spare_join":
            return f"started {self.cl.start_node().name}"
        if kind in ("master_kill", "master_term"):
            lead = self.cl.leader()
            if lead is None:
                return "no leading master"
            proc = self.cl.masters[lead]
            assert proc is not None
            if kind == "master_kill":
                proc.kill_tree()
            else:
                os.kill(proc.pid, signal.SIGTERM)
            self.later(now, "master back", lambda: self._restart_master(lead, now + 30.0))
            return f"{'SIGKILL' if kind == 'master_kill' else 'SIGTERM'} master {lead}"
        if kind == "etcd_kill":
            self.cl.etcd.kill()
            self.later(now, "etcd back", self.cl.etcd.start)
            return "SIGKILL etcd, restarted"
        if kind == "etcd_stop":
            proc = self.cl.etcd.proc
            if proc is None or proc.poll() is not None:
                return "etcd not running"
            os.kill(proc.pid, signal.SIGSTOP)
            self.later(now + fault.duration_s, "etcd cont", lambda: _continue(proc))
            return f"SIGSTOP etcd for {fault.duration_s:.1f}s"
        raise ValueError(f"unknown fault kind {kind}")

    def _restart_master(self, i: int, deadline: float) -> None:
        """Start master ``i`` again (as the standby) once its old process exited; a SIGTERMed leader steps
        down first (past ``deadline`` it is SIGKILLed). Polled, so the schedule goes on meanwhile."""
        proc = self.cl.masters[i]
        if proc is not None and proc.alive():
            if time.time() > deadline:
                proc.kill_tree()
            self.later(time.time() + 0.1, "master back", lambda: self._restart_master(i, deadline))
            return
        if proc is not None:
            proc.reap(5.0)
        self.cl.start_master(i)


def _continue(proc: subprocess.Popen) -> None:
    """SIGCONT a stopped etcd, unless a paired ``etcd_kill`` ended that process meanwhile."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)


def _signal(ident: tuple[int, float], sig: signal.Signals) -> None:
    proc = c.same_process(ident)
    if proc is not None:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m[1]) if m else None


def nft_usable() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["nft", "list", "tables"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _torch_cache(path: Path) -> bool:
    """torch's own compile cache folder (``$TMPDIR/torchinductor_<user>``), made empty at import: not ours."""
    return path.is_dir() and path.name.startswith("torchinductor_") and not any(path.iterdir())


def _stack_dump(path: Path, tmp: Path) -> bool:
    """A hung worker's stack dump (``elastic-run-stacks-*``): the evidence the failure report names (the
    agent keeps it for the operator on purpose), counted apart from leaks."""
    return path.relative_to(tmp).parts[0].startswith("elastic-run-stacks-")


def shm_entries(job: str) -> list[str]:
    return sorted(str(p) for p in Path("/dev/shm").glob(f"*{job}*"))


def reference_weights(folder: Path, steps: int, timeout: float) -> Path | None:
    """One fault-free run at world size 1 (``--step-time 0``) to ``steps``: its final weights."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "reference.pt"
    argv = [
        *c.elastic_tool().argv, "--standalone", "--nproc-per-node", "1", "--quiet", str(SCRIPT),
        "--mode", "restart", "--steps", str(steps), "--batch-size", str(BATCH),
        "--num-samples", str(NUM_SAMPLES), "--final-weights", str(out),
    ]  # fmt: skip
    with c.Group(folder) as group:
        proc = group.launch(argv, "reference", env=c.bench_env(OMP_NUM_THREADS="1"))
        c.wait_until(lambda: not proc.alive(), timeout, tick=lambda: None if proc.track() else None)
    return out if out.exists() else None


def weights_equal(path: Path, reference: Path | None) -> bool:
    import torch  # only here: the harness itself does not need torch

    if reference is None or not path.exists():
        return False
    mine, ref = torch.load(path), torch.load(reference)
    return mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)


def run(args: argparse.Namespace, folder: Path) -> Result:
    kinds = tuple(args.kinds.split(","))
    result = Result(args.mode, args.seed, args.duration, args.interval, args.nproc_per_node)
    plan = sch.schedule(args.seed, args.duration, args.interval, kinds)
    result.schedule = sch.as_json(plan)
    print(f"schedule (seed {args.seed}, {len(plan)} injections, t from the job's first step):", flush=True)
    for injection in plan:
        print("  " + injection.line(), flush=True)
    with c.Group(folder) as group:
        cluster = Cluster(args, group, folder)
        try:
            result = drive(args, cluster, plan, result)
        finally:
            for table in list(cluster.tables):
                cluster.heal(table)
            cluster.etcd.kill()
            group.close()  # before the machines' folders go: their processes may still write there
            shutil.rmtree(cluster.machines, ignore_errors=True)
    return result


def drive(args: argparse.Namespace, cl: Cluster, plan: list[sch.Injection], result: Result) -> Result:
    cl.start_master(0)
    cl.start_master(1)
    if not c.wait_until(lambda: cl.leader() is not None, 120.0):
        result.problems.append("no master led within 120 s")
        return result
    started = time.time()
    for _ in range(3):
        cl.start_node()
    failed: list[tuple[str, int]] = []

    def stepping() -> bool:
        cl.group.track()
        failed.extend(cl.exited_nodes())  # an agent that could not start: no need to wait any longer
        return cl.newest_step()[0] >= 3 or bool(failed)

    if not c.wait_until(stepping, 180.0):
        result.problems.append("the job did not reach step 3 within 180 s")
        return result
    if failed:
        result.problems += [
            f"{name} exited with {code} before step 3 (log {cl.folder})" for name, code in failed
        ]
        return result
    t0 = time.time()  # the schedule's zero: the job's first steps
    inj = Injector(cl, result)
    pending = list(plan)
    full_world = 3 * args.nproc_per_node
    while pending or inj.actions:
        now = time.time()
        if not pending and now - t0 > args.duration:
            break
        while pending and t0 + pending[0].at <= now:
            injection = pending.pop(0)
            for fault in injection.faults:
                what = inj.inject(fault, time.time())
                result.injected.append({"t": round(time.time() - t0, 3), "kind": fault.kind, "what": what})
                c.log(f"t={time.time() - t0:6.1f}s {fault.kind}: {what}")
        inj.due(time.time())
        inj.note_nodes(time.time())
        cl.group.track()
        for name, why in cl.excluded_nodes():  # as a platform replaces a node its job excluded
            replacement = cl.start_node()
            result.excluded.append({"t": round(now - t0, 3), "node": name, "why": why})
            c.log(f"t={now - t0:6.1f}s {name} excluded by the master ({why}); started {replacement.name}")
        failed = cl.exited_nodes()
        if failed:  # an agent the harness did not end exited non-zero: the job failed, stop here
            result.problems += [f"{name} exited with {code} at t={now - t0:.1f}s" for name, code in failed]
            break
        time.sleep(0.05)  # a schedule driven by wall time: nothing to wait on
    inj.due(time.time(), everything=True)  # heal: stopped processes continue, replacements join
    fault_end = time.time()
    # Let the job come back to all its live nodes, then tell it where to stop.
    want = len(cl.live()) * args.nproc_per_node
    reached = bool(cl.live()) and c.wait_until(
        lambda: cl.newest_step()[1] == want or not cl.live(), 120.0, tick=cl.group.track
    )
    if not reached and cl.live():
        result.problems.append(f"world {want} not reached within 120 s after the faults ended")
    last = cl.newest_step()[0] + STOP_MARGIN
    tmp = cl.stop_file.with_suffix(".tmp")
    tmp.write_text(f"{last}\n")
    os.replace(tmp, cl.stop_file)
    ended = c.wait_until(lambda: not cl.live(), 180.0, tick=cl.group.track)
    inj.note_nodes(time.time() + 1e-3)
    finished = time.time()
    if not ended:
        result.problems.append("the job did not end within 180 s of its stop step")
    for node in cl.nodes.values():
        if not node.ended or node.ended.startswith("exit"):
            result.agent_exit_codes[node.name] = node.proc.reap(5.0)
    result.exit_ok = bool(ended) and all(code == 0 for code in result.agent_exit_codes.values())
    text = cl.metrics()
    result.master_goodput_ratio = _metric(text, "elastic_goodput_ratio")
    result.master_badput_s = {
        m[1]: round(float(m[2]), 3)
        for m in re.finditer(r'^elastic_badput_seconds_total\{[^}]*bucket="(\w+)"[^}]*\} (\S+)$', text, re.M)
    }
    restarts = _metric(text, "elastic_restarts_total")
    result.restarts_charged = int(restarts) if restarts is not None else None
    for proc in cl.masters:
        if proc is not None and proc.alive():
            os.kill(proc.pid, signal.SIGTERM)
            proc.reap(30.0)

    # -- accounting ------------------------------------------------------------------------------------
    logs = chk.read_logs(cl.step_log)
    done = [int(s) for s in re.findall(r"^(?:\[rank0\]:)?done step=(\d+)$", cl.rank0_output(), re.M)]
    final_step = max(done, default=0)
    lin = chk.lineage(logs, final_step, NUM_SAMPLES, BATCH)
    result.kept_steps = final_step
    result.samples_exactly_once = lin.samples_exactly_once and final_step == last
    result.problems += lin.problems
    result.steps_lost, result.redone_steps = lin.steps_lost, lin.redone_steps
    first_fault = t0 + (plan[0].at if plan else args.duration)
    step_s = chk.step_time(logs, full_world, first_fault)
    result.fault_free_step_s = step_s
    result.wall_s = round(finished - started, 3)
    timeline = chk.rank0_timeline(logs)
    result.degraded_world_s = round(chk.degraded_s(timeline, full_world), 3)
    if step_s:
        good = final_step * step_s
        result.goodput = round(good / result.wall_s, 4)
        below = sum(b - a for a, b in inj.below_min)
        phases = chk.read_phases(cl.event_logs())
        result.badput_s = chk.badput(result.wall_s, good, phases, lin.redone_steps * step_s, below)
    by_kind: dict[str, list[float]] = {}
    starts = sorted({rec["t"] for rec in result.injected})
    for rec in result.injected:
        result.faults += 1
        result.faults_by_kind[rec["kind"]] = result.faults_by_kind.get(rec["kind"], 0) + 1
        until = next((t0 + t for t in starts if t > rec["t"]), fault_end)
        seconds = chk.recovery_s(timeline, t0 + rec["t"], until)
        if seconds is None:
            result.unrecovered += 1
        else:
            by_kind.setdefault(rec["kind"], []).append(seconds)
    result.recovery_s = {
        k: {"p50": round(statistics.median(v), 3), "p99": round(c.nearest_rank(v, 99) or 0.0, 3), "n": len(v)}
        for k, v in sorted(by_kind.items())
    }
    result.weights_equal = (
        weights_equal(cl.folder / "final.pt", reference_weights(cl.folder / "reference", final_step, 300.0))
        if final_step
        else False
    )

    # -- leaks: after every process of the job ended ---------------------------------------------------
    cl.group.track()
    for node in cl.nodes.values():
        if node.ended == "killed":
            node.proc.kill()  # a lost machine's processes are gone with it
    # Every process this run started carries its tag (orphans whose parent died included).
    for orphan in c.tagged_processes():
        with contextlib.suppress(psutil.Error):
            result.leaks.append(f"process {orphan.pid} ({' '.join(orphan.cmdline()[:3])})")
    result.leaks += [f"shm {s}" for s in shm_entries(cl.job)]
    for node in cl.nodes.values():
        if node.ended != "killed":
            for path in node.tmp.rglob("*"):
                if _stack_dump(path, node.tmp):
                    result.kept_stack_dumps += path.is_file()
                elif not _torch_cache(path):
                    result.leaks.append(f"temp {path}")
    result.leaked = len(result.leaks)
    # The final check (the run fails when any part fails); the targets are reported beside it.
    result.passed = (
        result.exit_ok and result.samples_exactly_once and result.weights_equal and not result.leaked
    )
    result.targets = {
        "faults >= 120": result.faults >= 120,
        "0 unrecovered": result.unrecovered == 0,
        "0 steps lost": result.steps_lost == 0,
        f"goodput >= {GOODPUT_TARGET[result.mode]}": (result.goodput or 0.0) >= GOODPUT_TARGET[result.mode],
        # The master's own figure (a different observer: the nodes' reports, not the step logs) within 2
        # points of the harness's; a target beside the final check, not part of it.
        "master's goodput within 0.02": result.goodput is not None
        and result.master_goodput_ratio is not None
        and abs(result.goodput - result.master_goodput_ratio) <= 0.02,
    }
    return result


def report(r: Result) -> str:
    rows = [[k, n, r.recovery_s.get(k, {}).get("p50", "n/a"), r.recovery_s.get(k, {}).get("p99", "n/a")]
            for k, n in sorted(r.faults_by_kind.items())]  # fmt: skip
    lines = [
        f"mode {r.mode}, seed {r.seed}, {r.duration_s:g} s of faults every {r.interval_s:g} s, "
        f"{r.nproc_per_node} worker(s) per node",
        "",
        c.table(["kind", "faults", "recovery p50 (s)", "recovery p99 (s)"], rows),
        "",
        f"goodput {r.goodput} (kept {r.kept_steps} steps x {r.fault_free_step_s} s / wall {r.wall_s} s); "
        f"master's elastic_goodput_ratio {r.master_goodput_ratio}; degraded world {r.degraded_world_s} s",
        "badput (s): " + ", ".join(f"{k} {v}" for k, v in r.badput_s.items()),
        "master's badput (s): " + ", ".join(f"{k} {v}" for k, v in r.master_badput_s.items()),
        f"faults {r.faults}, unrecovered {r.unrecovered}, steps lost {r.steps_lost}, "
        f"redone {r.redone_steps}, restarts charged {r.restarts_charged}",
        f"final check: exit 0 {r.exit_ok}, samples exactly once {r.samples_exactly_once}, weights equal "
        f"{r.weights_equal}, leaked {r.leaked} -> {'PASSED' if r.passed else 'FAILED'} "
        f"({r.kept_stack_dumps} stack dump file(s) kept by the agents for the operator)",
        "targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in r.targets.items()),
    ]
    if r.excluded:
        named = "; ".join(f"{e['node']} at t={e['t']:.0f}s ({e['why']})" for e in r.excluded)
        lines += ["", f"excluded by the master (agent exit 4, a replacement started): {named}"]
    if r.problems or r.leaks:
        lines += ["", "problems: " + "; ".join(r.problems + r.leaks)[:3000]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("inprocess", "restart"), default="inprocess")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of faults (default %(default)s)")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between injections")
    p.add_argument("--seed", type=int, default=None, help="default: int(HEAD's sha[:8], 16)")
    p.add_argument("--nproc-per-node", type=int, default=1, choices=(1, 2))
    p.add_argument("--step-time", type=float, default=0.2, help="extra seconds per training step")
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        help="the agents' --hang-timeout (default: theirs, the adaptive bound; the runs before 2026-11-28 "
        "evening used 5)",
    )
    p.add_argument(
        "--kinds",
        default=",".join(sch.CHEAP_KINDS + sch.ROOT_KINDS),
        help="comma-separated fault kinds, or 'cheap' for all but partition (default: all; partition needs "
        "root)",
    )
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    c.add_json_option(p)
    args = p.parse_args(argv)
    if args.kinds == "cheap":
        args.kinds = ",".join(sch.CHEAP_KINDS)
    unknown = set(args.kinds.split(",")) - set(sch.CHEAP_KINDS) - set(sch.ROOT_KINDS)
    if unknown:
        p.error(f"unknown fault kind(s): {', '.join(sorted(unknown))}")
    if "partition" in args.kinds.split(",") and not nft_usable():
        print(
            "chaos: the partition kind needs root and a usable nft (it adds a drop rule per cut-off node); "
            "run as root or leave it out with --kinds",
            file=sys.stderr,
        )
        return 2
    if args.seed is None:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=c.REPO, capture_output=True, text=True).stdout
        args.seed = int(sha[:8], 16) if sha.strip() else 0
    # A SIGTERM (a test's timeout, a CI cancel) unwinds like Ctrl-C: the run's processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with c.workdir(args.workdir) as folder:
        result = run(args, folder)
    c.emit_report(argparse.Namespace(markdown_out=None), "Chaos", report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=1) + "\n")
    return c.finish(0 if result.passed else 1)


if __name__ == "__main__":
    sys.exit(main())
