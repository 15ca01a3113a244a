"""The job the API fuzzer (bench/fuzz_engine.py) runs its master with, and the names of the operations it
sends: what every part of the fuzzer agrees on."""

from __future__ import annotations

from hypothesis import strategies as st

#: The fuzzed job: nodes join 1 to 3 at a time, a round closes at once (no last call), nobody is declared
#: dead and the rendezvous never times out while the fuzz runs (those are time-driven transitions: one
#: that fell into a batch of refusals would look like a refusal that changed the state), and the restart
#: budget is never spent (failures keep reopening rounds instead of ending the job).
MIN_NODES, MAX_NODES = 1, 3
MASTER_ARGS = (
    "--nnodes", f"{MIN_NODES}:{MAX_NODES}",
    "--last-call", "0",
    "--heartbeat-interval", "1",
    "--heartbeat-timeout", "3600",
    "--join-timeout", "3600",
    "--max-restarts", "1000000",
)  # fmt: skip
#: Long-poll timeouts the fuzz asks for (seconds): small, so that the run is fast.
POLL_TIMEOUTS = (0.0, 0.001, 0.01, 0.05)
#: Host names a joining node gives (mostly).
VALID_HOSTS = st.sampled_from(["127.0.0.1", "10.0.0.7", "::1", "node-3.cluster.local", "gpu12"])

# Operations by their short name (see fuzz_target.operation_name): ``join`` for ``POST /v1/join``.
NODE_OPS = ("round", "heartbeat", "watch", "leave")
#: The node and script API: what the gate guards.
API_OPS = ("info", "join", *NODE_OPS, "status")
#: Operations whose request has a body or query parameters: what negative (schema-violating) data targets.
WITH_INPUT = ("join", *NODE_OPS)
METRICS = "GET /metrics"
UI_READS = ("GET /ui", "GET /ui/login", "GET /ui/status", "GET /ui/{name}")
UI_LOGIN = "POST /ui/login"
