"""elastic: the library a training script imports, plus what master and agent share.

The worker API (``init_process_group``, ``save``, ``load_latest``...) needs torch, but the agent and the
master import ``elastic.protocol`` and must stay torch-free, so nothing here imports torch eagerly: the
worker API is resolved on first attribute access (PEP 562 module ``__getattr__``)::

    import elastic                      # cheap, no torch
    elastic.init_process_group()        # imports elastic.distributed (and torch) now
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> submodule that defines it. Everything listed here is imported on first use only.
_LAZY_ATTRS: dict[str, str] = {
    "init_process_group": "distributed",
    "destroy_process_group": "distributed",
    "backend_for_device": "distributed",
    "save": "checkpoint",
    "load_latest": "checkpoint",
    "CheckpointError": "checkpoint",
}
_LAZY_SUBMODULES = frozenset({"distributed", "checkpoint"})

__all__ = [
    "CheckpointError",
    "__version__",
    "backend_for_device",
    "checkpoint",
    "destroy_process_group",
    "distributed",
    "init_process_group",
    "load_latest",
    "save",
]

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time these resolve lazily
    from elastic import checkpoint, distributed
    from elastic.checkpoint import CheckpointError, load_latest, save
    from elastic.distributed import backend_for_device, destroy_process_group, init_process_group


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
