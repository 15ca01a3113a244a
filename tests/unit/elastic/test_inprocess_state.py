"""elastic.inprocess.state: the committed step in memory (undo of a broken step) and who sends it."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from elastic.inprocess.state import Committed, plan
from elastic.sampler import ElasticSampler


def make() -> tuple[nn.Module, torch.optim.Optimizer, ElasticSampler]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(64, num_replicas=2, rank=0, global_batch_size=8)
    return model, optimizer, sampler


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    sampler.advance()


def test_restore_undoes_a_step_that_broke_half_way_including_the_rng() -> None:
    model, optimizer, sampler = make()
    train_step(model, optimizer, sampler)
    committed = Committed({"model": model, "optimizer": optimizer, "sampler": sampler}, step=1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    draw = torch.rand(1)
    py_draw = random.random()
    for _ in range(2):  # the broken step, then the restore, twice: the buffers are reused
        torch.rand(5)
        train_step(model, optimizer, sampler)
        committed.restore()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
        assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)
        assert sampler.step == 1
    committed.restore()
    assert torch.equal(torch.rand(1), draw) and random.random() == py_draw, "the RNG is back where it was"


def test_training_after_a_restore_does_not_change_the_committed_copy() -> None:
    model, optimizer, sampler = make()
    train_step(model, optimizer, sampler)
    committed = Committed({"model": model, "optimizer": optimizer}, step=1)
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"].clone()
    committed.restore()  # load_state_dict may keep the tensors it is given: they must be copies
    train_step(model, optimizer, sampler)  # updates the momentum in place
    committed.restore()
    assert torch.equal(optimizer.state_dict()["state"][0]["momentum_buffer"], momentum)


def test_restore_copies_into_the_objects_own_tensors_and_clones_what_does_not_fit() -> None:
    model, optimizer, sampler = make()
    train_step(model, optimizer, sampler)
    committed = Committed({"model": model, "optimizer": optimizer, "sampler": sampler}, step=1)
    storages = [t.untyped_storage().data_ptr() for t in model.state_dict().values()]
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    train_step(model, optimizer, sampler)
    committed.restore()
    assert [t.untyped_storage().data_ptr() for t in model.state_dict().values()] == storages, "no new memory"
    assert optimizer.state_dict()["state"][0]["momentum_buffer"].data_ptr() == momentum.data_ptr()
    optimizer.state.clear()  # the live state lacks what was committed: it gets copies
    committed.restore()
    restored = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(restored, momentum) and restored.data_ptr() != momentum.data_ptr()


def test_a_peer_payload_is_adopted_without_its_rng() -> None:
    model, optimizer, sampler = make()
    for _ in range(3):
        train_step(model, optimizer, sampler)
    sender = Committed({"model": model, "optimizer": optimizer, "sampler": sampler}, step=3, fresh=False)
    fresh_model, fresh_optimizer, fresh_sampler = make()
    receiver = Committed(
        {"model": fresh_model, "optimizer": fresh_optimizer, "sampler": fresh_sampler}, step=0
    )
    torch.manual_seed(7)
    draw = torch.rand(1)
    torch.manual_seed(7)
    receiver.adopt(sender.payload())
    assert receiver.step == 3 and not receiver.fresh
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())
    assert fresh_sampler.state_dict() == sampler.state_dict()
    assert torch.equal(torch.rand(1), draw), "the receiver's RNG is its own"


@pytest.mark.parametrize(
    ("reports", "step", "source", "receivers"),
    [
        ([(0, True), (0, True)], 0, None, ()),  # a job's first start: nobody sends
        ([(7, False), (7, False)], 7, None, ()),  # a node left: every survivor holds the step
        ([(7, False), (0, True)], 7, 0, (1,)),  # rank 1 replaced
        ([(0, True), (7, False), (7, False)], 7, 1, (0,)),  # the new rank 0 receives from rank 1
        ([(7, False), (8, False), (0, True)], 8, 1, (0, 2)),  # rank 0 was one step behind
        ([(5, True), (9, False)], 9, 1, (0,)),  # an older step a fresh process loaded is replaced
        # A rank kept in its process while cut off (step 2598) and two processes restarted beside it that
        # loaded their node's newer copy: the newer step wins (the kept one's won and lost 80 steps).
        ([(2670, True), (2670, True), (2598, False)], 2670, 0, (2,)),
        ([(2670, True), (2678, True), (2598, False)], 2678, 1, (0, 2)),
        ([(12, True), (10, True)], 12, 0, (1,)),  # every process restarted, copies of different steps
        ([(9, True), (9, False)], 9, 1, (0,)),  # at the same step the kept rank sends (a fresh init)
    ],
)
def test_the_newest_committed_step_comes_from_the_lowest_rank_holding_it(
    reports, step, source, receivers
) -> None:
    decided = plan(reports)
    assert (decided.step, decided.source, decided.receivers) == (step, source, receivers)
