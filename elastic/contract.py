"""The worker<->agent contract: environment variable names, shared defaults and the progress datagram.

Standard library only: the worker library (:mod:`elastic.report`, :mod:`elastic.checkpoint.replicated`), the
agent and the warm-start zygote all read it. docs/protocol.md ("Worker environment", "Progress datagram")
lists the same names; ``tests/unit/test_contract_docs.py`` fails when the two differ.

The datagram's wire form is one compact JSON object with one-letter keys (it must fit one small Unix
datagram and be cheap to build on every training step); :class:`Progress` is its typed form, and the
only code that knows the keys.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from elastic import errors

# -- environment the agent sets for every worker: torchrun's contract -------------------------------------
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
ROLE_NAME = "ROLE_NAME"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: Set per attempt by the worker group: where the worker's ``@record`` writes its error (torchrun's).
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
OMP_NUM_THREADS = "OMP_NUM_THREADS"

#: torchrun's per-worker variables, in the order the agent sets them.
TORCHRUN_VARIABLES: tuple[str, ...] = (
    RANK,
    LOCAL_RANK,
    WORLD_SIZE,
    LOCAL_WORLD_SIZE,
    GROUP_RANK,
    GROUP_WORLD_SIZE,
    ROLE_RANK,
    ROLE_WORLD_SIZE,
    ROLE_NAME,
    MASTER_ADDR,
    MASTER_PORT,
    RESTART_COUNT,
    MAX_RESTARTS,
    RUN_ID,
    USE_AGENT_STORE,
    NCCL_ASYNC_ERROR_HANDLING,
    OMP_NUM_THREADS,
)

# -- our additions (prefix ELASTIC_) ----------------------------------------------------------------------
#: The agent's Unix datagram socket for progress reports (:class:`Progress`).
AGENT_SOCKET = "ELASTIC_AGENT_SOCKET"
#: The worker's real local rank, also under --virtual-local-rank (where LOCAL_RANK is 0 everywhere).
ELASTIC_LOCAL_RANK = "ELASTIC_LOCAL_RANK"
#: The rendezvous round the workers were started in; fences the agent's persist of their checkpoints.
ROUND = "ELASTIC_ROUND"
#: This node's id (the agent's --node-id).
NODE_ID = "ELASTIC_NODE_ID"
#: The step every node holds a checkpoint of, when the master knows one: where to resume.
COMMITTED_STEP = "ELASTIC_COMMITTED_STEP"
#: The agent's --ckpt-dir: where checkpoints are persisted.
CKPT_DIR = "ELASTIC_CKPT_DIR"
#: "1" when the job starts from scratch (--ckpt-reset): ignore checkpoints found on disk.
CKPT_RESET = "ELASTIC_CKPT_RESET"
#: The agent's shared-memory folder for flash checkpoints (in /dev/shm).
SHM_DIR = "ELASTIC_SHM_DIR"
#: Per-worker file for the faulthandler stack dump before a hang kill.
STACK_FILE = "ELASTIC_STACK_FILE"
#: Where a node-check worker writes its result, and its time limit (set by the agent's node check).
NODE_CHECK_RESULT = "ELASTIC_NODE_CHECK_RESULT"
NODE_CHECK_TIMEOUT_S = "ELASTIC_NODE_CHECK_TIMEOUT_S"
#: The agent's Unix stream socket for in-process recovery (:mod:`elastic.inprocess.wire`).
INPROCESS_SOCKET = "ELASTIC_INPROCESS_SOCKET"

#: Every ``ELASTIC_*`` variable the agent sets for a worker (documented in docs/protocol.md).
ELASTIC_VARIABLES: tuple[str, ...] = (
    AGENT_SOCKET,
    ELASTIC_LOCAL_RANK,
    ROUND,
    NODE_ID,
    COMMITTED_STEP,
    CKPT_DIR,
    CKPT_RESET,
    SHM_DIR,
    STACK_FILE,
    NODE_CHECK_RESULT,
    NODE_CHECK_TIMEOUT_S,
    INPROCESS_SOCKET,
)

#: Every variable of the worker environment, as docs/protocol.md ("Worker environment") lists them.
WORKER_ENVIRONMENT: tuple[str, ...] = (*TORCHRUN_VARIABLES, ERROR_FILE, *ELASTIC_VARIABLES)

# -- set by the user, not by the agent ---------------------------------------------------------------------
#: Read by the worker library: the process groups' collective timeout, seconds (default 300).
PG_TIMEOUT_S = "ELASTIC_PG_TIMEOUT_S"
#: Read by the agent itself: the modules the warm-start zygote imports (comma-separated).
WARM_PRELOAD = "ELASTIC_WARM_PRELOAD"
#: The variables above (documented in docs/protocol.md).
USER_VARIABLES: tuple[str, ...] = (PG_TIMEOUT_S, WARM_PRELOAD)

# -- defaults shared by the worker library and the agent ---------------------------------------------------
#: Checkpoints kept on disk (``elastic.save(keep=)``, ``elastic-run --ckpt-keep``).
DEFAULT_CKPT_KEEP = 3
#: Longest wait of a checkpoint report for room in the agent's queue (the agent is stalled, e.g. SIGSTOP).
CKPT_SEND_TIMEOUT_S = 10.0
#: Largest datagram the agent reads; a report is far smaller.
MAX_DATAGRAM_BYTES = 65536


# -- the progress datagram ---------------------------------------------------------------------------------
class ProgressKind(str, Enum):
    """What a progress datagram reports."""

    STEP = "step"  # the worker completed a training step
    CKPT = "ckpt"  # the worker holds a complete checkpoint of a step
    DONE = "done"  # the worker's training is over; it is no longer judged on step progress
    CORRUPT = "corrupt"  # a copy of checkpoint ``step`` (``location``) failed its digest at restore
    # Sent by elastic.autoprogress without user code (additive: an older agent drops what it cannot parse).
    AUTO = "auto"  # the worker's optimizers made ``step`` steps so far (the global optimizer-step hook)
    LIFE = "life"  # a sign of life: a forward pass ran (evaluation is not a hang); ``step`` as for auto
    SAVE = "save"  # a checkpoint save began (elastic.save, torch.save): not a hang until it ends
    SAVED = "saved"  # that save ended (a ``ckpt`` report ends it too)
    # The integrity guard (elastic.integrity): a detection at ``step`` (``detail``: what and which ranks),
    # and with ``rolled_back_to`` the in-process rollback that followed it.
    INTEGRITY = "integrity"


#: :class:`Progress` field -> its key on the wire.
WIRE_KEYS: dict[str, str] = {
    "local_rank": "r",
    "kind": "k",
    "step": "step",
    "sent_at": "t",
    "compute_s": "b",
    "location": "loc",
    "persist_to": "dir",
    "save_s": "sv",
    "round": "rd",
    "detail": "d",
    "rolled_back_to": "rb",
}


class MalformedDatagram(errors.ProtocolError, ValueError):
    """A datagram that is not a progress report (the agent drops it)."""


@dataclass(frozen=True)
class Progress:
    """One worker->agent progress report (the typed form of the datagram)."""

    local_rank: int
    kind: ProgressKind
    step: int
    #: ``time.time()`` when sent.
    sent_at: float | None = None
    #: Step time minus all-reduce wait, seconds per step (with ``elastic.track_ddp``; step reports only).
    compute_s: float | None = None
    #: The checkpoint file in the agent's shared memory, when the agent should persist it (ckpt only).
    location: str = ""
    #: The folder to persist to, when not the agent's --ckpt-dir (ckpt only).
    persist_to: str = ""
    #: How long the save took until complete in memory, seconds (ckpt only; finite and >= 0, else None).
    save_s: float | None = None
    #: The worker's rendezvous round (``ELASTIC_ROUND``), fencing the persist (ckpt only).
    round: int | None = None
    #: What the integrity guard found (integrity only): an :class:`IntegrityNote` as JSON.
    detail: str = ""
    #: The verified step the job rolled back to after that detection (integrity only; None: not yet).
    rolled_back_to: int | None = None

    def encode(self) -> bytes:
        """The datagram: compact JSON, optional fields left out when empty."""
        message: dict[str, Any] = {"k": self.kind.value, "step": self.step}
        if self.location or self.kind is ProgressKind.CKPT:
            message["loc"] = self.location
        optional = {
            "dir": self.persist_to or None,
            "b": self.compute_s,
            "sv": self.save_s,
            "rd": self.round,
            "d": self.detail or None,
            "rb": self.rolled_back_to,
        }
        message.update({k: v for k, v in optional.items() if v is not None})
        message["r"] = self.local_rank
        if self.sent_at is not None:
            message["t"] = self.sent_at
        return json.dumps(message, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Progress:
        """Parse a datagram; raises :class:`MalformedDatagram` for anything that is not a report.

        A checkpoint report's ``sv`` that is not a finite non-negative number is ignored (the report
        stays valid); an ``sv`` that is not a number at all makes the datagram malformed."""
        try:
            message = json.loads(data)
            kind = ProgressKind(str(message["k"]))
            compute = float(message["b"]) if "b" in message else None
            save_s = float(message["sv"]) if kind is ProgressKind.CKPT and "sv" in message else None
            sent_at = float(message["t"]) if "t" in message else None
            return cls(
                local_rank=int(message["r"]),
                kind=kind,
                step=int(message["step"]),
                sent_at=sent_at,
                compute_s=compute,
                location=str(message.get("loc") or ""),
                persist_to=str(message.get("dir") or ""),
                save_s=save_s if save_s is not None and math.isfinite(save_s) and save_s >= 0 else None,
                round=int(message["rd"]) if "rd" in message else None,
                detail=str(message.get("d") or ""),
                rolled_back_to=int(message["rb"]) if "rb" in message else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MalformedDatagram(f"not a progress report: {e}") from None


#: Sample indices an integrity report names at most (the step's global batch, cut to this many)...
MAX_NOTE_SAMPLES = 256
#: ...and ranks (a heartbeat that carries a node's findings must stay far below the master's body limit).
MAX_NOTE_RANKS = 64


@dataclass(frozen=True)
class IntegrityNote:
    """What the integrity guard found at a step, as an ``integrity`` datagram's ``detail`` carries it.

    ``kind``: ``non_finite``, ``mismatch`` or ``spike`` (elastic.integrity.Verdict). ``ranks``: the global
    ranks the verdict names (the first :data:`MAX_NOTE_RANKS`); ``world_size``: the replicas compared;
    ``odd``: a mismatch naming a strict minority of them (the odd replicas; with two, or no majority,
    nobody is odd); ``named_here``: the sender is one of the ranks named (its node's agent then knows one
    of its workers was); ``recurring``: the same NaN or spike was found at that step before a rollback
    (data, not hardware); ``samples``: the global sample indices of that step, when the sampler knows them
    (at most :data:`MAX_NOTE_SAMPLES`). ``rolled_back_to`` is not part of ``detail``: the datagram carries
    it (``rb``), the agent puts it here."""

    kind: str
    ranks: tuple[int, ...] = ()
    world_size: int = 0
    named_here: bool = False
    recurring: bool = False
    samples: tuple[int, ...] = ()
    rolled_back_to: int | None = None
    odd: bool = False

    def to_detail(self) -> str:
        """The compact JSON the datagram's ``detail`` holds."""
        record: dict[str, Any] = {
            "kind": self.kind,
            "ranks": list(self.ranks[:MAX_NOTE_RANKS]),
            "world": self.world_size,
        }
        for flag in ("named_here", "recurring", "odd"):
            if getattr(self, flag):
                record[flag] = True
        if self.samples:
            record["samples"] = list(self.samples[:MAX_NOTE_SAMPLES])
        return json.dumps(record, separators=(",", ":"))

    @classmethod
    def from_detail(cls, text: str) -> IntegrityNote:
        """Parse :meth:`to_detail`; raises :class:`MalformedDatagram` for anything else."""
        try:
            record = json.loads(text)
            return cls(
                kind=str(record["kind"])[:32],
                ranks=tuple(int(r) for r in record.get("ranks", ()))[:MAX_NOTE_RANKS],
                world_size=int(record.get("world", 0)),
                named_here=bool(record.get("named_here", False)),
                recurring=bool(record.get("recurring", False)),
                samples=tuple(int(i) for i in record.get("samples", ()))[:MAX_NOTE_SAMPLES],
                odd=bool(record.get("odd", False)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MalformedDatagram(f"not an integrity note: {e}") from None
