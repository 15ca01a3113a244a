"""Serving the master: the listening socket, :class:`MasterServer` (the listeners, whose connections
master.http.connection serves, with a step-down-first shutdown), the daemon's ``serve_forever`` and the
master embedded in ``elastic-run`` (:class:`EmbeddedMaster`). The master runs its own listeners rather than
uvicorn's: master.http.connection says why.

Stopping (SIGTERM/SIGINT, or a failed task): the master first steps down (:meth:`MasterService.step_down`:
no more ticks, pending long-polls answer 503 ``not_leader``, a last save, the lease revoked so that a
standby leads at once), and only then drains its connections, for at most :data:`DRAIN_GRACE_S`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl as ssl_module
import threading
import time
from collections.abc import MutableMapping
from types import FrameType
from typing import Any

from fastapi import FastAPI

from elastic.control.protocol import LONG_POLL_CAP_S
from elastic.control.tls import server_context
from master.http.app import create_app
from master.http.conn_guard import (
    LISTEN_BACKLOG,
    ConnectionGuard,
    accept_batch,
    fleet_warning,
    install_log_filter,
    loop_exception_handler,
    raise_open_file_limit,
    resolve_cap,
)
from master.http.connection import ASGIApp, ConnectionContext, HttpConnection
from master.service.gc_pacing import GcPacer
from master.service.service import MasterService
from master.service.settings import ServerSettings
from master.store.base import StateStore

log = logging.getLogger(__name__)

#: Longest wait for open connections after stepping down (long-polls answer at once by then).
DRAIN_GRACE_S = 5
#: The signals that stop a master run in the main thread (``elastic-master``).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The exit status when the app's start-up fails (the store cannot be opened, ...).
STARTUP_FAILURE = 3


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


class _Lifespan:
    """The app's ASGI lifespan (the service's start and its step-down, master.http.app): started before
    the listeners serve, shut down after the connections drained."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self._started, self._stopped = asyncio.Event(), asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failed = False

    async def startup(self) -> bool:
        """Run the app's start-up; whether it succeeded."""
        self._task = asyncio.get_running_loop().create_task(self._main())
        await self._queue.put({"type": "lifespan.startup"})
        await self._started.wait()
        return not self.failed

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._queue.put({"type": "lifespan.shutdown"})
        await self._stopped.wait()

    async def _main(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}
        try:
            await self.app(scope, self._queue.get, self._send)
        except BaseException as exc:
            if not self.failed:  # a failure the app reported has been logged already
                log.error("the master's start-up or shutdown failed", exc_info=exc)
            self.failed = True
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        kind = message["type"]
        if kind.endswith(".failed"):
            self.failed = True
            log.error("the master's %s failed: %s", kind.split(".")[1], message.get("message", ""))
        (self._started if kind.startswith("lifespan.startup.") else self._stopped).set()


class MasterServer:
    """The master's listeners and their connections (master.http.connection), stepping down before it
    drains: on the first SIGTERM/SIGINT the service steps down (:meth:`MasterService.step_down`), and only
    once the lease is revoked are the listeners closed and the connections drained (for at most
    :data:`DRAIN_GRACE_S`). A second signal stops without waiting for the step-down, a SIGINT after
    that without draining or the app's shutdown; a failed supervised task stops it too
    (``service.on_failure``). Run in the main thread, it raises the signal that stopped it again once it
    has stopped (so the process ends by that signal)."""

    def __init__(
        self,
        app: ASGIApp,
        service: MasterService,
        guard: ConnectionGuard,
        ssl: ssl_module.SSLContext | None = None,
        accept_batch: int = LISTEN_BACKLOG,
    ) -> None:
        self.service, self.guard, self.ssl, self.accept_batch = service, guard, ssl, accept_batch
        stream = getattr(getattr(app, "state", None), "agent_stream", None)
        self.context = ConnectionContext(app, guard, stream, keep_alive_s=LONG_POLL_CAP_S + 5)
        self.started = False
        self.should_exit = False
        self._force = False
        self._captured_signals: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None
        service.on_failure = self.request_exit
        service.connection_guard = guard  # its figures on /metrics

    def run(self, sockets: list[socket.socket]) -> None:
        """Serve on the bound, listening ``sockets`` until asked to stop (signals only in the main thread).

        Raises SystemExit(3) when the app's start-up fails."""
        if threading.current_thread() is not threading.main_thread():
            asyncio.run(self.serve(sockets))
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            asyncio.run(self.serve(sockets))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for captured in reversed(self._captured_signals):  # the process ends by that signal (exit status)
            signal.raise_signal(captured)

    def request_exit(self) -> None:
        """Stop serving: close the listeners, drain, shut down (from any thread)."""
        self.should_exit = True
        loop, event = self._loop, self._exit
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: it stopped already
                loop.call_soon_threadsafe(event.set)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: step down first, then stop; a second signal stops at once."""
        self._captured_signals.append(sig)
        loop = self._loop
        if self.should_exit or self.service.stopping or loop is None or not self.started:
            self._force = self._force or (self.should_exit and sig == signal.SIGINT)
            return self.request_exit()
        log.info("signal %d: stepping down before draining", sig)

        def step_down() -> None:  # in the loop, not in the signal handler
            if not self.service.stopping:
                self.service.step_down().add_done_callback(lambda _: self.request_exit())

        loop.call_soon_threadsafe(step_down)

    async def serve(self, sockets: list[socket.socket]) -> None:
        """Start the app, serve ``sockets`` until :meth:`request_exit`, then drain and shut down."""
        loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        self._loop = loop
        if self.should_exit:
            self._exit.set()
        # A failed accept() (out of descriptors) is one rate-limited line, not a traceback a second.
        loop.set_exception_handler(loop_exception_handler)
        lifespan = _Lifespan(self.context.app)
        if not await lifespan.startup():
            raise SystemExit(STARTUP_FAILURE)
        self.context.state = lifespan.state
        listeners: list[asyncio.Server] = []
        try:
            for sock in sockets:
                listeners.append(
                    await loop.create_server(
                        lambda: HttpConnection(self.context),
                        sock=sock,
                        ssl=self.ssl,
                        # a connection still in its handshake has made no protocol yet: the first-request
                        # timer cannot close it, this does (asyncio's default is 60 s)
                        ssl_handshake_timeout=self.guard.header_timeout_s if self.ssl else None,
                        # the accept batch (bounds the descriptors accepted but not yet admitted)
                        backlog=self.accept_batch,
                    )
                )
                # asyncio listened with the small accept batch: the kernel's queue goes back to its full
                # length, the batch asyncio accepts per wake-up stays.
                sock.listen(LISTEN_BACKLOG)
            self.started = True
            await self._exit.wait()
        finally:
            await self._shutdown(listeners, lifespan)

    async def _shutdown(self, listeners: list[asyncio.Server], lifespan: _Lifespan) -> None:
        for listener in listeners:
            listener.close()
        for connection in list(self.guard.connections):
            connection.shutdown()
        tasks = self.context.tasks
        if not self._force:
            try:
                await asyncio.wait_for(self._drained(), DRAIN_GRACE_S)
            except asyncio.TimeoutError:
                log.warning(
                    "%d connections still open %ds after stepping down: closing them",
                    len(self.guard.connections),
                    DRAIN_GRACE_S,
                )
        for task in list(tasks):
            task.cancel()
        for connection in list(self.guard.connections):
            connection.close()
        await asyncio.sleep(0)  # one loop turn: the closed transports release their sockets
        if not self._force:
            await lifespan.shutdown()

    async def _drained(self) -> None:
        await self.guard.all_closed()
        while self.context.tasks:
            await asyncio.wait(set(self.context.tasks))


def _master_server(app: FastAPI, settings: ServerSettings, service: MasterService) -> MasterServer:
    """A server for ``app``; https when ``settings`` name a certificate and key.

    Raises :class:`elastic.control.tls.TLSConfigError` when they cannot be used."""
    install_log_filter()
    limit = raise_open_file_limit()
    cap = resolve_cap(limit, settings.max_connections)
    if too_many := fleet_warning(cap, settings.job.min_nodes, settings.job.max_nodes):
        log.warning("%s", too_many)
    guard = ConnectionGuard(
        cap, settings.header_timeout_s, settings.unauthenticated_per_address, settings.max_unauthenticated
    )
    # TLS 1.2+, and a one-line error for a bad file (elastic.control.tls).
    context = None
    if settings.tls_cert and settings.tls_key:
        context = server_context(settings.tls_cert, settings.tls_key)
    return MasterServer(app, service, guard, ssl=context, accept_batch=accept_batch(limit.soft))


def serve_forever(
    settings: ServerSettings,
    sock: socket.socket,
    store: StateStore | None = None,
    metrics_sock: socket.socket | None = None,
    tick_fault_s: float | None = None,
) -> int | None:
    """Run the master in this (main) thread until SIGINT/SIGTERM; ``metrics_sock``: the bound
    ``--metrics-port`` listener (it serves ``/metrics`` only); ``tick_fault_s``: master.service.fault_hook.

    Raises :class:`MasterFailure` when a supervised task failed (the master resigned first). Returns the
    job's exit code when ``settings.exit_on_job_end`` ended the serving, else None."""
    service = MasterService(settings, store=store, tick_fault_s=tick_fault_s)
    # The daemon's process is the master's alone: it may pace the collector (not so in elastic-run, whose
    # embedded master shares the agent's process).
    service.gc_pacer = GcPacer()
    service.gc_pacer.start()
    server = _master_server(create_app(service), settings, service)
    service.on_job_end = server.request_exit
    server.run(sockets=[sock] + ([metrics_sock] if metrics_sock is not None else []))
    if service.failure is not None:
        raise service.failure
    return service.job_end_code


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
            self._server = _master_server(create_app(self.service), settings, self.service)
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
            time.sleep(0.005)  # start-up handshake only: the job is elected in the master's own thread
        return self

    def stop(self) -> None:
        self._server.request_exit()
        self._thread.join(timeout=5)
        self._sock.close()
