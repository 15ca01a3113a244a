"""Wire protocol between the elastic agent and the job master (HTTP/JSON, ``/v1``).

Every request carries two headers: ``Authorization: Bearer <token>`` and ``X-Elastic-Job: <job id>``;
requests for one node (round, heartbeat, watch, leave, and a rejoin) also carry that node's secret,
``X-Elastic-Node-Secret``, which its join returned (:class:`JoinReply`). Errors come back as
:class:`ErrorBody` with an HTTP status: 401 wrong token, 403 wrong node secret, 409 wrong job, conflicting
settings or a node id another live agent uses, 404 unknown node, 413 body too large, 422 malformed request
(field named). Which of them an agent retries: the table in :mod:`elastic.control.error_table`.

This module is shared by master and agent; it imports pydantic but never torch or a web framework.
"""

from __future__ import annotations

import ipaddress
import re
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elastic.control.job_settings import NodeCheckMode

API_PREFIX = "/v1"
JOB_HEADER = "X-Elastic-Job"
#: The secret of the node incarnation a request acts for (``JoinReply.node_secret``).
NODE_SECRET_HEADER = "X-Elastic-Node-Secret"
#: The wire protocol revision a client speaks; absent means 1. Revision 2 adds round terms
#: (``Assignment.term``, ``CommandReply.term``) and the flapping fields of ``NodeStatus``. A master leaves
#: out of its replies the fields a client's revision does not know: agents of the previous release refuse
#: unknown fields in replies (this release ignores them, see :class:`_Reply`), and masters are upgraded
#: while such agents train (docs/operations.md, rolling upgrade).
PROTOCOL_HEADER = "X-Elastic-Protocol"
PROTOCOL_VERSION = 3
MAX_BODY_BYTES = 64 * 1024
#: Upper bound for any long-poll the master serves; clients ask for less and loop.
LONG_POLL_CAP_S = 30.0
#: The agent stream (docs/protocol.md, "The agent stream"): ``GET`` this path with ``Connection: Upgrade``
#: and ``Upgrade:`` :data:`STREAM_UPGRADE` switches the connection to newline-delimited JSON frames that
#: carry the node API's calls and replies, multiplexed (one connection per agent).
STREAM_PATH = API_PREFIX + "/stream"
STREAM_UPGRADE = "elastic-stream/1"
#: The agent stream's operations and the HTTP route each stands for: (method, path under API_PREFIX).
STREAM_ROUTES: dict[str, tuple[str, str]] = {
    "info": ("GET", "/info"),
    "join": ("POST", "/join"),
    "round": ("GET", "/round"),
    "heartbeat": ("POST", "/heartbeat"),
    "watch": ("GET", "/watch"),
    "leave": ("POST", "/leave"),
}
#: Calls one stream connection may have pending (long-polls included); beyond, a call is answered 429 busy.
STREAM_MAX_PENDING = 16
#: Longest frame (one line, without its newline) the master reads; a longer one: 413, and the stream closes.
STREAM_MAX_FRAME_BYTES = MAX_BODY_BYTES + 4096

_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
#: Longest persist error an agent reports (the tail of it is kept).
PERSIST_ERROR_MAX = 2000


_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?$")


def valid_host(text: str) -> bool:
    """True for an IP address (v4, or v6 with an optional zone) or a DNS host name; nothing else (no
    spaces, control characters or URLs), since hosts end up in logs, status tables and MASTER_ADDR."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(text))


class _Model(BaseModel):
    # Unknown fields are rejected so that typos in requests surface as 422 instead of being ignored. NaN and
    # infinities (which Python's JSON parser accepts) are refused too: a NaN step time or age would poison
    # the master's aggregates (medians, straggler scores, recovery phases) and its JSON replies.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Reply(BaseModel):
    # A reply may carry fields of a newer master: ignored, so that agents keep working across upgrades.
    model_config = ConfigDict(extra="ignore", frozen=True)


class WireEnum(str, Enum):
    """A closed set of wire values: serialised as its value, and ``str()``/``format()`` give the value too
    (on every Python version), so that logs and status tables show ``running``, not ``NodeState.RUNNING``."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class NodeState(WireEnum):
    """What an agent reports about its local worker group."""

    WAITING = "waiting"  # joined, waiting for a round that includes it
    STARTING = "starting"  # assigned to a round, workers being started
    RUNNING = "running"  # workers running
    SUCCEEDED = "succeeded"  # all local workers exited 0
    FAILED = "failed"  # a local worker failed or hung


class Command(WireEnum):
    """What the master tells an agent to do in reply to a heartbeat or watch."""

    CONTINUE = "continue"  # keep the workers running
    REJOIN = "rejoin"  # stop the workers and join the next round
    STOP = "stop"  # the job is over: stop the workers and exit with ``exit_code``
    EXCLUDE = "exclude"  # this node is excluded (node check): stop, exit with ``outcome`` (the job goes on)


class FailureKind(WireEnum):
    """How a worker failed (:attr:`WorkerFailure.kind`)."""

    CRASH = "crash"  # it exited non-zero or was killed by a signal
    HANG = "hang"  # it reported no progress for the hang timeout (or its process is stopped)


class FailurePhase(WireEnum):
    """Where in its round a worker failed (:attr:`WorkerFailure.phase`), from the steps reported to its
    agent since the workers started (master.job.crash_loop compares failures by it)."""

    STARTUP = "startup"  # no local worker had reported a step: imports, set-up, restore, the first step
    FIRST_STEP = "first_step"  # the failed worker had reported no step, another local worker had
    STEADY = "steady"  # the failed worker had reported a step


class NodeCheckStage(WireEnum):
    """Where a node's health check failed (:attr:`NodeCheckResult.stage`); ``PASSED`` when it did not.

    The stages the check process itself writes (``elastic.node_check``, stdlib-only, so it writes the values)
    come first; the rest are the agent's verdicts about a check process that gave no result."""

    PASSED = ""
    SETUP = "setup"
    INIT = "init"
    PAIRING = "pairing"
    MATMUL = "matmul"
    ALLREDUCE = "allreduce"
    CRASH = "crash"  # the check process exited without a result
    HANG = "hang"  # it made no progress (the agent's hang detection)
    TIMEOUT = "timeout"  # no result within the agent's time limit


class RoundStatus(WireEnum):
    """What the long-poll for the next round answers (:attr:`RoundReply.status`)."""

    ASSIGNED = "assigned"  # the round closed with this node: ``assignment`` says its place
    WAITING = "waiting"  # no round for this node yet: ask again
    FINISHED = "finished"  # the job is over: ``outcome`` says how


class NodeView(WireEnum):
    """A node's state in ``/v1/status`` (:attr:`NodeStatus.state`): what its agent last reported
    (:class:`NodeState`), or that the master excluded it."""

    WAITING = NodeState.WAITING.value
    STARTING = NodeState.STARTING.value
    RUNNING = NodeState.RUNNING.value
    SUCCEEDED = NodeState.SUCCEEDED.value
    FAILED = NodeState.FAILED.value
    EXCLUDED = "excluded"  # node check, flapping: out of the job (the job goes on)


class JobPhase(WireEnum):
    """Where the job is (:attr:`JobStatus.phase`)."""

    RENDEZVOUS = "rendezvous"  # no round is running: nodes are gathering for the next one
    TRAINING = "training"  # a round is running
    SUCCEEDED = "succeeded"  # over: the job succeeded
    FAILED = "failed"  # over: the job failed


class WorkerFailure(_Model):
    """The root cause of a local worker-group failure, as reported by an agent."""

    rank: int = Field(ge=0, description="Global rank of the first worker that failed.")
    local_rank: int = Field(ge=0)
    exit_code: int | None = Field(default=None, description="Exit code, or None when killed by a signal.")
    signal: str | None = Field(default=None, description="Signal name when the worker was killed by one.")
    message: str = Field(default="", max_length=8192, description="Error message the worker left, if any.")
    kind: FailureKind = FailureKind.CRASH
    age_s: float | None = Field(
        default=None,
        ge=0,
        description="Seconds since the agent saw the failure (the worker's exit, or a hung worker's last "
        "progress) when it sent this report: where the master's recovery phase 'detect' starts.",
    )
    # Additive (an agent sends them only when it knows them): what the master's crash-loop policy compares.
    phase: FailurePhase | None = Field(default=None, description="Where in the round the workers failed.")
    step: int | None = Field(
        default=None, ge=0, description="Newest step the failed worker had reported in this round."
    )
    exception: str = Field(
        default="",
        max_length=256,
        description="Type of the exception in ``message`` (``ModuleNotFoundError``), when it names one.",
    )
    known_error: str = Field(
        default="",
        max_length=64,
        description="A known deterministic start-up error the agent recognised in ``message`` "
        "(agent.workers.errors_file.known_error): import, syntax, missing_file or shm_too_small.",
    )


class WorkerProgress(_Model):
    local_rank: int = Field(ge=0)
    pid: int | None = None
    step: int | None = None
    step_time_s: float | None = None
    compute_time_s: float | None = Field(
        default=None,
        description="Median time per step outside the wait for other ranks' gradients (elastic.track_ddp).",
    )

    @model_validator(mode="before")
    @classmethod
    def _ignore_legacy_status(cls, data: Any) -> Any:
        # Agents of protocol revision 3 and before may send ``status`` (always "running", never read): the
        # master accepts it and drops it, so that they keep training across a master upgrade.
        if isinstance(data, dict) and "status" in data:
            return {k: v for k, v in data.items() if k != "status"}
        return data


class NodeCheckResult(_Model):
    """Figures of one node's health check (``python -m elastic.node_check``), as its agent reports them."""

    ok: bool
    stage: NodeCheckStage = Field(default=NodeCheckStage.PASSED, description="Where the check failed.")
    error: str = Field(default="", max_length=2000)
    device: str = Field(default="", max_length=64)
    matmul_s: float | None = Field(default=None, description="Best time of one matmul on the local device.")
    allreduce_s: float | None = Field(
        default=None, description="Best time of one allreduce with the partner."
    )
    partner: int | None = Field(default=None, description="Node rank of the allreduce partner.")


class JoinRequest(_Model):
    node_id: str = Field(pattern=_ID_PATTERN)
    host: str = Field(
        min_length=1, max_length=255, description="Address that other nodes reach this node on."
    )
    nproc: int = Field(ge=1, le=4096, description="Number of workers this node runs.")
    store_port: int = Field(ge=1, le=65535, description="Free port for the workers' store if rank 0.")
    min_nodes: int = Field(
        ge=1, description="The agent's view of the job size, checked against the master's."
    )
    max_nodes: int = Field(ge=1)
    default_id: bool = Field(
        default=False,
        description="The node id is elastic-run's default, HOSTNAME-PID (new at every agent start): the "
        "master counts this node's losses per host name and address rather than per id.",
    )

    @field_validator("host")
    @classmethod
    def _host_is_an_address_or_name(cls, host: str) -> str:
        if not valid_host(host):
            raise ValueError("must be an IP address or a host name")
        return host


class JoinReply(_Reply):
    round: int = Field(description="The round the node now waits for (the master's next round).")
    master_id: str
    node_secret: str = Field(
        description="The secret of this node incarnation: send it as X-Elastic-Node-Secret on every request "
        "for the node; keep it in memory only. The same on a rejoin with it; empty once the job is over."
    )


class RoundOpening(_Reply):
    """Why the master opened a round, for the one line an agent prints when it restarts its workers for it
    (``restarting workers (attempt 2 of 3 restarts): ...``, ``new round 4: ... (membership change, not
    charged)``). Sent with the round's assignment and with the waiting replies while the round forms;
    absent for a job's first round and from older masters."""

    round: int = Field(description="The round it opened.")
    cause: str = Field(
        default="",
        description="worker_failure, hang, node_loss or scale_up (the cause of the master's round_opened "
        "event); '' for another reason (a node check done).",
    )
    why: str = Field(
        default="",
        max_length=512,
        description="What happened, in a few words: 'rank 1 (local rank 0 on node n-b) failed with signal "
        "SIGKILL', 'admitting waiting nodes n-c'.",
    )
    charged: bool = Field(
        default=False,
        description="Charged against --max-restarts (a worker failure or hang); a membership change is "
        "free, and so is a failure that followed a lost node.",
    )
    restart_count: int = Field(default=0, description="Restarts spent, this one included.")
    max_restarts: int = Field(default=0, description="The job's --max-restarts.")


class Assignment(_Reply):
    """A node's place in a closed rendezvous round."""

    round: int
    node_rank: int
    nnodes: int
    rank_offset: int = Field(description="Global rank of this node's local rank 0.")
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    members: list[str] = Field(
        default_factory=list,
        description="Node ids in rank order; sent only to clients of protocol revision 2 or older, which "
        "need it: N members in each of N assignments would make a round's replies O(N^2) bytes (120 KB "
        "each at 10,000 nodes). GET /v1/status lists the members.",
    )
    committed_step: int | None = Field(
        default=None, description="Newest checkpoint step that every rank holds; workers restore it."
    )
    check: bool = Field(
        default=False,
        description="A node-check round: run one `python -m elastic.node_check` per node (world = nodes).",
    )
    term: int = Field(
        default=0,
        ge=0,
        description="The leader term under which the round was closed: a round is identified by "
        "(term, round), so a node never mixes the worlds of two leaders; 0 from masters without terms.",
    )
    job_incarnation: str = Field(
        default="",
        max_length=64,
        description="The job submission's incarnation: chosen when the job's master creates the job, kept "
        "across master failovers, new for each submission; later submissions compare greater (a "
        "fixed-width hex wall-clock time, then a random part). Agents record it with the round in "
        "--ckpt-dir's fence, so that a resubmitted job's persists supersede the earlier submission's "
        "whatever the round numbers. Empty from older masters.",
    )
    opening: RoundOpening | None = Field(
        default=None, description="Why the master opened this round; None for the first round."
    )


class Outcome(_Reply):
    """How the job ended."""

    succeeded: bool
    exit_code: int
    summary: str = ""


class RoundReply(_Reply):
    """Reply of the long-poll for the next round."""

    status: RoundStatus
    assignment: Assignment | None = None
    outcome: Outcome | None = None
    round: int = Field(description="The master's current round number.")
    # How the rendezvous stands, in a ``waiting`` reply (None from older masters): the agent's waiting line,
    # ``round 3: 2 of 3 nodes joined (min 2, max 4); last call ends in 1.4 s``. O(1) for the master to fill.
    joined: int | None = Field(
        default=None, description="Nodes that joined and wait for the next round (this node included)."
    )
    min_nodes: int | None = Field(default=None, description="The job's minimum number of nodes.")
    max_nodes: int | None = Field(default=None, description="The job's maximum number of nodes.")
    expected_back: int | None = Field(
        default=None,
        description="Members of the previous round that the forming round waits for (not rejoined yet).",
    )
    running_nodes: int | None = Field(
        default=None,
        description="Members of the round that runs without this node (a spare, or a node waiting for the "
        "world to grow); None while a round forms.",
    )
    last_call_ends_in_s: float | None = Field(
        default=None,
        description="Seconds until the last call ends: the round then closes (or the running one grows) "
        "with the nodes that joined; None when no last call runs.",
    )
    opening: RoundOpening | None = Field(
        default=None, description="Why the master opened the forming round; None for the first round."
    )


class IntegrityFinding(_Model):
    """What the integrity guard (elastic.integrity) found at a step: a detection, or with
    ``rolled_back_to`` the in-process rollback that followed it (docs/integrity.md)."""

    kind: str = Field(max_length=32, description="'non_finite', 'mismatch' or 'spike'.")
    ranks: list[int] = Field(
        default_factory=list, max_length=64, description="The global ranks named (the first 64)."
    )
    world_size: int = Field(default=0, ge=0, description="The replicas compared.")
    named_here: bool = Field(default=False, description="A worker of the reporting node is one of ``ranks``.")
    odd: bool = Field(
        default=False, description="A mismatch naming a strict minority of the replicas: the odd one(s)."
    )
    recurring: bool = Field(
        default=False, description="The same NaN or spike was found at that step before a rollback."
    )
    rolled_back_to: int | None = Field(
        default=None, ge=0, description="The verified step the job rolled back to (a rollback report)."
    )
    samples: list[int] = Field(
        default_factory=list, max_length=256, description="The step's global sample indices, when known."
    )


class Finding(_Model):
    """Something a node found wrong and reports once: a copy of a checkpoint whose bytes failed their
    digest check (elastic.checkpoint.digest), found by a worker's restore (which went on with another
    copy) or by the agent before a persist (not persisted); or (``found_by`` 'integrity', with
    ``integrity``) what the integrity guard found."""

    id: str = Field(
        max_length=64,
        description="Unique per report of one agent: the master records each id once, however often the "
        "agent sends it (it sends a report until a heartbeat that carried it is answered).",
    )
    step: int = Field(ge=0, description="The checkpoint's step, or the step the guard judged.")
    file: str = Field(default="", max_length=1024, description="The damaged copy (on that node).")
    found_by: str = Field(default="", max_length=32, description="'restore', 'persist' or 'integrity'.")
    detail: str = Field(default="", max_length=1024, description="The mismatch, or who found it.")
    integrity: IntegrityFinding | None = Field(
        default=None, description="The integrity guard's finding (found_by 'integrity'); sent only then."
    )


#: Findings one heartbeat carries at most (the agent keeps the newest).
FINDINGS_MAX = 16


class HeartbeatRequest(_Model):
    node_id: str = Field(pattern=_ID_PATTERN)
    round: int = Field(ge=0, description="The round this node's workers belong to (0 while waiting).")
    term: int | None = Field(
        default=None,
        ge=0,
        description="The term of that round (Assignment.term); a different current term means rejoin. "
        "Omitted by agents that predate terms (round numbers alone are compared).",
    )
    state: NodeState
    workers: list[WorkerProgress] = Field(default_factory=list, max_length=4096)
    failure: WorkerFailure | None = None
    ckpt_step: int | None = Field(default=None, description="Newest step all local ranks have checkpointed.")
    node_check: NodeCheckResult | None = Field(default=None, description="Result of this node's check.")
    persisted_step: int | None = Field(
        default=None, description="Step of the last checkpoint this node's agent made durable on disk."
    )
    persist_error: str = Field(
        default="",
        max_length=PERSIST_ERROR_MAX,
        description="Why the agent's last persist failed, or that the running one makes no progress; "
        "empty while persists succeed.",
    )
    workers_started_age_s: float | None = Field(
        default=None, ge=0, description="Seconds since this round's workers were started on this node."
    )
    first_step_age_s: float | None = Field(
        default=None,
        ge=0,
        description="Seconds since every local worker of this round had reported its first step; None "
        "until then.",
    )
    replicas: int = Field(default=0, ge=0, le=64, description="Peers this node replicates its memory to.")
    replication_port: int | None = Field(
        default=None, ge=1, le=65535, description="This agent's replication listener (on its host)."
    )
    replicated_step: int | None = Field(
        default=None, description="Newest sharded step whose replicas on every target are complete."
    )
    replication_lag: int | None = Field(
        default=None, description="Newest sharded save's step minus the replicated step (None: off)."
    )
    replication_error: str = Field(default="", max_length=PERSIST_ERROR_MAX)
    ckpt_corrupt: list[Finding] = Field(
        default_factory=list,
        max_length=FINDINGS_MAX,
        description="Findings of this node not yet acknowledged by an answered heartbeat: checkpoint copies "
        "found damaged (their digest did not match), and the integrity guard's detections and rollbacks; "
        "sent only when there are some (soft state; the master records each id once: events "
        "checkpoint_corrupt, integrity_detected, integrity_rolled_back).",
    )


class CommandReply(_Reply):
    command: Command
    round: int = Field(description="The master's current round number.")
    term: int = Field(default=0, ge=0, description="The term of the master's current round.")
    outcome: Outcome | None = None
    master_id: str = ""
    peers: list[str] = Field(
        default_factory=list,
        description="HOST:PORT of the replication listeners of this node's ring successors "
        "('' where not known yet); soft state.",
    )
    peer_keys: list[str] = Field(
        default_factory=list,
        description="For each of ``peers``, the pair key (hex) with which this node proves itself to that "
        "successor and MACs what it pushes there (agent.checkpoints.replication_wire).",
    )
    replication_key: str = Field(
        default="",
        description="This node's receiver key (hex): its replication listener derives from it the pair key "
        "of any node that pushes to it. Empty from a master that hands out no keys.",
    )


class LeaveRequest(_Model):
    node_id: str = Field(pattern=_ID_PATTERN)
    reason: str = Field(default="", max_length=1024)


class JobInfo(_Reply):
    """Settings an agent must agree with; served at ``GET /v1/info``."""

    job_id: str
    master_id: str
    min_nodes: int
    max_nodes: int
    node_unit: int
    max_restarts: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    last_call_s: float
    join_timeout_s: float
    node_check: NodeCheckMode = "off"


class NodeStatus(_Reply):
    node_id: str
    rank: int | None
    state: NodeView
    heartbeat_age_s: float | None
    restarts: int
    round: int
    host: str
    nproc: int
    step: int | None = None
    step_time_s: float | None = None
    compute_time_s: float | None = None
    straggler: bool = False
    node_check: NodeCheckResult | None = None
    node_check_verdict: str = Field(default="", description="ok | slow: ... | failed: ... (and excluded)")
    persisted_step: int | None = Field(default=None, description="Last step this node made durable on disk.")
    persist_error: str = Field(default="", description="This node's last persist error, if persists fail.")
    replicated_step: int | None = Field(default=None, description="Newest step replicated to its peers.")
    replication_lag: int | None = Field(default=None, description="Steps its replicas lag its memory.")
    replication_error: str = Field(default="", description="Why its last replication push failed.")
    excluded_reason: str = Field(default="", description="Why the node is excluded (state excluded).")
    readmit_in_s: float | None = Field(
        default=None, description="Seconds until an exclusion for flapping ends (the cool-down's rest)."
    )


class ReadmitReply(_Reply):
    """``POST /v1/nodes/{node_id}/readmit``: the node's flapping exclusion is lifted."""

    node_id: str
    message: str


class StatusEvent(_Reply):
    """One of the job's recent events, as ``/v1/status`` shows it."""

    seq: int = Field(description="1 for the job's first event, then one more per event.")
    age_s: float = Field(description="Seconds since the event, on the master's clock.")
    kind: str
    message: str


class JobStatus(_Reply):
    job_id: str
    master_id: str
    phase: JobPhase
    round: int
    world_size: int
    nnodes: int
    restart_count: int
    max_restarts: int
    outcome: Outcome | None = None
    committed_step: int | None = None
    persisted_step: int | None = Field(
        default=None, description="Newest step any node made durable on disk (soft state, from heartbeats)."
    )
    nodes: list[NodeStatus]
    goodput_ratio: float | None = Field(
        default=None,
        description="Productive training time (less the steps trained again after a failure) / wall time "
        "since the job started (docs/observability.md); None before any time passed.",
    )
    badput_s: dict[str, float] = Field(
        default_factory=dict,
        description="The rest of the wall time, in seconds by bucket: detection, rendezvous, re_form, "
        "restore, redone_steps, waiting_for_nodes, other (docs/observability.md).",
    )
    waiting_reason: str = Field(
        default="",
        description="What the rendezvous does now and why: 'waiting for 1 more node (1 joined, 2 needed) "
        "until 12:00:03', 'closed: 2 nodes, world size 8 (...)'; the job's outcome once it ended.",
    )
    events: list[StatusEvent] = Field(
        default_factory=list, description="The job's most recent events, oldest first."
    )
    crash_loop: str = Field(
        default="",
        description="Why the job was stopped as deterministic (crash loop): the root cause and the rule "
        "(master.job.crash_loop); empty unless it was.",
    )
    spares: list[str] = Field(
        default_factory=list,
        description="Hot spares, in join order: nodes beyond the running round's maximum, registered and "
        "heartbeating, that take a lost member's node rank at the next round.",
    )


class ErrorBody(_Reply):
    error: str
    message: str


def describe_figures(result: NodeCheckResult) -> str:
    """``matmul 12.1 ms on cpu, allreduce 3.2 ms with node rank 1`` (the figures that exist)."""
    parts = []
    if result.matmul_s is not None:
        where = f" on {result.device}" if result.device else ""
        parts.append(f"matmul {format_ms(result.matmul_s)}{where}")
    if result.allreduce_s is not None:
        partner = f" with node rank {result.partner}" if result.partner is not None else ""
        parts.append(f"allreduce {format_ms(result.allreduce_s)}{partner}")
    return ", ".join(parts) or "no figures"


def format_ms(seconds: float) -> str:
    """``12.1 ms``: how node-check figures are shown in logs, events and the status table."""
    return f"{seconds * 1e3:.1f} ms"
