"""Progress reports from a worker to its node's agent: a local datagram, never a network call.

The agent listens on a Unix datagram socket named by ``ELASTIC_AGENT_SOCKET``. A report is one small
JSON datagram. Step reports are sent without blocking: progress is advisory, and one dropped while the
agent is busy is superseded by the next. Checkpoint reports are the agent's persist requests, so they
must arrive: they wait (at most :data:`CKPT_SEND_TIMEOUT_S`) for room in the agent's queue, which the
kernel never drops from. If the agent is not listening (e.g. the script runs under plain torchrun)
reports are silently dropped, so calling :func:`report` is always safe and cheap.

Stack dumps for hang verdicts: the first report arms ``faulthandler`` on SIGUSR1 (all threads), writing
to the file the agent names in ``ELASTIC_STACK_FILE``; before the agent kills a hung worker it sends
SIGUSR1 (then SIGCONT, so that a stopped worker can write it). Nothing is armed without that variable,
or when the script has its own SIGUSR1 handler.

Compute time for the straggler report: with :func:`elastic.track_ddp`, DDP's gradient all-reduce adds
the time it waited for other ranks (:func:`add_comm_wait`), and a step report also carries the step's
time minus that wait (seconds per step). The datagram's form is :class:`elastic.contract.Progress`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from elastic import contract
from elastic.contract import CKPT_SEND_TIMEOUT_S, Progress, ProgressKind

SOCKET_ENV = contract.AGENT_SOCKET
#: Per-worker file for the faulthandler stack dump (set by the agent).
STACK_FILE_ENV = contract.STACK_FILE
#: The signal that makes an armed worker write its Python stack (all threads) to its stack file.
STACK_SIGNAL = signal.SIGUSR1
ROUND_ENV = contract.ROUND

log = logging.getLogger(__name__)
_sock: socket.socket | None = None
_reliable_sock: socket.socket | None = None  # blocking, with a send timeout: checkpoint reports
_path: str | None = None
_armed = False
_stack_file = None  # kept open for the process's life: faulthandler writes to its descriptor

_lock = threading.Lock()
_comm_wait_s = 0.0  # all-reduce wait since the last step report (elastic.track_ddp)
_tracking = False
_last: tuple[int, float] | None = None  # (step, time.monotonic()) of the last step report


def _arm_stack_dump() -> None:
    """Register faulthandler on SIGUSR1 once, if the agent asked for it and the signal is free."""
    global _armed, _stack_file
    _armed = True
    path = os.environ.get(STACK_FILE_ENV)
    if not path or not hasattr(faulthandler, "register"):
        return
    if signal.getsignal(STACK_SIGNAL) not in (signal.SIG_DFL, None):
        return  # the script handles SIGUSR1 itself; the agent then sends nothing
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _stack_file = open(path, "w")  # noqa: SIM115 - must stay open for faulthandler
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        _stack_file = None  # no dump then; reporting progress must never fail


def rearm_stack_dump() -> None:
    """A worker that lives on into a new round (in-process recovery) dumps its stack to the file the
    agent named for that round; nothing changes when none was armed."""
    global _stack_file
    path = os.environ.get(STACK_FILE_ENV)
    old = _stack_file
    if old is None or not path or old.name == path:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _stack_file = open(path, "w")  # noqa: SIM115 - must stay open for faulthandler
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        return  # the old file keeps the dump; reporting must never fail
    old.close()


def add_comm_wait(seconds: float) -> None:
    """Add time that a collective waited for other ranks to the current step (see elastic.track_ddp)."""
    global _comm_wait_s, _tracking
    with _lock:
        _comm_wait_s += max(0.0, seconds)
        _tracking = True


def _sockets(path: str) -> tuple[socket.socket, socket.socket]:
    """The non-blocking socket of step reports and the blocking one of checkpoint reports."""
    global _sock, _reliable_sock, _path
    if _sock is None or _reliable_sock is None or _path != path:
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sock.setblocking(False)
        _reliable_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The kernel's own send timeout: a blocking send to a full Unix datagram queue sleeps until the
        # receiver reads (Python's settimeout would poll the unconnected socket in a busy loop).
        seconds = int(CKPT_SEND_TIMEOUT_S)
        timeval = struct.pack("ll", seconds, int((CKPT_SEND_TIMEOUT_S - seconds) * 1e6))
        _reliable_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        _path = path
    return _sock, _reliable_sock


def _local_rank() -> int:
    # ELASTIC_LOCAL_RANK: the real local rank, also under --virtual-local-rank (LOCAL_RANK=0 everywhere).
    return int(os.environ.get(contract.ELASTIC_LOCAL_RANK) or os.environ.get(contract.LOCAL_RANK, "0"))


def _progress(kind: ProgressKind, step: int, **fields: Any) -> Progress:
    """A report of this worker, sent now; ``fields``: the optional fields of :class:`Progress`."""
    return Progress(local_rank=_local_rank(), kind=kind, step=step, sent_at=time.time(), **fields)


def _send(message: Progress, *, reliable: bool = False) -> None:
    if not _armed:
        _arm_stack_dump()
    path = os.environ.get(SOCKET_ENV)
    if not path:
        return
    fast, sure = _sockets(path)
    data = message.encode()
    if not reliable:
        # The agent may be busy or gone (OSError): progress is advisory, a training step never waits for it.
        with contextlib.suppress(OSError):
            fast.sendto(data, path)
        return
    try:
        sure.sendto(data, path)
    except (BlockingIOError, TimeoutError):
        log.warning(
            "elastic: the agent took no checkpoint report for %gs (is it stopped?); step %s not reported",
            CKPT_SEND_TIMEOUT_S,
            message.step,
        )
    except OSError:
        pass  # no agent listens (gone, or never there): nothing to report to


def report(step: int) -> None:
    """Tell the agent this worker completed training step ``step`` (feeds hang and straggler checks).

    Non-blocking, and never raises for want of an agent: a report the agent cannot take now is dropped
    (the next one supersedes it), and without elastic-run nothing is sent. The first report arms the
    stack dump the agent asks for before it kills a hung worker. :meth:`elastic.ElasticSampler.advance`
    and :meth:`elastic.World.commit` call it; call it yourself after each optimizer step otherwise.

    Args:
        step: optimizer steps completed so far.
    """
    global _comm_wait_s, _last
    step = int(step)
    compute: float | None = None
    now = time.monotonic()
    with _lock:
        if _last is None or step > _last[0]:
            if _tracking and _last is not None:
                compute = max(0.0, now - _last[1] - _comm_wait_s) / (step - _last[0])
            _comm_wait_s, _last = 0.0, (step, now)
    _send(_progress(ProgressKind.STEP, step, compute_s=compute))


def report_done() -> None:
    """Tell the agent this worker's training is over (its teardown follows): from now on it is not judged
    on step progress. Called by :func:`elastic.destroy_process_group`."""
    _send(_progress(ProgressKind.DONE, _last[0] if _last is not None else 0))


def report_checkpoint(
    step: int, location: str = "", persist_to: str = "", *, save_s: float | None = None
) -> None:
    """Tell the agent this worker holds a complete checkpoint of ``step`` (feeds the committed step).

    :func:`elastic.save` calls it; a script calls it itself only for checkpoints it writes another way.
    Waits for room in the agent's queue, at most :data:`CKPT_SEND_TIMEOUT_S` (then the report is dropped
    with a warning); without elastic-run nothing is sent.

    Args:
        step: the training step the checkpoint holds.
        location: the checkpoint file in the agent's shared memory, when the agent should persist it.
        persist_to: the folder to persist it to (default: the agent's ``--ckpt-dir``).
        save_s: how long the save took, from the call to the checkpoint being complete in memory (the
            agent's ``elastic_agent_checkpoint_save_seconds``; an agent that predates it ignores it).
    """
    fence: int | None = None
    with contextlib.suppress(
        KeyError, ValueError
    ):  # the round fences the agent's persist (agent.checkpoints.fence)
        fence = int(os.environ[ROUND_ENV])
    message = _progress(
        ProgressKind.CKPT,
        int(step),
        location=location,
        persist_to=persist_to,
        save_s=None if save_s is None else round(max(0.0, float(save_s)), 6),
        round=fence,
    )
    _send(message, reliable=True)


def report_corrupt(step: int, location: str) -> None:
    """Tell the agent that a copy of the checkpoint of ``step`` (the file ``location``) failed its digest
    check at restore (:class:`elastic.checkpoint.digest.CheckpointCorruptError`); the restore went on with
    another copy. The agent's heartbeat carries it to the master (event ``checkpoint_corrupt``). Sent like
    a checkpoint report: it waits for room in the agent's queue, at most :data:`CKPT_SEND_TIMEOUT_S`."""
    _send(_progress(ProgressKind.CORRUPT, int(step), location=str(location)), reliable=True)


def report_integrity(
    verdict: Any,
    *,
    rank: int,
    world_size: int = 0,
    rolled_back_to: int | None = None,
    samples: Sequence[int] = (),
) -> None:
    """Tell the agent what the integrity guard found (an :class:`elastic.integrity.Verdict` with a
    ``kind``), and with ``rolled_back_to`` the verified step the job then rolled back to in process. The
    agent's heartbeat carries it to the master (events ``integrity_detected``, ``integrity_rolled_back``;
    a recurring one stops the job, a node named as the odd replica too often is excluded).

    Every rank's verdict is the same, so only global rank 0 and the ranks the verdict names report it
    (each agent then knows whether one of its own workers was named). ``world_size``: the replicas
    compared; ``samples``: the global sample indices of the verdict's step, when known (rank 0 sends
    them). Sent like a
    checkpoint report: it waits for room in the agent's queue, at most :data:`CKPT_SEND_TIMEOUT_S`."""
    ranks = tuple(int(r) for r in getattr(verdict, "ranks", ()))
    if rank != 0 and rank not in ranks:
        return
    note = contract.IntegrityNote(
        kind=str(verdict.kind),
        ranks=ranks,
        world_size=int(world_size),
        named_here=rank in ranks,
        recurring=bool(getattr(verdict, "recurring", False)),
        samples=tuple(int(i) for i in samples),
        odd=verdict.kind == "mismatch" and 0 < 2 * len(ranks) < world_size,
    )
    _send(
        _progress(
            ProgressKind.INTEGRITY, int(verdict.step), detail=note.to_detail(), rolled_back_to=rolled_back_to
        ),
        reliable=True,
    )
