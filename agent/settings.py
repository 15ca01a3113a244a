"""Agent settings: resolved once from the CLI, then passed down frozen."""

from __future__ import annotations

import pathlib
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.observe.progress import DEFAULT_PROGRESS_INTERVAL_S
from agent.workers.output import OutputPolicy
from elastic.contract import DEFAULT_CKPT_KEEP
from elastic.control.job_settings import JobSettings

#: Seconds between SIGTERM and SIGKILL when stopping workers.
DEFAULT_STOP_GRACE_S = 5.0
#: How long healthy workers keep training while no master answers, before the agent gives up.
DEFAULT_MASTER_TIMEOUT_S = 300.0
#: ``--hang-timeout``'s default: None, the adaptive bound (agent.observe.hang_policy: no progress for
#: max(3 x p99 step time, 2 s) after a warm-up). An explicit value T is the fixed rule: a worker that has
#: made steps is hung after T without a new one, or a worker process stopped or in disk sleep that long;
#: 0 turns hang verdicts off.
DEFAULT_HANG_TIMEOUT_S: float | None = None
#: Signals that stop the agent (and its workers) gracefully; any other handled signal is forwarded.
SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
#: Always handled as shutdown, listed or not: the agent's own stop signals must never kill it abruptly.
ALWAYS_HANDLED = frozenset({signal.SIGTERM, signal.SIGINT})
#: The pre-emption warning (``--preempt-signal``): SLURM's ``--signal=USR1@90`` before a time limit or a
#: pre-emption. The agent stops as for SIGTERM (the keeper persists the newest flash step) but exits 1.
DEFAULT_PREEMPT_SIGNAL = "USR1"


def preempt_signal(text: str) -> signal.Signals | None:
    """``--preempt-signal``'s value: a signal name (``USR1`` or ``SIGUSR1``, any case), or ``none``.

    Raises ValueError for an unknown name, a signal no process can handle (SIGKILL, SIGSTOP) and one
    that already stops the agent (SIGTERM, SIGINT, SIGHUP, SIGQUIT exit 128+N, as torchrun)."""
    name = text.strip().upper()
    if name in ("", "NONE"):
        return None
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        sig = signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {text!r}") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP) or sig in SHUTDOWN_SIGNALS:
        raise ValueError(f"{sig.name} cannot be the pre-emption signal")
    return sig


@dataclass(frozen=True)
class SignalPlan:
    """What the agent does with each signal it handles (``--signals-to-handle``, parsed by
    :func:`agent.cli.torchrun.parse_signals`)."""

    shutdown: frozenset[signal.Signals] = field(default_factory=lambda: SHUTDOWN_SIGNALS)
    forward: frozenset[signal.Signals] = frozenset()

    @property
    def handled(self) -> frozenset[signal.Signals]:
        """Every signal the agent installs a handler for."""
        return self.shutdown | self.forward


@dataclass(frozen=True)
class AgentSettings:
    """Everything one node's agent needs to run its share of a job."""

    argv: tuple[str, ...]  # the worker command line
    nproc: int
    job: JobSettings  # the job settings this agent expects (and hosts, when it embeds the master)
    token: str
    node_id: str
    #: ``--token-file`` (absolute) the token came from: re-read after a 401 and by this agent's listeners
    #: (elastic.control.token_source); None: a fixed token (ELASTIC_TOKEN, derived or random).
    token_file: str | None = None
    #: No token was given off loopback and torchrun's spelling opted in: the token is the one derived from
    #: the job id, which anyone can compute (elastic.control.listener_rules.UNAUTHENTICATED).
    unauthenticated: bool = False
    #: ``node_id`` is elastic-run's default HOSTNAME-PID (no --node-id): the master counts its losses per
    #: host and address (master.job.flapping), since a restarted agent comes back under a new id.
    node_id_is_default: bool = False
    #: Master addresses (``HOST:PORT``); empty in standalone mode, where the agent embeds the master.
    masters: tuple[str, ...] = ()
    #: Host an embedded master at this address if none answers there (torchrun's c10d convenience).
    host_master_at: str | None = None
    #: CA file the master's certificate is verified with; given, the master is spoken to over https.
    tls_ca: str | None = None
    #: Certificate and key of the master this agent hosts in convenience mode (https); None: plain http.
    tls_cert: str | None = None
    tls_key: str | None = None
    local_addr: str | None = None
    role: str = "default"
    log_dir: pathlib.Path | None = None
    ckpt_dir: pathlib.Path | None = None
    #: Checkpoints the keeper keeps in ckpt_dir (agent.checkpoints.keeper).
    ckpt_keep: int = DEFAULT_CKPT_KEEP
    #: The first worker start ignores this node's checkpoints (ELASTIC_CKPT_RESET=1); later ones restore.
    ckpt_reset: bool = False
    #: Peer nodes each node streams its sharded memory checkpoints to (agent.checkpoints.replication); 0: off.
    replicas: int = 1
    #: Steps the replicas may lag the newest sharded save before a save waits.
    replication_lag: int = 1
    #: Cap of one push's bandwidth in MB/s; 0: none.
    replication_bandwidth: float = 0.0
    #: MiB of this node's shared memory one peer's replica may take; 0: the /dev/shm size / (replicas + 2).
    replication_peer_cap: int = 0
    stop_grace_s: float = DEFAULT_STOP_GRACE_S
    master_timeout_s: float = DEFAULT_MASTER_TIMEOUT_S
    hang_timeout_s: float | None = DEFAULT_HANG_TIMEOUT_S
    cwd: str | None = None
    #: Fork restarted workers from a zygote that has imported torch (agent.warm.starter); False: always exec.
    warm_start: bool = True
    #: Which worker streams reach the console, which lines go to filtered logs (torchrun's log flags).
    output: OutputPolicy = OutputPolicy()
    #: Variables set per local rank on top of the worker contract (--virtual-local-rank); empty: none.
    per_rank_env: tuple[Mapping[str, str], ...] = ()
    #: Signals that stop the agent, and signals it forwards to its workers (--signals-to-handle).
    signals: SignalPlan = field(default_factory=SignalPlan)
    #: The pre-emption warning (--preempt-signal): stop as for SIGTERM, persist the newest flash step, exit
    #: 1 (retryable: requeue the job). A signal --signals-to-handle also lists is forwarded instead. None:
    #: off.
    preempt_signal: signal.Signals | None = signal.SIGUSR1
    #: SLURM's name of this node (SLURMD_NODENAME): before each join the agent asks sinfo for its state and
    #: refuses to join (exit 4) when SLURM drains it, or declared it down or failed
    #: (agent.executor.slurm_state). None: not under SLURM, no check.
    slurm_node: str | None = None
    #: --event-log-handler: "console" prints lifecycle events, anything else drops them
    #: (agent.observe.events).
    event_log_handler: str = "null"
    #: Seconds between two progress lines (agent.observe.progress); 0: none (--quiet).
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S
    #: Port of this agent's metrics listener (agent.observe.metrics), on ``local_addr``; 0: a free one; None:
    #: off.
    metrics_port: int | None = None
    #: The ports the workers' store port is drawn from (``ELASTIC_STORE_PORTS``, agent.executor.net);
    #: None: any free port.
    store_ports: range | None = None

    @property
    def standalone(self) -> bool:
        return not self.masters
