"""One persist of a checkpoint from the node's shared memory to disk, as the keeper's thread runs it.

A replicated checkpoint file is copied to a temp file next to its final name (flushed as it goes, see
:func:`copy`), then committed fenced by the worker's round (:mod:`agent.checkpoints.fence`: rename, fsync the
folder, move ``latest`` never backwards, prune only older files). A node's sharded save is persisted
by :mod:`agent.checkpoints.sharded_persist` (the node completing a step commits it). A checkpoint the worker
replaced in memory before its persist began is skipped: a newer one exists and its report follows.

Test hook (the only one): ``ELASTIC_PERSIST_DELAY_S`` (:func:`parse_persist_delay`, ``D`` or ``D@S``)
pauses every persist of a step >= ``S`` for ``D`` seconds right after the first chunk of the temp file
is written, i.e. in the middle of the copy.

Standard library only (the agent never imports torch).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agent.checkpoints import fence as ckpt_fence
from agent.checkpoints import sharded_persist
from elastic.checkpoint import layout, shard_layout

log = logging.getLogger(__name__)

PERSIST_DELAY_ENV = "ELASTIC_PERSIST_DELAY_S"
_COPY_CHUNK = 8 << 20
_SYNC_EVERY = 256 << 20

#: ``copy(src, dst)``: the copy of one file's bytes, as the keeper runs it (progress, test pause).
Copy = Callable[[BinaryIO, BinaryIO], None]


def parse_persist_delay(text: str | None) -> tuple[float, int]:
    """``"D"`` or ``"D@S"`` → ``(D seconds, from step S)``; empty → no delay."""
    if not text:
        return 0.0, 0
    seconds, _, step = text.partition("@")
    try:
        delay, first = float(seconds), int(step or 0)
    except ValueError:
        raise ValueError(f"{PERSIST_DELAY_ENV} must be SECONDS or SECONDS@STEP, got {text!r}") from None
    if delay < 0:
        raise ValueError(f"{PERSIST_DELAY_ENV} must not be negative, got {text!r}")
    return delay, first


@dataclass(frozen=True)
class Request:
    """A checkpoint to persist: its step, file in memory (a sharded save: the node's data folder, and
    ``save_id``), target folder and the worker's round."""

    step: int
    source: Path
    target: Path
    round: int | None
    save_id: str = (
        ""  # a sharded save's (agent.checkpoints.sharded_persist); "" for a replicated checkpoint file
    )

    @property
    def kind(self) -> str:
        return "sharded" if self.save_id else "file"


def sharded_request(step: int, link: Path, target: Path, round_number: int | None) -> Request | None:
    """The request for a node's sharded save of ``step``, reported by its ``step_<N>`` ``link`` in memory,
    to persist to ``<target>/sharded``; None when a newer save replaced it meanwhile."""
    try:
        match = shard_layout.DATA_DIR.match(os.readlink(link))
    except OSError:
        match = None
    if match is None or int(match.group(1)) != step:
        log.info("sharded checkpoint of step %d was replaced in memory before its persist; skipped", step)
        return None
    source = link.parent / match.group(0)
    return Request(step, source, target / shard_layout.SHARDED_SUBDIR, round_number, match.group(2))


def newest_in(folder: Path, last: Request) -> Request | None:
    """The newest checkpoint of ``last``'s kind in the memory ``folder``, to persist where ``last`` went."""
    if last.kind == "sharded":
        saves = shard_layout.committed(folder / shard_layout.SHARDED_SUBDIR)[:1]
        newest = [Request(s, data, last.target, last.round, sid) for s, sid, data in saves]
    else:
        files = layout.checkpoint_files(folder)[:1]
        newest = [Request(s, path, last.target, last.round) for s, path in files]
    return newest[0] if newest else None


@dataclass(frozen=True)
class Outcome:
    """What a persist did. Neither published nor superseded: skipped (replaced in memory) or given up."""

    published: bool = False  # the files are in the target folder
    committed: bool = False  # and the step is complete there: the keeper's persisted step moves
    superseded: bool = False  # not published: a newer round committed to the folder


def copy(
    src: BinaryIO, dst: BinaryIO, on_progress: Callable[[], None], pause: Callable[[], None] | None = None
) -> None:
    """Copy ``src`` to ``dst`` in chunks, calling ``on_progress`` after each and ``pause`` (the test
    hook) after the first."""
    first = True
    unsynced = 0
    while chunk := src.read(_COPY_CHUNK):
        dst.write(chunk)
        unsynced += len(chunk)
        if unsynced >= _SYNC_EVERY:
            # Flush as we go: the final fsync then stays short, so that a long silence means a hung
            # disk (the keeper's stall_s), not a large checkpoint's last flush.
            dst.flush()
            os.fdatasync(dst.fileno())
            unsynced = 0
        on_progress()
        if first and pause is not None:
            dst.flush()  # the torn temp file is visible on disk during the pause
            pause()
        first = False


def persist(
    request: Request, *, keep: int, copy: Copy, lock_timeout_s: float, cancel: threading.Event
) -> Outcome:
    """Persist ``request`` (see the module doc), keeping the newest ``keep`` in its target folder.

    ``cancel``: set when the keeper's stop gives this persist up; it ends a wait for the fence lock, and
    nothing is published after it is set.

    Raises:
        OSError: the copy or the commit failed (disk full, EIO, the fence lock held too long...).
    """
    if request.save_id:
        return _persist_sharded(request, keep, copy, lock_timeout_s, cancel)
    started = time.monotonic()
    try:
        # Open first: the worker may prune or recycle the file any time; an open file under the
        # shared lock stays readable and unchanged.
        src = layout.open_shared(request.source)
    except FileNotFoundError:
        log.info("checkpoint of step %d was replaced in memory before its persist; skipped", request.step)
        return Outcome()
    with src:
        request.target.mkdir(parents=True, exist_ok=True)
        final = request.target / request.source.name
        tmp = layout.write_temp(final, lambda dst: copy(src, dst))
    if cancel.is_set():  # the stop gave this persist up: publish nothing behind its back
        tmp.unlink(missing_ok=True)
        return Outcome()
    decision = ckpt_fence.commit(
        request.target,
        tmp,
        final,
        round_=request.round,
        step=request.step,
        keep=keep,
        lock_timeout_s=lock_timeout_s,
        cancel=cancel,
    )
    if not decision.publish:
        log.info("not persisting the checkpoint of step %d: %s", request.step, decision.why)
        return Outcome(superseded=True)
    log.debug(
        "persisted the checkpoint of step %d to %s in %.2fs (%s)",
        request.step,
        final,
        time.monotonic() - started,
        decision.why,
    )
    return Outcome(published=True, committed=True)


def _persist_sharded(
    request: Request, keep: int, copy: Copy, lock_timeout_s: float, cancel: threading.Event
) -> Outcome:
    started = time.monotonic()
    try:
        outcome = sharded_persist.persist(
            request.source,
            request.target,
            step=request.step,
            save_id=request.save_id,
            round_=request.round,
            keep=keep,
            copy=copy,
            lock_timeout_s=lock_timeout_s,
            cancel=cancel,
        )
    except FileNotFoundError:
        log.info(
            "sharded checkpoint of step %d was replaced in memory before its persist; skipped",
            request.step,
        )
        return Outcome()
    if not outcome.published:
        if cancel.is_set():
            return Outcome()
        log.info("not persisting the sharded checkpoint of step %d: %s", request.step, outcome.why)
        return Outcome(superseded=True)
    log.debug(
        "persisted this node's part of the sharded checkpoint of step %d to %s in %.2fs%s",
        request.step,
        request.target,
        time.monotonic() - started,
        " (the step is complete there)" if outcome.committed else "",
    )
    return Outcome(published=True, committed=outcome.committed)
