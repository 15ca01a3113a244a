"""Tensors lent to gloo stay referenced by Python until gloo lets go (elastic.collectives.lend/settle).

Gloo frees a finished work on its own thread; freeing a Python-created tensor there needs the GIL, which
aborts the process when it happens during interpreter shutdown. These tests use a real one-rank gloo
group (an in-memory store, no port) and check the bookkeeping that keeps that last release in Python.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from elastic import collectives

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gloo_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        collectives.settle()
        dist.destroy_process_group()


def test_settle_waits_while_gloo_holds_a_lent_tensor_and_gives_up_at_its_deadline(gloo_group: None) -> None:
    tensor = torch.zeros(4)
    collectives.lend(tensor)
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    assert tensor._use_count() > 1  # the work still holds it, as gloo's thread does after completion
    assert collectives.settle(timeout_s=0.05) is False
    assert collectives._lent == []  # let go anyway: a stuck backend must not block the exit
    del work


def test_settle_returns_once_gloo_released_everything(gloo_group: None) -> None:
    tensor = torch.zeros(4)
    collectives.lend(tensor)
    dist.all_reduce(tensor)
    assert collectives.settle(timeout_s=5) is True
    assert collectives._lent == []


def test_lend_drops_only_tensors_the_backend_no_longer_holds(gloo_group: None) -> None:
    held, released = torch.zeros(2), torch.zeros(2)
    collectives.lend(held, released)
    work = dist.all_reduce(held, async_op=True)
    work.wait()
    fresh = torch.zeros(1)
    collectives.lend(fresh)
    assert [t.data_ptr() for t in collectives._lent] == [held.data_ptr(), fresh.data_ptr()]
    del work
    assert collectives.settle(timeout_s=5) is True
