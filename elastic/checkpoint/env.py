"""Where a worker's checkpoint calls look, from the environment elastic-run sets: the checkpoint folder,
the agent's shared-memory folder, the worker's ranks; and the checks of the calls' arguments.

Shared by the replicated checkpoints (:mod:`elastic.checkpoint.replicated`) and the sharded ones
(:mod:`elastic.sharded`). Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, overload

from elastic import contract, errors

CKPT_DIR_ENV = contract.CKPT_DIR
SHM_DIR_ENV = contract.SHM_DIR
COMMITTED_STEP_ENV = contract.COMMITTED_STEP
#: Set to 1 by ``elastic-run --ckpt-reset``: loads ignore this rank's checkpoints (a deliberate fresh start).
CKPT_RESET_ENV = contract.CKPT_RESET


class CheckpointError(errors.CheckpointError):
    """No checkpoint can be saved (shared memory too small) or loaded (files exist, none loads)."""


def resolve_dir(ckpt_dir: str | os.PathLike[str] | None) -> Path:
    """``ckpt_dir``, else ``ELASTIC_CKPT_DIR``; a ValueError when neither is given."""
    if ckpt_dir is None:
        ckpt_dir = os.environ.get(CKPT_DIR_ENV) or None
    if ckpt_dir is None:
        raise ValueError(
            f"no checkpoint directory: pass ckpt_dir or set the {CKPT_DIR_ENV} environment variable"
        )
    return Path(ckpt_dir)


@overload
def env_int(name: str, default: int) -> int: ...
@overload
def env_int(name: str, default: None) -> int | None: ...
def env_int(name: str, default: int | None) -> int | None:
    """The integer in environment variable ``name``, else ``default``; a ValueError naming it if malformed."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def node_local_rank() -> int:
    """This worker's place on its node; ``ELASTIC_LOCAL_RANK`` stays real under ``--virtual-local-rank``
    (where every worker's ``LOCAL_RANK`` is 0), so that one worker per node writes to shared memory."""
    real = env_int(contract.ELASTIC_LOCAL_RANK, None)
    return real if real is not None else env_int("LOCAL_RANK", 0)


def resolve_rank(rank: int | None) -> int:
    """``rank``, else the ``RANK`` environment variable, else 0."""
    return rank if rank is not None else env_int("RANK", 0)


def check_args(state: Any, step: Any) -> None:
    """A TypeError or ValueError unless ``state`` is a dict and ``step`` a non-negative int."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
