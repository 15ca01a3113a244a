"""The warm-start zygote's protocol: its operations and their typed messages (standard library only).

The agent (:mod:`agent.warm.starter`) and the zygote (:mod:`agent.warm._zygote_proc`) talk over a
``SOCK_SEQPACKET`` Unix socket pair, one JSON object per message, ``"op"`` naming the operation; file
descriptors travel beside a message (SCM_RIGHTS). docs/protocol.md ("Warm-start zygote") lists the same
operations and fields; ``tests/unit/test_contract_docs.py`` fails when the two differ.

This file is also part of the zygote's source bundle (:data:`agent.warm.starter.BUNDLE`): it runs in a bare
interpreter that may not have this package, so it imports nothing but the standard library and has no
``from __future__`` import.
"""

import dataclasses
import json
from enum import Enum
from typing import Any, ClassVar, Literal


class ZygoteOp(str, Enum):
    """The operations, each with the message class that carries it (:data:`MESSAGES`)."""

    READY = "ready"  # zygote -> agent, once: it imported the preloads and passed the fork-safety checks
    UNAVAILABLE = "unavailable"  # zygote -> agent, once: it cannot serve (it exits next)
    SPAWN = "spawn"  # agent -> zygote: fork a worker; its stdout and stderr write ends attached
    SPAWNED = "spawned"  # zygote -> agent: the worker's pid; its pidfd attached
    SPAWN_FAILED = "spawn_failed"  # zygote -> agent: the fork or its preparation failed
    EXIT = "exit"  # zygote -> agent: a worker exited (the zygote is its parent and reaps it)


class MalformedMessage(ValueError):
    """Not a message of this protocol. ``request_id``: the id of a spawn request that could be read."""

    def __init__(self, why: str, request_id: int | None = None) -> None:
        super().__init__(why)
        self.request_id = request_id


@dataclasses.dataclass(frozen=True)
class Ready:
    OP: ClassVar[ZygoteOp] = ZygoteOp.READY
    pid: int
    import_s: float  # seconds the preloading took
    torch: str  # torch.__version__
    preloaded: list[str]  # modules imported, torch first
    skipped: list[str]  # preloads that failed to import ("name (error)"), skipped
    native_threads: int  # threads after the import (BLAS pools stop themselves at fork)


@dataclasses.dataclass(frozen=True)
class Unavailable:
    OP: ClassVar[ZygoteOp] = ZygoteOp.UNAVAILABLE
    reason: str


@dataclasses.dataclass(frozen=True)
class SpawnRequest:
    OP: ClassVar[ZygoteOp] = ZygoteOp.SPAWN
    id: int  # the agent's request number, echoed in the answer
    argv: list[str]  # the command as exec would run it (shown in /proc/<pid>/cmdline)
    mode: Literal["script", "module"]
    target: str  # the script path or the module name
    args: list[str]  # the arguments after it
    env: dict[str, str]  # the worker's complete environment
    cwd: str
    umask: int | None  # the agent's umask (None: leave the zygote's)
    unbuffered: bool  # python -u (or PYTHONUNBUFFERED)


@dataclasses.dataclass(frozen=True)
class Spawned:
    OP: ClassVar[ZygoteOp] = ZygoteOp.SPAWNED
    id: int
    pid: int


@dataclasses.dataclass(frozen=True)
class SpawnFailed:
    OP: ClassVar[ZygoteOp] = ZygoteOp.SPAWN_FAILED
    id: int
    error: str


@dataclasses.dataclass(frozen=True)
class WorkerExited:
    OP: ClassVar[ZygoteOp] = ZygoteOp.EXIT
    pid: int
    returncode: int  # negative for a signal, as in Popen


#: Operation -> its message class.
MESSAGES: dict[ZygoteOp, Any] = {
    cls.OP: cls for cls in (Ready, Unavailable, SpawnRequest, Spawned, SpawnFailed, WorkerExited)
}


def encode(message: Any) -> bytes:
    """The wire form of a message: ``{"op": ..., fields...}`` as compact JSON."""
    return json.dumps({"op": message.OP.value, **dataclasses.asdict(message)}, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message ``data`` carries; raises :class:`MalformedMessage` for anything else."""
    try:
        raw = json.loads(data)
        op = ZygoteOp(raw["op"])
    except (ValueError, KeyError, TypeError) as e:
        raise MalformedMessage(f"not a zygote message: {e}", _request_id(data)) from None
    cls = MESSAGES[op]
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in raw]
    if missing:
        raise MalformedMessage(f"{op.value} message without {', '.join(missing)}", _request_id(data))
    return cls(**{n: raw[n] for n in names})


def _request_id(data: bytes) -> int | None:
    try:
        value = json.loads(data)["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) else None
