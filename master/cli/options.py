"""``elastic-master`` option groups beyond the job's own: its connections (the cap and the first-request
timeout: master.http.conn_guard; docs/operations.md, "Open files and connections") and observability (the
event log and the separate metrics listener). Each group adds its options to the command and maps them onto
:class:`master.service.settings.ServerSettings`. Then the store a ``--store`` URL names (:func:`open_store`;
the etcd client is imported only when used)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import stat
import time
from collections.abc import Callable

import click

from elastic.control.listener_rules import MASTER_METRICS, Auth, check_listener
from master.service.event_log import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from master.service.settings import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_UNAUTHENTICATED_PER_ADDRESS,
    ServerSettings,
)
from master.store.base import MemoryStore, StateStore, StoreError, StoreUnreachableError

log = logging.getLogger(__name__)


def connection_options(command: Callable) -> Callable:
    """Add ``--max-connections``, ``--header-timeout``, ``--max-unauthenticated-per-address`` and
    ``--max-unauthenticated``."""
    options = [
        click.option(
            "--max-connections",
            type=click.IntRange(min=1),
            default=None,
            help="Connections served at once; a new one beyond it replaces the oldest that sent no request, "
            "or is answered 503 busy. Default and maximum: what the open-file limit allows, raised to the "
            "hard limit at start (docs/operations.md).",
        ),
        click.option(
            "--header-timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=DEFAULT_HEADER_TIMEOUT_S,
            show_default=True,
            help="Close a connection whose request head (the first, or one begun after a keep-alive) or "
            "request body is not complete within this many seconds of its start (requests in flight, "
            "long-polls included, are never cut).",
        ),
        click.option(
            "--max-unauthenticated-per-address",
            type=click.IntRange(min=1),
            default=DEFAULT_UNAUTHENTICATED_PER_ADDRESS,
            show_default=True,
            help="Connections one source address may hold before they present the job's token; one more "
            "is answered 503 busy. Agents behind one NAT share an address: each connection counts only "
            "until its stream is open (docs/security.md).",
        ),
        click.option(
            "--max-unauthenticated",
            type=click.IntRange(min=1),
            default=DEFAULT_MAX_UNAUTHENTICATED,
            show_default=True,
            help="Connections from all addresses together that have not presented the job's token yet; a "
            "new one beyond it closes the oldest of them (docs/security.md).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def connection_settings(settings: ServerSettings, opts: dict) -> ServerSettings:
    """``settings`` with the connection options."""
    return dataclasses.replace(
        settings,
        max_connections=opts["max_connections"],
        header_timeout_s=opts["header_timeout"],
        unauthenticated_per_address=opts["max_unauthenticated_per_address"],
        max_unauthenticated=opts["max_unauthenticated"],
    )


def observability_options(command: Callable) -> Callable:
    """Add ``--event-log``, ``--event-log-max-bytes``, ``--event-log-backups`` and ``--metrics-port``."""
    options = [
        click.option(
            "--event-log",
            type=click.Path(dir_okay=False),
            default=None,
            help="Append every job event to this file as one JSON line (docs/observability.md); a new "
            "leader continues it after a failover.",
        ),
        click.option(
            "--event-log-max-bytes",
            type=click.IntRange(min=1024),
            default=DEFAULT_MAX_BYTES,
            show_default=True,
            help="Rotate the event log when it would grow past this size.",
        ),
        click.option(
            "--event-log-backups",
            type=click.IntRange(min=0),
            default=DEFAULT_BACKUPS,
            show_default=True,
            help="Rotated event logs kept (FILE.1 ... FILE.N).",
        ),
        click.option(
            "--metrics-port",
            type=click.IntRange(0, 65535),
            default=None,
            help="Also serve GET /metrics (only) on this port, with the same host, token and TLS as the API; "
            "/metrics is always on the API port too.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def observability_settings(settings: ServerSettings, opts: dict) -> ServerSettings:
    """``settings`` with the event log options; a file that cannot be appended to is a usage error."""
    path = opts["event_log"]
    if path:
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            raise click.BadParameter(
                f"cannot append to {path}: {exc.strerror}", param_hint="--event-log"
            ) from None
    return dataclasses.replace(
        settings,
        event_log=path or None,
        event_log_max_bytes=opts["event_log_max_bytes"],
        event_log_backups=opts["event_log_backups"],
    )


def bind_metrics(settings: ServerSettings, port: int | None, bind: Callable[[str, int], socket.socket]):
    """Bind the ``--metrics-port`` listener (after the listener rules); (settings with its port, socket),
    or (settings, None) without the option."""
    if port is None:
        return settings, None
    for warning in check_listener(
        MASTER_METRICS, settings.host, auth=Auth.SECRET, tls=bool(settings.tls_cert)
    ):
        log.warning("%s", warning)
    try:
        sock = bind(settings.host, port)
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {settings.host}:{port} (--metrics-port): {exc.strerror}"
        ) from None
    bound = sock.getsockname()[1]
    log.info("metrics on %s:%d/metrics%s", settings.host, bound, " (https)" if settings.tls_cert else "")
    return dataclasses.replace(settings, metrics_port=bound), sock


def read_password_file(path: str) -> str:
    """The etcd user's password in ``path`` (surrounding whitespace stripped); warns when group or others
    may read the file. Raises :class:`StoreError` (one line) when it is missing, unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as fh:
            password = fh.read().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise StoreError(f"cannot read the etcd password file {path}: {exc.strerror}") from None
    if not password:
        raise StoreError(f"the etcd password file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("etcd password file %s is accessible by group or others; run: chmod 600 %s", path, path)
    return password


def open_store(url: str, job_id: str, *, password: str | None = None) -> StateStore:
    """``memory://`` or ``etcd://[USER@]HOST:PORT[,HOST:PORT...]`` → a store for ``job_id``; ``password``
    is the etcd user's (etcd's authentication on), needed exactly when the URL names a user."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise StoreError(f"--store must look like memory:// or etcd://HOST:PORT, got {url!r}")
    if scheme == "memory":
        if password is not None:
            raise StoreError("--store-password-file is for an etcd user (--store etcd://USER@HOST:PORT)")
        return MemoryStore()
    if scheme == "etcd":
        from master.store.etcd_store import EtcdStore  # the etcd client is imported only when used

        user, at, endpoints = rest.rpartition("@")
        if at and not user:
            raise StoreError(f"--store {url!r}: the etcd user name before '@' is empty")
        if user and password is None:
            raise StoreError(
                f"--store names the etcd user {user!r}: give its password with --store-password-file"
            )
        if password is not None and not user:
            raise StoreError("--store-password-file needs the etcd user in --store: etcd://USER@HOST:PORT")
        return EtcdStore(endpoints, job_id, username=user or None, password=password)
    raise StoreError(f"unknown store scheme {scheme!r} in --store {url!r}; use memory:// or etcd://HOST:PORT")


def check_store(url: str, job_id: str, *, password: str | None = None, wait_s: float = 0.0) -> None:
    """Fail, with one line, when the store at ``url`` is unreachable or refuses us (before serving): at
    once, or while it stays unreachable for ``wait_s`` (``--store-wait``: a master that a supervisor
    restarts during an etcd restart or pause waits for it instead of exiting). A refusal fails at once."""

    async def probe() -> None:
        store = open_store(url, job_id, password=password)
        try:
            await store.start()
        finally:
            await store.close()

    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            asyncio.run(probe())
            if said:
                log.info("the store answers: starting")
            return
        except StoreUnreachableError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not said:
                said = True
                log.warning("%s; waiting for it, at most %gs more (--store-wait)", exc, left)
            time.sleep(min(1.0, left))  # a retry delay while etcd comes back, not a synchronisation
