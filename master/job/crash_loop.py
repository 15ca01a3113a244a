"""Crash loops: when a worker failure is deterministic, so that restarting cannot help and the job stops
at once (exit 3, :attr:`elastic.exit_codes.ExitCode.FAILED_FOR_GOOD`) instead of spending its restart budget.

Pure: no clock (the job passes ``now``), no I/O. Before the restart budget charges a round's first failure
report, the job asks :meth:`CrashLoop.judge_report` (the budget's ``crash_loop``), and
stops the job when the answer is a :class:`Stop`. The series kept here is durable with the budget (the job's
snapshot, key ``crash_loop``), so a master failover, or an agent, pod or job resubmitted with the same job id
and incarnation, continues it; a refunded failure (it followed a node's loss) leaves it.

**A failure's signature** (:class:`Signature`, :func:`signature_of`) is where in its round it came (the
agent's :class:`~elastic.control.protocol.FailurePhase`: ``startup`` before any local worker reported a
step, ``first_step`` when the failed worker had not but another had, ``steady`` once the failed worker had)
and what it was: a hang; else the exception line (type and message, normalised by :func:`normalise`:
addresses, ports, PIDs, temporary paths and every number that may vary between two runs of the same fault
are replaced), with the signal when a signal killed the worker (``signal SIGSEGV: ...``); else the signal
alone (``signal SIGKILL``); else the exit code. Which rank failed is not part of it: a deterministic fault
fails on the same rank or on every rank, and which of them reports first varies.

**The rules**, in order (:func:`decide`):

1. *A known start-up error* (the agent recognised it: ``import``, ``syntax``, ``missing_file``,
   ``shm_too_small``; agent.workers.errors_file.known_error) stops the job at its first occurrence, when it
   came at start-up or in the first step, or (``shm_too_small``) before any checkpoint was committed: the
   checkpoint does not fit ``/dev/shm`` at its first save. ``--no-stop-on-startup-error`` turns this off
   (files that appear late, such as network mounts at pod start).
2. *A repeat*: the same signature as the previous failure, at most ``--crash-loop-window`` seconds after
   it, with no progress in between (the committed checkpoint step did not advance, and the failed worker
   reached no later step than the previous failure's), is the second failure of a crash loop: the job
   stops. A failure while another member's connection to the master is closed is never a repeat: it
   probably followed that node's loss, which refunds it (a membership change). ``--crash-loop-window 0``
   turns this rule off. A worker killed by a signal sent from outside (SIGKILL, SIGTERM...: an operator, a
   scheduler, a chaos test, the OOM killer) is never a repeat, however often it comes: nothing says the
   next start would fail too (repeated OOM kills spend the budget and end the job with exit 1).
3. Anything else is charged against ``--max-restarts`` as usual, and starts a new series when it differs
   from the previous failure or followed progress. A single failure never stops the job by rule 2, so a
   single transient kill (SIGKILL, OOM) is charged once, as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.control.job_settings import JobSettings
from elastic.control.protocol import FailurePhase, Outcome, WorkerFailure
from elastic.exit_codes import ExitCode

if TYPE_CHECKING:
    from master.job.progress import NodeInfo

#: Failures of the same signature that make a crash loop (rule 2).
REPEATS = 2
#: Signals a worker raises itself when it crashes (as agent.workers.types.CRASH_SIGNALS): a repeat of one is
#: a crash loop; any other signal came from outside and says nothing about the worker's code.
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "SIGSYS", "SIGTRAP"})
#: Known start-up errors deterministic at start-up and in the first step (rule 1).
STARTUP_PHASES = frozenset({FailurePhase.STARTUP.value, FailurePhase.FIRST_STEP.value})
#: Longest normalised message kept in a signature (a traceback's first line is far shorter).
MAX_WHAT_CHARS = 500

# What varies between two runs of the same fault, replaced in that order (normalise()).
_NORMALISE = (
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x#"),  # addresses
    (re.compile(r"\[[0-9a-fA-F:]*:[0-9a-fA-F:.]*\](?::\d+)?"), "<addr>"),  # [::1]:29500
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<addr>"),  # 10.0.0.7:29500
    # temporary paths: /tmp/..., /var/tmp/..., /dev/shm/..., /run/user/N/...; Python's mkdtemp names
    (re.compile(r"(?:/tmp|/var/tmp|/dev/shm|/run/user)(?:/[^\s'\",:)\]]*)?"), "<tmp>"),
    (re.compile(r"\btmp[A-Za-z0-9_]{6,}\b"), "<tmp>"),
    (re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?"), "#"),  # numbers: PIDs, ports, steps, sizes, times
)
_SPACES = re.compile(r"\s+")


def normalise(message: str) -> str:
    """``message`` with what varies between two runs of the same fault replaced (addresses, ports, PIDs,
    temporary paths, numbers) and its whitespace collapsed: ``"ValueError: bad batch at step #"``."""
    text = message.strip()
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    return _SPACES.sub(" ", text)[:MAX_WHAT_CHARS]


@dataclass(frozen=True)
class Signature:
    """Where in its round a failure came (``phase``; empty from an agent that does not say), what it was."""

    phase: str
    what: str

    @property
    def where(self) -> str:
        """The phase in words: ``at start-up``, ``in the first step``, ``after steps``."""
        return _WHERE.get(self.phase, "in an unknown phase")

    def describe(self) -> str:
        return f"{self.what} ({self.where})"

    @property
    def from_outside(self) -> bool:
        """Whether the worker was killed by a signal sent from outside (SIGKILL, SIGTERM...: an operator, a
        scheduler, a chaos test, the OOM killer), with no error of its own: never a crash loop (rule 2)."""
        if not self.what.startswith("signal ") or ":" in self.what:
            return False
        return self.what.removeprefix("signal ") not in CRASH_SIGNALS


_WHERE = {
    FailurePhase.STARTUP.value: "at start-up",
    FailurePhase.FIRST_STEP.value: "in the first step",
    FailurePhase.STEADY.value: "after steps",
}


def signature_of(failure: WorkerFailure) -> Signature:
    """The signature of a reported failure (module docstring)."""
    phase = failure.phase.value if failure.phase is not None else ""
    if failure.kind == "hang":
        return Signature(phase, "hang")  # its message says for how long: it varies
    message = normalise(failure.message) if failure.message else ""
    if message:
        what = f"signal {failure.signal}: {message}" if failure.signal else message
    elif failure.signal:
        what = f"signal {failure.signal}"
    else:
        what = f"exit code {failure.exit_code}"
    return Signature(phase, what)


@dataclass(frozen=True)
class FailureSeen:
    """A failure as the policy judges it: its signature, when it came, the job's progress at that moment
    (the committed checkpoint step, and the newest step the failed worker had reported in its round), and
    the known start-up error the agent recognised, if any."""

    signature: Signature
    at: float
    round: int
    committed_step: int | None = None
    reached_step: int | None = None
    known_error: str = ""


@dataclass(frozen=True)
class Series:
    """Consecutive failures of one signature with no progress in between (durable)."""

    signature: Signature
    count: int
    first_at: float
    last_at: float
    round: int  # of the last failure
    committed_step: int | None
    reached_step: int | None

    def record(self) -> dict[str, Any]:
        return {
            "phase": self.signature.phase,
            "what": self.signature.what,
            "count": self.count,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "round": self.round,
            "committed_step": self.committed_step,
            "reached_step": self.reached_step,
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Series:
        return cls(
            Signature(str(data["phase"]), str(data["what"])),
            int(data["count"]),
            float(data["first_at"]),
            float(data["last_at"]),
            int(data["round"]),
            data.get("committed_step"),
            data.get("reached_step"),
        )


@dataclass(frozen=True)
class CrashLoopPolicy:
    """The settings of the rules (module docstring)."""

    stop_on_startup_error: bool = True
    window_s: float = 600.0  # 0: rule 2 is off

    @classmethod
    def of(cls, settings: JobSettings) -> CrashLoopPolicy:
        return cls(settings.stop_on_startup_error, settings.crash_loop_window_s)


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded: whether the job stops, why (one sentence for the summary, the event
    and the status; empty when it does not stop), and the series after this failure."""

    stop: bool
    reason: str
    series: Series


def _advanced(now: int | None, before: int | None) -> bool:
    return now is not None and (before is None or now > before)


def decide(
    policy: CrashLoopPolicy, previous: Series | None, seen: FailureSeen, peer_suspected: bool = False
) -> Decision:
    """Judge one failure after the series ``previous`` (None: none, or it was forgotten); pure."""
    sig = seen.signature
    progressed = previous is not None and (
        _advanced(seen.committed_step, previous.committed_step)
        or _advanced(seen.reached_step, previous.reached_step)
    )
    repeat = (
        previous is not None
        and previous.signature == sig
        and seen.at - previous.last_at <= policy.window_s
        and not progressed
    )
    if repeat and previous is not None:
        reached = [s for s in (seen.reached_step, previous.reached_step) if s is not None]
        series = Series(
            sig,
            previous.count + 1,
            previous.first_at,
            seen.at,
            seen.round,
            previous.committed_step,
            max(reached, default=None),
        )
    else:
        series = Series(sig, 1, seen.at, seen.at, seen.round, seen.committed_step, seen.reached_step)
    known = seen.known_error
    if (
        known
        and policy.stop_on_startup_error
        and (sig.phase in STARTUP_PHASES or (known == "shm_too_small" and seen.committed_step is None))
    ):
        return Decision(
            True,
            f"a known start-up error ({known.replace('_', ' ')}) {sig.where}: restarting cannot fix it "
            "(stopped at its first occurrence; --no-stop-on-startup-error charges it as a restart)",
            series,
        )
    stoppable = not sig.from_outside  # a kill from outside is charged, however often it comes
    if policy.window_s > 0 and repeat and stoppable and not peer_suspected and series.count >= REPEATS:
        return Decision(
            True,
            f"the same failure {series.count} times in {seen.at - series.first_at:.0f}s "
            f"({sig.describe()}) with no step committed or reached in between "
            f"(--crash-loop-window {policy.window_s:g}s)",
            series,
        )
    return Decision(False, "", series)


@dataclass(frozen=True)
class Stop:
    """A failure judged deterministic: the job's outcome (exit 3) and the fields of its ``crash_loop``
    event (:meth:`master.job.job.Job.record`: round, node, data)."""

    outcome: Outcome
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


class CrashLoop:
    """The job's crash-loop state: the current series and, once it stopped the job, why (durable)."""

    def __init__(self, policy: CrashLoopPolicy) -> None:
        self.policy = policy
        self.series: Series | None = None
        #: Why the job was stopped as deterministic (the status field ``crash_loop``); empty until then.
        self.verdict = ""

    def judge(self, seen: FailureSeen, peer_suspected: bool = False) -> Decision:
        """Judge the first failure of a round (:func:`decide`) and keep the series it continues."""
        decision = decide(self.policy, self.series, seen, peer_suspected)
        self.series = decision.series
        return decision

    def judge_report(
        self,
        reporter: NodeInfo,
        failure: WorkerFailure | None,
        cause: str,
        round_number: int,
        now: float,
        committed_step: int | None,
        peers: Iterable[NodeInfo],
        suspected: Callable[[str], bool],
    ) -> Stop | None:
        """Judge a round's first failure report (``reporter``'s; ``cause``: its description,
        master.job.progress) given the job's committed step and the round's other members ``peers``
        (whether their connection to the master closed: ``suspected``); a :class:`Stop` when restarting
        cannot help."""
        if failure is None:  # an agent that said nothing about it: nothing to compare
            return None
        # The failed worker's own newest step: how far its peers got by then is a matter of timing.
        seen = FailureSeen(
            signature_of(failure), now, round_number, committed_step, failure.step, failure.known_error
        )
        suspect = any(suspected(peer.node_id) for peer in peers)
        decision = self.judge(seen, peer_suspected=suspect)
        if not decision.stop:
            return None
        self.verdict = f"deterministic (crash loop): {cause}; {decision.reason}"
        data = {
            "phase": seen.signature.phase,
            "signature": seen.signature.what,
            "count": decision.series.count,
        }
        if seen.known_error:
            data["known_error"] = seen.known_error
        summary = f"{self.verdict}; fix it and start the job again"
        return Stop(
            Outcome(succeeded=False, exit_code=ExitCode.FAILED_FOR_GOOD, summary=summary),
            f"round {round_number}: {self.verdict}",
            {"round": round_number, "node": reporter.node_id, "data": data},
        )

    def forget(self, round_number: int) -> None:
        """The failure of ``round_number`` followed a node's loss (its restart was refunded): it is no
        failure of the job's own, so it neither continues a series nor starts one."""
        if self.series is not None and self.series.round == round_number:
            self.series = None

    def snapshot(self) -> dict[str, Any]:
        """The durable part, under the job snapshot's key ``crash_loop``."""
        return {"series": None if self.series is None else self.series.record(), "verdict": self.verdict}

    def restore(self, data: dict[str, Any] | None) -> None:
        """From :meth:`snapshot`; absent (an older master's state): no series."""
        if not data:
            return
        self.series = Series.from_record(data["series"]) if data.get("series") else None
        self.verdict = str(data.get("verdict") or "")
