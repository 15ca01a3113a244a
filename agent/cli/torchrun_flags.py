"""torchrun's process and log flags for ``elastic-run``: their click options, and their resolution into
agent settings plus the warnings for what cannot apply here.

The parsing and the judging are :mod:`agent.cli.torchrun_compat`'s (pure); this module only adapts them to
click: a ``ValueError`` becomes a one-line usage error (exit 2).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import click

from agent.cli import torchrun_compat as tc
from agent.workers.output import OutputPolicy

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torchrun 2.13's choices


def _opt(*names: str, **kwargs: Any) -> Callable:
    """An option with torchrun's two spellings (``--a-b`` and ``--a_b``) and destination ``a_b``."""
    long = names[-1]
    dest = long.lstrip("-").replace("-", "_")
    spellings = [*names] if "-" not in long.lstrip("-") else [*names, "--" + dest]
    return click.option(*spellings, dest, **kwargs)


def torchrun_options() -> Callable:
    """Decorator adding torchrun's --node-rank, --run-path, -r/--redirects, -t/--tee, --local-ranks-filter,
    --duplicate-std{out,err}-filters, --logs-specs, --monitor-interval, --start-method, --numa-binding,
    --virtual-local-rank, --shutdown-timeout, --signals-to-handle and --event-log-handler."""
    std_spec = "N or LOCAL_RANK:N,... (0 none, 1 stdout, 2 stderr, 3 both)"
    also_logged = "with --log-dir every stream is written to its file anyway"
    options = [
        _opt(
            "--node-rank",
            type=int,
            default=-1,
            help="Ignored (warns): node ranks are assigned by the master.",
        ),
        _opt(
            "--run-path", is_flag=True, help="No effect (warns): the script runs in its own worker processes."
        ),
        click.option(
            "-r",
            "--redirects",
            default="0",
            show_default=True,
            help=f"Worker streams written only to the --log-dir files, not shown: {std_spec}.",
        ),
        click.option(
            "-t",
            "--tee",
            default="0",
            show_default=True,
            help=f"Worker streams shown and written to the --log-dir files (as --redirects; wins over it); "
            f"{also_logged}.",
        ),
        _opt(
            "--local-ranks-filter",
            default="",
            help="Show only these local ranks' output on the console, e.g. 0,1 (log files get every rank).",
        ),
        _opt(
            "--duplicate-stdout-filters",
            default="",
            help="Also copy worker stdout lines containing any of these comma-separated substrings (,, is a "
            "comma) to LOG_DIR/round<N>/filtered_stdout.log; needs --log-dir.",
        ),
        _opt(
            "--duplicate-stderr-filters",
            default="",
            help="The same for stderr: LOG_DIR/round<N>/filtered_stderr.log.",
        ),
        _opt(
            "--logs-specs",
            default=None,
            help="Ignored (warns): torchrun's LogsSpecs entry points are not loaded; see --log-dir.",
        ),
        _opt(
            "--monitor-interval",
            type=float,
            default=0.1,
            show_default=True,
            help="No effect (warns): worker exits are seen at once.",
        ),
        _opt(
            "--start-method",
            type=click.Choice(["spawn", "fork", "forkserver"]),
            default="spawn",
            show_default=True,
            help="No effect (warns): workers are processes started by exec or from the warm zygote.",
        ),
        _opt(
            "--numa-binding",
            type=click.Choice(NUMA_MODES),
            default=None,
            help="Not implemented (warns): workers are not bound to CPUs near their GPU.",
        ),
        _opt(
            "--virtual-local-rank",
            is_flag=True,
            help="LOCAL_RANK=0 for every worker and, with GPUs, CUDA_VISIBLE_DEVICES narrowed to its own "
            "device (ELASTIC_LOCAL_RANK keeps the real local rank).",
        ),
        _opt(
            "--shutdown-timeout",
            type=click.FloatRange(min=0),
            default=None,
            help="Alias of --stop-grace (default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT if set); both with "
            "different values is an error.",
        ),
        _opt(
            "--signals-to-handle",
            default=tc.DEFAULT_SIGNALS,
            show_default=True,
            help="SIGTERM, SIGINT, SIGHUP, SIGQUIT stop the agent (SIGTERM, SIGINT always do); other listed "
            "signals (e.g. SIGUSR1) are forwarded to the workers.",
        ),
        _opt(
            "--event-log-handler",
            default="null",
            show_default=True,
            help="console: print the agent's events as JSON lines to stderr; null: none.",
        ),
    ]

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


@dataclass(frozen=True)
class TorchrunSettings:
    """What torchrun's flags resolve to: agent settings fields, and warnings to log once each."""

    stop_grace_s: float
    output: OutputPolicy
    per_rank_env: tuple[Mapping[str, str], ...]
    signals: tc.SignalPlan
    event_log_handler: str
    warnings: tuple[str, ...]


def _parsed(parse: Callable[[str], Any], value: str, flag: str) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None


def resolve_torchrun(
    o: Mapping[str, Any],
    given: frozenset[str],
    *,
    nproc: int,
    gpus: int,
    default_stop_grace: float,
    environ: Mapping[str, str] = os.environ,
    unknown_rdzv_keys: tuple[str, ...] = (),
) -> TorchrunSettings:
    """Resolve the torchrun flags of the CLI options ``o``; ``given``: the names of the options the user gave
    (command line or ``PET_*``). Raises click.BadParameter/UsageError for invalid values (exit 2)."""
    log_dir = o["log_dir"] is not None
    redirects = _parsed(tc.parse_std_spec, o["redirects"], "--redirects")
    tee = _parsed(tc.parse_std_spec, o["tee"], "--tee")
    try:
        stop_grace = tc.resolve_stop_grace(
            o["stop_grace"] if "stop_grace" in given else None,
            o["shutdown_timeout"] if "shutdown_timeout" in given else None,
            environ.get(tc.SHUTDOWN_TIMEOUT_ENV),
            default_stop_grace,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    per_rank_env: tuple[Mapping[str, str], ...] = ()
    if o["virtual_local_rank"]:
        try:
            per_rank_env = tc.virtual_local_rank_envs(nproc, environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        except ValueError as exc:
            raise click.UsageError(f"--virtual-local-rank: {exc}") from None
    output = OutputPolicy(
        console_ranks=_parsed(tc.parse_local_ranks, o["local_ranks_filter"], "--local-ranks-filter"),
        redirects=redirects if log_dir else tc.StdSpec(),
        tee=tee if log_dir else tc.StdSpec(),
        stdout_filters=tc.parse_filters(o["duplicate_stdout_filters"]) if log_dir else (),
        stderr_filters=tc.parse_filters(o["duplicate_stderr_filters"]) if log_dir else (),
    )
    flags = tc.GivenFlags(
        log_dir=log_dir,
        gpus=gpus,
        redirects=redirects if "redirects" in given else None,
        tee=tee if "tee" in given else None,
        monitor_interval=o["monitor_interval"] if "monitor_interval" in given else None,
        start_method=o["start_method"] if "start_method" in given else None,
        run_path=bool(o["run_path"]) and "run_path" in given,
        node_rank=o["node_rank"] if "node_rank" in given else None,
        logs_specs=o["logs_specs"],
        numa_binding=o["numa_binding"],
        event_log_handler=o["event_log_handler"],
        duplicate_stdout_filters=bool(tc.parse_filters(o["duplicate_stdout_filters"])),
        duplicate_stderr_filters=bool(tc.parse_filters(o["duplicate_stderr_filters"])),
        unknown_rdzv_keys=unknown_rdzv_keys,
    )
    return TorchrunSettings(
        stop_grace_s=stop_grace,
        output=output,
        per_rank_env=per_rank_env,
        signals=_parsed(tc.parse_signals, o["signals_to_handle"], "--signals-to-handle"),
        event_log_handler=o["event_log_handler"],
        warnings=tuple(tc.compat_warnings(flags)),
    )
