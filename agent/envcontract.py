"""The worker environment: torchrun's contract, so unmodified torchrun scripts work.

Our own additions are prefixed ``ELASTIC_``. ``TORCHELASTIC_ERROR_FILE`` is added by the worker group,
which owns the per-attempt error files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: the warm zygote side imports CONTRACT without pydantic
    from elastic.protocol import Assignment

CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)
#: The worker's real local rank (what progress reports name it by), whatever LOCAL_RANK says.
LOCAL_RANK_ENV = "ELASTIC_LOCAL_RANK"


def worker_envs(
    base: Mapping[str, str],
    assignment: Assignment,
    nproc: int,
    *,
    run_id: str,
    role: str = "default",
    extra: Mapping[str, str] | None = None,
) -> list[dict[str, str]]:
    """One complete environment per local rank for the workers of ``assignment``."""
    envs = []
    for local_rank in range(nproc):
        rank = assignment.rank_offset + local_rank
        env = dict(base)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(assignment.world_size),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": str(assignment.node_rank),
                "GROUP_WORLD_SIZE": str(assignment.nnodes),
                # One role per job (as torchrun), so role ranks equal global ranks.
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(assignment.world_size),
                "ROLE_NAME": role,
                "MASTER_ADDR": assignment.master_addr,
                "MASTER_PORT": str(assignment.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(assignment.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(assignment.max_restarts),
                "TORCHELASTIC_RUN_ID": run_id,
                # Workers host their own TCPStore on MASTER_PORT, fresh every round.
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                "ELASTIC_ROUND": str(assignment.round),
                # The real local rank, also when --virtual-local-rank makes LOCAL_RANK 0 for every worker.
                LOCAL_RANK_ENV: str(local_rank),
            }
        )
        # torchrun's rule: one OpenMP thread per worker unless the user chose otherwise.
        if "OMP_NUM_THREADS" not in base and nproc > 1:
            env["OMP_NUM_THREADS"] = "1"
        env.update(extra or {})
        envs.append(env)
    return envs
