"""Job-policy flags shared by ``elastic-master`` and ``elastic-run`` (which passes them to the master it
embeds in standalone and convenience mode): one definition, so defaults and ranges never drift apart."""

from __future__ import annotations

from collections.abc import Callable

import click

from master import settings as ms


def job_policy_options(*, embedded: bool) -> Callable:
    """Decorator adding --node-unit, --last-call, --join-timeout, --heartbeat-interval/-timeout."""
    prefix = "Embedded master: " if embedded else ""
    positive = click.FloatRange(min=0, min_open=True)
    options = [
        click.option(
            "--node-unit",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help=prefix + "the node count of a round is a multiple of this.",
        ),
        click.option(
            "--last-call",
            type=click.FloatRange(min=0),
            default=ms.DEFAULT_LAST_CALL_S,
            show_default=True,
            help=prefix + "seconds to wait for more nodes once MIN joined, and before admitting new nodes.",
        ),
        click.option(
            "--join-timeout",
            type=positive,
            default=ms.DEFAULT_JOIN_TIMEOUT_S,
            show_default=True,
            help=prefix + "fail the job when a round cannot form within this many seconds.",
        ),
        click.option(
            "--heartbeat-interval",
            type=positive,
            default=ms.DEFAULT_HEARTBEAT_INTERVAL_S,
            show_default=True,
            help=prefix + "seconds between agent heartbeats.",
        ),
        click.option(
            "--heartbeat-timeout",
            type=positive,
            default=ms.DEFAULT_HEARTBEAT_TIMEOUT_S,
            show_default=True,
            help=prefix + "a node is declared dead after this many seconds without a heartbeat.",
        ),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate
