"""The agent's health duties, as the executor (agent.executor.loop) performs them: hang checks with stack
dumps, and the node-check process. What follows from them (report, rejoin, exit) is decided by
agent.machine.decisions.

Hangs (see :mod:`agent.observe.hang`): every :data:`HANG_CHECK_S` the hang-watch thread
(:class:`HangWatchThread`) asks :class:`HangMonitor` about the running workers; a hung one becomes a
``HangSeen`` event (once per worker generation). Reporting it,
:func:`hang_failure` records the hung workers' Python stacks (:mod:`agent.observe.stackdump`) and names the
root cause; the master counts it as a failure (kind ``hang``) and opens a new round, like a crash.

Node check (see :mod:`master.job.node_check`): an assignment with ``check=True`` makes the node run
``python -m elastic.node_check`` as its single worker (:func:`check_spec`), with the world being the nodes
(RANK = node rank). The agent reports the figures (:func:`read_check_result`) in a heartbeat and waits for
the master's verdict: ``rejoin`` (the training round follows), ``exclude`` (this node leaves the job: the
agent exits 1 with the reason) or ``stop`` (the job is over).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from pydantic import ValidationError

from agent.executor.node_view import NodeView
from agent.machine.decisions import CHECK_PG_TIMEOUT_S
from agent.machine.events import AgentEvent, HangLike, HangSeen
from agent.observe.channel import ProgressChannel
from agent.observe.hang import Hang, HangWatch
from agent.observe.stackdump import StackDump, dump_stacks, stack_file_path
from agent.settings import AgentSettings
from agent.workers.environment import worker_envs
from agent.workers.group import FailureInfo, WorkerExit, WorkerGroup, WorkerSpec
from elastic import contract
from elastic.control.protocol import Assignment, JobInfo, NodeCheckResult, NodeCheckStage, NodeState
from elastic.node_check import RESULT_ENV, TIMEOUT_ENV
from elastic.report import STACK_FILE_ENV

log = logging.getLogger(__name__)

#: Lines of each stack dump copied into the agent's log (the file has all of it).
STACK_LOG_LINES = 60
#: Seconds a worker may take to exit after it said its training is over (elastic.report.report_done, sent
#: by elastic.destroy_process_group). torch 2.13's gloo can deadlock in the process group's destructor (the
#: main thread joins gloo's threads holding the GIL, a gloo thread waits for the GIL to free a finished
#: work), so such a worker would never exit and its job never end; its training is over, so it is stopped
#: and counts as succeeded. Generous: a normal teardown takes well under a second.
DONE_EXIT_GRACE_S = 30.0
#: Seconds between two hang checks of the running workers. A verdict comes at most this long after its
#: bound expired (the bound itself is 2 s at least): checked at each heartbeat instead, a hang was declared
#: up to a whole heartbeat interval (1 s) late, half a second on average, for every hung or stopped worker
#: and, through the survivors' stall, for every node that vanished. A check reads the progress channel and
#: each live worker's process state (/proc), some tens of microseconds per worker.
HANG_CHECK_S = 0.1


def warn_on_node_check_setting(settings: AgentSettings, info: JobInfo) -> None:
    """``--node-check`` is the master's setting: warn when this agent asks for another one."""
    want = settings.job.node_check
    if want != "off" and info.node_check != want:
        log.warning(
            "--node-check %s is a setting of the job master; the master of job %s runs with "
            "--node-check %s (pass it to elastic-master)",
            want,
            info.job_id,
            info.node_check,
        )


def stack_root(settings: AgentSettings, group: WorkerGroup) -> Path:
    """The folder under which each attempt's workers write their stack dumps."""
    return settings.log_dir or group.error_dir


def add_stack_files(envs: list[dict[str, str]], root: Path, assignment: Assignment) -> None:
    """Name each worker's faulthandler dump file (``ELASTIC_STACK_FILE``) next to its logs."""
    attempt = f"round{assignment.round}"
    for local_rank, env in enumerate(envs):
        env[STACK_FILE_ENV] = str(stack_file_path(root, attempt, assignment.rank_offset + local_rank))


class HangMonitor:
    """Hang checks of the running workers, every :data:`HANG_CHECK_S` (the hang-watch thread only)."""

    def __init__(
        self,
        timeout_s: float | None,
        group: WorkerGroup,
        channel: ProgressChannel,
        done_exit_grace_s: float = DONE_EXIT_GRACE_S,
    ) -> None:
        self.timeout_s = timeout_s  # --hang-timeout; 0: no verdicts; None: the adaptive bound
        self.done_exit_grace_s = done_exit_grace_s
        self.group = group
        self.channel = channel
        self._watch: HangWatch | None = None
        self._generation = -1  # the worker generation that _watch observes
        self._reported = -1  # the worker generation whose hang was reported already
        self._done_since: dict[int, float] = {}  # pid -> when it was first seen done (report_done) and alive
        #: pids of workers stopped after their training was over (:data:`DONE_EXIT_GRACE_S`): their exit is a
        #: success (read by the exit relay, another thread: a set's membership test is atomic).
        self.finished_pids: set[int] = set()

    def check(self, generation: int) -> list[Hang]:
        """The hung workers of ``generation`` (running now); empty once they were reported. Also stops a
        worker whose training is over but which does not exit (:data:`DONE_EXIT_GRACE_S`)."""
        self._stop_finished_workers(time.monotonic())
        if self.timeout_s == 0 or self._reported == generation:
            return []
        if self._watch is None or self._generation != generation:
            self._watch, self._generation = HangWatch(self.timeout_s), generation
        pids = self.group.pids
        live = {r: pids[r] for r in self.group.running() if r < len(pids)}
        hangs = self._watch.check(time.monotonic(), self.channel.snapshot(), live)
        if hangs:
            self._reported = generation
        return hangs

    def _stop_finished_workers(self, now: float) -> None:
        pids = self.group.pids
        progress = self.channel.snapshot()
        live = {r: pids[r] for r in self.group.running() if r < len(pids)}
        done = {r: pid for r, pid in live.items() if (p := progress.get(r)) is not None and p.done}
        self._done_since = {pid: self._done_since.get(pid, now) for pid in done.values()}
        for local_rank, pid in done.items():
            if now - self._done_since[pid] < self.done_exit_grace_s or pid in self.finished_pids:
                continue
            self.finished_pids.add(pid)
            log.warning(
                "local rank %d (pid %d) said its training is over %.0f s ago but has not exited (a teardown "
                "that never ends, e.g. torch's gloo process group destructor): stopping it; it counts as "
                "succeeded",
                local_rank,
                pid,
                now - self._done_since[pid],
            )
            if self.group.kill_worker(local_rank) is None:
                self.finished_pids.discard(pid)  # it exited meanwhile, by itself


class HangWatchThread:
    """Checks the running workers for hangs every ``interval_s`` until ``closing`` is set (thread
    ``hang-watch``); a hang is posted as a :class:`HangSeen` of the worker generation it was found in.

    Apart from the heartbeat thread so that a verdict waits for no heartbeat (nor for a master that does
    not answer one): a node that cannot reach its master still names its hung workers on time."""

    def __init__(
        self,
        monitor: HangMonitor,
        view: Callable[[], NodeView],
        post: Callable[[AgentEvent], None],
        generation: Callable[[], int],
        closing: threading.Event,
        interval_s: float = HANG_CHECK_S,
    ) -> None:
        self.monitor = monitor
        self._view = view
        self._post = post
        self._generation = generation
        self._closing = closing
        self.interval_s = interval_s

    def start(self) -> None:
        threading.Thread(target=self.run, name="hang-watch", daemon=True).start()

    def run(self) -> None:
        """Check until the agent closes (the thread's body)."""
        while not self._closing.wait(self.interval_s):
            self.check_once()

    def check_once(self) -> None:
        """One check: post the hung workers of the current generation, if any (only while training)."""
        generation = self._generation()  # read first: a newer generation's machine ignores this verdict
        if self._view().state is not NodeState.RUNNING:
            return
        hangs = self.monitor.check(generation)
        if hangs:
            self._post(HangSeen(tuple(hangs), generation=generation))


def hang_failure(
    hangs: tuple[HangLike, ...], pids: list[int], assignment: Assignment, root: Path
) -> FailureInfo:
    """Log the hung workers, record their Python stacks, and name the first one as the root cause."""
    offset = assignment.rank_offset
    for hang in hangs:
        log.warning(
            "rank %d (local rank %d, pid %d) is hung: %s",
            offset + hang.local_rank,
            hang.local_rank,
            pids[hang.local_rank],
            hang.reason,
        )
    dumps = record_stacks([h.local_rank for h in hangs], pids, assignment, root, f"round{assignment.round}")
    first, dump = hangs[0], dumps[0]
    message = first.reason + (f"; Python stack in {dump.path}" if dump.path else "")
    return FailureInfo(
        local_rank=first.local_rank,
        global_rank=offset + first.local_rank,
        exit_code=None,
        signal=None,
        message=message,
    )


def continue_stopped(
    local_ranks: tuple[int, ...], pids: list[int], assignment: Assignment, root: Path, attempt: str
) -> list[int]:
    """Record the Python stacks of those of ``local_ranks`` whose process is stopped (SIGSTOP, job control;
    not a tracer's stop) and continue them (SIGCONT); the local ranks found stopped.

    Called as the node leaves a round in process: a stopped worker cannot leave its step, so the round
    would wait out ``--stop-grace`` and restart the node's processes. Its own node names a stopped worker
    hung and records its stack (continuing it) when it sees the stop first; when a peer's stall was
    reported first, this is where the same happens."""
    stopped = []
    for local_rank in local_ranks:
        try:
            if psutil.Process(pids[local_rank]).status() == psutil.STATUS_STOPPED:
                stopped.append(local_rank)
        except (psutil.Error, IndexError):
            continue  # gone: its exit is reported on its own
    if stopped:
        offset = assignment.rank_offset
        for r in stopped:
            log.warning(
                "rank %d (local rank %d, pid %d) is stopped as the round changes; recording its stack and "
                "continuing it (SIGCONT), so that it leaves its step with the others",
                offset + r,
                r,
                pids[r],
            )
        record_stacks(stopped, pids, assignment, root, attempt)
        for r in stopped:  # a faulthandler dump continued it already; a py-spy dump did not
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[r], signal.SIGCONT)
    return stopped


def record_stacks(
    local_ranks: list[int], pids: list[int], assignment: Assignment, root: Path, attempt: str
) -> list[StackDump]:
    """Record the Python stacks of ``local_ranks`` under ``root/attempt`` and log them (the first lines)."""
    offset = assignment.rank_offset
    targets = [(pids[r], offset + r, stack_file_path(root, attempt, offset + r)) for r in local_ranks]
    dumps = dump_stacks(targets)
    for dump in dumps:
        if dump.path is None:
            log.warning("rank %d: no Python stack recorded: %s", dump.global_rank, dump.error)
            continue
        lines = dump.text.rstrip().splitlines()
        shown = "\n".join(f"    {line}" for line in lines[:STACK_LOG_LINES])
        more = (
            f"\n    ... ({len(lines) - STACK_LOG_LINES} more lines)" if len(lines) > STACK_LOG_LINES else ""
        )
        log.warning(
            "rank %d: Python stack (%s) saved to %s:\n%s%s",
            dump.global_rank,
            dump.how,
            dump.path,
            shown,
            more,
        )
    return dumps


def check_result_file(group: WorkerGroup, assignment: Assignment) -> Path:
    """Where the node-check process of ``assignment`` writes its figures (emptied for this attempt)."""
    result_file = group.error_dir / f"round{assignment.round}-check" / "node-check.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    return result_file


def check_spec(settings: AgentSettings, assignment: Assignment, result_file: Path) -> WorkerSpec:
    """The node-check process: one worker per node, the world being the nodes (RANK = node rank)."""
    nodes = assignment.model_copy(
        update={"rank_offset": assignment.node_rank, "world_size": assignment.nnodes}
    )
    extra = {
        contract.NODE_ID: settings.node_id,
        RESULT_ENV: str(result_file),
        TIMEOUT_ENV: f"{CHECK_PG_TIMEOUT_S:g}",
    }
    envs = worker_envs(os.environ, nodes, 1, run_id=settings.job.job_id, role=settings.role, extra=extra)
    return WorkerSpec(
        argv=[sys.executable, "-u", "-m", "elastic.node_check"],
        envs=envs,
        global_ranks=[assignment.node_rank],
        log_dir=settings.log_dir,
        attempt=result_file.parent.name,
        cwd=settings.cwd,
    )


def read_check_result(path: Path, exit_: WorkerExit, group: WorkerGroup) -> NodeCheckResult:
    """The figures the check process wrote, or a ``crash`` result with its root cause."""
    try:
        data = json.loads(path.read_text())
        fields = NodeCheckResult.model_fields
        return NodeCheckResult(**{k: v for k, v in data.items() if k in fields})
    except (OSError, ValueError, TypeError, ValidationError):
        info = group.failure_info(exit_)
        return NodeCheckResult(ok=False, stage=NodeCheckStage.CRASH, error=info.message[-2000:])
