"""Lightning with ``ElasticCheckpoint`` under elastic-run: a worker lost to SIGKILL costs at most one step.

scripts/examples/lightning_train.py (an MLP with dropout, a step LR schedule, an ``ElasticDataLoader``
crossing an epoch boundary) runs fault-free and with rank 1 killed mid-run, at the same time, each under
``elastic-run --standalone --nproc-per-node 2``; the killed run resumes from its last flash checkpoint
and ends with the fault-free run's weights, bitwise (tests/support/frameworks.py). In this process:
``ElasticDataLoader``, the resumable loader the position travels in.
"""

from __future__ import annotations

import e2e
import pytest
import torch
from frameworks import check_kill_and_resume, require_package
from torch.utils.data import SequentialSampler, TensorDataset

from elastic.sampler import ElasticSampler

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown
jobs = e2e.jobs  # the fixture: removes the shared-memory folders of the test's jobs


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_lightning_run_killed_mid_run_redoes_no_completed_step_and_ends_with_the_fault_free_weights(
    launch, jobs, tmp_path
) -> None:
    require_package("lightning")
    # 8 steps per epoch (64 samples, 2 ranks of 4): the kill lands in epoch 0, the run ends in epoch 1.
    check_kill_and_resume(launch, jobs, tmp_path, "lightning_train.py", steps=12, hold=5)


@pytest.fixture
def lightning_module():
    require_package("lightning")
    from elastic.integrations import lightning

    return lightning


@pytest.mark.timeout(30)
def test_elastic_dataloader_keeps_a_whole_epoch_length_after_a_restore_mid_epoch(lightning_module) -> None:
    # Lightning sizes every epoch by the loader's length when its loop starts, after the restore.
    sampler = ElasticSampler(64, num_replicas=2, rank=0, batch_size=4, seed=0)
    loader = lightning_module.ElasticDataLoader(TensorDataset(torch.arange(64)), sampler=sampler)
    assert len(loader) == 8
    loader.load_state_dict({**sampler.state_dict(), "consumed": 40})
    assert len(loader) == 8, "the remaining 3 batches would shorten every later epoch"
    assert len(list(loader)) == 3, "but the iteration goes on from the restored position"


@pytest.mark.timeout(30)
def test_elastic_dataloader_draws_nothing_from_torchs_global_rng(lightning_module) -> None:
    # A restarted run creates one more iterator than the run it replays: that must not shift dropout masks.
    sampler = ElasticSampler(16, num_replicas=1, rank=0, batch_size=4, seed=0)
    loader = lightning_module.ElasticDataLoader(TensorDataset(torch.arange(16)), sampler=sampler)
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.timeout(30)
def test_elastic_dataloader_refuses_a_replaced_sampler_naming_the_trainer_option(lightning_module) -> None:
    dataset = TensorDataset(torch.arange(16))
    with pytest.raises(TypeError, match=r"use_distributed_sampler=False"):
        lightning_module.ElasticDataLoader(dataset, sampler=SequentialSampler(dataset))
    with pytest.raises(ValueError, match="drop_last"):
        sampler = ElasticSampler(16, num_replicas=1, rank=0, batch_size=4)
        lightning_module.ElasticDataLoader(dataset, sampler=sampler, drop_last=True)
