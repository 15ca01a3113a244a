"""In-process recovery: on a lost worker or node, or a joining node, live workers keep their processes.

Promises: :func:`run` forms the process group and calls ``train(world)``; after a fault it releases the
broken group (``pg_control``: gloo by shutting its connections, NCCL by abort), takes the next round's
environment from the agent over the control channel (``wire``, ``link``), re-forms the group in the same
process, agrees with the other ranks on the newest committed step (``state``) and calls ``train`` again.
Without an agent (plain torchrun) it forms the group once and calls ``train`` once.

Raises: :class:`WorldChanged` inside ``train`` when the agent asks the worker to leave its step (``run``
catches it); a group that cannot re-form within ``reform_timeout_s`` ends the process so that the agent
falls back to a process restart.

Owns: the worker's end of the in-process control channel and the memory copy of the last committed step.
Importing this package imports no torch; the worker API below resolves on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.lazy import lazy_exports

_LAZY_ATTRS: dict[str, str] = {"run": "recovery", "World": "recovery", "WorldChanged": "recovery"}
__all__ = ["World", "WorldChanged", "run"]

if TYPE_CHECKING:
    from elastic.inprocess.recovery import World, WorldChanged, run


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_ATTRS, __all__)
