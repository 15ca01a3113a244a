"""Unit tests of elastic.ElasticSampler: DistributedSampler parity, exact resume at any world size,
constant global batch through gradient accumulation, and its state."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic.sampler import ElasticSampler


def samplers(world: int, n: int, **kwargs) -> list[ElasticSampler]:
    return [ElasticSampler(n, num_replicas=world, rank=r, **kwargs) for r in range(world)]


def run_steps(group: list[ElasticSampler], steps: int | None = None) -> list[list[int]]:
    """Consume ``steps`` steps (all when None) on every rank in lockstep; the global batch of each step."""
    iterators = [s.steps() for s in group]
    batches = []
    while steps is None or len(batches) < steps:
        shares = [next(it, None) for it in iterators]
        if shares[0] is None:
            assert all(share is None for share in shares), "ranks disagree on the number of steps"
            break
        global_batch = [i for share in shares for micro in share.micro_batches for i in micro]
        assert len(global_batch) == shares[0].global_size
        batches.append(global_batch)
        for s in group:
            s.advance()
    return batches


@pytest.mark.timeout(10)
def test_order_matches_distributed_sampler_when_nothing_is_left_over() -> None:
    data = TensorDataset(torch.arange(96))
    for epoch in (0, 3):
        for rank in range(3):
            ours = ElasticSampler(data, num_replicas=3, rank=rank, seed=7, batch_size=4)
            theirs = DistributedSampler(data, num_replicas=3, rank=rank, seed=7)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs) == 32


@pytest.mark.timeout(10)
def test_world_and_rank_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    sampler = ElasticSampler(10)
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    with pytest.raises(ValueError, match="rank 5 is not in a world of 4"):
        ElasticSampler(10, rank=5)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "world", "batch"), [(100, 3, 4), (64, 2, 8), (7, 4, 1), (1000, 5, 7)])
@pytest.mark.timeout(10)
def test_an_epoch_deals_every_sample_at_most_once(n: int, world: int, batch: int, drop_last: bool) -> None:
    group = samplers(world, n, batch_size=batch, drop_last=drop_last, seed=1)
    dealt = [i for b in run_steps(group) for i in b]
    assert len(dealt) == len(set(dealt))
    left_out = n - len(dealt)
    # Only a tail that cannot make a whole step (drop_last) or give every rank a sample is left out.
    assert left_out < (world * batch if drop_last else world)
    assert all(s.epoch_done for s in group)


@pytest.mark.parametrize(
    ("worlds", "kwargs"),
    [
        ((2, 1, 2), {"global_batch_size": 12, "batch_size": 4}),
        ((2, 3, 1), {"global_batch_size": 10}),
        ((4, 2, 3), {"batch_size": 5}),
        ((1, 5), {"batch_size": 3, "drop_last": True}),
    ],
)
@pytest.mark.timeout(20)
def test_resume_at_other_world_sizes_skips_and_repeats_nothing(worlds: tuple[int, ...], kwargs: dict) -> None:
    n = 240
    state = None
    dealt: list[int] = []
    for i, world in enumerate(worlds):
        group = samplers(world, n, seed=3, **kwargs)
        if state is not None:
            for s in group:
                s.load_state_dict(state)
        last = i == len(worlds) - 1
        dealt += [x for b in run_steps(group, None if last else 4) for x in b]
        # Through a real checkpoint: plain ints survive weights_only loading.
        buffer = io.BytesIO()
        torch.save(group[0].state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
    counts = Counter(dealt)
    assert max(counts.values()) == 1, "a sample was repeated"
    # Nothing skipped: only the end of the epoch that cannot make a step at the last world size is left.
    assert n - len(dealt) < group[0].step_size
    if "global_batch_size" in kwargs:
        assert len(dealt) == n


@pytest.mark.timeout(10)
def test_global_batch_is_the_same_at_every_world_size_with_accumulation() -> None:
    expected = None
    for world, accumulation in ((1, 4), (2, 2), (3, 2), (4, 1), (8, 1)):
        group = samplers(world, 2048, global_batch_size=512, batch_size=128, seed=5)
        assert group[0].accumulation_steps == accumulation
        shares = [next(s.steps()) for s in group]
        micro_sizes = [len(m) for share in shares for m in share.micro_batches]
        assert max(micro_sizes) <= 128
        per_rank = [sum(len(m) for m in share.micro_batches) for share in shares]
        assert max(per_rank) - min(per_rank) <= 1
        batches = [sorted(b) for b in run_steps(group)]
        assert len(batches) == 4
        assert expected is None or batches == expected, f"world {world} dealt other global batches"
        expected = batches


@pytest.mark.timeout(10)
def test_set_epoch_keeps_a_restored_position_and_reshuffles_a_new_epoch() -> None:
    sampler = ElasticSampler(50, num_replicas=1, rank=0, batch_size=5, seed=2)
    first = list(sampler)
    sampler.advance(3)
    sampler.set_epoch(0)
    assert list(sampler) == first[15:]
    assert len(sampler) == 35
    sampler.set_epoch(1)
    assert sampler.consumed == 0 and sorted(sampler) == list(range(50)) and list(sampler) != first
    assert ElasticSampler(50, num_replicas=1, rank=0, seed=2, shuffle=False).__iter__().__next__() == 0


@pytest.mark.timeout(10)
def test_state_round_trip_and_mismatches_are_refused() -> None:
    sampler = ElasticSampler(50, num_replicas=2, rank=0, batch_size=5, seed=2)
    sampler.set_epoch(4)
    sampler.advance(2)
    state = sampler.state_dict()
    assert state == {"epoch": 4, "consumed": 20, "step": 2, "num_samples": 50, "seed": 2, "shuffle": True}

    other = ElasticSampler(50, num_replicas=5, rank=3, batch_size=1, seed=2)
    other.load_state_dict(state)
    assert (other.epoch, other.consumed, other.step) == (4, 20, 2)
    with pytest.raises(ValueError, match="num_samples=50"):
        ElasticSampler(51, num_replicas=1, rank=0, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=2"):
        ElasticSampler(50, num_replicas=1, rank=0, seed=3).load_state_dict(state)


@pytest.mark.timeout(10)
def test_advance_needs_a_batch_size_and_stops_at_the_end_of_the_epoch() -> None:
    with pytest.raises(ValueError, match="batch_size="):
        ElasticSampler(10, num_replicas=1, rank=0).advance()
    sampler = ElasticSampler(10, num_replicas=2, rank=0, batch_size=4)
    sampler.advance()
    sampler.advance()  # the last, smaller step (2 samples, one per rank)
    assert sampler.epoch_done and sampler.consumed == 10
    with pytest.raises(ValueError, match="no samples left"):
        sampler.advance()
    with pytest.raises(ValueError, match="smaller than the world size"):
        ElasticSampler(10, num_replicas=4, rank=0, global_batch_size=3)


@pytest.mark.timeout(10)
def test_batch_sampler_drives_a_data_loader_with_uneven_micro_batches() -> None:
    data = TensorDataset(torch.arange(40))
    sampler = ElasticSampler(data, num_replicas=3, rank=1, global_batch_size=10, batch_size=2, seed=0)
    assert sampler.accumulation_steps == 2  # ceil(10 / 3) = 4 per rank at most, in micro-batches of 2
    loader = DataLoader(data, batch_sampler=sampler.batch_sampler())
    got = [batch[0].tolist() for batch in loader]
    assert len(got) == len(sampler.batch_sampler())
    assert [i for b in got for i in b] == list(sampler)
    assert all(1 <= len(b) <= 2 for b in got)


def test_reshard_keeps_the_position_and_deals_the_next_steps_to_the_new_world() -> None:
    two = [ElasticSampler(48, num_replicas=2, rank=r, global_batch_size=8, seed=3) for r in range(2)]
    for s in two:
        s.advance(2)
    one = two[0]
    one.reshard(1, 0)  # rank 1 left: rank 0 now takes whole steps
    whole = next(one.steps()).micro_batches[0]
    three = [ElasticSampler(48, num_replicas=3, rank=r, global_batch_size=8, seed=3) for r in range(3)]
    for s in three:
        s.load_state_dict(two[1].state_dict())
    assert sorted(whole) == sorted(i for s in three for i in next(s.steps()).micro_batches[0])
    with pytest.raises(ValueError):
        one.reshard(2, 2)
    with pytest.raises(ValueError):
        one.reshard(9, 0)  # more ranks than samples per step


def test_the_last_steps_indices_are_its_whole_global_batch() -> None:
    sampler = ElasticSampler(20, num_replicas=2, rank=0, seed=3, global_batch_size=6)
    assert sampler.last_step_indices() == []
    steps = list(ElasticSampler(20, num_replicas=2, rank=1, seed=3, global_batch_size=6).steps())
    mine = next(iter(sampler.steps()))
    sampler.advance(2)
    last = sampler.last_step_indices()
    assert len(last) == 6 and set(steps[1].micro_batches[0]) < set(last)
    assert not set(mine.micro_batches[0]) & set(last), "step 1's samples are not step 2's"
