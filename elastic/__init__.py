"""``import elastic``: the library a training script calls under ``elastic-run`` (or plain torchrun).

This page is the reference of its public names, generated from their docstrings by pdoc (the command is
in docs/testing.md); docs/quickstart.md adapts a torchrun script to them step by step.

| Need | Call |
| --- | --- |
| join the process group the launcher describes | `init_process_group`, `destroy_process_group` |
| save and restore replicated (data-parallel) state, in memory then on disk | `save`, `load`, `load_latest` |
| resume the data at the exact sample, at any world size | `ElasticSampler` |
| save and restore sharded state (FSDP, DTensor) | `save_sharded`, `load_sharded` |
| keep the live processes through a fault (in-process recovery) | `run`, `World`, `WorldChanged` |
| catch a corrupted replica, a NaN or a loss spike and roll back | `Guard`, `IntegrityFault` |
| tell the agent about progress (hang and straggler checks) | `report`, `report_checkpoint`, `track_ddp` |

Every call works without an agent too (plain torchrun, or one process): saves go to disk, reports are
dropped, and :func:`run` calls the training function once.

The worker API needs torch, but the agent and the master import ``elastic.control.protocol`` and must
stay torch-free, so nothing here imports torch eagerly: the worker API is resolved on first attribute
access (PEP 562 module ``__getattr__``):

    import elastic                      # cheap, no torch
    elastic.init_process_group()        # imports elastic.distributed (and torch) now
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
"""The version of elastic-run (the package) this library belongs to."""

# Progress reports are stdlib-only and cheap, so they are imported eagerly: ``elastic.report(step)`` is the
# function (the name shadows the submodule ``elastic.report``; import its other names with ``from``).
from elastic.report import report, report_checkpoint  # noqa: E402

# Public name -> submodule that defines it. Everything listed here is imported on first use only.
_LAZY_ATTRS: dict[str, str] = {
    "init_process_group": "distributed",
    "destroy_process_group": "distributed",
    "backend_for_device": "distributed",
    "save": "checkpoint",
    "load": "checkpoint",
    "load_latest": "checkpoint",
    "CheckpointError": "checkpoint",
    "save_sharded": "sharded",
    "load_sharded": "sharded",
    "ElasticSampler": "sampler",
    "track_ddp": "ddp_timing",
    "run": "inprocess",
    "World": "inprocess",
    "WorldChanged": "inprocess",
    "Guard": "integrity",
    "IntegrityFault": "integrity",
}
_LAZY_SUBMODULES = frozenset({"distributed", "checkpoint", "sharded", "sampler", "inprocess"})

__all__ = [
    "CheckpointError",
    "ElasticSampler",
    "Guard",
    "IntegrityFault",
    "World",
    "WorldChanged",
    "__version__",
    "backend_for_device",
    "checkpoint",
    "destroy_process_group",
    "distributed",
    "inprocess",
    "init_process_group",
    "load",
    "load_latest",
    "load_sharded",
    "report",
    "report_checkpoint",
    "run",
    "sampler",
    "save",
    "save_sharded",
    "sharded",
    "track_ddp",
]

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time these resolve lazily
    from elastic import distributed, sampler, sharded
    from elastic.checkpoint import replicated as checkpoint
    from elastic.checkpoint.replicated import CheckpointError, load, load_latest, save
    from elastic.ddp_timing import track_ddp
    from elastic.distributed import backend_for_device, destroy_process_group, init_process_group
    from elastic.inprocess import recovery as inprocess
    from elastic.inprocess.recovery import World, WorldChanged, run
    from elastic.integrity import Guard, IntegrityFault
    from elastic.sampler import ElasticSampler
    from elastic.sharded import load_sharded, save_sharded


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    submodule = _LAZY_ATTRS.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
