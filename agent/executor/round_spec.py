"""What the executor (agent.executor.loop) starts for a training round, and how it words a worker's failure.

:func:`training_spec` builds the workers' environments (torchrun's contract, agent.workers.environment, plus
the agent's ``ELASTIC_*`` additions); :func:`worker_failure` turns a root cause
(agent.workers.group.FailureInfo) into the failure a heartbeat reports.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent.executor.health import add_stack_files
from agent.settings import AgentSettings
from agent.workers.environment import worker_envs
from agent.workers.group import FailureInfo, WorkerSpec
from elastic import contract
from elastic.control.protocol import Assignment, WorkerFailure


def training_spec(
    settings: AgentSettings,
    assignment: Assignment,
    agent_socket: str,
    worker_env: dict[str, str],
    reset_ckpt: bool,
    stack_root: Path,
) -> WorkerSpec:
    """This node's workers of ``assignment``. ``reset_ckpt``: the first start of --ckpt-reset only (a
    restart after a failure must restore what this run saved)."""
    s = settings
    extra = {contract.NODE_ID: s.node_id, contract.AGENT_SOCKET: agent_socket}
    if assignment.committed_step is not None:
        extra[contract.COMMITTED_STEP] = str(assignment.committed_step)
    if s.ckpt_dir is not None:
        extra[contract.CKPT_DIR] = str(s.ckpt_dir)
    if reset_ckpt:
        extra[contract.CKPT_RESET] = "1"
    extra.update(worker_env)
    envs = worker_envs(os.environ, assignment, s.nproc, run_id=s.job.job_id, role=s.role, extra=extra)
    for local_rank, overrides in enumerate(s.per_rank_env):  # --virtual-local-rank
        envs[local_rank].update(overrides)
    add_stack_files(envs, stack_root, assignment)
    return WorkerSpec(
        argv=list(s.argv),
        envs=envs,
        global_ranks=[assignment.rank_offset + i for i in range(s.nproc)],
        log_dir=s.log_dir,
        attempt=f"round{assignment.round}",
        cwd=s.cwd,
        output=s.output,
    )


def round_line(assignment: Assignment, nproc: int) -> str:
    """The log line of a round this node trains in."""
    a = assignment
    return (
        f"round {a.round}: node rank {a.node_rank} of {a.nnodes}, ranks {a.rank_offset}-"
        f"{a.rank_offset + nproc - 1} of world {a.world_size}, restart {a.restart_count}/{a.max_restarts}, "
        f"term {a.term}"  # a round is (term, number): tests/e2e/test_etcd_trouble_e2e.py reads both
    )


def worker_failure(info: FailureInfo, kind: str) -> WorkerFailure:
    """The failure a heartbeat reports for ``info`` (``kind``: crash or hang)."""
    # The group's generic fallback ("killed by SIGKILL") only repeats the signal; keep real messages.
    generic = info.message.startswith(("killed by ", "exited with code "))
    return WorkerFailure(
        rank=info.global_rank,
        local_rank=info.local_rank,
        exit_code=info.exit_code,
        signal=info.signal,
        message="" if generic else info.message[-8000:],
        kind=kind,
    )


def how_it_failed(info: FailureInfo, kind: str) -> str:
    """``a hang``, ``signal SIGKILL`` or ``exit code 1``: for the agent's log line."""
    if kind == "hang":
        return "a hang"
    if info.signal is None and info.exit_code is None:
        return "a failed collective (the process lives on)"
    return f"signal {info.signal}" if info.signal else f"exit code {info.exit_code}"
