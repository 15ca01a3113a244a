"""The job: rendezvous, liveness, restarts and outcome as a pure state machine.

Promises: :class:`~master.job.job.Job` takes requests and ``now`` and returns explicit effects (events to
log and publish, durable state to persist before any reply that reveals it: ``events.Effects``); it does no
I/O, reads no clock and starts no thread, so tests drive it with a fake clock. Its parts, each owning its own
state, are pure in the same way: ``rendezvous``, ``liveness`` (and node credentials), ``accounting`` (the
restart budget, goodput, recovery phases, lifetime totals), ``progress`` (node records, checkpoint steps),
``flapping``, ``stragglers``, ``node_check``. ``views`` reads the job for ``/v1/status`` and the replies;
``snapshot`` is the stored form's schema version. ``Job.version`` changes only through ``Job.record`` and
``Job.note_durable_change``.

Raises: the job's request errors (``errors``), each naming itself on the wire with a code;
``snapshot.UnreadableStateError`` for a stored state a master cannot continue from.

Owns: the job's durable state (membership, rounds, assignments, restart budget, outcome, credentials,
flap counters, exclusions) and its soft state rebuilt from heartbeats (steps, holders, stragglers).
"""
