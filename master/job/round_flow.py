"""Rounds: open the next one (and account the recovery it begins), close it when the rendezvous allows,
admit waiting nodes, time out the rendezvous."""

from __future__ import annotations

from elastic.control.protocol import (
    NodeState,
    Outcome,
)
from master.job.events import SCALE_UP
from master.job.progress import update_committed_step
from master.job.rendezvous import Phase, name_list
from master.job.state import EXIT_FAILED, JobState


def open_round(
    job,
    now: float,
    why: str,
    *,
    counted: bool,
    cause: str | None = None,
    began_at: float | None = None,
    stopped_at: float | None = None,
) -> None:
    """Open the next round. ``cause`` (a running world broke: a recovery begins) comes with when it
    broke (``began_at``, where detection starts) and when training stopped (``stopped_at``, by default
    the same moment)."""
    update_committed_step(job)  # the closing round's last word, before its reports are reset
    current = job.rdzv.current
    running = job.rdzv.phase is Phase.ACTIVE and current is not None
    cause = cause if running and not job.is_check_round(current.number) else None
    expected = set(current.members) if current else set()
    expected &= set(job.nodes)
    steps = [job.nodes[n].step for n in expected if job.nodes[n].step is not None]
    steps_lost = max(0, max(steps) - (job.committed_step or 0)) if steps and cause else 0
    job.succeeded.clear()
    for node in job.nodes.values():
        node.ckpt_step = None  # checkpoint reports count per round; the committed step stays
    job.ckpt_floor.reset(())
    number = job.rdzv.open_round(now, expected)
    job.wake_long_polls()  # members' watches answer "rejoin"
    data: dict = {}
    if cause is not None:
        began = now if began_at is None else min(began_at, now)
        job.recovery.verdict(cause, began, now)
        stopped = job.training_stopped(began if stopped_at is None else stopped_at)
        data = {"steps_lost": steps_lost, **stopped}
    kind = "restart" if counted else "membership change"
    job.record(
        now,
        "round_opened",
        f"round {number} opened ({kind}: {why}); restarts {job.restart_count}/{job.settings.max_restarts}",
        round=number,
        cause=cause,
        data=data,
    )


def advance(job: JobState, now: float) -> None:
    """Close the open round, start growth, or time out the rendezvous, as due."""
    rdzv = job.rdzv
    # Once a member has finished, its agent is gone: the world can no longer be re-formed.
    if rdzv.phase is Phase.ACTIVE and not job.succeeded and rdzv.growth_due(now):
        joined = [job.nodes[n].joined_at for n in rdzv.waiting if n in job.nodes]
        open_round(
            job,
            now,
            f"admitting waiting nodes {name_list(rdzv.waiting)}",
            counted=False,
            cause=SCALE_UP,
            began_at=min((t for t in joined if t is not None), default=now),
            stopped_at=now,  # the world trained until this verdict
        )
    if rdzv.phase is Phase.OPEN:
        closed = rdzv.try_close(now)
        pending, job.pending_failure = job.pending_failure, None
        if closed is not None and pending is not None and not pending.counted:
            attempts = job.restart_count + 1
            job.finish(
                Outcome(
                    succeeded=False,
                    exit_code=EXIT_FAILED,
                    summary=f"job failed after {attempts} attempt(s) "
                    f"(max restarts {job.settings.max_restarts}); root cause: {pending.cause}",
                ),
                now,
            )
            return
        if closed is None:
            job.pending_failure = pending
        if closed is not None:
            job.round_term = job.term  # assignments are first revealed now, under this term
            job.wake_long_polls()  # waiting nodes get their assignment
            job.ckpt_floor.reset(closed.members)
            for slot in closed.slots:
                job.nodes[slot.node_id].state = NodeState.STARTING
                job.nodes[slot.node_id].round = closed.number
            waiting = f"; waiting: {name_list(rdzv.waiting)}" if rdzv.waiting else ""
            if not job.is_check_round(closed.number):  # a check round trains nothing
                job.recovery.round_closed(closed.number, closed.members, now)
            job.record(
                now,
                "round_closed",
                f"round {closed.number} closed: {len(closed.slots)} nodes, world size "
                f"{closed.world_size}, members {name_list(closed.members)} (term {job.round_term}){waiting}",
                round=closed.number,
                data={"world_size": closed.world_size, "nnodes": len(closed.slots), "term": job.round_term},
            )
            return
        deadline = rdzv.join_deadline()
        if deadline is not None and now >= deadline:
            have = len(rdzv.waiting)
            job.finish(
                Outcome(
                    succeeded=False,
                    exit_code=EXIT_FAILED,
                    summary=f"rendezvous timed out after {job.settings.join_timeout_s:g}s: "
                    f"{have} node(s) joined, at least {job.settings.min_nodes} needed "
                    f"(node unit {job.settings.node_unit})",
                ),
                now,
            )
