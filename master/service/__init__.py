"""The master's service: it leads the job while elected and carries out what the job decides.

Promises: ``service.MasterService`` runs the tick, persists durable state before any reply that reveals
it, wakes long-polls and holds a standby's calls (``waiting``), steps down before draining, supervises its
background tasks (``supervision``) and serves the node API's operations (``api_ops``) the same way to the HTTP
routes and to the agent streams. It speaks no HTTP: the transport is :mod:`master.http`.

Raises: the job's request errors, unchanged, for the transport to map to statuses.

Owns: the master process's own health figures and the event log file.
"""
