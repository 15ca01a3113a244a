"""The agent's event log (torchrun's ``--event-log-handler``): one record per lifecycle step.

``null`` drops every event; ``console`` prints each as one line to the agent's stderr,
``[elastic.events] {"name": "workers_started", "timestamp": ..., "node_id": ..., ...}`` (JSON, one line).
torchrun's handler registry is not used: any other name behaves as ``null`` (the CLI warns once).

Events: ``workers_started``, ``worker_failed``, ``workers_stopped``, ``restart`` (the master opened a new
round), ``signal_forwarded``, ``node_left`` (the agent stops on a signal), ``job_finished``,
``master_tls_failure`` (a master's certificate stopped verifying while the job runs:
agent.executor.tls_trouble) and ``master_tls_recovered``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

PREFIX = "[elastic.events] "


class EventLog:
    """Drops every event (``--event-log-handler null``)."""

    name = "null"

    def record(self, event: str, **fields: Any) -> None:
        """Log ``event`` with ``fields`` (JSON-serializable values)."""


class ConsoleEventLog(EventLog):
    """Prints each event as one JSON line to the agent's stderr (``--event-log-handler console``)."""

    name = "console"

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._lock = threading.Lock()

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps(
            {"name": event, "timestamp": round(time.time(), 3), "node_id": self._node_id, **fields},
            default=str,
            separators=(", ", ": "),
        )
        with self._lock:
            stream = sys.stderr
            if stream is None:
                return
            try:
                stream.write(f"{PREFIX}{line}\n")
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stderr: events are advisory
                return


def event_log_for(handler: str, node_id: str) -> EventLog:
    """The event log named by ``--event-log-handler``; unknown names get the null log."""
    return ConsoleEventLog(node_id) if handler == "console" else EventLog()
