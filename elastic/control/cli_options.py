"""Job-policy flags shared by ``elastic-master`` and ``elastic-run`` (which passes them to the master it
embeds in standalone and convenience mode): one definition, so defaults and ranges never drift apart."""

from __future__ import annotations

from collections.abc import Callable

import click

from elastic.control import job_settings as ms


def job_policy_options(*, embedded: bool) -> Callable:
    """Decorator adding --node-unit, --last-call, --join-timeout, --heartbeat-interval/-timeout,
    --straggler-factor, --node-check and --node-check-factor."""
    prefix = "Embedded master: " if embedded else ""
    node_check_hint = (
        " Right before the script, write --node-check=on. With elastic-master, set it there."
        if embedded
        else ""
    )
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
        _factor_option(
            "--straggler-factor",
            ms.DEFAULT_STRAGGLER_FACTOR,
            prefix + "flag a node whose step time exceeds this many times the nodes' median (status).",
        ),
        click.option(
            "--node-check",
            type=click.Choice(ms.NODE_CHECK_MODES),
            default="off",
            show_default=True,
            is_flag=False,
            flag_value="on",
            help=prefix + "before the first round, check every node (matmul, allreduce in pairs): 'on' "
            "(or no value) excludes failed or slow nodes, 'warn' only reports them." + node_check_hint,
        ),
        _factor_option(
            "--node-check-factor",
            ms.DEFAULT_NODE_CHECK_FACTOR,
            prefix + "a node whose check figures exceed this many times the nodes' median counts as slow.",
        ),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _factor_option(name: str, default: float, help: str) -> Callable:
    """A ``> 1`` multiple of the nodes' median."""
    return click.option(
        name, type=click.FloatRange(min=1, min_open=True), default=default, show_default=True, help=help
    )
