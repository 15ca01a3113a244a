"""The committed state sent to a replaced rank (elastic.inprocess.state.agree) between real gloo processes:
tensor by tensor into the receiver's live tensors, or as one object when a tensor is not a plain strided
one; equal to the sender's, the receiver's own RNG kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port

pytestmark = pytest.mark.timeout(120)

RANK_SCRIPT = Path(__file__).resolve().parent.parent / "support" / "state_transfer_rank.py"


def run(tmp_path: Path, case: str, world: int = 2) -> list[dict]:
    port, out = free_port(), tmp_path / case
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(r), str(world), str(port), str(out), case],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    return [torch.load(f"{out}.{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("case", ["plain", "sparse"])
def test_a_fresh_rank_receives_the_committed_state_equal_to_the_senders(tmp_path, case):
    sender, *receivers = run(tmp_path, case, world=3)
    for got in receivers:
        assert got["step"] == got["committed_step"] == 3
        assert all(torch.equal(got["model"][k], v) for k, v in sender["model"].items())
        assert len(got["momentum"]) == 2, "the optimizer's state, which the fresh rank did not have"
        assert all(torch.equal(a, b) for a, b in zip(got["momentum"], sender["momentum"], strict=True))
        assert got["sampler"] == sender["sampler"]
        assert torch.equal(got["dense"], sender["dense"]) and got["dense"].dtype == torch.float64
        if case == "sparse":
            assert torch.equal(got["sparse"], torch.eye(3))


def test_a_receiver_whose_tensors_do_not_fit_gets_new_ones_and_load_state_dict_says_so(tmp_path):
    sender, receiver = run(tmp_path, "shape")
    assert sender["step"] == 3 and sender["error"] == ""
    assert receiver["error"].startswith("Error(s) in loading state_dict for Linear")
