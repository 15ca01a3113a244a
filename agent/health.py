"""The agent's health duties, mixed into :class:`agent.loop.ElasticAgent`: hang verdicts with stack dumps,
and the node-check round.

Hangs (see :mod:`agent.hang`): at every heartbeat the heartbeat thread judges the running workers and, when
one is hung, queues a ``hang`` event (once per worker generation). The main thread then records the hung
workers' Python stacks (:mod:`agent.stackdump`) and reports the failure with kind ``hang``: the master
counts it as a failure and opens a new round, like a crash.

Node check (see :mod:`master.node_check`): an assignment with ``check=True`` makes the node run
``python -m elastic.node_check`` as its single worker, with the world being the nodes (RANK = node rank).
The agent reports the figures in a heartbeat (state ``running``) and waits for the master's verdict:
``rejoin`` (the training round follows), ``exclude`` (this node leaves the job: the agent exits 1 with the
reason) or ``stop`` (the job is over).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from agent.envcontract import worker_envs
from agent.errors import AgentError
from agent.hang import Hang, HangWatch
from agent.loop_state import NodeUnknownError, NodeView, QueuedEvent
from agent.stackdump import dump_stacks, stack_file_path
from agent.workers import FailureInfo, WorkerExit, WorkerGroupError, WorkerSpec
from elastic.node_check import RESULT_ENV, TIMEOUT_ENV
from elastic.protocol import (
    Assignment,
    Command,
    CommandReply,
    JobInfo,
    NodeCheckResult,
    NodeState,
    describe_figures,
)
from elastic.report import STACK_FILE_ENV

log = logging.getLogger("elastic.agent")

#: Collective timeout inside the check; a node that breaks its part makes its peers fail within it.
CHECK_PG_TIMEOUT_S = 60.0
#: The agent gives up on its check process (result: ``timeout``) after this long.
CHECK_TIMEOUT_S = CHECK_PG_TIMEOUT_S + 60.0
#: Lines of each stack dump copied into the agent's log (the file has all of it).
STACK_LOG_LINES = 60


class HealthMixin:
    """Hang verdicts and the node-check round; uses the agent loop's state (see agent.loop)."""

    _hang_watch: HangWatch | None = None
    _hang_generation = -1  # the worker generation that _hang_watch observes
    _hang_reported = -1  # the worker generation whose hang was queued already

    # -- settings ----------------------------------------------------------------------------------
    def _check_health_settings(self, info: JobInfo) -> None:
        want = self.settings.job.node_check
        if want != "off" and info.node_check != want:
            log.warning(
                "--node-check %s is a setting of the job master; the master of job %s runs with "
                "--node-check %s (pass it to elastic-master)",
                want,
                info.job_id,
                info.node_check,
            )

    # -- worker environment ------------------------------------------------------------------------
    def _stack_root(self) -> Path:
        return self.settings.log_dir or self.group.error_dir

    def _add_stack_files(self, envs: list[dict[str, str]], assignment: Assignment) -> None:
        """Name each worker's faulthandler dump file (``ELASTIC_STACK_FILE``) next to its logs."""
        root, attempt = self._stack_root(), f"round{assignment.round}"
        for local_rank, env in enumerate(envs):
            env[STACK_FILE_ENV] = str(stack_file_path(root, attempt, assignment.rank_offset + local_rank))

    # -- hangs -------------------------------------------------------------------------------------
    def _check_hangs(self, generation: int) -> None:
        """Heartbeat thread: queue a ``hang`` event when a running worker is hung (once per generation)."""
        timeout = self.settings.hang_timeout_s
        if timeout <= 0 or self.view.state is not NodeState.RUNNING or self._hang_reported == generation:
            return
        if self._hang_watch is None or self._hang_generation != generation:
            self._hang_watch, self._hang_generation = HangWatch(timeout), generation
        pids = self.group.pids
        live = {r: pids[r] for r in self.group.running() if r < len(pids)}
        hangs = self._hang_watch.check(time.monotonic(), self.channel.snapshot(), live)
        if hangs and generation == self.generation:
            self._hang_reported = generation
            self.events.put(QueuedEvent("hang", generation, hangs))

    def _on_hang(self, assignment: Assignment, hangs: list[Hang]) -> int | None:
        """Main thread: record the hung workers' stacks, then report the failure (kind ``hang``)."""
        pids, offset = self.group.pids, assignment.rank_offset
        for hang in hangs:
            log.warning(
                "rank %d (local rank %d, pid %d) is hung: %s",
                offset + hang.local_rank,
                hang.local_rank,
                pids[hang.local_rank],
                hang.reason,
            )
        root, attempt = self._stack_root(), f"round{assignment.round}"
        targets = [
            (pids[h.local_rank], offset + h.local_rank, stack_file_path(root, attempt, offset + h.local_rank))
            for h in hangs
        ]
        dumps = dump_stacks(targets)
        for dump in dumps:
            if dump.path is None:
                log.warning("rank %d: no Python stack recorded: %s", dump.global_rank, dump.error)
                continue
            lines = dump.text.rstrip().splitlines()
            shown = "\n".join(f"    {line}" for line in lines[:STACK_LOG_LINES])
            more = (
                f"\n    ... ({len(lines) - STACK_LOG_LINES} more lines)"
                if len(lines) > STACK_LOG_LINES
                else ""
            )
            log.warning(
                "rank %d: Python stack (%s) saved to %s:\n%s%s",
                dump.global_rank,
                dump.how,
                dump.path,
                shown,
                more,
            )
        first, dump = hangs[0], dumps[0]
        message = first.reason + (f"; Python stack in {dump.path}" if dump.path else "")
        info = FailureInfo(
            local_rank=first.local_rank,
            global_rank=offset + first.local_rank,
            exit_code=None,
            signal=None,
            message=message,
        )
        # Detection starts at the hung worker's last progress (the stall's beginning).
        return self._report_failure(
            assignment.round, info, kind="hang", seen_at=time.monotonic() - first.stalled_s
        )

    # -- node check --------------------------------------------------------------------------------
    def _check_round(self, assignment: Assignment) -> int | None:
        """Run this node's health check of a check round; return an exit code, or None to rejoin."""
        s = self.settings
        self.generation += 1
        generation = self.generation
        log.info(
            "round %d: node check (node rank %d of %d)",
            assignment.round,
            assignment.node_rank,
            assignment.nnodes,
        )
        attempt = f"round{assignment.round}-check"
        result_file = self.group.error_dir / attempt / "node-check.json"
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.unlink(missing_ok=True)
        nodes = assignment.model_copy(
            update={"rank_offset": assignment.node_rank, "world_size": assignment.nnodes}
        )
        extra = {
            "ELASTIC_NODE_ID": s.node_id,
            RESULT_ENV: str(result_file),
            TIMEOUT_ENV: f"{CHECK_PG_TIMEOUT_S:g}",
        }
        envs = worker_envs(os.environ, nodes, 1, run_id=s.job.job_id, role=s.role, extra=extra)
        self.channel.reset(1)
        result: NodeCheckResult | None = None
        try:
            self.group.start(
                WorkerSpec(
                    argv=[sys.executable, "-u", "-m", "elastic.node_check"],
                    envs=envs,
                    global_ranks=[assignment.node_rank],
                    log_dir=s.log_dir,
                    attempt=attempt,
                    cwd=s.cwd,
                ),
                on_exit=lambda exit_: self.events.put(QueuedEvent("exit", generation, exit_)),
            )
        except WorkerGroupError as exc:
            result = NodeCheckResult(ok=False, stage="setup", error=str(exc)[-2000:])
        self.view = NodeView(state=NodeState.RUNNING, round=assignment.round, pids=list(self.group.pids))
        threading.Thread(
            target=self._watch, args=(generation, assignment.round), name="watch", daemon=True
        ).start()
        timer = threading.Timer(
            CHECK_TIMEOUT_S, lambda: self.events.put(QueuedEvent("check_timeout", generation))
        )
        timer.daemon = True
        timer.start()
        try:
            while result is None:
                event = self._next_event()
                if event.kind in ("signal", "master_lost", "node_unknown", "command"):
                    return self._check_round_event(event)
                if event.kind == "exit":
                    result = self._check_result(result_file, event.payload)
                elif event.kind == "check_timeout":
                    result = NodeCheckResult(
                        ok=False, stage="timeout", error=f"no result within {CHECK_TIMEOUT_S:g}s"
                    )
                elif event.kind == "hang":
                    result = NodeCheckResult(ok=False, stage="hang", error=event.payload[0].reason[:2000])
        finally:
            timer.cancel()
        self.group.stop(s.stop_grace_s)  # not _stop_workers(): the watch of this generation must go on
        outcome = "passed" if result.ok else f"failed at {result.stage}: {result.error}"
        log.info("node check %s; %s (the master judges all nodes)", outcome, describe_figures(result))
        self.view = NodeView(state=NodeState.RUNNING, round=assignment.round, node_check=result)
        try:
            reply = self._call_master(
                lambda: self.client.heartbeat(self._heartbeat_request()), "node-check report"
            )
        except NodeUnknownError:
            self._on_node_unknown()
            return None
        if reply.command is not Command.CONTINUE:
            return self._after_check(reply)
        while True:  # the master decides once every node has reported
            event = self._next_event()
            if event.kind in ("signal", "master_lost", "node_unknown", "command"):
                return self._check_round_event(event)

    def _check_round_event(self, event) -> int | None:
        if event.kind == "signal":
            return self._shut_down(event.payload)
        if event.kind == "master_lost":
            raise AgentError(event.payload)
        if event.kind == "node_unknown":
            self._on_node_unknown()
            return None
        return self._after_check(event.payload)

    def _after_check(self, reply: CommandReply) -> int | None:
        self._stop_workers()
        if reply.command is Command.EXCLUDE:
            outcome = reply.outcome
            summary = outcome.summary if outcome else "this node was excluded from the job by the node check"
            print(f"elastic-run: {summary}", file=sys.stderr, flush=True)
            return outcome.exit_code if outcome else 1
        if reply.command is Command.STOP:
            return self._finish(reply.outcome)
        log.info("node check done; master opened round %d", reply.round)
        return None

    def _check_result(self, path: Path, exit_: WorkerExit) -> NodeCheckResult:
        """The figures the check process wrote, or a ``crash`` result with its root cause."""
        try:
            data = json.loads(path.read_text())
            fields = NodeCheckResult.model_fields
            return NodeCheckResult(**{k: v for k, v in data.items() if k in fields})
        except (OSError, ValueError, TypeError, ValidationError):
            info = self.group.failure_info(exit_)
            return NodeCheckResult(ok=False, stage="crash", error=info.message[-2000:])
