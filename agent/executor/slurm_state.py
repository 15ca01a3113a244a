"""SLURM's state of this node, read before each join: a node SLURM drains, or declared down or failed, is
refused admission (the agent leaves the job and exits 4, "node unhealthy").

Why the agent and not the master decides: the agent knows its SLURM node name for certain (slurmd sets
``SLURMD_NODENAME`` in every task's environment), while the master only sees node ids and addresses,
which need not map to SLURM's names (several slurmd per host, NAT, a ``--node-id`` of the user's); and
``sinfo`` is on every compute node, while the master may run outside the allocation. Each agent reads
only its own node (``sinfo -n NODE``), at most once per :data:`DEFAULT_TTL_S`, and only when it joins (once
per round), so a job of N nodes costs SLURM's controller N small queries per round, never per heartbeat.

The check fails open: without ``sinfo``, with a controller that does not answer within
:data:`SINFO_TIMEOUT_S`, or with a node ``sinfo`` does not list, the node is admitted and the caller warns.

:func:`parse_sinfo` and :func:`refusal` are pure (tested on recorded output); :class:`SlurmNodeState` runs
``sinfo`` and caches its answer. Standard library only.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elastic import errors

#: States (``sinfo``'s ``%T``, lower case, without its flag suffixes) whose node must not join a round:
#: drain requested (``drain``; ``draining`` while jobs still run there, ``drained`` once idle), ``down``,
#: ``fail`` (``failing`` while jobs still run there).
REFUSED_STATES = frozenset({"drain", "drained", "draining", "down", "fail", "failing"})
#: Suffixes ``sinfo`` appends to a state: ``*`` not responding, ``~`` powered off, ``#`` powering up,
#: ``!`` pending power down, ``%`` powering down, ``$`` maintenance reservation, ``@`` pending reboot,
#: ``^`` reboot issued, ``-`` planned by the backfill scheduler.
STATE_FLAGS = "*~#!%$@^-"
#: The node's SLURM state is read again after this long: the cache spares the controller when rounds follow
#: each other quickly (a crash loop), and is short enough that a drain ordered just before a failure's
#: round is seen by it.
DEFAULT_TTL_S = 2.0
#: A controller that does not answer within this long counts as no answer (the check fails open).
SINFO_TIMEOUT_S = 10.0


class SlurmUnavailableError(errors.ElasticRunError):
    """``sinfo`` could not say (missing, failed, timed out): the check fails open."""


def sinfo_argv(node: str) -> list[str]:
    """The command that lists ``node``'s state: ``sinfo -h -N -n NODE -o "%N %T"``."""
    return ["sinfo", "-h", "-N", "-n", node, "-o", "%N %T"]


def parse_sinfo(text: str) -> dict[str, str]:
    """``sinfo -h -N -o "%N %T"``'s output as ``{node: state}``. A node of several partitions is listed once
    per partition with the same state; blank or malformed lines are skipped."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states.setdefault(parts[0], parts[1])
    return states


def state_words(state: str) -> frozenset[str]:
    """The words of one ``%T`` state: ``MIXED+DRAIN`` (newer releases) gives {mixed, drain}, ``down*``
    {down}; lower case, flag suffixes removed."""
    return frozenset(word.rstrip(STATE_FLAGS) for word in state.lower().split("+") if word)


def refusal(states: Mapping[str, str], node: str) -> str | None:
    """Why ``node`` must not join, given the states :func:`parse_sinfo` read; None when it may (also when
    ``states`` does not list it: the caller decides what an unknown node means)."""
    state = states.get(node)
    if state is None or not state_words(state) & REFUSED_STATES:
        return None
    return f"SLURM reports node {node} {state} (sinfo)"


@dataclass(frozen=True)
class Verdict:
    """One check: ``refused`` says why the node must not join; ``warning``, why the check could not tell
    (the node is admitted: the check fails open). Both None: SLURM reports the node usable."""

    refused: str | None = None
    warning: str | None = None


def run_sinfo(argv: Sequence[str], timeout_s: float) -> str:
    """Run ``argv``; its stdout, or :class:`SlurmUnavailableError` saying why there is none."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise SlurmUnavailableError(f"{argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailableError(f"{argv[0]} did not answer within {timeout_s:g}s") from None
    except OSError as exc:
        raise SlurmUnavailableError(f"{argv[0]} could not run: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise SlurmUnavailableError(f"{argv[0]} exited {done.returncode}: {last}")
    return done.stdout


class SlurmNodeState:
    """This node's SLURM state, read on demand with a short cache; :meth:`check` before each join."""

    def __init__(
        self,
        node: str,
        run: Callable[[Sequence[str], float], str] = run_sinfo,
        clock: Callable[[], float] = time.monotonic,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        self.node = node
        self._run = run
        self._clock = clock
        self._ttl_s = ttl_s
        self._cached: tuple[float, Verdict] | None = None

    def check(self) -> Verdict:
        """The verdict of the last read when younger than the cache's time to live, else of a new one."""
        now = self._clock()
        if self._cached is not None and now - self._cached[0] < self._ttl_s:
            return self._cached[1]
        verdict = self._read()
        self._cached = (now, verdict)
        return verdict

    def _read(self) -> Verdict:
        try:
            states = parse_sinfo(self._run(sinfo_argv(self.node), SINFO_TIMEOUT_S))
        except SlurmUnavailableError as exc:
            return Verdict(warning=f"cannot read SLURM's state of node {self.node}: {exc}")
        if self.node not in states:
            return Verdict(warning=f"sinfo does not list node {self.node} (SLURMD_NODENAME)")
        return Verdict(refused=refusal(states, self.node))
