"""Persists are never dropped silently, end to end: real ``elastic-run`` agents hosting their
master (``--standalone``) and the example training script's real workers.

* README's resubmission flow: run 1 reaches round 2 (a worker SIGKILLed), run 2 trains on with more
  steps, run 3 resumes from run 2's last step (before the job incarnation in ``--ckpt-dir``'s fence, run 2's
  persists were "superseded" by run 1's round 2 and dropped, run 2 exited 0, run 3 resumed from run 1);
* an unwritable ``--ckpt-dir`` is a one-line error with exit 2 before anything starts;
* a persist that fails during the run (the folder replaced by a file: a fault that holds for root too)
  ends the job with exit 1, the shared-memory copy kept, and one line whose command persists it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import e2e
import psutil
import pytest
from e2e import SHM, TRAIN_SCRIPT, elastic_run_argv, unique_job, wait_until

from agent.checkpoints.fence import FENCE_FILE
from elastic.checkpoint import layout

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs

RUN_TIMEOUT_S = 120  # other suites share the 2 cores; each torch worker takes seconds to start
KEPT_LINE = (
    r"^elastic-run: the checkpoint of step (\d+) is not on disk \((.*)\); its copy is kept in (\S+): "
    r"persist it with: (.+)$"
)


def run_argv(job: str, ckpt: Path, steps: int, *script: str) -> list[str]:
    """One submission of the job ``job`` (the same id each time, as a resubmission has)."""
    agent = (
        "--standalone",
        "--rdzv-id",
        job,
        "--node-id",
        "n1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
    )
    return elastic_run_argv(
        *agent,
        str(TRAIN_SCRIPT),
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(ckpt),
        "--batch-size",
        "32",
        *script,
    )


def resumed_step(out: str) -> int:
    match = re.search(r"^\[rank0\]:start rank=0 world=2 restart=\d+ resumed_step=(\d+)$", out, re.M)
    assert match, out[-4000:]
    return int(match.group(1))


def kept_folders(job: str) -> list[Path]:
    return [p for p in SHM.iterdir() if p.name.startswith(f"elastic-unpersisted-{job}-")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_resubmitted_job_persists_and_the_third_run_resumes_from_the_second(launch, jobs, tmp_path) -> None:
    job = unique_job("resubmit")
    jobs.append(job)
    ckpt = tmp_path / "ckpt"

    # Run 1: a worker SIGKILLed while it holds at step 4 (saved and persisted): round 2 trains to step 8.
    run1 = launch(run_argv(job, ckpt, 8, "--ckpt-every", "4", "--hold-at-step", "4"), name="run1")
    run1.wait_for(r"^\[rank0\]:step=4 ", RUN_TIMEOUT_S)
    wait_until(lambda: len(run1.worker_pids()) == 2, RUN_TIMEOUT_S, "both workers")
    rank1 = [p for p in run1.worker_pids() if psutil.Process(p).environ().get("RANK") == "1"]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    assert run1.wait(RUN_TIMEOUT_S) == 0, run1.output()[-4000:]
    assert "restart=1" in run1.output(), "run 1 reached a second round"
    assert layout.read_marker(ckpt) == ckpt / layout.step_file_name(8)

    # Run 2: the same job submitted again, with more steps; its rounds start at 1 again.
    run2 = launch(run_argv(job, ckpt, 12, "--ckpt-every", "4"), name="run2")
    assert run2.wait(RUN_TIMEOUT_S) == 0, run2.output()[-4000:]
    assert resumed_step(run2.output()) == 8
    assert "was not persisted" not in run2.output(), run2.output()[-4000:]
    assert layout.read_marker(ckpt) == ckpt / layout.step_file_name(12)

    # Run 3 resumes from run 2's last step, not from run 1's.
    run3 = launch(run_argv(job, ckpt, 12), name="run3")
    assert run3.wait(RUN_TIMEOUT_S) == 0, run3.output()[-4000:]
    assert resumed_step(run3.output()) == 12
    assert '"incarnation"' in (ckpt / FENCE_FILE).read_text()
    assert kept_folders(job) == []


@pytest.mark.timeout(60)
def test_an_unwritable_ckpt_dir_fails_at_start_with_exit_2(launch, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ("--standalone", "--nproc-per-node", "2", "--ckpt-dir", str(blocker / "ckpt"), str(TRAIN_SCRIPT))
    proc = launch(elastic_run_argv(*argv, "--steps", "1"), name="run")
    assert proc.wait(RUN_TIMEOUT_S) == 2, proc.output()
    lines = proc.output().strip().splitlines()
    assert len(lines) == 1 and "--ckpt-dir" in lines[0] and "Not a directory" in lines[0], lines
    assert proc.worker_pids() == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failed_persist_exits_1_and_keeps_the_memory_copy_with_a_command(launch, jobs, tmp_path) -> None:
    job = unique_job("persistfail")
    jobs.append(job)
    ckpt = tmp_path / "ckpt"
    proc = launch(run_argv(job, ckpt, 8, "--ckpt-every", "4", "--hold-at-step", "4"), name="run")
    try:
        # Step 4 is on disk; then the fence file turns into a folder (a fault that holds for root too, and
        # leaves the folder readable for the restarted workers' restore): the persist of step 8 fails.
        proc.wait_for(r"^\[rank0\]:step=4 ", RUN_TIMEOUT_S)
        wait_until(lambda: (ckpt / FENCE_FILE).exists(), RUN_TIMEOUT_S, "step 4 on disk")
        (ckpt / FENCE_FILE).unlink()
        (ckpt / FENCE_FILE).mkdir()
        for pid in proc.worker_pids():  # out of the hold: the restarted round trains steps 5 to 8
            if psutil.Process(pid).environ().get("RANK") == "1":
                os.kill(pid, signal.SIGKILL)
        assert proc.wait(RUN_TIMEOUT_S) == 1, proc.output()[-4000:]
        out = proc.output()
        assert "could not persist the checkpoint of step 8" in out, out[-4000:]  # logged as a warning
        assert "persist_failed: node n1: checkpoint persist failed: step 8" in out, "an event of the master"
        kept = re.search(KEPT_LINE, out, re.M)
        assert kept, out[-4000:]
        assert kept.group(1) == "8"
        assert Path(kept.group(3)).is_file()
        assert len(kept_folders(job)) == 1

        # The printed command persists it.
        subprocess.run(kept.group(4), shell=True, check=True)
        assert layout.read_marker(ckpt) == ckpt / layout.step_file_name(8)
        assert kept_folders(job) == []
    finally:
        for folder in kept_folders(job):
            shutil.rmtree(folder, ignore_errors=True)
