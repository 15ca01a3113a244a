"""The agent's restart/rescale loop: join a round, start workers, watch them, stop, rejoin.

Threads only produce events; the main thread consumes them from one queue and owns every decision:

* rendezvous waiter — long-polls the master for this node's next assignment;
* heartbeat — reports the node's state every interval, relays a non-``continue`` command;
* watcher — long-polls the master so that a new round is learnt at once, not at the next heartbeat;
* exit relay — forwards worker exits the moment the worker group sees them;
* signal handlers (agent.signals) — shutdown signals become events; others are forwarded to the workers.

Each event carries the *generation* it belongs to (one per worker start), so stale events of a
stopped generation are dropped.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from dataclasses import asdict

from agent.channel import ProgressChannel
from agent.ckpt_keeper import CheckpointKeeper
from agent.envcontract import worker_envs
from agent.errors import EXIT_CONFIG, EXIT_FAILED, AgentError
from agent.events import event_log_for
from agent.health import HealthMixin
from agent.loop_state import NodeUnknownError as _NodeUnknownError
from agent.loop_state import NodeView as _NodeView
from agent.loop_state import QueuedEvent as _Event
from agent.net import free_port
from agent.proc_start import last_created_at
from agent.progress import ProgressReporter, sample_agent
from agent.settings import AgentSettings
from agent.signals import SignalRouter
from agent.tls_trouble import TLSTrouble
from agent.workers import FailureInfo, WorkerExit, WorkerGroup, WorkerSpec
from elastic.client import (
    Backoff,
    MasterClient,
    MasterError,
    MasterRejectedError,
    MasterTLSError,
    MasterUnreachableError,
)
from elastic.master_errors import Disposition
from elastic.protocol import (
    PERSIST_ERROR_MAX,
    Assignment,
    Command,
    CommandReply,
    HeartbeatRequest,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    NodeState,
    Outcome,
    WorkerFailure,
    WorkerProgress,
)

log = logging.getLogger("elastic.agent")

LONG_POLL_S = 20.0


class ElasticAgent(HealthMixin):
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
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()  # put() is safe in signal handlers
        self.view = _NodeView()
        self.generation = 0
        self.heartbeat_interval = settings.job.heartbeat_interval_s
        #: Per-address limit of one heartbeat call: a third of the master's heartbeat timeout, so that
        #: after a failover a node whose last master hangs (rather than refusing connections) still
        #: reaches the new leader well within its grace period (one heartbeat timeout).
        self.heartbeat_call_timeout = settings.job.heartbeat_timeout_s / 3
        self._closing = threading.Event()
        self.failure_summary: str | None = None  # the job's root-cause summary when it failed
        self._last_contact = time.monotonic()
        self.host = settings.local_addr or "127.0.0.1"
        self._workers_started = False  # --ckpt-reset applies to the first start only
        self.event_log = event_log_for(settings.event_log_handler, settings.node_id)
        #: A final refusal a background thread got from the master (e.g. 403: another agent has this node id).
        self._final_refusal: AgentError | None = None
        self.tls_trouble = TLSTrouble(self.event_log)  # a master's certificate that stopped verifying
        self.assignment: Assignment | None = None  # the newest round this node trains in
        self.progress = ProgressReporter(settings.progress_interval_s, lambda: sample_agent(self), log.info)

    # -- entry point ------------------------------------------------------------------------------
    def run(self) -> int:
        self._check_job_settings()
        with SignalRouter(self.settings.signals, self._on_signal, self._forward_signal):
            try:
                signum = self._await_warm_start()
                if signum is not None:
                    log.warning("received %s before joining; exiting", signal.Signals(signum).name)
                    return 128 + signum
                threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
                self.progress.start()  # the progress line every --progress-interval (agent.progress)
                return self._rounds()
            finally:
                self.progress.stop()
                self._closing.set()
                self.generation += 1
                self.group.stop(self.settings.stop_grace_s)

    def _check_job_settings(self) -> None:
        info = self.client.info()
        self.heartbeat_interval = info.heartbeat_interval_s
        self.heartbeat_call_timeout = info.heartbeat_timeout_s / 3
        want = self.settings.job
        if (info.min_nodes, info.max_nodes) != (want.min_nodes, want.max_nodes):
            raise AgentError(
                f"--nnodes {want.min_nodes}:{want.max_nodes} disagrees with the master of job {info.job_id}, "
                f"which runs {info.min_nodes}:{info.max_nodes}; use the same --nnodes on every node",
                EXIT_CONFIG,
            )
        self._check_health_settings(info)

    # -- the loop ---------------------------------------------------------------------------------
    def _await_warm_start(self) -> int | None:
        """Wait until the warm-start zygote has imported torch (bounded); a signal number if one came.

        A node joins only then: a join opens a round that stops the running nodes' workers, and this node's
        workers could start only once the zygote is ready (an exec'd worker would import torch from
        scratch, which is never faster). So the running nodes keep training while this node warms up."""
        warm_up_s = self.group.launcher_warm_up_left_s()
        if warm_up_s <= 0:
            return None
        log.info("joining once the warm-start zygote has imported torch (at most %.0fs)", warm_up_s)
        self.generation += 1
        threading.Thread(
            target=self._await_launcher, args=(self.generation, warm_up_s), name="warm-wait", daemon=True
        ).start()
        event = self._next_event()  # launcher_ready or a signal: nothing else runs yet
        return event.payload if event.kind == "signal" else None

    def _rounds(self) -> int:
        after = 0
        while True:
            self.generation += 1
            self.view = _NodeView()
            joined = self._join()
            log.info("joined: waiting for round %d (master %s)", joined.round, joined.master_id)
            if joined.round <= after:
                # Rounds only grow, so the master restarted without its state (memory store): wait for
                # its rounds, not for a round past the last one we saw.
                log.warning(
                    "master %s is at round %d, not past this node's last round %d: it lost the job's "
                    "state (restarted without a durable store); joining its rounds afresh",
                    joined.master_id,
                    joined.round,
                    after,
                )
                after = joined.round - 1
            threading.Thread(
                target=self._await_assignment, args=(self.generation, after), name="rendezvous", daemon=True
            ).start()
            event = self._next_event()
            if event.kind == "signal":
                return self._shut_down(event.payload)
            if event.kind == "finished":
                return self._finish(event.payload)
            if event.kind == "master_lost":
                raise AgentError(event.payload)
            if event.kind == "node_unknown":
                continue
            assignment: Assignment = event.payload
            after = assignment.round
            verdict = self._check_round(assignment) if assignment.check else self._train(assignment)
            if verdict is not None:
                return verdict

    def _join(self) -> JoinReply:
        store_port = free_port(self.host)
        req = JoinRequest(
            node_id=self.settings.node_id,
            host=self.host,
            nproc=self.settings.nproc,
            store_port=store_port,
            min_nodes=self.settings.job.min_nodes,
            max_nodes=self.settings.job.max_nodes,
        )
        return self._call_master(lambda: self.client.join(req), "join")

    def _train(self, assignment: Assignment) -> int | None:
        """Run the workers of one round; return an exit code, or None to rejoin."""
        self.generation += 1
        generation = self.generation
        log.info(
            "round %d: node rank %d of %d, ranks %d-%d of world %d, restart %d/%d",
            assignment.round,
            assignment.node_rank,
            assignment.nnodes,
            assignment.rank_offset,
            assignment.rank_offset + self.settings.nproc - 1,
            assignment.world_size,
            assignment.restart_count,
            assignment.max_restarts,
        )
        self.assignment = assignment
        self._start_workers(assignment, generation)
        pids = list(self.group.pids)
        returned = time.monotonic()
        # The kernel's creation time of the last worker, not the start call's return (bookkeeping after
        # the fork): where the master's recovery phase ``restart`` ends.
        created = last_created_at(pids)
        self.view = _NodeView(
            state=NodeState.RUNNING,
            round=assignment.round,
            pids=pids,
            started_at=min(created, returned) if created is not None else returned,
        )
        threading.Thread(
            target=self._watch, args=(generation, assignment.round), name="watch", daemon=True
        ).start()
        succeeded: set[int] = set()
        while True:
            event = self._next_event()
            if event.kind == "signal":
                return self._shut_down(event.payload)
            if event.kind == "master_lost":
                raise AgentError(event.payload)
            if event.kind == "node_unknown":
                self._on_node_unknown()
                return None
            if event.kind == "exit":
                exit_: WorkerExit = event.payload
                if exit_.succeeded:
                    succeeded.add(exit_.local_rank)
                    if len(succeeded) == self.settings.nproc:
                        return self._report_success(assignment.round)
                    continue
                info = self.group.failure_info(exit_)
                return self._report_failure(assignment.round, info, seen_at=exit_.seen_at)
            if event.kind == "hang":
                return self._on_hang(assignment, event.payload)
            if event.kind == "command":
                reply: CommandReply = event.payload
                self._stop_workers()
                if reply.command is Command.STOP:
                    return self._finish(reply.outcome)
                log.info("master opened round %d; restarting workers", reply.round)
                self.event_log.record("restart", round=reply.round)
                return None

    # -- outcomes ---------------------------------------------------------------------------------
    def _report_failure(
        self, round_number: int, info: FailureInfo, kind: str = "crash", seen_at: float | None = None
    ) -> int | None:
        """Report a local failure (``seen_at``: when the agent saw it, time.monotonic; default now)."""
        # The group's generic fallback ("killed by SIGKILL") only repeats the signal; keep real messages.
        generic = info.message.startswith(("killed by ", "exited with code "))
        failure = WorkerFailure(
            rank=info.global_rank,
            local_rank=info.local_rank,
            exit_code=info.exit_code,
            signal=info.signal,
            message="" if generic else info.message[-8000:],
            kind=kind,
        )
        how = f"signal {info.signal}" if info.signal else f"exit code {info.exit_code}"
        if kind == "hang":
            how = "a hang"
        log.warning("rank %d (local rank %d) failed with %s", info.global_rank, info.local_rank, how)
        self.event_log.record("worker_failed", round=round_number, kind=kind, **asdict(info))
        self.view = _NodeView(
            state=NodeState.FAILED,
            round=round_number,
            failure=failure,
            failed_at=time.monotonic() if seen_at is None else seen_at,
        )
        # Report before stopping the others, so that the other nodes start stopping in parallel.
        try:
            reply = self._call_master(
                lambda: self.client.heartbeat(self._heartbeat_request()), "failure report"
            )
        except _NodeUnknownError:  # e.g. a peer's crash caused by the master's restart: just rejoin
            self._on_node_unknown()
            return None
        self._stop_workers()
        if reply.command is Command.STOP:
            return self._finish(reply.outcome)
        return None

    def _report_success(self, round_number: int) -> int | None:
        self.view = _NodeView(state=NodeState.SUCCEEDED, round=round_number)
        try:
            reply = self._call_master(
                lambda: self.client.heartbeat(self._heartbeat_request()), "success report"
            )
        except _NodeUnknownError:  # the master lost the job's state: rejoin (resumes from the checkpoint)
            self._on_node_unknown()
            return None
        if reply.command is Command.STOP or self.settings.host_master_at is None:
            return self._finish(reply.outcome or Outcome(succeeded=True, exit_code=0))
        # This agent hosts the master for other nodes: keep serving until the whole job is over.
        while True:
            reply = self._call_master(
                lambda: self.client.watch(self.settings.node_id, round_number, LONG_POLL_S), "watch"
            )
            if reply.command is Command.STOP:
                return self._finish(reply.outcome or Outcome(succeeded=True, exit_code=0))

    def _finish(self, outcome: Outcome | None) -> int:
        done = outcome or Outcome(succeeded=True, exit_code=0)
        self.event_log.record("job_finished", succeeded=done.succeeded, exit_code=done.exit_code)
        if outcome is None:
            return 0
        if outcome.succeeded:
            log.info("job succeeded")
        else:
            # Printed by the CLI after every resource is released, so it is the last line a user sees.
            self.failure_summary = outcome.summary
        return outcome.exit_code

    def _shut_down(self, signum: int) -> int:
        name = signal.Signals(signum).name
        log.warning("received %s; stopping workers", name)
        self._stop_workers()
        self.event_log.record("node_left", signal=name)
        try:
            self.client.leave(LeaveRequest(node_id=self.settings.node_id, reason=f"agent received {name}"))
        except MasterError as exc:
            log.info("could not tell the master that this node leaves: %s", exc)
        return 128 + signum

    # -- workers ----------------------------------------------------------------------------------
    def _start_workers(self, assignment: Assignment, generation: int) -> None:
        s = self.settings
        extra = {"ELASTIC_NODE_ID": s.node_id, "ELASTIC_AGENT_SOCKET": self.channel.path}
        if assignment.committed_step is not None:
            extra["ELASTIC_COMMITTED_STEP"] = str(assignment.committed_step)
        if s.ckpt_dir is not None:
            extra["ELASTIC_CKPT_DIR"] = str(s.ckpt_dir)
        if s.ckpt_reset and not self._workers_started:
            # Only the first start: a restart after a failure must restore what this run saved.
            extra["ELASTIC_CKPT_RESET"] = "1"
        self._workers_started = True
        extra.update(self.worker_env)
        envs = worker_envs(os.environ, assignment, s.nproc, run_id=s.job.job_id, role=s.role, extra=extra)
        for local_rank, overrides in enumerate(s.per_rank_env):  # --virtual-local-rank
            envs[local_rank].update(overrides)
        self._add_stack_files(envs, assignment)
        ranks = [assignment.rank_offset + i for i in range(s.nproc)]
        self.channel.reset(s.nproc)
        self.group.start(
            WorkerSpec(
                argv=list(s.argv),
                envs=envs,
                global_ranks=ranks,
                log_dir=s.log_dir,
                attempt=f"round{assignment.round}",
                cwd=s.cwd,
                output=s.output,
            ),
            on_exit=lambda exit_: self.events.put(_Event("exit", generation, exit_)),
        )
        self.event_log.record(
            "workers_started",
            round=assignment.round,
            ranks=ranks,
            pids=self.group.pids,
            restart=assignment.restart_count,
        )

    def _await_launcher(self, generation: int, timeout: float) -> None:
        self.group.wait_launcher(timeout)  # if it is still not ready, the group says so and execs
        self.events.put(_Event("launcher_ready", generation))

    def _on_node_unknown(self) -> None:
        """The master answered 404 unknown_node for this node while it ran workers: it lost its state
        (restarted with the memory store) or dropped the node (declared it dead). Say so, stop the
        workers and rejoin: never keep training in a world the master no longer tracks (split brain)."""
        log.warning(
            "the master no longer knows this node (it was restarted without a durable store, or it "
            "declared this node dead); stopping workers and rejoining"
        )
        self._stop_workers()

    def _stop_workers(self) -> None:
        self.generation += 1  # exits caused by the stop are not failures
        self.view = _NodeView(state=NodeState.WAITING)
        running = self.group.running()
        self.group.stop(self.settings.stop_grace_s)
        if self.keeper is not None:
            # A worker killed mid-save left a checkpoint-sized temp file; no worker writes now.
            self.keeper.sweep(workers_stopped=True)
        if running:
            self.event_log.record("workers_stopped", local_ranks=running)

    # -- event producers --------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> None:
        self.events.put(_Event("signal", -1, signum))

    def _forward_signal(self, signum: int) -> None:
        """Signal-forward thread: pass ``signum`` on to every live worker; the agent keeps running."""
        name = signal.Signals(signum).name
        pids = self.group.signal_workers(signum)
        if pids:
            log.info("forwarded %s to the workers (pids %s)", name, ", ".join(map(str, pids)))
        else:
            log.info("received %s; no worker runs to forward it to", name)
        self.event_log.record("signal_forwarded", signal=name, pids=pids)

    def _next_event(self) -> _Event:
        """The next event of the current generation (or a signal). A final refusal by the master, queued
        by any thread (``rejected``), ends the agent here: its :class:`AgentError` is raised."""
        while True:
            event = self.events.get()
            if event.kind == "rejected":
                raise event.payload
            if event.kind == "signal" or event.generation == self.generation:
                return event

    def _await_assignment(self, generation: int, after: int) -> None:
        retry = Backoff(0.1, min(1.0, self.heartbeat_interval))  # while the master is away
        while generation == self.generation and not self._closing.is_set():
            try:
                reply = self.client.next_round(self.settings.node_id, after, LONG_POLL_S)
            except MasterRejectedError as exc:
                if exc.disposition is not Disposition.RETRY:
                    self._refused(exc, "rendezvous", generation)
                    return
                if self._master_lost(generation):
                    return
                time.sleep(retry.next())
                continue
            except MasterError as exc:
                self.tls_trouble.failed(exc)
                if self._master_lost(generation):
                    return
                time.sleep(retry.next())
                continue
            self._contact()
            retry.reset()
            if reply.status == "assigned":
                self.events.put(_Event("assigned", generation, reply.assignment))
                return
            if reply.status == "finished":
                self.events.put(_Event("finished", generation, reply.outcome))
                return

    def _watch(self, generation: int, round_number: int) -> None:
        retry = Backoff(0.1, min(1.0, self.heartbeat_interval))  # while the master is away
        while generation == self.generation and not self._closing.is_set():
            try:
                reply = self.client.watch(self.settings.node_id, round_number, LONG_POLL_S)
            except MasterRejectedError as exc:
                if exc.disposition is not Disposition.RETRY:
                    self._refused(exc, "watch", generation)
                    return
                time.sleep(self.heartbeat_interval)
                continue
            except MasterError as exc:
                self.tls_trouble.failed(exc)
                if self._master_lost(generation):
                    return
                time.sleep(retry.next())
                continue
            self._contact()
            retry.reset()
            if reply.command is not Command.CONTINUE:
                self.events.put(_Event("command", generation, reply))
                return

    def _heartbeat_request(self) -> HeartbeatRequest:
        view = self.view
        progress = self.channel.snapshot() if view.state is NodeState.RUNNING else {}
        workers = []
        for i, pid in enumerate(view.pids):
            p = progress.get(i)
            workers.append(
                WorkerProgress(
                    local_rank=i,
                    pid=pid,
                    step=p.step if p else None,
                    step_time_s=p.step_time_s if p else None,
                    compute_time_s=p.compute_time_s if p else None,
                )
            )
        persisted_step, persist_error = self.keeper.persist_status() if self.keeper else (None, "")
        now = time.monotonic()
        failure = view.failure
        if failure is not None and view.failed_at is not None:
            failure = failure.model_copy(update={"age_s": max(0.0, now - view.failed_at)})
        firsts = [p.first_step_at for p in progress.values()]
        stepped = bool(firsts) and len(firsts) == len(view.pids) and None not in firsts
        return HeartbeatRequest(
            node_id=self.settings.node_id,
            round=view.round,
            state=view.state,
            workers=workers,
            failure=failure,
            ckpt_step=self.channel.checkpointed_step() if view.state is not NodeState.WAITING else None,
            node_check=view.node_check,
            persisted_step=persisted_step,
            persist_error=persist_error[-PERSIST_ERROR_MAX:],
            workers_started_age_s=max(0.0, now - view.started_at) if view.started_at is not None else None,
            first_step_age_s=max(0.0, now - max(firsts)) if stepped else None,
            **(self.keeper.replication_fields() if self.keeper else {}),
        )

    def _heartbeat_loop(self) -> None:
        # After a failed heartbeat the next one comes after a random 50-100% of the interval: jitter but
        # no backoff, so that a master that just took over hears from every live node well within its
        # grace period (one heartbeat timeout), yet not from all nodes at the same instant.
        retry = Backoff(self.heartbeat_interval, self.heartbeat_interval)
        wait = self.heartbeat_interval
        while not self._closing.wait(wait):
            wait = self.heartbeat_interval
            generation = self.generation
            self._check_hangs(generation)  # a hung worker queues a "hang" event (agent.health)
            if not self.client.has_joined(self.settings.node_id):
                continue  # no incarnation yet (the join is being retried): nothing to report for
            try:
                reply = self.client.heartbeat(self._heartbeat_request(), timeout=self.heartbeat_call_timeout)
            except MasterRejectedError as exc:
                if exc.disposition is Disposition.FINAL:
                    self._refused(exc, "heartbeat", generation)
                elif exc.disposition is Disposition.REJOIN and self.view.state is not NodeState.WAITING:
                    self.events.put(_Event("node_unknown", generation, exc.message))
                continue
            except MasterError as exc:
                self.tls_trouble.failed(exc)
                self._master_lost(generation)
                wait = retry.next()
                continue
            self._contact()
            if self.keeper is not None and reply.command is Command.CONTINUE:
                self.keeper.set_replica_targets(reply.peers)  # peer replication (agent.replication)
            if reply.command is not Command.CONTINUE and self.view.state is NodeState.RUNNING:
                self.events.put(_Event("command", generation, reply))

    def _contact(self) -> None:
        self._last_contact = time.monotonic()
        self.tls_trouble.answered()

    def _master_lost(self, generation: int) -> bool:
        """True (and an event queued) when no master answered for longer than the allowed time."""
        silent = time.monotonic() - self._last_contact
        if silent < self.settings.master_timeout_s:
            return False
        message = self.tls_trouble.lost(silent, self.settings.master_timeout_s, self.client.addresses)
        self.events.put(_Event("master_lost", generation, message))
        return True

    def _refused(self, exc: MasterRejectedError, what: str, generation: int) -> None:
        """A background thread's call was refused: queue ``node_unknown`` (rejoin) or, when final,
        ``rejected`` (the agent stops: :meth:`_next_event`, or :meth:`_call_master` if it is retrying)."""
        if exc.disposition is Disposition.REJOIN:
            self.events.put(_Event("node_unknown", generation, exc.message))
        else:
            self._final_refusal = _rejection(exc, what)
            self.events.put(_Event("rejected", generation, self._final_refusal))

    def _call_master(self, call, what: str):
        """A call the loop cannot go on without: retried (backoff with jitter) until the master-unreachable
        timeout, and so is a refusal that the error table says to retry (elastic.master_errors; e.g. 409
        duplicate_node: another live agent uses this node id), for at most --master-timeout. A 404
        unknown_node raises :class:`_NodeUnknownError`, a final refusal :class:`AgentError`."""
        retry = Backoff(0.1, 2.0)
        refused_since: float | None = None
        while True:
            if self._final_refusal is not None:  # e.g. a heartbeat learnt that another agent has this id
                raise self._final_refusal
            try:
                reply = call()
                self._contact()
                return reply
            except MasterRejectedError as exc:
                if exc.disposition is Disposition.REJOIN:
                    raise _NodeUnknownError(exc.message) from None
                if exc.disposition is Disposition.FINAL:
                    raise _rejection(exc, what) from None
                now = time.monotonic()
                if refused_since is None:
                    refused_since = now
                    log.warning(
                        "master refused the %s (%s: %s); retrying for at most %gs (--master-timeout)",
                        what,
                        exc.code,
                        exc.message,
                        self.settings.master_timeout_s,
                    )
                if now - refused_since > self.settings.master_timeout_s:
                    raise AgentError(
                        f"master refused the {what} for {now - refused_since:.0f}s (--master-timeout "
                        f"{self.settings.master_timeout_s:g}s): {exc.message}",
                        _exit_code(exc),
                    ) from None
                time.sleep(retry.next())
            except (MasterUnreachableError, MasterTLSError) as exc:
                # TLS too: after the first contact, a certificate that stops verifying may be a failover
                # under way (agent.tls_trouble); the workers train on while it is retried.
                self.tls_trouble.failed(exc)
                silent = time.monotonic() - self._last_contact
                if silent > self.settings.master_timeout_s:
                    if self.tls_trouble.reason is None:
                        raise AgentError(str(exc)) from None
                    lost = self.tls_trouble.lost(
                        silent, self.settings.master_timeout_s, self.client.addresses
                    )
                    raise AgentError(lost) from None
                time.sleep(retry.next())


def _exit_code(exc: MasterRejectedError) -> int:
    """A configuration problem (token, node id, --nnodes, job id) exits 2, anything else 1."""
    return EXIT_CONFIG if exc.status in (401, 403, 409, 422) else EXIT_FAILED


def _rejection(exc: MasterRejectedError, what: str) -> AgentError:
    """The one line an agent stops with when the master refuses a call for good."""
    return AgentError(f"master rejected the {what}: {exc.message}", _exit_code(exc))
