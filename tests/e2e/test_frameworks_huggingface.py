"""The Hugging Face Trainer with ``ElasticTrainerCallback`` under elastic-run: a SIGKILL costs one step.

scripts/examples/hf_trainer_train.py (a one-layer GPT-2 with dropout, a warmup-then-linear LR schedule,
the Trainer's own sampler crossing an epoch boundary) runs fault-free and with rank 1 killed mid-run, at
the same time, each under ``elastic-run --standalone --nproc-per-node 2``; the killed run resumes through
``train(resume_from_checkpoint=...)`` from its last flash checkpoint and ends with the fault-free run's
weights, bitwise (tests/support/frameworks.py).
"""

from __future__ import annotations

import e2e
import pytest
from frameworks import check_kill_and_resume, require_package

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_hf_trainer_run_killed_mid_run_redoes_no_completed_step_and_ends_with_the_fault_free_weights(
    launch, jobs, tmp_path
) -> None:
    require_package("transformers")
    require_package("accelerate")  # the Trainer needs it on torch
    # 8 steps per epoch (64 samples, 2 ranks of 4): the kill lands in epoch 0, the run ends in epoch 1.
    check_kill_and_resume(launch, jobs, tmp_path, "hf_trainer_train.py", steps=12, hold=5)
