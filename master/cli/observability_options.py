"""``elastic-master`` options for observability: the event log and the separate metrics listener."""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable

import click

from elastic.control.listener_rules import MASTER_METRICS, Auth, check_listener
from master.service.event_log import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from master.service.settings import ServerSettings

log = logging.getLogger(__name__)


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
