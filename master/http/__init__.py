"""The master's transports: the FastAPI app, the agent streams, metrics and the status page.

Promises: every listener follows the rules of :mod:`elastic.control.listener_rules`; ``gatekeeper``
checks token, job id, body size and rate limits before a request reaches the service; ``conn_guard``
bounds connections (first-request timer, idle eviction, a cap); ``openapi`` documents every status an
operation can return; ``wire_compat`` answers clients of an older protocol revision.

Raises: nothing to its callers: every error becomes a documented HTTP status with an error body.

Owns: the mapping of job errors to HTTP statuses (``errors``) and the status page's assets.
"""
