"""The agent's executor: it turns what happens into events for the machine (agent.machine.decisions) and
performs the actions the machine returns. It owns every thread, process and call; it decides nothing.

Threads only produce events; the main thread consumes them from one queue, hands each to the machine and
performs the actions in order:

* rendezvous waiter and watcher (agent.executor.master_link) — long-poll the master for this node's next
  assignment, and so that a new round is learnt at once, not at the next heartbeat;
* heartbeat (agent.executor.heartbeats) — reports the node's state every interval, relays a non-``continue``
  command, checks for hangs;
* exit relay — forwards worker exits the moment the worker group sees them;
* signal handlers (:class:`SignalRouter`) — shutdown signals and the pre-emption signal become events;
  others are forwarded to the workers.

Pre-emption (``--preempt-signal``, SIGUSR1 by default: SLURM's warning before a time limit or a
pre-emption) stops the job on this node as SIGTERM does (workers stopped, the master told that the node
leaves; the checkpoint keeper then persists the newest flash step as it stops), but :meth:`ElasticAgent.run`
returns 1, retryable, instead of 128+N: the batch script requeues the job on 1 and the requeued job
resumes from that step. Before each join, an agent under SLURM asks ``sinfo`` for its node's state
(agent.executor.slurm_state) and, when SLURM drains it or declared it down or failed, leaves the job and
exits 4 instead of joining.

An action that is a call the machine waits for (join, a report, a serve watch, the in-process probe and
pause wait) is answered by feeding its reply, or its failure, to the machine before any queued event.
:data:`PERFORMERS` names the method that performs each action. The executor also builds each round's worker
environment (:func:`training_spec`) and words a worker's failure for the heartbeat (:func:`worker_failure`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any, cast

from agent.checkpoints.keeper import CheckpointKeeper
from agent.errors import AgentError
from agent.executor import health
from agent.executor.heartbeats import HeartbeatThread, heartbeat_request
from agent.executor.inprocess import InProcessHub, InProcessSteps
from agent.executor.master_link import LONG_POLL_S, CallFailed, MasterLink
from agent.executor.net import free_port
from agent.executor.node_view import NodeView
from agent.executor.slurm_state import SlurmNodeState
from agent.executor.tls_trouble import TLSTrouble
from agent.machine import events as ev
from agent.machine.decisions import CHECK_TIMEOUT_S, AgentMachine, MachineConfig
from agent.observe.channel import ProgressChannel, RankProgress
from agent.observe.events import event_log_for
from agent.observe.progress import ProgressReporter, sample_agent
from agent.settings import AgentSettings, SignalPlan
from agent.workers.environment import worker_envs
from agent.workers.errors_file import exception_type, known_error
from agent.workers.group import FailureInfo, WorkerExit, WorkerGroup, WorkerGroupError, WorkerSpec
from elastic import contract
from elastic.control.client import MasterClient, MasterError
from elastic.control.protocol import (
    Assignment,
    FailureKind,
    FailurePhase,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    NodeCheckResult,
    NodeCheckStage,
    NodeState,
    WorkerFailure,
    describe_figures,
)
from elastic.exit_codes import ExitCode, for_signal
from elastic.text import ALWAYS_SHOWN

log = logging.getLogger(__name__)

__all__ = ["LONG_POLL_S", "PERFORMERS", "ElasticAgent", "SignalRouter"]


def _exit_of(record: object) -> WorkerExit:
    """An action's exit record: the machine hands back, unread, the :class:`WorkerExit` this loop put into
    the ``WorkerExited`` event it decided on (agent.machine.events keeps it opaque)."""
    return cast(WorkerExit, record)


class ElasticAgent:
    """Runs this node's share of one job until the job ends; :meth:`run` returns the exit code."""

    def __init__(
        self,
        settings: AgentSettings,
        client: MasterClient,
        group: WorkerGroup,
        channel: ProgressChannel,
        worker_env: dict[str, str] | None = None,
        keeper: CheckpointKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.group = group
        self.channel = channel
        self.keeper = keeper  # the node's checkpoint memory: swept after each stop, reported in heartbeats
        self.worker_env = dict(worker_env or {})  # added to every worker's environment (ELASTIC_SHM_DIR)
        # One queue for every thread's events; its put() is safe in signal handlers.
        self.events: queue.SimpleQueue[ev.AgentEvent] = queue.SimpleQueue()
        # Workers run by elastic.inprocess.run connect here: they keep their processes across rounds.
        hub = InProcessHub(channel.folder, self._on_broken)
        self.worker_env[contract.INPROCESS_SOCKET] = hub.path
        self.machine = AgentMachine(
            MachineConfig(
                nproc=settings.nproc,
                master_timeout_s=settings.master_timeout_s,
                stop_grace_s=settings.stop_grace_s,
                hosts_master=settings.host_master_at is not None,
                ckpt_reset=settings.ckpt_reset,
            )
        )
        self.view = NodeView()  # what the heartbeats report; replaced whole by the main thread only
        self._closing = threading.Event()
        self.failure_summary: str | None = None  # the job's root-cause summary when it failed
        self.host = settings.local_addr or "127.0.0.1"
        self.event_log = event_log_for(settings.event_log_handler, settings.node_id)
        self.inprocess = InProcessSteps(hub, group, self.event_log)
        self.tls_trouble = TLSTrouble(self.event_log)  # a master's certificate that stopped verifying
        self.link = MasterLink(
            settings, client, self.tls_trouble, self.events.put, self._generation, self._closing
        )
        #: Per-address limit of one heartbeat call: a third of the master's heartbeat timeout, so that
        #: after a failover a node whose last master hangs (rather than refusing connections) still
        #: reaches the new leader well within its grace period (one heartbeat timeout).
        self.heartbeat_call_timeout = settings.job.heartbeat_timeout_s / 3
        self.hangs = health.HangMonitor(settings.hang_timeout_s, group, channel)
        self.assignment: Assignment | None = None  # the newest round this node trains in
        self.progress = ProgressReporter(settings.progress_interval_s, lambda: sample_agent(self), log.info)
        self._check_timer: threading.Timer | None = None
        self._check_file = Path()  # where the running node check writes its figures
        #: The line of a restart the master announced, when its round replies say nothing about it.
        self._restart_plain: str | None = None
        #: The pre-emption signal once received (--preempt-signal): the exit is then 1, not 128+N.
        self.preempted: int | None = None
        #: SLURM's state of this node, read before each join (None: not under SLURM).
        self.slurm = SlurmNodeState(settings.slurm_node) if settings.slurm_node else None
        self._slurm_warning: str | None = None  # the last "cannot tell" of that check, logged when it changes

    # -- entry point ---------------------------------------------------------------------------------
    def run(self) -> int:
        self._check_job_settings()
        plan, preempt = self.settings.signals, self.settings.preempt_signal
        with SignalRouter(plan, self._on_signal, self._forward_signal, preempt):
            try:
                code = self._drive()
                if self.preempted is not None and code == for_signal(self.preempted):
                    log.warning(
                        "pre-empted (%s): workers stopped, the newest checkpoint is persisted before exit; "
                        "exiting %d (retryable) so that the job is requeued",
                        signal.Signals(self.preempted).name,
                        ExitCode.FAILED,
                        extra=ALWAYS_SHOWN,
                    )
                    return int(ExitCode.FAILED)
                return code
            finally:
                self.progress.stop()
                self._closing.set()
                self.machine.generation += 1  # every thread's events are stale from now on
                self._cancel_check_timer()
                self.group.stop(self.settings.stop_grace_s)
                self.inprocess.hub.close()

    def _generation(self) -> int:
        return self.machine.generation

    def _check_job_settings(self) -> None:
        info = self.link.check_job()
        self.heartbeat_call_timeout = info.heartbeat_timeout_s / 3
        health.warn_on_node_check_setting(self.settings, info)

    def _drive(self) -> int:
        """Feed events to the machine and perform its actions until one of them is an exit."""
        replies: deque[ev.AgentEvent] = deque([ev.Started(self.group.launcher_warm_up_left_s())])
        while True:
            event = replies.popleft() if replies else self.events.get()
            for action in self.machine.handle(event, time.monotonic()):
                if isinstance(action, ev.Exit):
                    if action.error is not None:
                        raise AgentError(action.error, action.code)
                    return action.code
                reply = PERFORMERS[type(action)](self, action)
                if reply is not None:
                    replies.append(reply)

    # -- actions -------------------------------------------------------------------------------------
    def _ignored(self, action: ev.Ignored) -> None:
        log.debug("ignored: %s", action.why)

    def _note(self, action: ev.Note) -> None:
        log.log(action.level, "%s", action.text)

    def _start_heartbeats(self, action: ev.StartHeartbeats) -> None:
        HeartbeatThread(
            self.link,
            self._heartbeat_request,
            lambda: self.view,
            self.keeper,
            self.events.put,
            self._generation,
            self.heartbeat_call_timeout,
        ).start()
        health.HangWatchThread(
            self.hangs, lambda: self.view, self.events.put, self._generation, self._closing
        ).start()
        self.progress.start()  # the progress line every --progress-interval (agent.observe.progress)

    def _await_launcher(self, action: ev.AwaitLauncher) -> None:
        def wait() -> None:
            # If it is still not ready then, the group says so and execs the workers.
            self.group.wait_launcher(action.timeout_s)
            self.events.put(ev.LauncherReady(generation=action.generation))

        threading.Thread(target=wait, name="warm-wait", daemon=True).start()

    def _join(self, action: ev.Join) -> ev.AgentEvent:
        self.view = NodeView()
        refused = self._slurm_refusal()
        if refused is not None:
            return refused
        req = JoinRequest(
            node_id=self.settings.node_id,
            host=self.host,
            nproc=self.settings.nproc,
            store_port=free_port(self.host, self.settings.store_ports),
            min_nodes=self.settings.job.min_nodes,
            max_nodes=self.settings.job.max_nodes,
            # Sent only when true: a master of the previous release, which lacks the field, takes the rest.
            **({"default_id": True} if self.settings.node_id_is_default else {}),
        )
        try:
            joined = self.link.call(lambda: self.client.join(req), "join")
        except CallFailed as failed:
            return failed.event
        return ev.Joined(joined.round, joined.master_id)

    def _await_round(self, action: ev.AwaitRound) -> None:
        # A node that ran workers says why it restarts them at the first reply (master_link.RoundWaitLines).
        plain, self._restart_plain = self._restart_plain, None
        self.link.start_round_wait(action.generation, action.after, self.assignment is not None, plain)

    def _start_workers(self, action: ev.StartWorkers) -> None:
        assignment, s = action.assignment, self.settings
        log.info("%s", round_line(assignment, s.nproc))
        self.assignment = assignment
        if self.keeper is not None:  # the fence orders this submission's persists after earlier ones'
            self.keeper.incarnation = assignment.job_incarnation
        root = health.stack_root(s, self.group)
        spec = training_spec(s, assignment, self.channel.path, self.worker_env, action.reset_ckpt, root)
        carried = self.inprocess.keepable(action.keep)  # kept workers keep their hang bound's step times
        self.channel.reset(s.nproc, carried)
        pids, kept, started_at = self.inprocess.start(
            spec, assignment.round, self._exit_relay(action.generation), keep=action.keep
        )
        self.channel.forget_durations(set(carried) - set(kept))
        restart, ranks = assignment.restart_count, spec.global_ranks
        self.event_log.record(
            "workers_started", round=assignment.round, ranks=ranks, pids=pids, restart=restart, kept=kept
        )
        self.view = NodeView(
            state=NodeState.RUNNING, round=assignment.round, pids=pids, started_at=started_at
        )
        self.link.start_watch(action.generation, assignment.round)

    def _start_check(self, action: ev.StartCheck) -> ev.AgentEvent | None:
        assignment, generation = action.assignment, action.generation
        log.info(
            "round %d: node check (node rank %d of %d)",
            assignment.round,
            assignment.node_rank,
            assignment.nnodes,
        )
        self._check_file = health.check_result_file(self.group, assignment)
        self.channel.reset(1)
        setup_failed: ev.CheckDone | None = None
        try:
            self.group.start(
                health.check_spec(self.settings, assignment, self._check_file),
                on_exit=self._exit_relay(generation),
            )
        except WorkerGroupError as exc:
            failed = NodeCheckResult(ok=False, stage=NodeCheckStage.SETUP, error=str(exc)[-2000:])
            setup_failed = ev.CheckDone(failed)
        self.view = NodeView(state=NodeState.RUNNING, round=assignment.round, pids=list(self.group.pids))
        self.link.start_watch(generation, assignment.round)
        self._check_timer = threading.Timer(
            CHECK_TIMEOUT_S, lambda: self.events.put(ev.CheckTimeout(generation))
        )
        self._check_timer.daemon = True
        self._check_timer.start()
        return setup_failed

    def _stop_workers(self, action: ev.StopWorkers) -> None:
        # The machine began a new generation: exits caused by the stop are not failures.
        self._cancel_check_timer()
        self.view = NodeView(state=NodeState.WAITING)
        running = self.group.running()
        self.inprocess.stopped()
        self.group.stop(self.settings.stop_grace_s)
        if self.keeper is not None:
            # A worker killed mid-save left a checkpoint-sized temp file; no worker writes now.
            self.keeper.sweep(workers_stopped=True)
        if running:
            self.event_log.record("workers_stopped", local_ranks=running)

    def _probe_workers(self, action: ev.ProbeWorkers) -> ev.AgentEvent:
        local_ranks, can_leave, failed = self.inprocess.probe()
        return ev.WorkersProbed(local_ranks, can_leave, failed)

    def _pause_workers(self, action: ev.PauseWorkers) -> None:
        # The machine began a new generation: exits of paused workers are not failures of the next round.
        self.view = NodeView(state=NodeState.WAITING)
        self.inprocess.pause(action.local_ranks, action.round)  # they leave their step while the node joins
        if self.assignment is not None:
            # A stopped worker cannot leave its step (a peer's stall named the hang before this node saw
            # the stop): its stack is recorded, it is continued (SIGCONT), and it leaves in process.
            root = health.stack_root(self.settings, self.group)
            attempt = f"round{action.round}-stopped"
            stopped = health.continue_stopped(
                action.local_ranks, self.group.pids, self.assignment, root, attempt
            )
            if stopped:
                self.event_log.record("stopped_workers_continued", round=action.round, local_ranks=stopped)

    def _await_paused(self, action: ev.AwaitPaused) -> ev.AgentEvent:
        return ev.PauseSettled(self.inprocess.await_paused(action.timeout_s))

    def _fall_back(self, action: ev.FallBack) -> None:
        stacks: list[str] = []
        if action.stuck and self.assignment is not None:
            # Why a worker could not leave its step is in its stack: record it before it is stopped.
            root = health.stack_root(self.settings, self.group)
            attempt = f"round{action.round}-stuck"
            dumps = health.record_stacks(list(action.stuck), self.group.pids, self.assignment, root, attempt)
            stacks = [str(d.path) for d in dumps if d.path is not None]
        self.inprocess.fall_back(action.round, action.reason, stacks)

    def _stop_check(self, action: ev.StopCheck) -> None:
        self._cancel_check_timer()
        self.group.stop(self.settings.stop_grace_s)

    def _collect_check_result(self, action: ev.CollectCheckResult) -> ev.AgentEvent:
        return ev.CheckDone(health.read_check_result(self._check_file, _exit_of(action.exit), self.group))

    def _report_crash(self, action: ev.ReportCrash) -> ev.AgentEvent:
        return self._report_failure(
            action.round, self.group.failure_info(_exit_of(action.exit)), FailureKind.CRASH, action.seen_at
        )

    def _report_broken(self, action: ev.ReportBroken) -> ev.AgentEvent:
        info, seen_at = self.inprocess.broken_cause(
            self.assignment, action.local_rank, action.message, action.seen_at
        )
        return self._report_failure(action.round, info, FailureKind.CRASH, seen_at)

    def _on_broken(self, local_rank: int, pid: int, message: str) -> None:  # hub thread; the machine decides
        self.events.put(ev.CollectiveBroken(local_rank, message, time.monotonic(), self.machine.generation))

    def _report_hang(self, action: ev.ReportHang) -> ev.AgentEvent:
        root = health.stack_root(self.settings, self.group)
        info = health.hang_failure(action.hangs, self.group.pids, action.assignment, root)
        return self._report_failure(action.assignment.round, info, FailureKind.HANG, action.seen_at)

    def _report_success(self, action: ev.ReportSuccess) -> ev.AgentEvent:
        self.view = NodeView(state=NodeState.SUCCEEDED, round=action.round)
        return self._heartbeat_now("success report")

    def _report_check(self, action: ev.ReportCheck) -> ev.AgentEvent:
        result = action.result
        outcome = "passed" if result.ok else f"failed at {result.stage}: {result.error}"
        log.info("node check %s; %s (the master judges all nodes)", outcome, describe_figures(result))
        self.view = NodeView(state=NodeState.RUNNING, round=action.round, node_check=result)
        return self._heartbeat_now("node-check report")

    def _serve(self, action: ev.Serve) -> ev.AgentEvent:
        try:
            reply = self.link.call(
                lambda: self.client.watch(self.settings.node_id, action.round, LONG_POLL_S), "watch"
            )
        except CallFailed as failed:
            return failed.event
        return ev.MasterReplied(reply)

    def _record_restart(self, action: ev.RecordRestart) -> None:
        # Said once the node waits for the round: the master's reply then says why it opened (one line).
        self._restart_plain = f"master opened round {action.round}; restarting workers"
        self.event_log.record("restart", round=action.round)

    def _leave(self, action: ev.Leave) -> None:
        name = signal.Signals(action.signum).name
        preempted = action.signum == self.preempted
        self.event_log.record("node_left", signal=name, **({"preempted": True} if preempted else {}))
        reason = f"agent received {name}"
        if preempted:
            reason += " (pre-emption: it persists its newest checkpoint and exits 1 to be requeued)"
        try:
            self.link.leave(
                lambda: self.client.leave(LeaveRequest(node_id=self.settings.node_id, reason=reason))
            )
        except MasterError as exc:
            log.info("could not tell the master that this node leaves: %s", exc)

    def _finish(self, action: ev.Finish) -> None:
        outcome = action.outcome
        succeeded, code = (True, 0) if outcome is None else (outcome.succeeded, outcome.exit_code)
        self.event_log.record("job_finished", succeeded=succeeded, exit_code=code)
        if outcome is None:
            return
        if outcome.succeeded:
            log.info("job succeeded", extra=ALWAYS_SHOWN)  # --quiet keeps it: the run's last word
        else:
            # Printed by the CLI after every resource is released, so it is the last line a user sees.
            self.failure_summary = outcome.summary

    def _excluded(self, action: ev.Excluded) -> None:
        print(f"elastic-run: {action.summary}", file=sys.stderr, flush=True)

    # -- helpers -------------------------------------------------------------------------------------
    def _slurm_refusal(self) -> ev.AgentEvent | None:
        """Before a join: a refusal (exit 4) when SLURM drains this node or declared it down or failed, after
        telling the master that the node leaves (an event there: ``node_left`` with the reason). The
        check fails open: when sinfo cannot tell, the node joins and the reason is logged once."""
        if self.slurm is None:
            return None
        verdict = self.slurm.check()
        if verdict.warning != self._slurm_warning:
            self._slurm_warning = verdict.warning
            if verdict.warning is not None:
                log.warning("%s; joining anyway (the drain check fails open)", verdict.warning)
                self.event_log.record("slurm_state_unknown", reason=verdict.warning)
        if verdict.refused is None:
            return None
        why = f"{verdict.refused}: this node does not join the next round"
        self.event_log.record("node_refused", reason=why)
        try:  # a member of an earlier round leaves; a node that never joined is unknown to the master
            self.client.leave(LeaveRequest(node_id=self.settings.node_id, reason=why))
        except MasterError as exc:
            log.info("could not tell the master that this node leaves: %s", exc)
        hint = "resume it (scontrol update NodeName=... State=RESUME) or let the job go on without it"
        return ev.Rejected(f"{why}; {hint}", int(ExitCode.NODE_UNHEALTHY))

    def _report_failure(
        self, round_number: int, info: FailureInfo, kind: FailureKind, seen_at: float
    ) -> ev.AgentEvent:
        """Report a local failure (``seen_at``: when the agent saw it, time.monotonic)."""
        log.warning(
            "rank %d (local rank %d) failed with %s",
            info.global_rank,
            info.local_rank,
            how_it_failed(info, kind),
        )
        cause = {k: v for k, v in asdict(info).items() if k != "generic"}  # the record keeps its fields
        self.event_log.record("worker_failed", round=round_number, kind=kind.value, **cause)
        failure = worker_failure(info, kind, self.channel.snapshot())
        self.view = NodeView(state=NodeState.FAILED, round=round_number, failure=failure, failed_at=seen_at)
        return self._heartbeat_now("failure report")

    def _heartbeat_now(self, what: str) -> ev.AgentEvent:
        """A heartbeat the machine waits for (a report): its reply, or how the call failed."""
        try:
            reply = self.link.call(lambda: self.client.heartbeat(self._heartbeat_request()), what)
        except CallFailed as failed:
            return failed.event
        return ev.MasterReplied(reply)

    def _heartbeat_request(self) -> HeartbeatRequest:
        return heartbeat_request(self.settings.node_id, self.view, self.channel, self.keeper)

    def _exit_relay(self, generation: int) -> Callable[[WorkerExit], None]:
        def relay(exit_: WorkerExit) -> None:
            # A worker stopped after its training was over (health.DONE_EXIT_GRACE_S) succeeded.
            succeeded = exit_.succeeded or exit_.pid in self.hangs.finished_pids
            self.events.put(ev.WorkerExited(exit_.local_rank, succeeded, exit_.seen_at, exit_, generation))

        return relay

    def _cancel_check_timer(self) -> None:
        if self._check_timer is not None:
            self._check_timer.cancel()
            self._check_timer = None

    # -- signals -------------------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        if signum == self.settings.preempt_signal:  # not forwarded (SignalRouter): this node is pre-empted
            self.preempted = signum
        self.events.put(ev.SignalReceived(signum))

    def _forward_signal(self, signum: int) -> None:
        """Signal-forward thread: pass ``signum`` on to every live worker; the agent keeps running."""
        name = signal.Signals(signum).name
        pids = self.group.signal_workers(signum)
        if pids:
            log.info("forwarded %s to the workers (pids %s)", name, ", ".join(map(str, pids)))
        else:
            log.info("received %s; no worker runs to forward it to", name)
        self.event_log.record("signal_forwarded", signal=name, pids=pids)


#: The method that performs each action of the machine (agent.machine.events); Exit ends _drive itself.
PERFORMERS: dict[type[Any], Callable[[ElasticAgent, Any], ev.AgentEvent | None]] = {
    ev.Ignored: ElasticAgent._ignored,
    ev.Note: ElasticAgent._note,
    ev.StartHeartbeats: ElasticAgent._start_heartbeats,
    ev.AwaitLauncher: ElasticAgent._await_launcher,
    ev.Join: ElasticAgent._join,
    ev.AwaitRound: ElasticAgent._await_round,
    ev.StartWorkers: ElasticAgent._start_workers,
    ev.StartCheck: ElasticAgent._start_check,
    ev.StopWorkers: ElasticAgent._stop_workers,
    ev.ProbeWorkers: ElasticAgent._probe_workers,
    ev.PauseWorkers: ElasticAgent._pause_workers,
    ev.AwaitPaused: ElasticAgent._await_paused,
    ev.FallBack: ElasticAgent._fall_back,
    ev.StopCheck: ElasticAgent._stop_check,
    ev.CollectCheckResult: ElasticAgent._collect_check_result,
    ev.ReportCrash: ElasticAgent._report_crash,
    ev.ReportBroken: ElasticAgent._report_broken,
    ev.ReportHang: ElasticAgent._report_hang,
    ev.ReportSuccess: ElasticAgent._report_success,
    ev.ReportCheck: ElasticAgent._report_check,
    ev.Serve: ElasticAgent._serve,
    ev.RecordRestart: ElasticAgent._record_restart,
    ev.Leave: ElasticAgent._leave,
    ev.Finish: ElasticAgent._finish,
    ev.Excluded: ElasticAgent._excluded,
}


# -- what a training round starts, and how a failure is worded ---------------------------------------
def training_spec(
    settings: AgentSettings,
    assignment: Assignment,
    agent_socket: str,
    worker_env: dict[str, str],
    reset_ckpt: bool,
    stack_root: Path,
) -> WorkerSpec:
    """This node's workers of ``assignment``: torchrun's contract (agent.workers.environment) plus the
    agent's ``ELASTIC_*`` additions. ``reset_ckpt``: the first start of --ckpt-reset only (a restart after
    a failure must restore what this run saved)."""
    s = settings
    extra = {contract.NODE_ID: s.node_id, contract.AGENT_SOCKET: agent_socket}
    if assignment.committed_step is not None:
        extra[contract.COMMITTED_STEP] = str(assignment.committed_step)
    if s.ckpt_dir is not None:
        extra[contract.CKPT_DIR] = str(s.ckpt_dir)
    if reset_ckpt:
        extra[contract.CKPT_RESET] = "1"
    extra.update(worker_env)
    envs = worker_envs(os.environ, assignment, s.nproc, run_id=s.job.job_id, role=s.role, extra=extra)
    for local_rank, overrides in enumerate(s.per_rank_env):  # --virtual-local-rank
        envs[local_rank].update(overrides)
    health.add_stack_files(envs, stack_root, assignment)
    return WorkerSpec(
        argv=list(s.argv),
        envs=envs,
        global_ranks=[assignment.rank_offset + i for i in range(s.nproc)],
        log_dir=s.log_dir,
        attempt=f"round{assignment.round}",
        cwd=s.cwd,
        output=s.output,
    )


def round_line(assignment: Assignment, nproc: int) -> str:
    """The log line of a round this node trains in."""
    a = assignment
    return (
        f"round {a.round}: node rank {a.node_rank} of {a.nnodes}, ranks {a.rank_offset}-"
        f"{a.rank_offset + nproc - 1} of world {a.world_size}, restart {a.restart_count}/{a.max_restarts}, "
        f"term {a.term}"  # a round is (term, number): tests/e2e/test_etcd_trouble_e2e.py reads both
    )


def worker_failure(
    info: FailureInfo, kind: FailureKind, progress: Mapping[int, RankProgress] | None = None
) -> WorkerFailure:
    """The failure a heartbeat reports for ``info``; ``progress``: the failed group's progress by local rank
    (agent.observe.channel), which tells where in the round it failed (:class:`FailurePhase`). The failed
    worker's own steps decide (a deterministic fault fails it at the same point every time; how far its
    peers got by then is a matter of timing): a step reported, ``steady``; none, but another local worker
    reported one, ``first_step``; none on the node, ``startup``."""
    # A message that only restates the signal or exit code repeats those fields: keep real ones only.
    message = "" if info.generic else info.message[-8000:]
    # Set only when known (the client sends set fields only): a master of an earlier release refuses them.
    extra: dict[str, Any] = {}
    if progress:
        own = progress.get(info.local_rank)
        if own is not None and own.step is not None:
            extra.update(phase=FailurePhase.STEADY, step=own.step)
        elif any(p.step is not None for p in progress.values()):
            extra["phase"] = FailurePhase.FIRST_STEP
        else:
            extra["phase"] = FailurePhase.STARTUP
    if message and (found := exception_type(message)):
        extra["exception"] = found
    if message and (kind_of := known_error(message)):
        extra["known_error"] = kind_of
    return WorkerFailure(
        rank=info.global_rank,
        local_rank=info.local_rank,
        exit_code=info.exit_code,
        signal=info.signal,
        message=message,
        kind=kind,
        **extra,
    )


def how_it_failed(info: FailureInfo, kind: FailureKind) -> str:
    """``a hang``, ``signal SIGKILL`` or ``exit code 1``: for the agent's log line."""
    if kind is FailureKind.HANG:
        return "a hang"
    if info.signal is None and info.exit_code is None:
        return "a failed collective (the process lives on)"
    return f"signal {info.signal}" if info.signal else f"exit code {info.exit_code}"


# -- signals ----------------------------------------------------------------------------------------
class SignalRouter:
    """The agent's signal handlers (torchrun's ``--signals-to-handle``), installed from a
    :class:`SignalPlan` (main thread only); use as a context manager.

    A shutdown signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) and the pre-emption signal ``preempt`` (SIGUSR1:
    SLURM's warning before a time limit) are handed to ``on_shutdown`` (the loop queues them and stops the
    job gracefully). Any other handled signal (``--signals-to-handle SIGUSR2``) is forwarded to every live
    worker by a thread of its own, so that the handler itself takes no lock and the agent's main thread is
    never needed for it: the agent keeps running. A signal both forwarded and ``preempt`` is forwarded:
    torchrun's ``--signals-to-handle`` asked for that explicitly.
    """

    def __init__(
        self,
        plan: SignalPlan,
        on_shutdown: Callable[[int], None],
        forward: Callable[[int], None],
        preempt: signal.Signals | None = None,
    ) -> None:
        self._plan = plan
        self._handled = plan.handled | ({preempt} if preempt is not None else set())
        self._on_shutdown = on_shutdown
        self._forward = forward
        self._pending: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # put() is reentrant
        self._previous: dict[signal.Signals, Any] = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalRouter:
        if self._plan.forward:
            self._thread = threading.Thread(target=self._forward_loop, name="signal-forward", daemon=True)
            self._thread.start()
        for sig in sorted(self._handled):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum in self._plan.forward:
            self._pending.put(signum)
        else:
            self._on_shutdown(signum)

    def _forward_loop(self) -> None:
        while True:
            signum = self._pending.get()
            if signum is None:
                return
            try:
                self._forward(signum)
            except Exception:  # a failed forward must not end forwarding
                log.exception("forwarding %s to the workers failed", signal.Signals(signum).name)
