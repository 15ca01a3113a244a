"""The job's snapshot as the store keeps it (:func:`snapshot_of`): its schema version, and one-line
descriptions of a stored state a master cannot read.

:func:`snapshot_of` stamps :data:`SCHEMA_VERSION` under :data:`SCHEMA_KEY`;
:meth:`master.job.job.Job.restore` refuses a version it does not know. A state written before versioning
(no key) has the layout of version 1. A newer master reads every older version it lists in
:data:`READABLE_VERSIONS`; an older master refuses a newer version (a rolling upgrade upgrades the
standbys first, then restarts the leader: docs/operations.md).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from elastic import errors

#: A :class:`master.job.job.Job` (not imported: the job imports this module).
Job = Any

#: The version this master writes.
SCHEMA_VERSION = 1
#: The versions this master reads (absent = 1: written before the key existed, same layout).
READABLE_VERSIONS = frozenset({1})
SCHEMA_KEY = "schema"


class UnreadableStateError(errors.StoreError, ValueError):
    """The stored state is not one this master can continue from; the message says why in one line."""


def check_version(data: object) -> None:
    """Raise :class:`UnreadableStateError` unless ``data`` is a mapping of a readable schema version."""
    if not isinstance(data, dict):
        raise UnreadableStateError(f"it is a JSON {type(data).__name__}, not an object")
    version = data.get(SCHEMA_KEY, 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise UnreadableStateError(f"its schema version {version!r} is not an integer")
    if version not in READABLE_VERSIONS:
        newest = max(READABLE_VERSIONS)
        hint = "run a newer elastic-master" if version > newest else "it is too old for this elastic-master"
        raise UnreadableStateError(
            f"its schema version {version} is not one this master reads ({newest} and older): {hint}"
        )


def describe(exc: Exception) -> str:
    """What a failed :meth:`master.job.job.Job.restore` met, in one line."""
    if isinstance(exc, KeyError):
        return f"the field {exc.args[0]!r} is missing"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, UnreadableStateError) else f"{type(exc).__name__}: {text}"


def snapshot_of(job: Job) -> dict[str, Any]:
    """Everything a master taking over needs, as plain JSON-able data (:meth:`master.job.job.Job.restore`
    reads it back)."""
    return {
        SCHEMA_KEY: SCHEMA_VERSION,
        "job_id": job.settings.job_id,
        "master_id": job.master_id,
        "rendezvous": job.rdzv.snapshot(),
        "nodes": [
            {
                "node_id": n.node_id,
                "host": n.host,
                "nproc": n.nproc,
                "failures": n.failures,
                "secret_hash": n.secret_hash,
                "default_id": n.default_id,
            }
            for n in job.nodes.values()
        ],
        **job.budget.snapshot(),  # restart_count, round_failed
        "round_term": job.round_term,
        "incarnation": job.incarnation,
        # Durable: the nodes' replication keys derive from it (master.job.views.replication_fields).
        "replication_secret": job.replication_secret,
        # Soft (not a reason to write), but kept when written: a new leader's first assignments
        # then name a step to restore before heartbeats have reported one.
        "committed_step": job.committed_step,
        "outcome": None if job.outcome is None else job.outcome.model_dump(),
        "succeeded": sorted(job.succeeded),
        "event_count": job.event_count,
        "events": [e.record() for e in list(job.events)[-100:]],
        "node_check": job.node_check.snapshot(),
        "flapping": job.flapping.snapshot(),
        "silent_incident": sorted(job.suspicion.incident),
        "goodput": job.goodput.snapshot(),
        "stats": job.stats.snapshot(),
        "recovery": job.recovery.snapshot(),
    }


def new_incarnation() -> str:
    """A new job incarnation (``Assignment.job_incarnation``, stored with the job): the wall-clock time in
    fixed-width hex, so that a later submission compares greater as a string, then a random part (two
    masters started in the same nanosecond still differ)."""
    return f"{time.time_ns():016x}-{secrets.token_hex(4)}"
