"""torchrun compatibility of ``elastic-run``: torchrun's process and log flags, and their judgement.

:func:`torchrun_options` declares the flags (both spellings, ``PET_*`` defaults) for
:mod:`agent.cli.main`. The rest is pure, no I/O: each parser takes a flag's text as torchrun takes it and
returns a value elastic-run can use, or raises ``ValueError`` with a one-line reason;
:func:`compat_warnings` says in one line each which of the given flags elastic-run cannot honour as
torchrun would; :func:`resolve_flags` combines them into :class:`TorchrunSettings`, raising
:class:`FlagError`, which :mod:`agent.cli.resolve` turns into a usage error (exit 2).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import click

from agent.settings import ALWAYS_HANDLED, DEFAULT_STOP_GRACE_S, SHUTDOWN_SIGNALS, SignalPlan
from agent.workers.output import OutputPolicy, Std, StdSpec
from elastic import errors

#: torchrun's default for --signals-to-handle.
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: torchrun reads this when --shutdown-timeout is not given.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: --event-log-handler names elastic-run has.
EVENT_LOG_HANDLERS = ("null", "console")
#: --numa-binding's choices (torchrun 2.13's).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
#: --rdzv-conf keys with a meaning here, and the job settings they set.
RDZV_CONF_KEYS = {"join_timeout": "join_timeout_s", "last_call_timeout": "last_call_s"}

_COMMA = "\0"
_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^(\d+:[0-3],)*\d+:[0-3]$")


# -- the flags --------------------------------------------------------------------------------------------
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
            default=DEFAULT_SIGNALS,
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


# -- the judgement ---------------------------------------------------------------------------------------
def parse_std_spec(text: str) -> StdSpec:
    """torchrun's ``N`` or ``LR:N,LR:N`` (0 none, 1 stdout, 2 stderr, 3 both); ranks not listed: none."""
    text = text.strip()
    if _STD_VALUE.match(text):
        return StdSpec(default=Std(int(text)))
    if _STD_MAPPING.match(text):
        pairs = [item.split(":") for item in text.split(",")]
        return StdSpec(by_rank=tuple((int(rank), Std(int(value))) for rank, value in pairs))
    raise ValueError(f"expected 0-3 or LOCAL_RANK:0-3,... (e.g. 3 or 0:1,1:2), got {text!r}")


def parse_local_ranks(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter``: a comma-separated list of local ranks; None (no filter) when empty."""
    if not text.strip():
        return None
    ranks = set()
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit():
            raise ValueError(f"expected comma-separated local ranks (e.g. 0,1), got {text!r}")
        ranks.add(int(item))
    return frozenset(ranks)


def parse_filters(text: str) -> tuple[str, ...]:
    """``--duplicate-std*-filters``: comma-separated substrings, ``,,`` standing for a comma (torchrun's
    rule); empty ones are dropped, so an empty value duplicates nothing."""
    items = text.replace(",,", _COMMA).split(",")
    return tuple(item.replace(_COMMA, ",") for item in items if item)


def parse_signals(text: str) -> SignalPlan:
    """``--signals-to-handle``: comma-separated names (``SIGUSR1`` or ``USR1``, any case).

    SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the agent gracefully; any other listed signal is forwarded to
    the workers. SIGTERM and SIGINT are handled even when not listed. Unknown names and signals no
    process can handle (SIGKILL, SIGSTOP) raise ValueError.
    """
    chosen: set[signal.Signals] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        name = item.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {item!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{sig.name} cannot be handled")
        chosen.add(sig)
    shutdown = frozenset(s for s in chosen if s in SHUTDOWN_SIGNALS) | ALWAYS_HANDLED
    return SignalPlan(shutdown=shutdown, forward=frozenset(chosen - SHUTDOWN_SIGNALS))


def parse_rdzv_conf(text: str) -> tuple[dict[str, float], tuple[str, ...]]:
    """``--rdzv-conf``'s ``KEY=VALUE,...``: the job settings it sets (:data:`RDZV_CONF_KEYS`), and the keys
    it names that have no meaning here (torchrun's timeout, read_timeout, is_host, ...: warned about)."""
    out: dict[str, float] = {}
    unknown: list[str] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        if key in RDZV_CONF_KEYS:
            try:
                out[RDZV_CONF_KEYS[key]] = float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number of seconds") from None
        elif key not in unknown:
            unknown.append(key)
    return out, tuple(unknown)


def resolve_stop_grace(
    stop_grace: float | None, shutdown_timeout: float | None, env_value: str | None, default: float
) -> float:
    """Seconds between SIGTERM and SIGKILL when stopping workers.

    ``stop_grace``/``shutdown_timeout``: the flags' values when given (command line or ``PET_*``), else
    None. Both given with different values: ValueError. One given: it wins. Neither: ``env_value``
    (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) when set, else ``default``.
    """
    if stop_grace is not None and shutdown_timeout is not None and stop_grace != shutdown_timeout:
        raise ValueError(
            f"--stop-grace {stop_grace:g} and --shutdown-timeout {shutdown_timeout:g} are the same setting; "
            "give one"
        )
    for given in (stop_grace, shutdown_timeout):
        if given is not None:
            return given
    if env_value is not None and env_value.strip():
        try:
            seconds = float(env_value)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0:
            raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV} must be a number of seconds >= 0, got {env_value!r}")
        return seconds
    return default


def virtual_local_rank_envs(nproc: int, visible_devices: str | None, gpus: int) -> tuple[dict[str, str], ...]:
    """Per local rank, the variables ``--virtual-local-rank`` sets (torchrun's semantics).

    Every worker gets ``LOCAL_RANK=0``. With GPUs (``gpus`` > 0), ``CUDA_VISIBLE_DEVICES`` is narrowed to
    the worker's device: the local_rank-th entry of the agent's ``visible_devices``, else the index itself;
    without GPUs it is left alone. ValueError when ``visible_devices`` has too few entries.
    """
    entries = [d.strip() for d in visible_devices.split(",")] if visible_devices is not None else None
    envs = []
    for local_rank in range(nproc):
        env = {"LOCAL_RANK": "0"}
        if gpus > 0:
            if entries is None:
                env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
            elif local_rank < len(entries):
                env["CUDA_VISIBLE_DEVICES"] = entries[local_rank]
            else:
                raise ValueError(
                    f"local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible_devices}"
                )
        envs.append(env)
    return tuple(envs)


@dataclass(frozen=True)
class GivenFlags:
    """The torchrun flags the user gave (command line or ``PET_*``) that may need a warning, with values."""

    log_dir: bool = False
    gpus: int = 0
    redirects: StdSpec | None = None
    tee: StdSpec | None = None
    monitor_interval: float | None = None
    start_method: str | None = None
    run_path: bool = False
    node_rank: int | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    event_log_handler: str = "null"
    duplicate_stdout_filters: bool = False
    duplicate_stderr_filters: bool = False
    unknown_rdzv_keys: tuple[str, ...] = ()


_LOG_LAYOUT = "LOG_DIR/round<N>/rank<R>/{stdout,stderr}.log"


def compat_warnings(given: GivenFlags) -> list[str]:
    """One line per given flag that elastic-run cannot honour as torchrun would (nothing for the rest)."""
    out = []
    if given.redirects is not None and not given.redirects.empty and not given.log_dir:
        out.append(
            "--redirects needs --log-dir (redirected streams go to its files); output stays on the console"
        )
    if given.tee is not None and not given.tee.empty and not given.log_dir:
        out.append("--tee needs --log-dir (the files it writes); output goes to the console only")
    if given.monitor_interval is not None:
        out.append("--monitor-interval has no effect: elastic-run sees worker exits at once")
    if given.start_method is not None:
        out.append(
            f"--start-method {given.start_method} has no effect: workers are separate processes, started by "
            "exec or forked from the warm-start zygote (--no-warm-start: always exec)"
        )
    if given.run_path:
        out.append("--run-path has no effect: the script runs in its own worker processes")
    if given.node_rank is not None:
        out.append(f"--node-rank {given.node_rank} is ignored: node ranks are assigned by the master")
    if given.unknown_rdzv_keys:
        out.append(
            f"--rdzv-conf key(s) {', '.join(given.unknown_rdzv_keys)} ignored: only join_timeout and "
            "last_call_timeout have a meaning here"
        )
    if given.logs_specs is not None:
        out.append(
            f"--logs-specs {given.logs_specs} is ignored: torchrun's LogsSpecs entry points are not loaded; "
            f"worker output is shown with [rank<R>]: prefixes and, with --log-dir, written to {_LOG_LAYOUT}"
        )
    if given.numa_binding is not None:
        if given.gpus == 0:
            out.append(
                f"--numa-binding {given.numa_binding} is ignored: no GPU is visible to bind workers near"
            )
        else:
            out.append(f"--numa-binding {given.numa_binding} is not implemented yet: workers are not bound")
    if given.event_log_handler not in EVENT_LOG_HANDLERS:
        out.append(
            f"--event-log-handler {given.event_log_handler} does not exist here (only null and console; "
            "torchrun's handler registry is not used): events are not logged"
        )
    for stream, flag in (
        ("stdout", given.duplicate_stdout_filters),
        ("stderr", given.duplicate_stderr_filters),
    ):
        if flag and not given.log_dir:
            out.append(
                f"--duplicate-{stream}-filters needs --log-dir (matching lines go to "
                f"LOG_DIR/round<N>/filtered_{stream}.log); ignored"
            )
    return out


# -- the resolution ---------------------------------------------------------------------------------------
class FlagError(errors.UsageError, ValueError):
    """A torchrun flag value, or a combination of flags, that cannot be used; ``flag`` names the flag
    (None: the message names the flags itself)."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class TorchrunSettings:
    """What torchrun's flags resolve to: agent settings fields, and warnings to log once each."""

    stop_grace_s: float
    output: OutputPolicy
    per_rank_env: tuple[Mapping[str, str], ...]
    signals: SignalPlan
    event_log_handler: str
    #: Job settings fields that --rdzv-conf sets (``join_timeout_s``, ``last_call_s``), where the flag of
    #: the same setting (--join-timeout, --last-call) was not given: the flag wins.
    job_fields: Mapping[str, float]
    warnings: tuple[str, ...]


def _parsed(parse: Callable[[str], Any], value: str, flag: str) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise FlagError(str(exc), flag) from None


def resolve_flags(
    o: Mapping[str, Any], given: frozenset[str], *, nproc: int, gpus: int, environ: Mapping[str, str]
) -> TorchrunSettings:
    """Resolve the torchrun flags of the parsed options ``o``; ``given``: the names of the options the user
    gave (command line or ``PET_*``), the only ones warned about; ``environ``: the agent's environment
    (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, ``CUDA_VISIBLE_DEVICES``). Raises :class:`FlagError`."""
    rdzv_conf, unknown_rdzv_keys = _parsed(parse_rdzv_conf, o["rdzv_conf"], "--rdzv-conf")
    job_fields = {
        key: rdzv_conf[key]
        for key, flag in (("join_timeout_s", "join_timeout"), ("last_call_s", "last_call"))
        if key in rdzv_conf and flag not in given
    }
    log_dir = o["log_dir"] is not None
    redirects = _parsed(parse_std_spec, o["redirects"], "--redirects")
    tee = _parsed(parse_std_spec, o["tee"], "--tee")
    try:
        stop_grace = resolve_stop_grace(
            o["stop_grace"] if "stop_grace" in given else None,
            o["shutdown_timeout"] if "shutdown_timeout" in given else None,
            environ.get(SHUTDOWN_TIMEOUT_ENV),
            DEFAULT_STOP_GRACE_S,
        )
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    per_rank_env: tuple[Mapping[str, str], ...] = ()
    if o["virtual_local_rank"]:
        try:
            per_rank_env = virtual_local_rank_envs(nproc, environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        except ValueError as exc:
            raise FlagError(f"--virtual-local-rank: {exc}") from None
    output = OutputPolicy(
        console_ranks=_parsed(parse_local_ranks, o["local_ranks_filter"], "--local-ranks-filter"),
        redirects=redirects if log_dir else StdSpec(),
        tee=tee if log_dir else StdSpec(),
        stdout_filters=parse_filters(o["duplicate_stdout_filters"]) if log_dir else (),
        stderr_filters=parse_filters(o["duplicate_stderr_filters"]) if log_dir else (),
    )
    flags = GivenFlags(
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
        duplicate_stdout_filters=bool(parse_filters(o["duplicate_stdout_filters"])),
        duplicate_stderr_filters=bool(parse_filters(o["duplicate_stderr_filters"])),
        unknown_rdzv_keys=unknown_rdzv_keys,
    )
    return TorchrunSettings(
        stop_grace_s=stop_grace,
        output=output,
        per_rank_env=per_rank_env,
        signals=_parsed(parse_signals, o["signals_to_handle"], "--signals-to-handle"),
        event_log_handler=o["event_log_handler"],
        job_fields=job_fields,
        warnings=tuple(compat_warnings(flags)),
    )
