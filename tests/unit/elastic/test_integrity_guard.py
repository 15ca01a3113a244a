"""The integrity guard in one process: the exact state digest, verdicts on NaN, spikes and steps that
pass, the newest verified step (one step behind a clean one, two behind a spike), and the lazy export."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import elastic
from elastic.integrity import digests
from elastic.integrity.guard import MISMATCH, NON_FINITE, SPIKE, Guard, IntegrityFault, Verdict


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    with torch.no_grad():
        raw = tensor.view(-1).view(torch.int32)
        raw[index] ^= 1 << bit


@pytest.mark.parametrize("bit", [0, 22, 30, 31])  # lowest mantissa, top mantissa, exponent, sign
def test_one_flipped_bit_changes_the_digest_and_only_its_part(bit):
    model, optimizer = make()
    train_step(model, optimizer, 1)
    twin, twin_opt = make()
    train_step(twin, twin_opt, 1)
    mine, theirs = digests.StateDigest(model, optimizer), digests.StateDigest(twin, twin_opt)
    assert mine.compute() == theirs.compute()  # exact over the bits of equal replicas
    before = [mine.compute(p, 4) for p in range(4)]
    flip_bit(next(model.parameters()), 3, bit)
    assert mine.compute() != theirs.compute()
    after = [mine.compute(p, 4) for p in range(4)]
    assert [b != a for b, a in zip(before, after, strict=True)] == [True, False, False, False]
    assert len(set(before)) == 4  # parts never share a digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_non_finite_gradient_check_is_exact(dtype):
    model = torch.nn.Linear(4, 3).to(dtype)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert not digests.non_finite_grads(model)
    weight = model.weight.grad
    assert weight is not None
    big = torch.finfo(dtype).max / 2  # finite elements whose sum overflows: not a finding
    weight.fill_(big)
    assert not digests.non_finite_grads(model)
    for bad in (float("nan"), float("inf"), float("-inf")):
        weight.fill_(1.0)
        weight[1, 2] = bad
        assert digests.non_finite_grads(model)


def test_the_digest_covers_the_optimizer_state_in_state_dict_order():
    model, optimizer = make()
    train_step(model, optimizer, 1)
    by_state_dict = [p.detach() for p in model.parameters()]
    state = optimizer.state_dict()["state"]
    for index in sorted(state):
        by_state_dict += [
            state[index][k] for k in sorted(state[index]) if isinstance(state[index][k], torch.Tensor)
        ]
    covered = digests.state_tensors(model, optimizer)
    assert len(covered) == len(by_state_dict) > len(list(model.parameters()))
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(covered, by_state_dict, strict=True))


def test_a_nan_gradient_is_named_and_the_step_before_is_the_rollback():
    model, optimizer = make()
    guard = Guard(parts=1)
    for step in range(1, 6):
        loss = train_step(model, optimizer, step)
        assert guard.after_step(step, loss, model, optimizer).ok
        guard.saved(step)
    assert guard.verified_step == 4  # step 5 waits for the loss of step 6
    loss = train_step(model, optimizer, 6)
    grad = next(model.parameters()).grad
    assert grad is not None
    grad[0, 0] = math.nan
    with pytest.raises(IntegrityFault) as caught:
        guard.after_step(6, loss, model, optimizer)
    verdict = caught.value.verdict
    assert (verdict.kind, verdict.ranks, verdict.rollback_to) == (NON_FINITE, (0,), 5)


def test_a_spike_rolls_back_past_the_update_its_loss_reflects():
    model, optimizer = make()
    guard = Guard(parts=1, warmup=5, raise_on_detection=False)
    for step in range(1, 11):
        assert guard.after_step(step, 1.0 + 0.01 * (step % 3), model, optimizer).ok
        guard.saved(step)
    verdict = guard.after_step(11, 100.0, model, optimizer)
    assert verdict.kind == SPIKE and verdict.limit < 100.0
    assert verdict.rollback_to == 9  # the loss of 11 comes from the weights of 10: 10 is not verified
    guard.rolled_back(9)
    again = guard.after_step(10, 1.0, model, optimizer)
    assert again.ok
    recurring = guard.after_step(11, 100.0, model, optimizer)
    assert recurring.kind == SPIKE and recurring.recurring


def test_a_budget_below_the_digest_cost_rotates_parts_and_still_verifies():
    model, optimizer = make()
    guard = Guard(budget=1e-9)  # far below any digest: as many parts as allowed
    for step in range(1, 4):
        guard.after_step(step, 1.0, model, optimizer)
        guard.saved(step)
    assert guard.parts > 1
    assert guard.verified_step is None  # not every part was checked since
    for step in range(4, 4 + guard.parts + 2):
        guard.after_step(step, 1.0, model, optimizer)
        guard.saved(step)
    assert guard.verified_step is not None


def test_verdicts_describe_themselves():
    assert "odd rank(s) [2]" in Verdict(7, MISMATCH, (2,), rollback_to=6).describe()
    assert Verdict(3).ok


def test_the_guard_is_public_and_import_elastic_stays_torch_free():
    assert elastic.Guard is Guard and elastic.IntegrityFault is IntegrityFault
    code = "import sys, elastic, elastic.integrity; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
