"""The root of elastic-run's exceptions and its categories (standard library only).

Every exception that elastic-run raises on purpose derives from :class:`ElasticRunError`, through one
category, so callers handle categories and a CLI maps each to one line and an exit code::

    ElasticRunError
    ├── UsageError        a setting, a flag or a file the user gave is wrong (fix it, run again)
    ├── MasterError       talking to the job master failed (elastic.control.error_table)
    ├── RequestRefused    the master refuses a request; ``code`` names it on the wire (an ErrorCode)
    ├── ProtocolError     a peer broke the protocol (a malformed or unexpected message)
    ├── CheckpointError   a checkpoint cannot be saved, found or loaded (elastic.checkpoint.replicated)
    ├── StoreError        the master's state store failed (master.store.base)
    ├── WorkerError       launching, supervising or stopping worker processes failed
    └── ReplicationError  copying a checkpoint between agents failed (agent.checkpoints.replication)

A concrete class may also derive from the built-in it replaces (``ValueError``, ``RuntimeError``,
``TimeoutError``) so that existing ``except`` clauses keep working.
"""

from __future__ import annotations


class ElasticRunError(Exception):
    """Base of every error elastic-run raises on purpose."""


class UsageError(ElasticRunError):
    """A problem the user can fix in a setting, flag, file or environment variable."""


class MasterError(ElasticRunError):
    """Base of the errors talking to the job master."""


class RequestRefused(ElasticRunError):
    """The master refuses a request (raised on the master's side; its ``code`` is the reply's error code)."""


class ProtocolError(ElasticRunError):
    """A peer sent a message that breaks the protocol."""


class CheckpointError(ElasticRunError):
    """A checkpoint could not be saved, found or loaded."""


class StoreError(ElasticRunError):
    """The master's state store failed."""


class WorkerError(ElasticRunError):
    """Launching, supervising or stopping worker processes failed."""


class ReplicationError(ElasticRunError):
    """Copying a checkpoint between agents failed."""
