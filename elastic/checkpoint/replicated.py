"""Checkpoints of data-parallel (replicated) training: :func:`save`, :func:`load`, :func:`load_latest`.

Under elastic-run, :func:`save` is a *flash* save: it writes the state into the shared-memory folder
that the node's agent owns (``ELASTIC_SHM_DIR``, in ``/dev/shm``) and returns; no disk I/O happens in
the worker. It is a memory copy of the tensors' bytes into a shared-memory segment that is reused from
save to save (already faulted in: :mod:`elastic.checkpoint.flash`, :mod:`elastic.checkpoint.segments`),
in the raw format of :mod:`elastic.checkpoint.flash`; a state that format does not describe falls back to
``torch.save`` into a new file, and a state no ``weights_only=True`` load could read back is refused
(:func:`check_loadable`). The file is written under a temp name and renamed when complete (the rename
is the commit), so a worker killed mid-save never leaves a torn checkpoint visible, and a worker killed
right after a save leaves that save behind in the agent's memory. The agent persists it to ``ckpt_dir``
(default its ``--ckpt-dir``) in the background (see ``agent/checkpoints/keeper.py``). Memory keeps the last
:data:`MEMORY_KEEP` saves; when space is short the older goes first, and a save that still does not fit is
a :class:`CheckpointError` naming the sizes and how to enlarge ``/dev/shm``.

The state of data-parallel training is the same on every rank, so on each node only local rank 0
writes it to memory (every node then holds a copy), and only the node with ``GROUP_RANK`` 0 asks the
agent to persist it (one writer on a shared file system). The other ranks only report the step.

Without an agent (plain torchrun, or no launcher), :func:`save` falls back to an atomic disk save by
global rank 0 into ``ckpt_dir`` (temp file, fsync, rename, then the ``latest`` marker), keeping the
newest ``keep``. Both use the layout of :mod:`elastic.checkpoint.layout`.

:func:`load` restores the same step on every rank: the newest step that *any* rank holds (the agent's
shared memory or the disk folder), agreed through the process group; the ranks that lack it receive it
from a holder. A node that joins, or replaces a lost one, never holds anything; requiring every rank to
hold a step would throw the whole job's progress away. Every rank restores the bytes of one holder's file:
the lowest-ranked holder whose copy loads sends it to all ranks, so no two ranks can restore different
states under one step number (after a rollback, memory and disk may both hold a "step N" of different
runs). Should no copy of the newest step load, the ranks agree to try the next newest, together. The
planning (:func:`plan`) is pure; :func:`restore` does the collectives and the file reads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from elastic import autoprogress, collectives, errors
from elastic.checkpoint import flash, hostmem, layout, segments
from elastic.checkpoint.digest import CheckpointCorruptError
from elastic.checkpoint.env import (
    CKPT_DIR_ENV,
    CKPT_RESET_ENV,
    COMMITTED_STEP_ENV,
    SHM_DIR_ENV,
    CheckpointError,
    check_args,
    env_int,
    node_local_rank,
    resolve_dir,
    resolve_rank,
)
from elastic.contract import DEFAULT_CKPT_KEEP, INPROCESS_SOCKET
from elastic.report import report, report_checkpoint, report_corrupt

LATEST_MARKER = layout.LATEST_MARKER

log = logging.getLogger(__name__)
_warned_memory_only = False


def flash_enabled() -> bool:
    """True under elastic-run: :func:`save` writes to the agent's shared memory."""
    return bool(os.environ.get(SHM_DIR_ENV))


# -- save -------------------------------------------------------------------------------------------
def save(
    state: dict[str, Any],
    step: int,
    ckpt_dir: str | os.PathLike[str] | None = None,
    *,
    keep: int = DEFAULT_CKPT_KEEP,
    rank: int | None = None,
    persist: bool = True,
) -> Path | None:
    """Save ``state`` as the checkpoint of ``step``.

    Call it on every rank with the same (replicated) state.

    Under elastic-run (``ELASTIC_SHM_DIR`` set) the save is a flash save: local rank 0 of each node
    writes the state into the agent's shared memory (a memory copy into a reused segment, see
    :mod:`elastic.checkpoint.flash`; GPU tensors are copied asynchronously and the save is reported once
    they are in) and every rank reports the step to its agent; the call returns without disk I/O.
    With ``persist`` (the default) the agent of node rank 0 then copies it to ``ckpt_dir`` (default
    ``ELASTIC_CKPT_DIR``, i.e. elastic-run's ``--ckpt-dir``) in the background, keeping elastic-run's
    ``--ckpt-keep``; ``persist=False`` keeps this save in memory only (e.g. save to memory every step,
    persist every N steps). ``keep`` and ``rank`` are not used then.

    Without an agent, global rank 0 writes the checkpoint to ``ckpt_dir`` atomically (temp file, fsync,
    rename, then the ``latest`` marker) and keeps the newest ``keep``; the other ranks return at once.

    Args:
        state: what to restore later, e.g. ``{"model": m.state_dict(), "optimizer": o.state_dict()}``.
            Keep to tensors, numbers, strings, None and containers of them: loading uses
            ``weights_only=True``.
        step: training steps completed; names the file, and the newest step is what is resumed.
        ckpt_dir: directory of disk saves (created if needed); default ``ELASTIC_CKPT_DIR``.
        keep: disk saves to keep, this one included (>= 1).
        rank: global rank of the caller; default the ``RANK`` environment variable, else 0.
        persist: under elastic-run, also persist this save to disk in the background.

    Returns:
        The file written (in shared memory or on disk) on the rank that wrote it, else ``None``.

    Raises:
        ValueError: no directory configured (disk mode), a negative ``step``, or ``keep < 1``.
        TypeError: ``state`` is not a dict.
        StateNotLoadableError: ``state`` holds a value no load could read back (a numpy array, an
            ``argparse.Namespace``...; see :func:`check_loadable`): one line naming its key.
        CheckpointError: the shared-memory folder is too small for the state (the message names the
            size needed and the size available) or is gone, or the background part of the previous
            save (device-to-host copies of GPU state) failed.
    """
    check_args(state, step)
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    autoprogress.save_started()  # not a hang while it saves; its checkpoint report ends the save
    shm_dir = os.environ.get(SHM_DIR_ENV)
    if shm_dir:
        return _flash_save(state, step, Path(shm_dir), ckpt_dir, persist)
    return _disk_save(state, step, resolve_dir(ckpt_dir), keep, resolve_rank(rank))


def _flash_save(
    state: dict[str, Any],
    step: int,
    shm_dir: Path,
    ckpt_dir: str | os.PathLike[str] | None,
    persist: bool,
) -> Path | None:
    global _warned_memory_only
    began = time.monotonic()  # the save's latency, reported to the agent (its checkpoint-save metric)
    writes = node_local_rank() == 0
    path = shm_dir / layout.step_file_name(step) if writes else None
    # A location asks the agent to persist the file: only one node does, the others keep memory copies.
    location = persist_to = ""
    if path is not None and persist and env_int("GROUP_RANK", 0) == 0:
        folder = ckpt_dir or os.environ.get(CKPT_DIR_ENV) or None  # '' counts as not given
        if folder is not None:
            # Absolute: the agent's working directory need not be the worker's.
            location, persist_to = str(path), str(Path(folder).resolve())
        elif not _warned_memory_only:
            _warned_memory_only = True
            log.warning(
                "elastic.save: no checkpoint folder (ckpt_dir, or elastic-run --ckpt-dir): checkpoints "
                "stay in shared memory only and do not survive the node"
            )
    if path is None:
        report_checkpoint(step)
        return None
    # Reported once the file is visible: at the return, or later for device state (async copies).
    return _write_to_memory(
        state,
        step,
        shm_dir,
        lambda: report_checkpoint(step, location, persist_to, save_s=time.monotonic() - began),
    )


def _disk_save(state: dict[str, Any], step: int, directory: Path, keep: int, rank: int) -> Path | None:
    path = None
    if rank == 0:
        check_loadable(state)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / layout.step_file_name(step)
        layout.atomic_write(path, lambda f: torch.save({"step": step, "state": state}, f))
        # The marker moves only after the checkpoint it names is durable.
        layout.write_marker(directory, path)
        layout.prune(directory, path, keep)
        layout.remove_temp_files(directory)
    report_checkpoint(step)  # a no-op without an agent
    return path


# -- load -------------------------------------------------------------------------------------------
def load_latest(
    ckpt_dir: str | os.PathLike[str] | None = None, *, map_location: Any = "cpu"
) -> tuple[dict[str, Any], int] | None:
    """Load the newest complete checkpoint of one disk folder, on this rank alone.

    Tries the file named by the ``latest`` marker first, then the ``step_*.pt`` files newest first, so a
    missing marker, or one naming a missing or unreadable file, falls back to the next good checkpoint.
    Temp files of unfinished saves are never read. For a restore that all ranks agree on, with the
    agent's shared memory first, use :func:`load`.

    Args:
        ckpt_dir: directory; default the ``ELASTIC_CKPT_DIR`` environment variable.
        map_location: passed to :func:`torch.load`; default loads tensors to CPU.

    Returns:
        ``(state, step)`` as given to :func:`save`, or ``None`` when there is no checkpoint yet.

    Raises:
        ValueError: no directory configured.
        CheckpointError: checkpoint files exist but none can be loaded.
    """
    directory = resolve_dir(ckpt_dir)
    if not directory.is_dir():
        return None
    candidates: list[Path] = []
    marked = layout.read_marker(directory)
    if marked is not None and marked.is_file():
        candidates.append(marked)
    candidates += [path for _, path in layout.checkpoint_files(directory) if path != marked]

    errors: list[str] = []
    with contextlib.ExitStack() as held:
        found = read_valid(candidates, lambda data: parse_checkpoint(data, map_location), errors, held)
    if found is not None:
        return found[1]
    if errors:
        raise CheckpointError(f"no loadable checkpoint in {directory}; tried " + "; ".join(errors))
    return None


def _local_copies(ckpt_dir: str | os.PathLike[str] | None) -> dict[int, list[Path]]:
    """Checkpoint files this rank can read, by step: the shared-memory copy first, then the disk one."""
    copies: dict[int, list[Path]] = {}
    folders = []
    if os.environ.get(SHM_DIR_ENV):
        folders.append(Path(os.environ[SHM_DIR_ENV]))
    disk = ckpt_dir or os.environ.get(CKPT_DIR_ENV) or None  # '' counts as not given
    if disk is not None:
        folders.append(Path(disk))
    for folder in folders:
        for step, path in layout.checkpoint_files(folder):
            copies.setdefault(step, []).append(path)
    return copies


def load(
    ckpt_dir: str | os.PathLike[str] | None = None, *, map_location: Any = "cpu", step: int | None = None
) -> tuple[dict[str, Any], int] | None:
    """Restore the same checkpoint on every rank: the newest step that *any* rank holds.

    Each rank lists the steps it can read, memory first (the agent's shared memory, ``ELASTIC_SHM_DIR``)
    then disk (``ckpt_dir``, default ``ELASTIC_CKPT_DIR``). With a process group of more than one rank
    the ranks exchange their lists, pick the newest step held anywhere, and the lowest-ranked holder
    whose copy loads sends its bytes to every rank (see :func:`restore`): a node that joins
    or replaces a lost one resumes from its peers' memory, and no two ranks restore different states.
    Should no copy of that step load, the ranks try the next newest together. On a node that lacked the
    restored step, local rank 0 keeps the received copy in the agent's memory. Call it on every rank,
    after :func:`elastic.init_process_group`.

    Without a process group in a multi-rank world (no collective to agree with), the step the job
    master recorded as committed (``ELASTIC_COMMITTED_STEP``, set by elastic-run) is the agreement. Under an
    agent that offers in-process recovery a process starts from this node's newest copy up to it (any
    while none is known), or a newer one in this node's memory, or from nothing: the ranks then agree inside
    :func:`elastic.run`, which sends the newest step any rank holds to the ranks that lack it.
    ``ELASTIC_CKPT_RESET=1`` (``elastic-run --ckpt-reset``, first start only) makes this rank ignore its
    own checkpoints: with it on every rank, training starts fresh.

    Args:
        ckpt_dir: disk folder; default ``ELASTIC_CKPT_DIR`` (none: memory only).
        map_location: passed to :func:`torch.load`; default loads tensors to CPU.
        step: restore exactly this step (some rank must hold a loadable copy).

    Returns:
        ``(state, step)`` as given to :func:`save`, or ``None`` when no rank holds a checkpoint.

    Raises:
        CheckpointError: checkpoints exist but none loads on any rank (starting fresh would throw the
            job's progress away: the message names the override); ``step`` was given and no rank can
            load it; or in a multi-rank world without a process group, checkpoints exist but no
            committed step says which to restore.
    """
    flash.wait_all()  # a save whose device copies are still running is in the folder first
    copies = _local_copies(ckpt_dir)
    joining = False  # a starting point for elastic.run's agreement, not the job's agreed step
    if os.environ.get(CKPT_RESET_ENV, "") in ("1", "true", "yes") and copies:
        # This rank holds nothing, but still takes part in the agreement: another rank's copy wins.
        log.warning("%s is set: ignoring this rank's checkpoints (steps %s)", CKPT_RESET_ENV, sorted(copies))
        copies = {}
    world = collectives.world_size()
    committed = env_int(COMMITTED_STEP_ENV, None)
    wanted = step
    if wanted is None and world == 0 and (env_int("WORLD_SIZE", 1) or 1) > 1 and copies:
        if os.environ.get(INPROCESS_SOCKET):
            # A process started to join live ranks under an agent that offers in-process recovery (a spare
            # taking a lost rank, a replacement, a worker lost before the master knew a committed step):
            # elastic.run agrees on the state with the live ranks before training and sends the newest step
            # to every rank that lacks it. This node's newest copy is only a starting point, and no copy at
            # all is no error: one up to the committed step (any, while none is known), or one in this
            # node's memory past it. The committed step trails the saves by a heartbeat or so, and memory
            # newer than a node's last restore was saved by the lineage the job is on (a restore drops what
            # is newer); the newest step of any rank wins the agreement, so steps that every rank saved
            # after the master last heard of them are not thrown away.
            usable = {
                s: paths
                for s, paths in copies.items()
                if committed is None or s <= committed or any(_in_memory(p) for p in paths)
            }
            joining = True
            start = max(usable) if usable else None
            log.log(
                logging.INFO
                if start is not None and committed is not None and start >= committed
                else logging.WARNING,
                "elastic.load without a process group, committed step %s: starting from %s; elastic.run "
                "agrees on the state with the other ranks",
                committed if committed is not None else "not known yet",
                f"this node's copy of step {start}" if start is not None else "no checkpoint",
            )
            if not usable:
                return None
            copies = usable
        elif committed is not None and committed in copies:
            wanted = committed
        elif committed is not None:
            wanted = committed  # held by no rank without a group: the error below names it
        else:
            raise CheckpointError(
                "cannot agree on a checkpoint step without a process group: call "
                "elastic.init_process_group() before elastic.load()"
            )
    rank = torch.distributed.get_rank() if world > 0 else 0
    try:
        found = restore(
            copies,
            world,
            rank,
            wanted,
            lambda data: parse_checkpoint(data, map_location),
            lambda f: flash.read_flash_file(f, map_location),
        )
    except NothingLoadableError as exc:
        if wanted is not None:
            raise CheckpointError(f"checkpoint step {wanted} is not loadable by any rank: {exc}") from None
        raise CheckpointError(
            f"checkpoints exist but none can be loaded ({exc}); starting fresh would lose the job's "
            f"progress: to do so on purpose, run elastic-run with --ckpt-reset ({CKPT_RESET_ENV}=1) or "
            "a new job id"
        ) from None
    if found is None:
        if wanted is not None:
            raise CheckpointError(f"checkpoint step {wanted} is not loadable by any rank: no rank holds it")
        return None
    (state, _), chosen, source, received = found
    if committed is not None and chosen < committed:
        log.warning(
            "restoring step %d, older than the committed step %d: no rank holds a copy of the newer one",
            chosen,
            committed,
        )
    if not joining:  # a starting point decides nothing: the agreement may still pick a newer step
        _forget_newer_memory(chosen)
    if chosen not in copies and received is not None:
        _keep_in_memory(chosen, received)
    log.info("restored the checkpoint of step %d from %s", chosen, source)
    report(chosen)
    report_checkpoint(chosen)
    return state, chosen


def _keep_in_memory(step: int, data: flash.Buffer) -> None:
    """Store a step received from a peer in this node's shared memory, so the node holds it too."""
    shm_dir = os.environ.get(SHM_DIR_ENV)
    if not shm_dir or node_local_rank() != 0 or not Path(shm_dir).is_dir():
        return
    final = Path(shm_dir) / layout.step_file_name(step)
    try:
        layout.atomic_write(final, lambda f: f.write(data), durable=False)
    except OSError as exc:  # the restore succeeded; only this node's extra copy is missing
        log.warning("could not keep the restored step %d in shared memory: %s", step, exc)


def _forget_newer_memory(step: int) -> None:
    """Drop memory saves newer than the restored step: they belong to the run that is rolled back."""
    shm_dir = os.environ.get(SHM_DIR_ENV)
    if not shm_dir or node_local_rank() != 0:
        return
    for newer, path in layout.checkpoint_files(Path(shm_dir)):
        if newer > step:
            path.unlink(missing_ok=True)


# -- the torch.save fallback of flash saves ---------------------------------------------------------
# torch.save's headers, pickled metadata and per-record alignment on top of the tensor bytes.
_SIZE_SLACK_BYTES = 1 << 20
_PER_TENSOR_SLACK_BYTES = 4096


@contextlib.contextmanager
def without_crc32() -> Iterator[None]:
    # torch.save's per-record CRC32 costs more than the copy itself (about 2x on a 1 GB state). The file
    # is committed by rename only when whole, so a checksum adds no protection against torn files.
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    previous = get()
    set_(False)
    try:
        yield
    finally:
        set_(previous)


def estimated_size(state: Any) -> int:
    """Bytes a torch.save of ``state`` takes, about: its tensors' storages plus headers."""
    seen: set[tuple[str, int]] = set()
    total = _SIZE_SLACK_BYTES

    def walk(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor) and obj.is_sparse:
            walk(obj._indices())  # no storage of its own: its index and value tensors have them
            walk(obj._values())
        elif isinstance(obj, torch.Tensor) and obj.layout != torch.strided:
            total += obj.numel() * obj.element_size() + _PER_TENSOR_SLACK_BYTES  # at most this, about
        elif isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes() + _PER_TENSOR_SLACK_BYTES
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)
    return total


def _torch_save(state: dict[str, Any], step: int, directory: Path, keep: int) -> Path:
    """torch.save ``{"step", "state"}`` as ``step_<step>.pt`` (temp file, rename), keep ``keep``."""
    final = directory / layout.step_file_name(step)
    with without_crc32():
        # No fsync: the folder is in memory. Only the rename makes the checkpoint visible.
        layout.atomic_write(final, lambda f: torch.save({"step": step, "state": state}, f), durable=False)
    layout.prune(directory, final, keep)
    return final


# -- the write into the agent's shared memory -------------------------------------------------------
#: Flash saves kept in shared memory per node: the newest and the one before it.
MEMORY_KEEP = 2

_warned_fallback = False


def free_bytes(directory: Path) -> int:
    """Bytes available in ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _space_error(
    step: int, directory: Path, need: int, free: int, size: int | None = None
) -> CheckpointError:
    # ``size``: one flash file; memory holds MEMORY_KEEP of them (the double buffer), plus one while the
    # agent persists the oldest.
    total = "" if size is None else f" (the {MEMORY_KEEP} saves memory keeps take {_mib(MEMORY_KEEP * size)})"
    return CheckpointError(
        f"not enough shared memory for the checkpoint of step {step}: it needs about {_mib(need)} more in "
        f"{directory}{total}, only {_mib(free)} is available. Enlarge /dev/shm (docker run --shm-size, or "
        "a Kubernetes emptyDir with medium: Memory and a sizeLimit) to at least "
        f"{MEMORY_KEEP + 1} times the checkpoint size"
    )


def _ensure_space(directory: Path, step: int, need: int) -> None:
    """Make room for a checkpoint of ``need`` bytes, or raise a CheckpointError naming the sizes.

    When space is short, memory gives up the older of its two saves first (the newest is kept: it is
    what a crash during this save falls back to).
    """
    free = free_bytes(directory)
    if free >= need:
        return
    for _, path in layout.checkpoint_files(directory)[1:]:
        path.unlink(missing_ok=True)
    free = free_bytes(directory)
    if free < need:
        raise _space_error(step, directory, need, free)


def _write_to_memory(
    state: dict[str, Any], step: int, directory: Path, on_commit: Callable[[], None]
) -> Path:
    """Flash-save into the agent's folder (:mod:`elastic.checkpoint.flash`); ``on_commit()`` once it is
    visible (later, from a background thread, when device copies are still running at the return)."""
    global _warned_fallback
    if not directory.is_dir():
        raise CheckpointError(
            f"the agent's shared-memory folder {directory} ({SHM_DIR_ENV}) does not exist; "
            "is the elastic-run agent of this worker still running?"
        )
    # A lambda: the module global is looked up at each call (tests replace it).
    writer = flash.writer_for(directory, MEMORY_KEEP, lambda folder: free_bytes(folder))
    try:
        return writer.save(state, step, on_commit)
    except flash.Unsupported as exc:
        unsupported = str(exc)
    except segments.NoSpaceError as exc:
        raise _space_error(step, directory, exc.need, exc.free, flash.plan(state).size) from None
    except flash.AsyncSaveError as exc:
        raise CheckpointError(str(exc)) from exc
    check_loadable(state)  # what torch.save would write but no load could read is refused here
    if not _warned_fallback:
        _warned_fallback = True
        log.warning("elastic.save: the state holds %s: saving with torch.save (slower)", unsupported)
    path = _write_torch_memory_checkpoint(state, step, directory)
    writer.forget_removed()  # the pruned segments' memory goes back now
    on_commit()
    return path


class StateNotLoadableError(CheckpointError, TypeError):
    """A state holds a value that ``torch.load(weights_only=True)``, and so :func:`load`, cannot read back."""


def check_loadable(state: dict[str, Any]) -> None:
    """Refuse a state that no load could read back, naming the first such value's key.

    Checkpoints are loaded with ``weights_only=True`` (by :func:`load` and by a plain ``torch.load`` of a
    persisted file), which rebuilds tensors, numbers, strings, None, bytes, dtypes, devices, sizes and
    dicts, lists, tuples and sets of them, plus the types given to ``torch.serialization.add_safe_globals``
    in this process. Anything else (a numpy array, an ``argparse.Namespace``, a custom object) would save
    and then fail at restore, when the job's progress depends on it: it is refused at the save instead.

    Raises:
        StateNotLoadableError: one line naming the key, the type and what to store instead.
    """
    allowed = _LOADABLE_LEAVES | {g for g in torch.serialization.get_safe_globals() if isinstance(g, type)}
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        path, value = stack.pop()
        kind = type(value)
        if kind in _LOADABLE_CONTAINERS:
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((f"{path}[{key!r}]", item) for key, item in items)
            if isinstance(value, dict):
                stack.extend((f"{path} key {key!r}", key) for key in value if type(key) is not str)
        elif kind in (list, tuple, set):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif kind not in allowed:
            raise StateNotLoadableError(
                f"elastic.save: state{path} is of type {kind.__module__}.{kind.__qualname__}, which "
                "torch.load(weights_only=True) and elastic.load cannot read back; store tensors, numbers, "
                "strings or containers of them instead (e.g. vars(args), torch.from_numpy(array))"
            )


#: What ``weights_only=True`` rebuilds (torch/_weights_only_unpickler.py), by exact type.
_LOADABLE_CONTAINERS = frozenset({dict, OrderedDict, Counter})
_LOADABLE_LEAVES = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
    | {torch.Tensor, torch.nn.Parameter, torch.dtype, torch.device, torch.Size, torch.layout}
)


def _write_torch_memory_checkpoint(state: dict[str, Any], step: int, directory: Path) -> Path:
    """The fallback for states the flash format does not describe: torch.save into a new file."""
    need = estimated_size(state)
    _ensure_space(directory, step, need)
    try:
        return _torch_save(state, step, directory, MEMORY_KEEP)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _space_error(step, directory, need, free_bytes(directory)) from exc
        raise


# -- restore from whichever rank holds the step -----------------------------------------------------


class NothingLoadableError(errors.CheckpointError):
    """Some rank holds checkpoints, but no copy of any held step loads."""


@dataclass(frozen=True)
class Plan:
    """The step to restore and the ranks that hold a copy of it, in the order they are asked."""

    step: int
    holders: tuple[int, ...]


def plan(holdings: Sequence[Sequence[int]], wanted: int | None, excluded: set[int]) -> Plan | None:
    """Choose what to restore from each rank's steps (``holdings[rank]``).

    The newest step held by any rank (``wanted`` when given), not in ``excluded``; ``None`` when there
    is none. Holders are listed lowest rank first: the same answer on every rank from the same input.
    """
    held = {step for steps in holdings for step in steps} - excluded
    if wanted is not None:
        held &= {wanted}
    if not held:
        return None
    step = max(held)
    return Plan(step, tuple(rank for rank, steps in enumerate(holdings) if step in steps))


def _in_memory(path: Path) -> bool:
    """Whether ``path`` is in the agent's shared-memory folder."""
    shm_dir = os.environ.get(SHM_DIR_ENV)
    return bool(shm_dir) and path.parent.resolve() == Path(str(shm_dir)).resolve()


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[flash.Buffer]:
    """A checkpoint's bytes: mapped where the file is in the agent's shared memory (its pages are in
    memory already), read where it is on disk (a mapping would fault a cold file's pages in one by one)."""
    if _in_memory(path):
        with layout.map_shared(path) as mapped:
            yield mapped
    else:
        yield layout.read_shared(path)


def read_valid(
    paths: Sequence[Path],
    parse: Callable[[flash.Buffer], Any],
    errors: list[str],
    held: contextlib.ExitStack,
    read_file: Callable[[BinaryIO], Any] | None = None,
) -> tuple[flash.Buffer, Any] | None:
    """The bytes of the first of ``paths`` that ``parse`` accepts (it raises on a bad file), parsed.

    A file in shared memory is mapped, not read (:func:`~elastic.checkpoint.layout.map_shared`):
    ``parse`` copies its storages once, from where they lie into the restored tensors. The map and its
    shared lock stay in ``held`` (the caller's: a holder broadcasts the same bytes to the other ranks),
    so the flash writer never recycles the file meanwhile. With ``read_file`` (no other rank needs the
    bytes), a file in shared memory is read by it instead, under the same lock (the bytes returned are
    then empty): :func:`elastic.checkpoint.flash.read_flash_file` reads each storage straight into its
    restored tensor, with no mapping's page tables to fill.
    """
    for path in paths:
        try:
            if read_file is not None and _in_memory(path):
                with layout.open_shared(path) as f:
                    return b"", read_file(f)
            with contextlib.ExitStack() as this_file:
                data = this_file.enter_context(_opened(path))
                parsed = parse(data)
                held.enter_context(this_file.pop_all())  # accepted: open until the caller is done
            return data, parsed
        except CheckpointCorruptError as exc:
            # Bytes that changed after their save: never loaded, reported (the master's event
            # checkpoint_corrupt), and the next copy is tried (a peer's, an older step's, the disk's).
            log.error("skipping the checkpoint %s: it failed its digest check: %s", path, exc)
            report_corrupt(layout.step_of(path.name) or 0, str(path))
            errors.append(f"{path}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any failure to read or parse means: try the next copy
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            errors.append(f"{path}: {exc}")
    return None


def restore(
    copies: dict[int, list[Path]],
    world: int,
    rank: int,
    wanted: int | None,
    parse: Callable[[flash.Buffer], Any],
    read_file: Callable[[BinaryIO], Any] | None = None,
) -> tuple[Any, int, str, flash.Buffer | None] | None:
    """Restore the newest step any rank holds; a collective when ``world`` > 1 (call it on every rank).

    Args:
        copies: this rank's readable files by step, preferred copy first (memory, then disk).
        world: ranks in the process group (0 or 1: this rank alone).
        rank: this rank's place in the group.
        wanted: restore exactly this step, or ``None`` for the newest.
        parse: turns a file's bytes into the restored value; raises on a damaged file.
        read_file: the same from an open file (used alone, where no rank needs the bytes sent).

    Returns:
        ``(parsed, step, source, received)`` (``source`` says whose file; ``received`` are its bytes when
        they came from another rank, None when this rank read its own copy), or ``None`` when no rank
        holds a step (or ``wanted``).

    Raises:
        NothingLoadableError: steps are held, but no copy of any of them loads on its holder.
    """
    errors: list[str] = []
    with contextlib.ExitStack() as held:  # the maps of files read here, open until the bytes are sent
        if world <= 1:
            excluded: set[int] = set()
            while (chosen := plan([sorted(copies)], wanted, excluded)) is not None:
                found = read_valid(copies[chosen.step], parse, errors, held, read_file)
                if found is not None:
                    return found[1], chosen.step, "this rank", None
                excluded.add(chosen.step)
            _raise_if_held(excluded, errors)
            return None

        holdings = collectives.all_step_lists(copies, world)
        excluded = set()
        while (chosen := plan(holdings, wanted, excluded)) is not None:
            for holder in chosen.holders:
                found = read_valid(copies[chosen.step], parse, errors, held) if holder == rank else None
                sent = broadcast_file(found[0] if found is not None else None, src=holder)
                if sent is None:
                    continue
                if found is not None:  # the holder parsed its own bytes already
                    return found[1], chosen.step, "this rank", None
                return parse(sent), chosen.step, f"rank {holder}", sent
            excluded.add(chosen.step)  # no holder could read it: the next newest, together
        _raise_if_held(excluded, errors)
        return None


def broadcast_file(data: flash.Buffer | None, src: int) -> flash.Buffer | None:
    """Rank ``src``'s file bytes on every rank (``None`` on every rank when it has none): a collective,
    the length first (-1 for none), then the bytes as one uint8 tensor (as ``broadcast_bytes``).

    The sender sends from its buffer (the file's map, no copy); a receiver receives straight into a
    private map faulted in huge pages (:func:`elastic.checkpoint.hostmem.anonymous`), which the parse then
    copies into the restored tensors: one copy of the bytes after the transfer, never two.
    """
    if collectives.world_size() <= 1:
        return data
    device = collectives.collective_device(str(torch.distributed.get_backend()))
    length = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=device)
    collectives.lend(length)
    torch.distributed.broadcast(length, src=src)
    size = int(length.item())
    if size <= 0:
        return None if size < 0 else b""
    with warnings.catch_warnings():
        # frombuffer warns that a read-only map is not writable: the sender's tensor is only read.
        warnings.simplefilter("ignore", UserWarning)
        if data is not None:
            payload = torch.frombuffer(data, dtype=torch.uint8).to(device)
            collectives.lend(payload)
            torch.distributed.broadcast(payload, src=src)
            return data
        received = hostmem.anonymous(size)
        target = torch.frombuffer(received, dtype=torch.uint8)
    payload = target if device.type == "cpu" else torch.empty(size, dtype=torch.uint8, device=device)
    collectives.lend(payload)
    torch.distributed.broadcast(payload, src=src)
    if payload is not target:
        target.copy_(payload)
    return received


def _raise_if_held(failed_steps: set[int], errors: list[str]) -> None:
    if failed_steps:
        here = "; ".join(errors) or "the copies are on other ranks"
        raise NothingLoadableError(f"steps {sorted(failed_steps)} are held but none loads; here: {here}")


def parse_checkpoint(data: flash.Buffer, map_location: Any) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from the bytes of a file written by ``elastic.save``; raises if it is not one.

    A flash file (:mod:`elastic.checkpoint.flash`, recognised by its magic: memory copies, and disk copies
    persisted by earlier versions) or a torch.save file (what the agent persists now, see
    :mod:`elastic.checkpoint.torch_format`; disk saves without an agent; older runs).
    Neither runs code: the flash format is JSON plus raw tensor bytes, and torch.save files load with
    ``weights_only=True``, so a checkpoint folder on a shared file system cannot be used to execute code
    in the job.
    """
    return flash.parse(data, map_location)
