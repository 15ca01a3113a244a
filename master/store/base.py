"""The master's state store: where durable job state lives and who may serve the job.

:class:`StateStore` is the one interface the server talks to. :class:`MemoryStore` keeps nothing
across restarts and is always the leader (standalone default). ``EtcdStore`` (``master/store/etcd_store.py``)
keeps the snapshot under ``/elastic/<job>/`` and elects one leader with an etcd lease. Which one a master
uses is the ``--store`` option's (:func:`master.cli.options.open_store`).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import Any

from elastic import errors

Snapshot = dict[str, Any]


class StoreError(errors.StoreError):
    """The store cannot be used (unreachable, bad URL...); the message is one actionable line."""


class StoreUnreachableError(StoreError):
    """No endpoint of the store answered: it may come back (etcd restarting or paused), where a refusal
    (user, permission) or a wrong protocol (TLS) does not pass by waiting."""


class StateFormatError(StoreError):
    """The store holds a job state this master cannot read (not JSON, an unknown schema version, a
    missing field). Unlike an unreachable store this does not pass by retrying: the master exits."""


class StateStore(abc.ABC):
    """Durable job state plus leader election. All methods run on the master's event loop."""

    #: False for stores whose state dies with the process (agents are told on a restart).
    durable: bool = False

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op for in-process stores
        """Connect; raise :class:`StoreError` when the store is unreachable."""

    @abc.abstractmethod
    async def campaign(self, candidate: str, on_lost: Callable[[], Awaitable[None] | None]) -> None:
        """Return once this master leads the job; ``on_lost`` is called if leadership is lost later."""

    @abc.abstractmethod
    async def load(self) -> Snapshot | None:
        """The last saved snapshot, or None for a new job."""

    @abc.abstractmethod
    async def save(self, snapshot: Snapshot) -> None:
        """Persist ``snapshot`` (only while leading); raise :class:`StoreError` on failure."""

    @property
    def leading(self) -> bool:
        """Whether this master may serve the job right now; always true for in-process stores."""
        return True

    @property
    def term(self) -> int:
        """The current leadership term, while leading: a number that grows with every new leader of the
        job (rounds are identified by ``(term, number)``). In-process stores have one term."""
        return 1

    @property
    def state_location(self) -> str:
        """Where the job state lives, for error messages (an etcd key names itself)."""
        return "memory"

    async def resign(self) -> None:  # noqa: B027 - optional hook, a no-op for in-process stores
        """End the current term quietly (``on_lost`` is not called) and let another master be elected at
        once (an etcd lease is revoked); the store stays open for the next :meth:`campaign`. In-process
        stores have no other master: nothing to do."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op for in-process stores
        """Resign leadership (if held) and disconnect."""


class MemoryStore(StateStore):
    """In-process state: the default for standalone jobs; a restart starts a fresh job state."""

    durable = False

    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None

    async def campaign(self, candidate: str, on_lost: Callable[[], Awaitable[None] | None]) -> None:
        return None

    async def load(self) -> Snapshot | None:
        return self._snapshot

    async def save(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
