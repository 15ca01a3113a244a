"""``elastic-master`` options for its connections: the cap and the first-request timeout
(master.http.conn_guard; docs/operations.md, "Open files and connections")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import click

from master.service.settings import DEFAULT_HEADER_TIMEOUT_S, ServerSettings


def connection_options(command: Callable) -> Callable:
    """Add ``--max-connections`` and ``--header-timeout``."""
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
            help="Close a new connection that has not sent a complete request head within this many "
            "seconds (requests in flight, long-polls included, are never cut).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def connection_settings(settings: ServerSettings, opts: dict) -> ServerSettings:
    """``settings`` with the connection options."""
    return dataclasses.replace(
        settings, max_connections=opts["max_connections"], header_timeout_s=opts["header_timeout"]
    )
