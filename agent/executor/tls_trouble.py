"""TLS trouble with the master while a job runs: the agent's memory of why no master answers.

At the first contact a certificate that does not verify is a configuration error, and the agent stops at once
(agent.cli.startup). Later it may be a failover under way (a standby with a wrong certificate took over, or
a master was restarted with a certificate from another CA) that an operator can fix while the workers train
on. So the agent loop's threads retry as for an unreachable master, until ``--master-timeout``, and report
each failure here: the TLS reason is logged at once, one line, when it starts or changes (also as a
``master_tls_failure`` event), a master that answers again is logged once, and the agent's final error
names the TLS reason instead of a generic "no master answered".
"""

from __future__ import annotations

import logging
import threading

from agent.observe.events import EventLog
from elastic.control.error_table import MasterTLSError

log = logging.getLogger(__name__)


class TLSTrouble:
    """The TLS failure that keeps the agent from its masters, if any; thread-safe (every loop thread
    reports its calls' failures)."""

    def __init__(self, event_log: EventLog) -> None:
        self._event_log = event_log
        self._lock = threading.Lock()
        self._reason: str | None = None

    @property
    def reason(self) -> str | None:
        """The TLS failure of the last failed call since a master last answered, or None."""
        return self._reason

    def failed(self, exc: BaseException) -> None:
        """A call to the masters failed with ``exc``: a TLS failure is logged when it is new."""
        if not isinstance(exc, MasterTLSError):
            return  # the master is away: the TLS reason, if any, stays the last word until one answers
        reason = str(exc)
        with self._lock:
            if reason == self._reason:
                return
            self._reason = reason
        log.warning(
            "TLS with the master failed: %s; the workers keep training, retrying until --master-timeout",
            reason,
        )
        self._event_log.record("master_tls_failure", reason=reason)

    def answered(self) -> None:
        """A master answered (over verified TLS, when the agent speaks TLS): the trouble is over."""
        with self._lock:
            reason, self._reason = self._reason, None
        if reason is not None:
            log.info("a master answers over verified TLS again; the job goes on")
            self._event_log.record("master_tls_recovered")

    def lost(self, silent_s: float, timeout_s: float, addresses: list[str]) -> str:
        """The agent's final error when no master answered for ``silent_s`` (past ``timeout_s``)."""
        waited = f"for {silent_s:.0f}s (--master-timeout {timeout_s:g}s)"
        if self._reason is not None:
            return f"{self._reason}; no job master answered over verified TLS {waited}"
        return f"no job master answered {waited} at {', '.join(addresses)}"
