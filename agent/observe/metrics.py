"""An agent's own Prometheus metrics: ``elastic-run --metrics-port PORT`` serves ``GET /metrics``.

What the master cannot see, or sees only through heartbeats: this node's workers by state, the worker
restarts this agent made, its step and step time, its workers' checkpoint saves (latency) and its
checkpoint persists (requests, latency, the queue, failures). Every family is named ``elastic_agent_*``
and carries the labels ``job_id`` and ``node`` (the ``--node-id``), so that one Prometheus job can scrape
every agent of many jobs. The figures
are read from the agent's state when Prometheus scrapes (a custom collector), never updated per step;
counters count what *this agent process* did and start from zero in a new one. The list with meanings:
docs/observability.md.

The listener follows the listener rules (``elastic.control.listener_rules.AGENT_METRICS``, checked by the CLI
before anything starts): it binds the agent's ``--local-addr`` (127.0.0.1 with ``--standalone``), needs
the job's token as a bearer token (``Authorization: Bearer``, which Prometheus sends with
``authorization: credentials_file``), and serves TLS with the agent's ``--tls-cert``/``--tls-key``.
prometheus_client's own HTTP server has no bearer authentication, hence the small stdlib server here.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from agent.observe.events import EventLog
from agent.observe.progress import sample_agent
from elastic.control.error_table import ErrorCode
from elastic.control.protocol import NodeState
from elastic.control.token_source import WatchedToken

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
#: Seconds a scrape connection may stay silent (a slow or stuck client does not hold a thread forever).
_IO_TIMEOUT_S = 10.0
_WORKER_STATES = ("running", "succeeded", "exited")


class CountingEventLog(EventLog):
    """The agent's lifecycle event log (agent.observe.events) with a count of each event kind, for the
    metrics:
    ``workers_started`` and ``worker_failed`` (by ``kind``: crash or hang) are what this agent did."""

    def __init__(self, inner: EventLog) -> None:
        self.inner = inner
        self.name = inner.name
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def record(self, event: str, **fields: Any) -> None:
        key = f"{event}:{fields.get('kind', '')}" if event == "worker_failed" else event
        with self._lock:
            self._counts[key] += 1
        self.inner.record(event, **fields)

    def count(self, key: str) -> int:
        """How often ``key`` was recorded (``worker_failed:crash`` for a failure kind)."""
        with self._lock:
            return self._counts[key]


class AgentCollector(Collector):
    """Builds every ``elastic_agent_*`` family from ``agent`` (an
    :class:`agent.executor.loop.ElasticAgent`)."""

    def __init__(self, agent: Any, events: CountingEventLog) -> None:
        self.agent, self.events = agent, events
        settings = agent.settings
        self.labels = [settings.job.job_id, settings.node_id]

    def _family(self, cls: type, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
        return cls(name, doc, labels=["job_id", "node", *extra])

    def _gauge(self, name: str, doc: str, value: float | None) -> Iterator[Metric]:
        if value is None:
            return  # unknown is an absent series, not a made-up zero
        family = self._family(GaugeMetricFamily, name, doc)
        family.add_metric(self.labels, value)
        yield family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = self._family(CounterMetricFamily, name, doc)
        family.add_metric(self.labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        agent, events = self.agent, self.events
        sample = sample_agent(agent)
        state = self._family(
            GaugeMetricFamily, "elastic_agent_node_state", "1 for the node's state.", ("state",)
        )
        for value in (s.value for s in NodeState):
            state.add_metric([*self.labels, value], 1.0 if value == sample.state else 0.0)
        yield state
        yield from self._gauge("elastic_agent_round", "The round this node last trained in.", sample.round)
        workers = self._family(
            GaugeMetricFamily,
            "elastic_agent_workers",
            "This node's workers of the last start, by state (exited: failed, or stopped by the agent).",
            ("state",),
        )
        codes = agent.group.exit_codes()
        counts = {
            "running": sum(c is None for c in codes),
            "succeeded": sum(c == 0 for c in codes),
            "exited": sum(c is not None and c != 0 for c in codes),
        }
        for name in _WORKER_STATES:
            workers.add_metric([*self.labels, name], counts[name])
        yield workers
        starts = events.count("workers_started")
        yield self._counter("elastic_agent_worker_starts", "Times this agent started its workers.", starts)
        yield self._counter(
            "elastic_agent_restarts",
            "Times this agent started its workers again (any cause: a failure, a new round).",
            max(0, starts - 1),
        )
        failures = self._family(
            CounterMetricFamily,
            "elastic_agent_worker_failures",
            "Worker failures this agent reported, by kind (crash or hang).",
            ("kind",),
        )
        for kind in ("crash", "hang"):
            failures.add_metric([*self.labels, kind], events.count(f"worker_failed:{kind}"))
        yield failures
        yield from self._gauge(
            "elastic_agent_job_restarts_charged",
            "Restarts charged to the job's budget, as of this node's last round.",
            sample.restarts,
        )
        yield from self._gauge(
            "elastic_agent_job_restarts_budget",
            "The job's restart budget (--max-restarts).",
            sample.max_restarts,
        )
        yield from self._gauge("elastic_agent_world_size", "Workers in this node's round.", sample.world_size)
        yield from self._gauge("elastic_agent_step", "The slowest local worker's step.", sample.step)
        yield from self._gauge(
            "elastic_agent_step_time_seconds",
            "The slowest local worker's median step time.",
            sample.step_time_s,
        )
        yield from self._gauge(
            "elastic_agent_checkpoint_step",
            "Newest step every local worker saved in memory.",
            sample.ckpt_step,
        )
        yield from self._gauge(
            "elastic_agent_persisted_step",
            "Newest step this node made durable on disk.",
            sample.persisted_step,
        )
        saves = agent.channel.save_latency.sample()
        save_latency = self._family(
            HistogramMetricFamily,
            "elastic_agent_checkpoint_save_seconds",
            "Time of the local workers' checkpoint saves, from elastic.save's call to the checkpoint being "
            "complete in memory (as the workers report them).",
        )
        save_latency.add_metric(self.labels, list(saves.buckets), saves.total)
        yield save_latency
        keeper = agent.keeper
        if keeper is not None:
            yield from self._keeper_metrics(keeper)

    def _keeper_metrics(self, keeper: Any) -> Iterator[Metric]:
        yield self._counter(
            "elastic_agent_persist_requests", "Checkpoints the workers asked to persist.", keeper.requests
        )
        yield self._counter("elastic_agent_persists", "Checkpoints made durable on disk.", keeper.persisted)
        yield self._counter(
            "elastic_agent_persists_skipped",
            "Persist requests replaced by a newer one, or not published (a newer round committed).",
            keeper.skipped + keeper.superseded,
        )
        yield self._counter("elastic_agent_persist_failures", "Persists that failed.", keeper.failures)
        outcomes = self._family(
            CounterMetricFamily,
            "elastic_agent_persist_outcomes",
            "Persist requests by outcome: persisted, skipped (replaced by a newer one before their persist "
            "began), superseded (not published: a newer round or submission of the job committed to the "
            "folder), failed.",
            ("outcome",),
        )
        for outcome, count in keeper.outcomes.items():
            outcomes.add_metric([*self.labels, outcome], count)
        yield outcomes
        count, total = keeper.persist_seconds
        latency = self._family(
            SummaryMetricFamily, "elastic_agent_persist_seconds", "Time of persists that ended without error."
        )
        latency.add_metric(self.labels, count, total)
        yield latency
        yield from self._gauge(
            "elastic_agent_persist_queue", "Persists waiting or running now.", keeper.queue_depth()
        )
        yield from self._gauge(
            "elastic_agent_persist_failing",
            "1 while the last persist failed or the running one makes no progress.",
            1.0 if keeper.persist_status()[1] else 0.0,
        )


class MetricsServer:
    """The agent's metrics listener: ``GET /metrics`` behind the job token, over TLS when given."""

    def __init__(
        self,
        registry: CollectorRegistry,
        token: str | WatchedToken,
        host: str,
        port: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``token``: the job token, or the watched ``--token-file`` (a rotated token is followed, the
        previous one accepted for one heartbeat timeout, as by the master)."""
        handler = _handler(
            registry, token if isinstance(token, WatchedToken) else WatchedToken(token, None, 0.0)
        )
        self._server = _Server((host, port), handler, tls)
        self.host, self.port = host, self._server.server_address[1]
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, tls: ssl.SSLContext | None) -> None:
        self.tls = tls
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        # In the connection's own thread, so that a slow TLS handshake never blocks the accept loop.
        request.settimeout(_IO_TIMEOUT_S)
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return  # a client that does not speak TLS, or gives up: nothing to serve
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001
        log.debug("metrics request from %s failed", client_address, exc_info=True)


def _error(code: ErrorCode, message: str) -> bytes:
    """The master's error body (elastic.control.protocol.ErrorBody) for this listener's refusals."""
    return json.dumps({"error": code, "message": message}).encode()


def _handler(registry: CollectorRegistry, token: WatchedToken) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "elastic-agent"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != METRICS_PATH:
                self._reply(404, _error(ErrorCode.NOT_FOUND, "this listener serves /metrics only"))
                return
            scheme, _, given = self.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.accepts(given.strip().encode()):
                body = _error(ErrorCode.UNAUTHORIZED, "missing or wrong bearer token; check --token-file")
                self._reply(401, body, {"www-authenticate": 'Bearer realm="elastic-run"'})
                return
            self._reply(200, generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

        def _reply(
            self,
            status: int,
            body: bytes,
            headers: dict[str, str] | None = None,
            content_type: str = "application/json",
        ) -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
            return  # Prometheus scrapes every few seconds: no line per request

    return Handler


def serve(agent: Any, host: str, port: int, tls: ssl.SSLContext | None = None) -> MetricsServer:
    """Count ``agent``'s lifecycle events and serve its metrics on ``host:port`` (0: a free port, logged).

    Raises:
        OSError: the port cannot be bound.
    """
    events = CountingEventLog(agent.event_log)
    agent.event_log = events  # the loop records through it from now on
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent, events))
    s = agent.settings
    token = WatchedToken(s.token, s.token_file, s.job.heartbeat_timeout_s)  # Prometheus re-reads it too
    server = MetricsServer(registry, token, host, port, tls).start()
    shown = f"[{server.host}]" if ":" in server.host else server.host
    log.info("metrics on %s:%d%s (%s)", shown, server.port, METRICS_PATH, server.scheme)
    return server
