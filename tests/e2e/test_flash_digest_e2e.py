"""A flipped bit in a shared-memory checkpoint, end to end: a real ``elastic-run`` agent hosting its master
(``--standalone``) and the example training script's real workers. The restore after a worker's death finds
the newest memory copy failing its digest, never loads it, resumes from the older step in memory, and the
master records event ``checkpoint_corrupt``; the job still ends well."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import e2e
import pytest
from e2e import SHM, TRAIN_SCRIPT, base_env, elastic_run_argv, shm_folders, unique_job

from agent.checkpoints.shm_folder import folder_name
from elastic.checkpoint import digest, layout

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs

RUN_TIMEOUT_S = 150  # other suites share the 2 cores; each torch worker takes seconds to start


def flip_a_tensor_byte(path: Path) -> None:
    """One bit of the file's tensor bytes flips (as a memory error would), in place."""
    with path.open("r+b") as f:
        data = f.read()
        header = digest.read_header(data, len(data))
        at = header.data_offset + 8
        f.seek(at)
        f.write(bytes([data[at] ^ 0x20]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_damaged_memory_checkpoint_is_skipped_reported_and_the_job_resumes_from_the_older_step(
    launch, jobs, tmp_path
) -> None:
    job = unique_job("digest")
    jobs.append(job)
    ckpt = tmp_path / "ckpt"
    # Every persist pauses mid-copy: the restore can only come from memory (steps 5 and 6 there).
    env = base_env(ELASTIC_PERSIST_DELAY_S="600")
    agent = ["--standalone", "--rdzv-id", job, "--node-id", "n1", "--nproc-per-node", "2"]
    agent += ["--max-restarts", "3", "--stop-grace", "2", "--ckpt-dir", str(ckpt)]
    # Both kills come at step 6 with no newer step in between: a crash loop by its rule (exit 3), unless off.
    agent += ["--crash-loop-window", "0"]
    script = ["--steps", "8", "--ckpt-every", "1", "--batch-size", "64", "--hold-at-step", "6"]
    proc = launch(elastic_run_argv(*agent, str(TRAIN_SCRIPT), *script), name="agent", env=env)

    proc.wait_for(r"^\[rank0\]:step=6 loss", RUN_TIMEOUT_S)  # logged after the save
    memory = SHM / folder_name(job, "n1")
    held = layout.checkpoint_files(memory)
    assert [step for step, _ in held] == [6, 5]
    flip_a_tensor_byte(held[0][1])
    offset = len(proc.output())
    os.kill(max(proc.worker_pids()), signal.SIGKILL)

    restarted = proc.wait_for(
        r"^\[rank0\]:start rank=0 world=2 restart=1 resumed_step=(\d+)$", RUN_TIMEOUT_S, after=offset
    )
    assert int(restarted.group(1)) == 5, "the damaged step 6 was not loaded"
    # Step 6 is trained and saved again, and the script holds there again: out of the hold once more.
    again = proc.wait_for(r"^\[rank0\]:step=6 loss", RUN_TIMEOUT_S, after=restarted.end())
    os.kill(max(proc.worker_pids()), signal.SIGKILL)
    proc.wait_for(
        r"^\[rank0\]:start rank=0 world=2 restart=2 resumed_step=6$", RUN_TIMEOUT_S, after=again.end()
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    out = proc.output()
    assert "failed its digest check" in out[offset:], "the worker's restore said so"
    assert f"checkpoint_corrupt: node n1: a copy of the checkpoint of step 6 ({held[0][1]})" in out, (
        "an event of the master"
    )
    assert (ckpt / "latest").read_text() == layout.step_file_name(8)
    assert shm_folders(job) == []
