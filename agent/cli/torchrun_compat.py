"""torchrun's flags, parsed and judged: pure functions, no I/O, no click.

Each parser takes the flag's text as torchrun takes it and returns a value elastic-run can use, or raises
``ValueError`` with a one-line reason (the CLI turns it into a usage error, exit 2). :func:`compat_warnings`
decides which of the given flags elastic-run cannot honour and says so in one line each.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from enum import IntFlag

#: torchrun's default for --signals-to-handle.
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: Signals that stop the agent (and its workers) gracefully; any other handled signal is forwarded.
SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
#: Always handled as shutdown, listed or not: the agent's own stop signals must never kill it abruptly.
ALWAYS_HANDLED = frozenset({signal.SIGTERM, signal.SIGINT})
#: torchrun reads this when --shutdown-timeout is not given.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
#: --event-log-handler names elastic-run has.
EVENT_LOG_HANDLERS = ("null", "console")

_COMMA = "\0"
_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^(\d+:[0-3],)*\d+:[0-3]$")


class Std(IntFlag):
    """Streams of a worker, as torchrun's ``--redirects``/``--tee`` name them."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR


@dataclass(frozen=True)
class StdSpec:
    """A parsed ``--redirects``/``--tee`` value: ``default`` for every local rank not in ``by_rank``."""

    default: Std = Std.NONE
    by_rank: tuple[tuple[int, Std], ...] = ()

    def for_rank(self, local_rank: int) -> Std:
        """The streams this spec names for ``local_rank``."""
        return dict(self.by_rank).get(local_rank, self.default)

    @property
    def empty(self) -> bool:
        """True when the spec names no stream of any rank."""
        return self.default is Std.NONE and all(s is Std.NONE for _, s in self.by_rank)


@dataclass(frozen=True)
class SignalPlan:
    """What the agent does with each signal it handles."""

    shutdown: frozenset[signal.Signals] = field(default_factory=lambda: SHUTDOWN_SIGNALS)
    forward: frozenset[signal.Signals] = frozenset()

    @property
    def handled(self) -> frozenset[signal.Signals]:
        return self.shutdown | self.forward


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
