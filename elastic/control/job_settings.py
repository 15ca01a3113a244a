"""Job settings shared by the master and the agents: every default in one place, validated once, then
passed down frozen. (The master's own serving settings are in ``master/service/settings.py``.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from elastic import errors

#: Defaults, documented in docs/cli.md. Trade-off: a dead node is declared after about three missed
#: heartbeats (fast verdicts, yet a loaded 2-core machine does not cause false ones); the last call is a
#: few seconds (torchrun waits 30 s) and only delays *growth*, never a restart of known members.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 4.0
DEFAULT_LAST_CALL_S = 2.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_MAX_RESTARTS = 3
#: How long a restart round waits for live members that are still stopping their workers.
DEFAULT_REJOIN_TIMEOUT_S = 30.0
#: A node whose step time (compute time with elastic.track_ddp) exceeds this many times the nodes' median
#: is flagged as a straggler (docs/failures.md).
DEFAULT_STRAGGLER_FACTOR = 2.0
#: ``--straggler-policy`` (docs/failures.md, master.job.stragglers): report only | evict | replace.
StragglerPolicyMode = Literal["report", "evict", "replace"]
STRAGGLER_POLICIES: tuple[StragglerPolicyMode, ...] = get_args(StragglerPolicyMode)
#: Steps a node must stay flagged before the policy acts. Its figure is already a median of its last 20
#: steps (one slow step, or fewer than about 10, never flags it); 5 more let a node whose first steps after
#: a restart are slow clear first, and still evict a node slowed for good within about 20 of its steps.
DEFAULT_STRAGGLER_WINDOW = 5
#: Seconds an evicted straggler stays excluded (as long as a flapping node: a repair takes that long).
DEFAULT_STRAGGLER_COOLDOWN_S = 600.0
#: ``--node-check``: off | on (exclude failed or slow nodes before the first round) | warn (report only).
NodeCheckMode = Literal["off", "on", "warn"]
NODE_CHECK_MODES: tuple[NodeCheckMode, ...] = get_args(NodeCheckMode)
#: A node whose check figures exceed this many times the nodes' median counts as slow.
DEFAULT_NODE_CHECK_FACTOR = 3.0
#: Flapping nodes (docs/failures.md): a node id lost (declared dead, or its agent replaced by a restarted
#: one) more than this many times within the window is excluded for the cool-down. 3 losses in 5 minutes
#: is already a crash loop (each one restarts every node's workers); a real repair takes longer than 10.
DEFAULT_FLAP_LIMIT = 3
DEFAULT_FLAP_WINDOW_S = 300.0
DEFAULT_FLAP_COOLDOWN_S = 600.0
#: A node named the odd replica by the integrity guard this many times within the window is excluded as
#: suspect hardware (docs/integrity.md; master.job.findings); 0 turns it off.
DEFAULT_SUSPECT_COUNT = 2
DEFAULT_SUSPECT_WINDOW_S = 24 * 3600.0
#: Crash loops (docs/failures.md, master.job.crash_loop): the same failure twice within this many seconds,
#: with no progress in between, stops the job as deterministic (exit 3). A restart of a large job (restore,
#: compile, data loading) takes minutes, so a loop's failures can be that far apart; failures further
#: apart are charged as usual (the restart budget still bounds them).
DEFAULT_CRASH_LOOP_WINDOW_S = 600.0


class SettingsError(errors.UsageError, ValueError):
    """A setting is out of range or inconsistent with another one."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse torchrun's ``--nnodes`` value, ``N`` or ``MIN:MAX``."""
    parts = str(text).strip().split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise SettingsError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if low < 1:
        raise SettingsError(f"--nnodes minimum must be at least 1, got {low}")
    if high < low:
        raise SettingsError(f"--nnodes {text}: maximum {high} is below minimum {low}")
    return low, high


@dataclass(frozen=True)
class JobSettings:
    """Settings of one job's rendezvous and liveness policy (no I/O, no addresses)."""

    job_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    node_unit: int = 1
    last_call_s: float = DEFAULT_LAST_CALL_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    rejoin_timeout_s: float = DEFAULT_REJOIN_TIMEOUT_S
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR
    straggler_policy: StragglerPolicyMode = "report"
    straggler_window: int = DEFAULT_STRAGGLER_WINDOW
    straggler_cooldown_s: float = DEFAULT_STRAGGLER_COOLDOWN_S
    node_check: NodeCheckMode = "off"
    node_check_factor: float = DEFAULT_NODE_CHECK_FACTOR
    #: 0 turns the flapping policy off (master.job.flapping).
    flap_limit: int = DEFAULT_FLAP_LIMIT
    flap_window_s: float = DEFAULT_FLAP_WINDOW_S
    flap_cooldown_s: float = DEFAULT_FLAP_COOLDOWN_S
    #: 0 turns the suspect-hardware exclusion off (master.job.findings).
    suspect_count: int = DEFAULT_SUSPECT_COUNT
    suspect_window_s: float = DEFAULT_SUSPECT_WINDOW_S
    #: A known deterministic start-up error (import, syntax, missing file, /dev/shm too small) stops the
    #: job at its first occurrence; False charges it as a restart (files that appear late: network mounts).
    stop_on_startup_error: bool = True
    #: 0 turns the repeat rule of the crash-loop policy off (master.job.crash_loop).
    crash_loop_window_s: float = DEFAULT_CRASH_LOOP_WINDOW_S

    def __post_init__(self) -> None:
        if not self.job_id:
            raise SettingsError("job id must not be empty")
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise SettingsError(f"nnodes {self.min_nodes}:{self.max_nodes} is not a valid MIN:MAX")
        if self.node_unit < 1:
            raise SettingsError(f"--node-unit must be at least 1, got {self.node_unit}")
        if self.node_unit > self.max_nodes:
            raise SettingsError(f"--node-unit {self.node_unit} exceeds the maximum of {self.max_nodes} nodes")
        if self.max_restarts < 0:
            raise SettingsError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.last_call_s < 0:
            raise SettingsError("last_call_s must be >= 0")
        for name in ("join_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "rejoin_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be > 0")
        if self.crash_loop_window_s < 0:
            raise SettingsError(f"--crash-loop-window must be >= 0 (0: off), got {self.crash_loop_window_s}")
        if self.suspect_count < 0 or self.suspect_window_s <= 0:
            raise SettingsError(
                f"--suspect-count must be >= 0 (0: off) and --suspect-window > 0, got {self.suspect_count} "
                f"and {self.suspect_window_s}"
            )
        if self.flap_limit < 0:
            raise SettingsError(f"--flap-limit must be >= 0 (0: off), got {self.flap_limit}")
        for name in ("flap_window_s", "flap_cooldown_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name[:-2].replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("straggler_factor", "node_check_factor"):
            if getattr(self, name) <= 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be > 1, got {getattr(self, name)}")
        if self.straggler_policy not in STRAGGLER_POLICIES:
            raise SettingsError(
                f"--straggler-policy must be one of {', '.join(STRAGGLER_POLICIES)}, "
                f"got {self.straggler_policy!r}"
            )
        if self.straggler_window < 1 or self.straggler_cooldown_s <= 0:
            raise SettingsError(
                f"--straggler-window must be >= 1 and --straggler-cooldown > 0, got {self.straggler_window} "
                f"and {self.straggler_cooldown_s}"
            )
        if self.node_check not in NODE_CHECK_MODES:
            raise SettingsError(
                f"--node-check must be one of {', '.join(NODE_CHECK_MODES)}, got {self.node_check!r}"
            )
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise SettingsError(
                f"--heartbeat-timeout ({self.heartbeat_timeout_s}s) must exceed "
                f"--heartbeat-interval ({self.heartbeat_interval_s}s)"
            )
