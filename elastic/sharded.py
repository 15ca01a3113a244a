"""Sharded checkpoints (FSDP, DTensor, tensor parallel) through ``torch.distributed.checkpoint`` (DCP).

DCP writes each rank's shards plus one metadata file describing the global tensors, and re-shards on load: a
checkpoint written at one world size loads at another, into state whose tensors are sharded for the new world.
The files follow :mod:`elastic.checkpoint.shard_layout` (a ``step_<N>`` symlink to the save's data folder,
replaced atomically).

**Under elastic-run** (``ELASTIC_SHM_DIR`` set) a save is a *flash* save: every rank writes its own shards
into its node's shared-memory folder (``<shm>/sharded``), through DCP's writer with its data files in reused,
pre-faulted segments (:mod:`elastic.checkpoint.dcp_io`), and returns; there is no disk I/O in the
worker. Local rank 0 of each node then commits the node's folder and reports it to the agent, which streams it
to a peer node's agent (replication) and persists it to ``--ckpt-dir`` in the background. Before it writes, a
save waits while the node's replication lags more than the agent's bound (``<shm>/replication.json``), so that
a lost node costs at most that many steps (:mod:`elastic.checkpoint.shard_save`).

:func:`load_sharded` restores the newest step whose files the job holds *somewhere*: each node lists what it
holds (its own memory, the replicas it keeps for peers, and the disk folder);
the ranks exchange the lists (int64 collectives) and pick the newest complete step. Each rank plans its DCP
reads; a node receives only the files its ranks read and it lacks, point to point from a rank that holds each
(:mod:`elastic.checkpoint.shard_restore`): at an unchanged world
size with every node holding its own shards nothing moves. Then ``dcp.load`` reads the node's assembled
folder, re-sharding to the current world. Every file read from memory is first checked against the digest
recorded when it was written (a node's own save) or received (a replica); a damaged one is reported to the
agent (the master's event ``checkpoint_corrupt``) and left out, and the ranks choose again.

**Without an agent** every rank writes its shards to ``<ckpt_dir>/sharded`` (a folder all ranks share)
and global rank 0 commits it once all have written.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from elastic import collectives
from elastic.checkpoint import shard_layout as sl
from elastic.checkpoint import shard_restore, shard_save
from elastic.checkpoint.env import (
    CKPT_DIR_ENV,
    CKPT_RESET_ENV,
    SHM_DIR_ENV,
    CheckpointError,
    check_args,
    node_local_rank,
    resolve_dir,
)
from elastic.checkpoint.shard_save import MEMORY_KEEP
from elastic.contract import DEFAULT_CKPT_KEEP
from elastic.report import report, report_checkpoint

log = logging.getLogger(__name__)

SHARDED_SUBDIR = sl.SHARDED_SUBDIR
_received = 0  # bytes this process received from other nodes in its last load_sharded
_direct = 0  # of them, received straight into the state's tensors


def last_restore_received_bytes() -> int:
    """Bytes of shard files this process received from other nodes in its last :func:`load_sharded`
    (0 when its node held every file its ranks read)."""
    return _received


def last_restore_direct_bytes() -> int:
    """Of :func:`last_restore_received_bytes`, the bytes received straight into the state's tensors
    (no copy after the receive): the data of tensor records of 64 KiB or more that this rank alone reads
    whole into a contiguous tensor of their dtype and shape."""
    return _direct


# -- save -------------------------------------------------------------------------------------------
def save_sharded(
    state: dict[str, Any],
    step: int,
    ckpt_dir: str | os.PathLike[str] | None = None,
    *,
    keep: int = DEFAULT_CKPT_KEEP,
) -> Path:
    """Save sharded ``state`` (a DCP state dict) as the checkpoint of ``step``; call it on every rank.

    Under elastic-run this is a flash save into the node's shared memory (see the module doc); the agent
    replicates it to a peer node and persists it to ``ckpt_dir`` (default ``ELASTIC_CKPT_DIR``) in DCP's
    file-system format. Without an agent it goes to ``ckpt_dir`` directly.

    Args:
        state: e.g. ``{"model": get_model_state_dict(model), "step": step}`` with DTensor/sharded
            tensors; plain tensors are saved once (they are assumed replicated).
        step: training steps completed.
        ckpt_dir: a folder all ranks share (disk saves); default ``ELASTIC_CKPT_DIR``.
        keep: sharded checkpoints to keep on disk, this one included (>= 1).

    Returns:
        The folder of the checkpoint (this node's, under elastic-run).

    Raises:
        CheckpointError: shared memory is too small (the message names the size needed).
    """
    check_args(state, step)
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    shm = os.environ.get(SHM_DIR_ENV)
    if shm:
        return shard_save.flash_save(state, step, Path(shm), ckpt_dir)
    return shard_save.disk_save(state, step, resolve_dir(ckpt_dir) / SHARDED_SUBDIR, keep)


#: Choices of a step a restore makes at most: each after damaged files were left out.
_MAX_CHOICES = 8


def _without(
    held: dict[tuple[int, str], dict[str, Path]], damaged: set[Path]
) -> dict[tuple[int, str], dict[str, Path]]:
    """``held`` without the files at ``damaged`` (the step's other files stay: other holders complete it)."""
    return {key: {n: p for n, p in files.items() if p not in damaged} for key, files in held.items()}


def _load(
    dcp: Any, state: dict[str, Any], found: shard_restore.Assembled, shm: Path | None
) -> set[Path] | None:
    """``dcp.load`` of the assembled step into ``state``; the files of this node that failed a digest
    check during the load (on any rank: :class:`~elastic.checkpoint.shard_restore.DamagedShardsError`,
    raised by DCP on every rank; empty when they lie on other nodes), None when it loaded. Other failures
    are raised as they are."""
    try:
        dcp.load(state, storage_reader=shard_restore.reader(found.folder, shm, found.deferred))
    except dcp.CheckpointException as exc:
        failures = {rank: failure for rank, (failure, _) in exc.failures.items()}
        damaged = {r: f for r, f in failures.items() if isinstance(f, shard_restore.DamagedShardsError)}
        if not failures or len(damaged) != len(failures):
            raise
        return found.deferred.damaged(damaged)
    return None


def load_sharded(
    state: dict[str, Any], step: int | None = None, ckpt_dir: str | os.PathLike[str] | None = None
) -> int | None:
    """Load a sharded checkpoint into ``state`` in place (resharded to this world); call it on every rank.

    The ranks agree on the newest step whose files the job holds anywhere (memory, replicas kept for
    peers, disk); files a node lacks travel to it over the process group (see the module doc).

    Args:
        state: the DCP state dict to load into, sharded for the current world (e.g.
            ``{"model": get_model_state_dict(model)}``), with the keys :func:`save_sharded` was given.
        step: load exactly this step; ``None``: the newest complete one.
        ckpt_dir: the disk folder of :func:`save_sharded`; default ``ELASTIC_CKPT_DIR``.

    Returns:
        The step loaded, or ``None`` when no rank holds a sharded checkpoint (``state`` is untouched).

    Raises:
        CheckpointError: ``step`` was given and there is no complete checkpoint of it, or no copy of any
            step passed its digest check (a file whose bytes fail its recorded digest,
            :func:`elastic.checkpoint.shard_layout.check_file`, is reported to the agent and left out:
            the ranks choose again, another holder's copy of that step or an older step, and load the
            whole state anew; after such a failure ``state`` may hold bytes that were never committed,
            which the next choice overwrites, and its contents are undefined when this raises).
    """
    import torch.distributed.checkpoint as dcp

    global _received, _direct
    _received = _direct = 0
    shm_text = os.environ.get(SHM_DIR_ENV)
    shm = Path(shm_text) if shm_text and Path(shm_text).is_dir() else None
    folder = ckpt_dir or os.environ.get(CKPT_DIR_ENV) or None
    disk = Path(folder) if folder else None
    held = shard_restore.held(shm, disk)
    if os.environ.get(CKPT_RESET_ENV, "") in ("1", "true", "yes"):
        held = {}
    world = collectives.world_size()
    touched = False  # a load that failed a digest check wrote into ``state``
    for _ in range(_MAX_CHOICES):
        lists = collectives.gather_ints(shard_restore.encode(held), world)
        choice = shard_restore.choose(lists, step)
        if choice is None:
            break
        chosen, sid_int = choice
        save_id = sl.save_id_str(sid_int)
        mine = held.get((chosen, save_id), {})
        manifest = next((m for p in mine.values() if (m := sl.read_manifest(p.parent)) is not None), None)
        try:
            found = shard_restore.assemble(state, chosen, save_id, mine, manifest, shm, world)
        except shard_restore.DamagedShardsError as exc:
            # Every rank is here together: the damaged files (reported already) are left out, and the
            # ranks choose again: another holder's copy of the step, else an older step.
            log.warning("%s; choosing again without it", exc)
            held = _without(held, set(exc.bad))
            continue
        try:
            damaged = _load(dcp, state, found, shm)
        finally:
            _received += found.received + found.deferred.received
            _direct = found.deferred.direct
            found.close()
            collectives.barrier()
            if found.writes:
                path = found.folder
                shutil.rmtree(path.parent if path.parent.name.startswith("elastic-restore-") else path, True)
        if damaged is None:
            break
        # A file checked as it arrived, or beside the sends, failed: every rank is here together (DCP
        # raised on all); the state is loaded anew from the next choice, all of it.
        touched = True
        log.warning(
            "a file of the sharded checkpoint of step %d failed its digest check; choosing again", chosen
        )
        held = _without(held, damaged)
    else:
        raise CheckpointError(f"no undamaged sharded checkpoint found after {_MAX_CHOICES} choices")
    if choice is None:
        if step is not None:
            where = disk if shm is None else f"memory or {disk}"
            raise CheckpointError(f"no complete sharded checkpoint of step {step} in {where}")
        partial = sorted({flat[i] for flat in lists for i in range(0, len(flat) - 2, 3) if flat[i] >= 0})
        if partial:
            # A lost node's shards with no replica anywhere: a fresh start would lose the job's progress.
            raise CheckpointError(
                f"the job holds parts of sharded checkpoints (steps {partial[-3:]}) but no step in full "
                "(a lost node's shards had no replica, or --replicas 0); starting fresh would lose the "
                "job's progress: to do so on purpose, run elastic-run with --ckpt-reset "
                f"({CKPT_RESET_ENV}=1) or a new job id, or give --ckpt-dir the folder of the persisted ones"
            )
        if touched:
            raise CheckpointError("every copy of the sharded checkpoint failed its digest check")
        return None
    if shm is not None and node_local_rank() == 0:
        sl.prune(shm / SHARDED_SUBDIR, MEMORY_KEEP, newest=chosen)  # newer saves were a rolled-back run
    log.info("restored the sharded checkpoint of step %d", chosen)
    report(chosen)
    report_checkpoint(chosen)
    return chosen
