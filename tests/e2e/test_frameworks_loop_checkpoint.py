"""What every framework integration's checkpoint holds besides the framework's state (in this process).

``elastic.integrations.loop_checkpoint``: the RNG states of every rank (one row per rank, each rank
restoring its own), the name of the loop that wrote a checkpoint, and whether saves have anywhere to go.
The end-to-end proof that they make a killed run replay exactly is in test_frameworks_*.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elastic.checkpoint.env import CheckpointError
from elastic.integrations import loop_checkpoint


def draws() -> tuple[list[float], list[float], list[float]]:
    """A few numbers from each generator a training step may consume."""
    return torch.rand(4).tolist(), [random.random() for _ in range(4)], np.random.rand(4).tolist()


@pytest.mark.timeout(30)
def test_restoring_the_gathered_rng_states_replays_torch_python_and_numpy_draws() -> None:
    random.gauss(0, 1)  # leaves a cached gauss in Python's state: it must survive too
    gathered = loop_checkpoint.gather_rng()
    expected = draws()
    assert gathered["rows"].shape[0] == 1, "one row without a process group"

    assert loop_checkpoint.restore_rng(gathered, 0)
    assert draws() == expected


@pytest.mark.timeout(30)
def test_a_rank_beyond_the_saved_world_keeps_its_own_rng_states() -> None:
    gathered = loop_checkpoint.gather_rng()
    draws()
    before = torch.get_rng_state()
    assert not loop_checkpoint.restore_rng(gathered, 1)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.timeout(30)
def test_a_checkpoint_another_loop_wrote_is_refused_in_one_line_naming_the_way_out() -> None:
    loop_checkpoint.check_written_by({"framework": "lightning"}, 7, "lightning", "ElasticCheckpoint")
    with pytest.raises(CheckpointError) as caught:
        loop_checkpoint.check_written_by({"model": {}}, 7, "lightning", "ElasticCheckpoint")
    message = str(caught.value)
    assert "step 7" in message and "--ckpt-reset" in message and "\n" not in message


@pytest.mark.timeout(30)
def test_checkpoints_are_off_with_a_warning_when_saves_have_nowhere_to_go(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("ELASTIC_SHM_DIR", "ELASTIC_CKPT_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert not loop_checkpoint.checkpoints_enabled(None, "ElasticCheckpoint")
    assert "checkpoints are off" in caplog.text
    assert loop_checkpoint.checkpoints_enabled("ckpt", "ElasticCheckpoint")
    monkeypatch.setenv("ELASTIC_CKPT_DIR", "ckpt")
    assert loop_checkpoint.checkpoints_enabled(None, "ElasticCheckpoint")
