"""The job: rendezvous, liveness, restarts and outcome as a pure state machine.

Promises: :class:`~master.job.job.Job` takes requests and ``now`` and returns explicit effects (events to
log and publish, durable state to persist before any reply that reveals it); it does no I/O, reads no
clock and starts no thread, so tests drive it with a fake clock. Its parts (``rendezvous``, ``liveness``,
``flapping``, ``stragglers``, ``goodput``, ``recovery_phases``, ``node_check``, ``credentials``) are pure in
the same way; ``snapshot`` turns the durable state into plain data and back.

Raises: the job's request errors (``errors``), each naming itself on the wire with a code.

Owns: the job's durable state (membership, rounds, assignments, restart budget, outcome, credentials,
flap counters, exclusions) and its soft state rebuilt from heartbeats (steps, holders, stragglers).
"""
