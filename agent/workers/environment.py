"""The worker environment: torchrun's contract, so unmodified torchrun scripts work.

``PYTHONPATH`` gets :data:`elastic.autoprogress.SITE_DIR` first: its ``sitecustomize`` installs the progress
hooks (optimizer steps, forward passes, saves) in exec'd workers before their script runs.

Our own additions are prefixed ``ELASTIC_``; every name is a constant of :mod:`elastic.contract`.
``TORCHELASTIC_ERROR_FILE`` is added by the worker group, which owns the per-attempt error files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastic import contract as c
from elastic.autoprogress import with_site_path

if TYPE_CHECKING:  # only for annotations: the warm zygote side imports CONTRACT without pydantic
    from elastic.control.protocol import Assignment

#: torchrun's per-worker variables (names: :mod:`elastic.contract`).
CONTRACT = c.TORCHRUN_VARIABLES
#: The worker's real local rank (what progress reports name it by), whatever LOCAL_RANK says.
LOCAL_RANK_ENV = c.ELASTIC_LOCAL_RANK


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
                c.RANK: str(rank),
                c.LOCAL_RANK: str(local_rank),
                c.WORLD_SIZE: str(assignment.world_size),
                c.LOCAL_WORLD_SIZE: str(nproc),
                c.GROUP_RANK: str(assignment.node_rank),
                c.GROUP_WORLD_SIZE: str(assignment.nnodes),
                # One role per job (as torchrun), so role ranks equal global ranks.
                c.ROLE_RANK: str(rank),
                c.ROLE_WORLD_SIZE: str(assignment.world_size),
                c.ROLE_NAME: role,
                c.MASTER_ADDR: assignment.master_addr,
                c.MASTER_PORT: str(assignment.master_port),
                c.RESTART_COUNT: str(assignment.restart_count),
                c.MAX_RESTARTS: str(assignment.max_restarts),
                c.RUN_ID: run_id,
                # Workers host their own TCPStore on MASTER_PORT, fresh every round.
                c.USE_AGENT_STORE: "False",
                c.NCCL_ASYNC_ERROR_HANDLING: base.get(c.NCCL_ASYNC_ERROR_HANDLING, "1"),
                c.ROUND: str(assignment.round),
                # The real local rank, also when --virtual-local-rank makes LOCAL_RANK 0 for every worker.
                LOCAL_RANK_ENV: str(local_rank),
            }
        )
        # torchrun's rule: one OpenMP thread per worker unless the user chose otherwise.
        if c.OMP_NUM_THREADS not in base and nproc > 1:
            env[c.OMP_NUM_THREADS] = "1"
        env.update(extra or {})
        # The exec path's sitecustomize installs the progress hooks (elastic.autoprogress) before the
        # script runs; a warm worker gets them from the zygote (agent.warm.starter ignores this difference).
        env["PYTHONPATH"] = with_site_path(env)
        envs.append(env)
    return envs
