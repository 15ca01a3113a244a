"""In-process recovery: on a lost worker or node, or a joining node, live workers keep their processes.

Opt in by handing the training function and its state to :func:`run`::

    model, optimizer = make_model(), make_optimizer()
    sampler = elastic.ElasticSampler(dataset, global_batch_size=512, drop_last=True)

    def train(world: elastic.World) -> None:
        ddp = DistributedDataParallel(model)             # wrapped on this world's group
        step = world.step                                # the newest committed step
        for batch in sampler.steps():
            ...forward, backward, optimizer.step()...
            step = sampler.advance()
            world.commit(step)                           # a step every rank completed

    elastic.run(train, {"model": model, "optimizer": optimizer, "sampler": sampler})

What happens on a fault:

1. The agent learns of a new round (a worker died, a node was lost or joined) and tells its live workers
   to leave the step. :meth:`World.commit` raises :class:`WorldChanged`; a collective blocked on a
   vanished peer is released (:mod:`elastic.inprocess.pg_control`) and raises too.
2. :func:`run` puts back the state of the last commit (a step that broke half-way is undone), drops the
   process group and waits for the next round's ranks from the agent, which also starts new processes for
   lost local ranks. ``os.environ`` (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``,
   ``TORCHELASTIC_RESTART_COUNT``...) is updated for libraries that read it.
3. The new group forms in the same process; every rank agrees on the newest committed step, and the
   ranks that lack it (new processes, or a rank one step behind) receive it from a live peer, in memory
   (:mod:`elastic.inprocess.state`). Then ``train`` is called again with the new :class:`World`.

If that does not work out (the agent goes away, the group does not form), the exception ends the
process and the agent falls back to restarting processes, as for any script. Without an agent that
offers it (plain torchrun) :func:`run` forms the group once and calls ``train`` once. docs/inprocess.md
has the whole story.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from elastic import contract
from elastic.distributed import backend_for_device
from elastic.errors import WorkerError
from elastic.inprocess import wire
from elastic.inprocess.link import AgentGone, AgentLink
from elastic.inprocess.pg_control import GroupControl
from elastic.inprocess.state import Committed, Stateful, agree
from elastic.integrity.guard import Guard, IntegrityFault
from elastic.report import rearm_stack_dump, report, report_integrity

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Default seconds between the agent's pause and the release of a group still in a collective.
DEFAULT_LEAVE_GRACE_S = 0.1
#: Default seconds a re-formed group may take to form (every rank reached the new store) before in-process
#: recovery gives up and the agent falls back to restarting processes.
DEFAULT_REFORM_TIMEOUT_S = 60.0


class WorldChanged(Exception):  # noqa: N818 - it is news, not an error
    """Raised by :meth:`World.commit` when the agent asked to leave: a new round is forming."""


@dataclass
class World:
    """The current world of an in-process job: this rank's place in it and the step it resumed from."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    round: int
    step: int
    backend: str
    _committed: Committed = field(repr=False)
    _link: AgentLink | None = field(repr=False)

    def commit(self, step: int) -> None:
        """Mark ``step`` as done on every rank (call it after the optimizer step, outside collectives).

        Copies the state into memory (what a broken next step goes back to), reports progress to the
        agent, and raises :class:`WorldChanged` when the agent asked to leave."""
        self._committed.take(step)
        report(step)
        link = self._link
        if link is None:
            return
        link.committed()
        if link.pausing.is_set():
            link.left_step()
            raise WorldChanged(f"round {link.pause_round} is forming")

    @property
    def is_first(self) -> bool:
        """Rank 0 (log, write files): rank-0 duties move with it when another process becomes rank 0."""
        return self.rank == 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _env_int(name: str, default: int = 0) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def run(
    train: Callable[[World], T],
    state: Mapping[str, Stateful],
    *,
    step: int = 0,
    backend: str | None = None,
    timeout_s: float | None = None,
    leave_grace_s: float = DEFAULT_LEAVE_GRACE_S,
    reform_timeout_s: float = DEFAULT_REFORM_TIMEOUT_S,
    guard: Guard | None = None,
) -> T:
    """Run ``train`` in this process until it returns, re-forming the group around it after each fault.

    Args:
        train: called with the current :class:`World` each time a group formed; returns when training is
            done. It must call :meth:`World.commit` after every step and rebuild what depends on the
            group (DDP, the sampler's share, data-loader iterators) at each call.
        state: the objects whose ``state_dict()`` is the training state (model, optimizer, sampler...);
            an :class:`~elastic.sampler.ElasticSampler` among them is re-sharded to each new world.
        step: the step ``state`` holds at start (e.g. what ``elastic.load`` restored).
        backend: the collective backend; by default nccl with a GPU, else gloo.
        timeout_s: how long a live worker waits for the agent's word (a pause after its collective broke,
            the next round after it paused) before it gives up; None: as long as its agent is connected
            (an agent that dies or stops the worker closes the connection, which ends the wait).
        leave_grace_s: how long a pause waits at least for the loop to reach a commit before it releases
            the group; one and a half last steps when longer, at most 0.8 s.
        reform_timeout_s: how long re-forming the group after a fault may take; past it this process ends
            and the agent falls back to restarting processes.
        guard: the :class:`elastic.Guard` that ``train`` calls after each step. When it raises
            :class:`elastic.IntegrityFault`, every rank rolls back in process to the guard's newest verified
            step: ``elastic.load(step=...)`` restores it into ``state`` (save the objects of ``state`` under
            the same keys, e.g. ``{name: obj.state_dict() for name, obj in state.items()}``, and tell the
            guard with ``guard.saved(step)``) and ``train`` is called again from there (docs/integrity.md).
            A fault with no verified step, or one that recurs at the same step, ends the process.

    Returns:
        What ``train`` returned. The process group is left formed (destroy it when done).
    """
    if (timeout_s is not None and timeout_s <= 0) or leave_grace_s < 0 or reform_timeout_s <= 0:
        raise ValueError(
            "timeout_s and reform_timeout_s must be > 0 (timeout_s may be None), leave_grace_s >= 0"
        )
    if backend is None:
        import torch

        backend = backend_for_device(torch.cuda.is_available())
    control = GroupControl(backend)
    link = AgentLink.connect(leave_grace_s, control.release)
    committed = Committed(state, step)
    recovering = False
    world: World | None = None
    while True:
        if world is None:
            try:
                world = _form(control, committed, link, backend, reform_timeout_s if recovering else None)
            except _PausedWhileForming:
                assert link is not None
                link.left_step()
                _leave(control, committed, link, timeout_s)
                recovering = True
                continue
        _reshard(state, world)
        try:
            return train(world)
        except IntegrityFault as fault:  # every rank raised it at the same step: the group is whole
            if guard is None:
                raise
            world = _roll_back(fault, guard, state, committed, world)
            continue
        except WorldChanged:
            pass
        except RuntimeError as exc:  # torch.distributed's errors (DistError) are RuntimeErrors
            if link is None:
                raise
            if not link.pausing.is_set():
                link.send(wire.BROKEN, error=_first_line(exc))
                if not link.wait_pause(timeout_s):
                    raise  # nobody opens a round: not a broken world but this worker's own error
            link.left_step()
        assert link is not None  # WorldChanged and a survived RuntimeError both need the agent
        _leave(control, committed, link, timeout_s)
        recovering = True
        world = None


class _PausedWhileForming(WorkerError):
    """The agent paused this worker while its group formed or agreed on the state: a newer round began."""


def _form(
    control: GroupControl, committed: Committed, link: AgentLink | None, backend: str, reform_s: float | None
) -> World:
    """Form this round's group from the environment and agree on the committed step; ``reform_s``: after
    a fault, how long that may take (the agent then falls back to restarting processes)."""
    began = time.monotonic()
    recovering = reform_s is not None
    if link is not None and link.pausing.is_set():  # the next round began before this one formed
        raise _PausedWhileForming(f"round {link.pause_round} began before this group formed")
    try:
        control.form(reform_s)
        decided = agree(committed)
    except Exception as exc:
        if link is not None and link.pausing.is_set():
            # The next round began while this one formed (a member that never came): the pause released
            # the formation; leave it like a broken step and form the next round's group in process.
            raise _PausedWhileForming(_first_line(exc)) from exc
        if link is not None and recovering:
            link.send(wire.FAILED, error=_first_line(exc))
        raise
    round_number = _env_int(contract.ROUND)
    if link is not None and recovering:
        link.send(wire.RESUMED, round=round_number)
    world = World(
        rank=_env_int(contract.RANK),
        world_size=_env_int(contract.WORLD_SIZE, 1),
        local_rank=_env_int(contract.LOCAL_RANK),
        restart_count=_env_int(contract.RESTART_COUNT),
        round=round_number,
        step=decided.step,
        backend=backend,
        _committed=committed,
        _link=link,
    )
    if recovering:
        sent = (
            f"rank {decided.source} sent it to ranks {list(decided.receivers)}"
            if decided.source is not None
            else "every rank held it"
        )
        log.info(
            "rank %d of %d: re-formed in process (round %d) at step %d in %.3fs; %s",
            world.rank,
            world.world_size,
            world.round,
            world.step,
            time.monotonic() - began,
            sent,
        )
    return world


def _reshard(state: Mapping[str, Stateful], world: World) -> None:
    """Deal the next steps of every sampler in ``state`` (``ElasticSampler.reshard``) to this world."""
    for obj in state.values():
        reshard = getattr(obj, "reshard", None)
        if callable(reshard):
            reshard(world.world_size, world.rank)


def _roll_back(
    fault: IntegrityFault, guard: Guard, state: Mapping[str, Stateful], committed: Committed, world: World
) -> World:
    """Put every rank back at the guard's newest verified step (checkpoint and sampler), in process; the
    fault goes on (ending the process) when there is none, or when it recurred at the same step."""
    from elastic.checkpoint import replicated  # torch-heavy, and only needed here

    verdict = fault.verdict
    target = verdict.rollback_to
    # A recurring fault ends the job (the master stops it, exit 3): name the samples of its step.
    samples = _step_samples(state, verdict.step) if verdict.recurring and world.rank == 0 else []
    report_integrity(verdict, rank=world.rank, world_size=world.world_size, samples=samples)
    if target is None or verdict.recurring:
        raise fault
    loaded = replicated.load(step=target)
    if loaded is None:  # load(step=) raises when no rank holds it; keep the types honest
        raise fault
    saved, restored = loaded
    missing = sorted(set(state) - set(saved))
    if missing:
        raise replicated.CheckpointError(
            f"integrity rollback: the checkpoint of step {restored} lacks {missing}: save the objects given "
            "to elastic.run under the same keys"
        )
    for name, obj in state.items():
        obj.load_state_dict(saved[name])
    committed.take(restored)
    guard.rolled_back(restored)
    report_integrity(verdict, rank=world.rank, world_size=world.world_size, rolled_back_to=restored)
    log.warning(
        "rank %d: integrity rollback in process from step %d to the verified step %d (%s)",
        world.rank,
        verdict.step,
        restored,
        verdict.kind,
    )
    return replace(world, step=restored)


def _step_samples(state: Mapping[str, Stateful], step: int) -> list[int]:
    """The global sample indices of ``step`` from a sampler in ``state`` that stands at it (an
    :class:`elastic.ElasticSampler`'s ``last_step_indices``); empty when none knows them."""
    for obj in state.values():
        indices = getattr(obj, "last_step_indices", None)
        if callable(indices) and getattr(obj, "step", None) == step:
            return list(indices())
    return []


def _leave(control: GroupControl, committed: Committed, link: AgentLink, timeout_s: float | None) -> None:
    """Undo the broken step, drop the group, and take the next round's environment."""
    committed.restore()
    control.drop()
    link.send(wire.PAUSED, round=link.pause_round, step=committed.step)
    try:
        resume = link.wait_resume(timeout_s)
    except (AgentGone, TimeoutError) as exc:
        raise RuntimeError(f"in-process recovery gave up: {exc}") from exc
    os.environ.update({str(k): str(v) for k, v in resume["env"].items()})
    rearm_stack_dump()  # a hang verdict reads this round's stack file
