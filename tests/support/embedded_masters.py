"""Real masters in this process for integration tests: :class:`EmbeddedMasters` starts
``master.http.serving.EmbeddedMaster`` instances (uvicorn in a thread, 127.0.0.1, a port the OS picks) and
closes, at the end of the test, every client it was handed and every master it started;
:func:`no_thread_left` checks that the test left no thread behind."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol, Self, TypeVar

import httpx
from e2e import wait_until

from elastic.control.client import MasterClient
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import JOB_HEADER, JoinRequest
from master.http.serving import EmbeddedMaster
from master.service.settings import ServerSettings
from master.store.base import StateStore


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


@contextlib.contextmanager
def no_thread_left(what: str = "the master's threads to end", timeout: float = 10.0) -> Iterator[None]:
    """Wait (up to ``timeout``) after the block until every thread started inside it has ended.

    A block that raises is not checked: its own error says more than the threads it left."""
    before = set(threading.enumerate())
    yield
    wait_until(lambda: not set(threading.enumerate()) - before, timeout, what)


class EmbeddedMasters:
    """Starts masters and keeps clients for one test; :meth:`close` (or leaving ``with``) closes the
    clients, in the order they were kept, then stops the masters.

    A subclass names the :attr:`token` and :attr:`job_id` of its masters, and may change the :attr:`job`
    they start with."""

    #: The bearer token and the job of every master started here.
    token: str
    job_id: str
    #: The ``JobSettings`` values (but the job id) every master starts with, which :meth:`start` overrides
    #: one by one: a job of two nodes with no timeout that a test's own pace could reach.
    job: ClassVar[dict[str, Any]] = dict(
        min_nodes=2,
        max_nodes=2,
        last_call_s=60.0,
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=60.0,
        join_timeout_s=600.0,
    )
    #: The timeout of the raw HTTP clients (:meth:`http`).
    http_timeout: ClassVar[httpx.Timeout | float] = 30.0

    def __init__(self) -> None:
        self.masters: list[EmbeddedMaster] = []
        self._closers: list[Callable[[], None]] = []

    def start(self, store: StateStore | None = None, **values: Any) -> EmbeddedMaster:
        """A started master; ``values`` naming a ``ServerSettings`` field go to the server (``tls_cert``,
        ``store_url``...), the others override :attr:`job`."""
        server = {k: values.pop(k) for k in list(values) if k in ServerSettings.__dataclass_fields__}
        job = JobSettings(**({"job_id": self.job_id} | self.job | values))
        settings = ServerSettings(job=job, token=self.token, host="127.0.0.1", port=0, **server)
        master = EmbeddedMaster(settings, store=store)
        self.masters.append(master)
        return master.start()

    def running_node(self, node_id: str = "a") -> tuple[EmbeddedMaster, MasterClient]:
        """A started master of one node, and the client of node ``node_id``, joined and assigned its round
        (kept: closed with this helper)."""
        master = self.start()
        client = self.keep(MasterClient([master.address], self.job_id, self.token, request_timeout=10.0))
        client.join(
            JoinRequest(
                node_id=node_id, host="127.0.0.1", nproc=1, store_port=29501, min_nodes=1, max_nodes=1
            )
        )
        assert client.next_round(node_id, 0, 10.0).assignment is not None
        return master, client

    def keep(self, closable: C) -> C:
        """``closable``, closed when this helper closes."""
        self._closers.append(closable.close)
        return closable

    @property
    def auth(self) -> dict[str, str]:
        """The headers of a request to this helper's job: its token and its job id."""
        return {"Authorization": f"Bearer {self.token}", JOB_HEADER: self.job_id}

    def http(self, master: EmbeddedMaster, headers: dict[str, str] | None = None) -> httpx.Client:
        """A raw HTTP client to ``master`` (no proxy from the environment); ``headers`` replace
        :attr:`auth` (``{}`` sends none)."""
        client = httpx.Client(
            base_url=f"http://{master.address}",
            headers=self.auth if headers is None else headers,
            trust_env=False,
            timeout=self.http_timeout,
        )
        return self.keep(client)

    def close(self) -> None:
        for close in self._closers:
            close()
        for master in self.masters:
            master.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
