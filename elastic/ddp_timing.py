"""Compute time per step for the straggler report: how long a rank works, not how long it waits.

In synchronous data parallelism every rank's step lasts as long as the slowest rank's, because DDP's
gradient all-reduce waits for it; wall-clock step times are then equal on every node and cannot name the
straggler. :func:`track_ddp` registers a DDP communication hook (public API) that does DDP's usual
all-reduce (``default_hooks.allreduce_hook``) and measures, per backward pass, how long the last gradient
bucket's all-reduce took after this rank had finished computing it. That wait is subtracted from the step
time in the next :func:`elastic.report` (see :mod:`elastic.report`), so the agent receives this rank's
*compute* time: long on the straggler, short on the ranks waiting for it.

A model can have only one communication hook: do not combine with another one (PowerSGD, fp16
compression); the straggler report then compares wall-clock step times.
"""

# No ``from __future__ import annotations``: DDP checks the hook's return annotation as a real type.
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from elastic.report import add_comm_wait


def _timed_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    future = default_hooks.allreduce_hook(process_group, bucket)
    if not bucket.is_last():
        return future
    ready = time.monotonic()  # this rank has computed every gradient of the step

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        add_comm_wait(time.monotonic() - ready)
        return fut.value()

    return future.then(done)


def track_ddp(model: DistributedDataParallel, process_group=None) -> DistributedDataParallel:
    """Make ``model`` report this rank's compute time per step (for the straggler report); returns it.

    Call once, before the first forward pass. The gradients are reduced exactly as by DDP's default
    all-reduce hook (divided by the world size, then summed), in ``process_group`` (default: the world).
    The time is sent with the next step report (:func:`elastic.report`, which
    :meth:`elastic.ElasticSampler.advance` calls); without step reports nothing is measured.

    Args:
        model: the DDP-wrapped model; it must have no communication hook yet (a model takes one).
        process_group: the group DDP reduces the gradients in; ``None``: the default group.

    Returns:
        ``model`` itself, so that the call can wrap the construction.

    Raises:
        TypeError: ``model`` is not a ``DistributedDataParallel``.
        RuntimeError: ``model`` already has a communication hook (raised by DDP).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"track_ddp needs a DistributedDataParallel model, got {type(model).__name__}")
    model.register_comm_hook(process_group, _timed_allreduce_hook)
    return model
