"""Job-policy flags shared by ``elastic-master`` and ``elastic-run`` (which passes them to the master it
embeds in standalone and convenience mode): one definition of the flags and one of their mapping to
:class:`~elastic.control.job_settings.JobSettings`, so defaults, ranges and meaning never drift apart."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click

from elastic.control import job_settings as ms


def job_policy_options(*, embedded: bool) -> Callable:
    """Decorator adding --node-unit, --last-call, --join-timeout, --heartbeat-interval/-timeout,
    --straggler-factor, --node-check, --node-check-factor, --stop-on-startup-error and --crash-loop-window."""
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
        click.option(
            "--stop-on-startup-error/--no-stop-on-startup-error",
            default=True,
            show_default=True,
            help=prefix + "stop the job at once, exit 3, at a known deterministic start-up error (import or "
            "syntax error, missing file, /dev/shm smaller than the checkpoint); off: charge it as a restart "
            "(files that appear late, such as network mounts at pod start).",
        ),
        click.option(
            "--crash-loop-window",
            type=click.FloatRange(min=0),
            default=ms.DEFAULT_CRASH_LOOP_WINDOW_S,
            show_default=True,
            help=prefix + "stop the job, exit 3, when the same failure recurs within this many seconds with "
            "no progress in between (a crash loop: docs/failures.md); 0 turns this off.",
        ),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def job_settings_from(
    opts: Mapping[str, Any], *, job_id: str, min_nodes: int, max_nodes: int, **fields: Any
) -> ms.JobSettings:
    """The job settings of the parsed options ``opts``: those :func:`job_policy_options` adds and
    ``--max-restarts`` (both command lines have it), for job ``job_id`` of ``min_nodes``..``max_nodes``
    nodes. ``fields``: further :class:`~elastic.control.job_settings.JobSettings` fields, which win over the
    mapped ones (elastic-master's flap options, elastic-run's --rdzv-conf timeouts). An inconsistent
    combination is a usage error (exit 2)."""
    mapped: dict[str, Any] = {
        "node_unit": opts["node_unit"],
        "last_call_s": opts["last_call"],
        "join_timeout_s": opts["join_timeout"],
        "heartbeat_interval_s": opts["heartbeat_interval"],
        "heartbeat_timeout_s": opts["heartbeat_timeout"],
        "max_restarts": opts["max_restarts"],
        "straggler_factor": opts["straggler_factor"],
        "node_check": opts["node_check"],
        "node_check_factor": opts["node_check_factor"],
        "stop_on_startup_error": opts["stop_on_startup_error"],
        "crash_loop_window_s": opts["crash_loop_window"],
    }
    try:
        return ms.JobSettings(job_id=job_id, min_nodes=min_nodes, max_nodes=max_nodes, **{**mapped, **fields})
    except ms.SettingsError as exc:
        raise click.UsageError(str(exc)) from None


def _factor_option(name: str, default: float, help: str) -> Callable:
    """A ``> 1`` multiple of the nodes' median."""
    return click.option(
        name, type=click.FloatRange(min=1, min_open=True), default=default, show_default=True, help=help
    )
