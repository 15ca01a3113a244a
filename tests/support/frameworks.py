"""The end-to-end check of a framework integration (tests/e2e/test_frameworks_*.py).

One example script of ``scripts/examples/`` runs twice under ``elastic-run --standalone --nproc-per-node 2
--ckpt-dir``, at the same time: once without a fault, once losing rank 1 to SIGKILL mid-run. The script
prints ``start rank=R world=W restart=N resumed_step=S`` when training starts and ``step=N`` on rank 0
after each optimizer step (after the flash save of that step), takes ``--hold-at-step K`` (rank 0 stops
right after step K's save and line, so the kill lands while rank 1 is in step K+1, whatever the machine's
speed) and ``--final-weights PATH`` (rank 0 writes the final ``state_dict``). The check: the killed run
restarts once, resumes at step K or later (so no completed step is done again; the step in progress at
the kill is the only one), runs every later step once, and ends with weights bitwise equal to the
fault-free run's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from pathlib import Path

import psutil
import pytest
import torch
from e2e import REPO, Proc, base_env, elastic_run_argv, shm_folders, unique_job
from tools import MISSING_TOOL

EXAMPLES = REPO / "scripts" / "examples"
#: Generous: the two runs share the machine's 2 cores with each other (and CI with other suites); each
#: worker imports torch and the framework, twice in the killed run.
RUN_TIMEOUT_S = 150


def require_package(module: str) -> None:
    """Skip the calling test when the framework is not installed (under CI=true the skip fails the run)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{MISSING_TOOL} {module!r} (Python package): pip install -e '.[frameworks]'")


def step_lines(output: str, after: int = 0) -> list[int]:
    """The steps rank 0 reported (``step=N``) in ``output`` past offset ``after``."""
    return [int(s) for s in re.findall(r"^\[rank0\]:step=(\d+)\b", output[after:], re.M)]


def _argv(job: str, ckpt: Path, script: Path, *script_args: str) -> list[str]:
    agent = ["--standalone", "--rdzv-id", job, "--node-id", "n1", "--nproc-per-node", "2"]
    agent += ["--max-restarts", "2", "--stop-grace", "2", "--ckpt-dir", str(ckpt)]
    return elastic_run_argv(*agent, str(script), *script_args)


def rank_pid(proc: Proc, script: str, rank: int) -> int:
    """The PID of the worker of global rank ``rank`` running ``script``."""
    for pid in proc.worker_pids(script):
        try:
            if psutil.Process(pid).environ().get("RANK") == str(rank):
                return pid
        except psutil.Error:
            continue
    raise AssertionError(f"no live worker of rank {rank}; output:\n{proc.output()[-4000:]}")


def check_kill_and_resume(
    launch, jobs: list[str], tmp_path: Path, script_name: str, steps: int, hold: int
) -> None:
    """Run the fault-free and the killed run of ``scripts/examples/<script_name>`` and check the outcome."""
    script = EXAMPLES / script_name
    env = base_env(OMP_NUM_THREADS="1")
    runs = {}
    for name, extra in (("reference", ()), ("killed", ("--hold-at-step", str(hold)))):
        job = unique_job(name)
        jobs.append(job)
        weights = tmp_path / f"{name}.pt"
        argv = _argv(
            job, tmp_path / f"{name}-ckpt", script, "--steps", str(steps), "--final-weights", str(weights)
        )
        runs[name] = (job, weights, launch([*argv, *extra], name=name, env=env))
    killed = runs["killed"][2]

    killed.wait_for(rf"^\[rank0\]:step={hold}\b", RUN_TIMEOUT_S)
    before = step_lines(killed.output())
    offset = len(killed.output())
    os.kill(rank_pid(killed, script_name, 1), signal.SIGKILL)  # rank 0 holds: rank 1 is in step hold+1
    restarted = killed.wait_for(
        r"^\[rank0\]:start rank=0 world=2 restart=1 resumed_step=(\d+)$", RUN_TIMEOUT_S, after=offset
    )
    resumed = int(restarted.group(1))

    for name, (job, _, proc) in runs.items():
        assert proc.wait(RUN_TIMEOUT_S) == 0, f"{name} run:\n{proc.output()[-4000:]}"
        assert re.search(rf"^\[rank0\]:done step={steps}$", proc.output(), re.M), proc.output()[-4000:]
        assert shm_folders(job) == [], "the agent removes its shared-memory folder at the end"
    assert before == list(range(1, hold + 1))
    # A save after every step: the restart resumes from the last step completed before the kill (or the one
    # rank 1 was in, should it have finished it), so no completed step is done again.
    assert resumed >= max(before), f"resumed at {resumed}, but step {max(before)} was done before the kill"
    assert step_lines(killed.output(), restarted.end()) == list(range(resumed + 1, steps + 1))
    assert "restart=2" not in killed.output(), "one kill, one restart"

    reference, after_kill = (torch.load(runs[n][1], weights_only=True) for n in ("reference", "killed"))
    assert reference.keys() == after_kill.keys()
    differing = [key for key in reference if not torch.equal(reference[key], after_kill[key])]
    assert not differing, f"final weights differ from the fault-free run's in {differing}"
