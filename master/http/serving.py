"""Serving the master: the listening socket, uvicorn with a step-down-first shutdown, the daemon's
``serve_forever`` and the master embedded in ``elastic-run`` (:class:`EmbeddedMaster`).

Stopping (SIGTERM/SIGINT, or a failed task): the master first steps down (:meth:`MasterService.step_down`:
no more ticks, pending long-polls answer 503 ``not_leader``, a last save, the lease revoked so that a
standby leads at once), and only then drains its connections, for at most :data:`DRAIN_GRACE_S`."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import TypeVar

import uvicorn
from fastapi import FastAPI

from elastic.control.protocol import (
    LONG_POLL_CAP_S,
)
from elastic.control.tls import server_context
from master.http.app import create_app
from master.http.conn_guard import (
    LISTEN_BACKLOG,
    ConnectionGuard,
    accept_batch,
    guarded_protocol,
    install_log_filter,
    loop_exception_handler,
    raise_open_file_limit,
    resolve_cap,
    tls_handshake_timeout,
)
from master.service.gc_pacing import GcPacer
from master.service.service import MasterService
from master.service.settings import ServerSettings
from master.store.base import StateStore

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Longest wait for open connections after stepping down (long-polls answer at once by then).
DRAIN_GRACE_S = 5


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket up front so that a busy port fails fast and port 0 is resolved."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP. Without
    # it a reply's body waits for the ACK of its headers (Nagle vs delayed ACK): ~40 ms per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(False)
    return sock


class _MasterServer(uvicorn.Server):
    """uvicorn, stepping down before it drains: on the first SIGTERM/SIGINT the service steps down
    (:meth:`MasterService.step_down`), and only once the lease is revoked does uvicorn close the listener
    and drain (bounded by ``timeout_graceful_shutdown``). A second signal exits at once as usual; a failed
    supervised task makes it exit too (``service.on_failure``)."""

    def __init__(self, config: uvicorn.Config, service: MasterService) -> None:
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        service.on_failure = self._exit

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        # A failed accept() (out of descriptors) is one rate-limited line, not a traceback a second.
        self._loop.set_exception_handler(loop_exception_handler)
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        with tls_handshake_timeout(asyncio.get_running_loop(), self.service.settings.header_timeout_s):
            await super().startup(sockets)
        # asyncio listened with the small accept batch (``Config.backlog``,
        # master.http.conn_guard.accept_batch): the kernel's queue goes back to its full length, the batch
        # asyncio accepts per wake-up stays.
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        loop = self._loop
        if self.should_exit or self.service.stopping or loop is None or not self.started:
            return super().handle_exit(sig, frame)  # a second signal, or before serving: uvicorn's way
        self._captured_signals.append(sig)  # uvicorn raises it again once served (the exit status)
        log.info("signal %d: stepping down before draining", sig)

        def step_down() -> None:  # in the loop, not in the signal handler
            if not self.service.stopping:
                self.service.step_down().add_done_callback(lambda _: self._exit())

        loop.call_soon_threadsafe(step_down)


def _uvicorn_server(app: FastAPI, settings: ServerSettings, service: MasterService) -> uvicorn.Server:
    """A uvicorn server for ``app``; https when ``settings`` name a certificate and key.

    Raises :class:`elastic.control.tls.TLSConfigError` when they cannot be used."""
    install_log_filter()
    limit = raise_open_file_limit()
    cap = resolve_cap(limit, settings.max_connections)
    guard = ConnectionGuard(cap, settings.header_timeout_s)
    service.connection_guard = guard  # its figures on /metrics
    config = uvicorn.Config(
        app,
        # uvicorn's h11 protocol with the connection cap and the first-request timeout
        # (master.http.conn_guard)
        http=guarded_protocol(guard, getattr(app.state, "agent_stream", None)),  # + the agent stream
        backlog=accept_batch(limit.soft),  # bounds the descriptors accepted but not yet admitted
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=int(LONG_POLL_CAP_S) + 5,
        timeout_graceful_shutdown=DRAIN_GRACE_S,
        ws="none",
    )
    if settings.tls_cert and settings.tls_key:
        # Our own context (TLS 1.2+ whatever the uvicorn version, a one-line error for a bad file) instead
        # of uvicorn's ssl_* options: load the config now and swap the context in; uvicorn does not load a
        # loaded config again, and serves with ``config.ssl``.
        context = server_context(settings.tls_cert, settings.tls_key)
        config.load()
        config.ssl = context
    return _MasterServer(config, service)


def serve_forever(
    settings: ServerSettings,
    sock: socket.socket,
    store: StateStore | None = None,
    metrics_sock: socket.socket | None = None,
    tick_fault_s: float | None = None,
) -> None:
    """Run the master in this (main) thread until SIGINT/SIGTERM; ``metrics_sock``: the bound
    ``--metrics-port`` listener (it serves ``/metrics`` only); ``tick_fault_s``: master.service.fault_hook.

    Raises :class:`MasterFailure` when a supervised task failed (the master resigned first)."""
    service = MasterService(settings, store=store, tick_fault_s=tick_fault_s)
    # The daemon's process is the master's alone: it may pace the collector (not so in elastic-run, whose
    # embedded master shares the agent's process).
    service.gc_pacer = GcPacer()
    service.gc_pacer.start()
    server = _uvicorn_server(create_app(service), settings, service)
    server.run(sockets=[sock] + ([metrics_sock] if metrics_sock is not None else []))
    if service.failure is not None:
        raise service.failure


class EmbeddedMaster:
    """A master running in a background thread of another process (``elastic-run --standalone``)."""

    def __init__(
        self, settings: ServerSettings, sock: socket.socket | None = None, store: StateStore | None = None
    ) -> None:
        self.settings = settings
        self._sock = sock or bind_socket(settings.host, settings.port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.service = MasterService(settings, store=store)
        try:
            self._server = _uvicorn_server(create_app(self.service), settings, self.service)
        except Exception:
            self._sock.close()
            raise
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="elastic-master", daemon=True
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedMaster:
        self._thread.start()
        deadline = time.monotonic() + timeout
        # A non-durable store elects at once: wait for the job too, so the first request is served.
        while not self._server.started or (self.service.job is None and not self.service.store.durable):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"embedded master failed to start on {self.address}")
            time.sleep(0.005)  # start-up handshake only; uvicorn exposes no event for it
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
