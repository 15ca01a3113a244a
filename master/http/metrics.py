"""``GET /metrics``: the job's Prometheus metrics, built from the job's state at scrape time.

A custom collector reads the job (its durable totals, :class:`master.job.accounting.JobStats`, and its soft
state) when Prometheus scrapes; nothing is updated on the request hot path except the master's own
health counters (:class:`master.service.service.MasterHealth`). Every series carries ``job_id``.
Per-node series are capped at :data:`NODE_SERIES_CAP` nodes (the most interesting ones: the stalest for
heartbeat ages, the slowest for step times and straggler scores); job-wide aggregates cover every node, and
``elastic_node_series_omitted`` says how many nodes the cap left out. The list with meanings:
docs/observability.md.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from elastic.control.error_table import ErrorCode
from elastic.control.protocol import ErrorBody, NodeState
from master.http.conn_guard import mark_authenticated
from master.http.gatekeeper import bearer_token, check_token
from master.http.rate_limits import PeerFailureLimiter
from master.job.accounting import PHASES, RECOVERY_BUCKETS, Histogram
from master.job.events import CAUSES
from master.job.rendezvous import Phase
from master.job.views import job_goodput

METRICS_PATH = "/metrics"
#: Most nodes that get series of their own (per metric); the rest are in the aggregates.
NODE_SERIES_CAP = 256
_NODE_STATES = [s.value for s in NodeState] + ["excluded"]


class JobCollector(Collector):
    """Builds every ``elastic_*`` family from ``service`` (a
    :class:`master.service.service.MasterService`)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        job_id = service.settings.job.job_id
        now = service.clock()
        job = service.job if service.store.leading else None
        yield from _master_health(service, job_id, job is not None, now)
        if job is not None:
            yield from _job_metrics(job, job_id, now)
            yield from _node_metrics(job, job_id, now)


def _gauge(name: str, doc: str, value: float | None, job_id: str) -> Iterator[Metric]:
    if value is None:
        return  # an unknown value is an absent series, not a made-up zero
    family = GaugeMetricFamily(name, doc, labels=["job_id"])
    family.add_metric([job_id], value)
    yield family


def _counter(name: str, doc: str, value: float, job_id: str) -> Metric:
    family = CounterMetricFamily(name, doc, labels=["job_id"])
    family.add_metric([job_id], value)
    return family


def _counters(name: str, doc: str, label: str, values: Mapping[str, float], job_id: str) -> Metric:
    """One counter series per ``values`` key, labelled ``label`` (and the job's id)."""
    family = CounterMetricFamily(name, doc, labels=["job_id", label])
    for key, value in values.items():
        family.add_metric([job_id, key], value)
    return family


def _master_health(service: Any, job_id: str, leading: bool, now: float) -> Iterator[Metric]:
    health = service.health
    leader = GaugeMetricFamily(
        "elastic_master_leader",
        "1 while this master leads the job, 0 while it stands by.",
        labels=["job_id", "master_id"],
    )
    leader.add_metric([job_id, service.master_id], 1.0 if leading else 0.0)
    yield leader
    yield _counter(
        "elastic_master_heartbeats", "Heartbeats this master process received.", health.heartbeats, job_id
    )
    yield from _gauge(
        "elastic_master_heartbeats_per_second",
        "Heartbeats received per second over the last 10 s.",
        health.heartbeats_per_second(now),
        job_id,
    )
    yield from _gauge(
        "elastic_master_overloaded",
        "1 while this master sheds heartbeats it cannot serve in time (answered 429 busy), else 0.",
        1.0 if service.admission.overloaded else 0.0,
        job_id,
    )
    yield from _gauge(
        "elastic_master_long_polls_open",
        "Long-polls (round, watch) waiting now.",
        health.long_polls_open,
        job_id,
    )
    writes = SummaryMetricFamily(
        "elastic_master_store_write_seconds",
        "Latency of this master's writes of the job state.",
        labels=["job_id"],
    )
    writes.add_metric([job_id], health.store_writes, health.store_write_seconds)
    yield writes
    event_log = getattr(service, "event_log", None)
    if event_log is not None:
        yield _counter(
            "elastic_master_event_log_errors", "Failed writes of --event-log.", event_log.errors, job_id
        )
    yield from _connection_metrics(getattr(service, "connection_guard", None), job_id)


def _connection_metrics(guard: Any, job_id: str) -> Iterator[Metric]:
    """The connection guard's figures (master.http.conn_guard), when the master serves with one."""
    if guard is None:
        return
    yield from _gauge("elastic_master_connections", "Connections open now.", guard.open, job_id)
    yield from _gauge(
        "elastic_master_connections_max", "Connections served at most (--max-connections).", guard.cap, job_id
    )
    yield from _gauge(
        "elastic_master_connections_unauthenticated",
        "Connections open now that have presented no valid token yet.",
        guard.unauthenticated,
        job_id,
    )
    yield _counters(
        "elastic_master_connections_closed",
        "Connections the master closed to save descriptors: evicted (presented no valid token, at the "
        "cap), refused (503 busy at the cap or at --max-unauthenticated-per-address), timed_out (a request "
        "head or body not complete within --header-timeout).",
        "reason",
        guard.closed,
        job_id,
    )


def _job_metrics(job: Any, job_id: str, now: float) -> Iterator[Metric]:
    stats, settings = job.stats, job.settings
    figures = job_goodput(job, now)
    yield from _gauge(
        "elastic_goodput_ratio",
        "Productive training time (training less the steps trained again after a failure) / wall time "
        "since the job started.",
        figures.ratio,
        job_id,
    )
    yield _counters(
        "elastic_badput_seconds",
        "Wall time that was not productive training, by bucket: detection, rendezvous, re_form, restore, "
        "redone_steps, waiting_for_nodes, other (docs/observability.md); with the productive time they sum "
        "to the wall time.",
        "bucket",
        figures.badput_s,
        job_id,
    )
    yield _counter(
        "elastic_training_seconds",
        "Time the full round's workers were stepping.",
        job.goodput.training_time(now),
        job_id,
    )
    yield from _gauge(
        "elastic_job_start_time_seconds", "When the job started (Unix time).", job.goodput.started_at, job_id
    )
    yield _counter(
        "elastic_restarts",
        "Times a running world was stopped and restarted (any cause).",
        stats.restarts,
        job_id,
    )
    yield from _gauge(
        "elastic_restarts_charged",
        "Restarts charged against the budget (worker failures).",
        job.restart_count,
        job_id,
    )
    yield from _gauge(
        "elastic_restarts_budget", "The job's restart budget (--max-restarts).", settings.max_restarts, job_id
    )
    yield _counter("elastic_rounds", "Rendezvous rounds opened.", job.rdzv.round, job_id)
    yield _counter(
        "elastic_steps_lost",
        "Steps trained after the committed checkpoint of a world that broke.",
        stats.steps_lost,
        job_id,
    )
    yield _counter(
        "elastic_checkpoints_committed",
        "Times the committed step moved forward.",
        stats.checkpoints_committed,
        job_id,
    )
    yield _counter(
        "elastic_checkpoints_persisted",
        "Times the newest step made durable on disk moved forward.",
        stats.checkpoints_persisted,
        job_id,
    )
    yield _counter(
        "elastic_persist_failures",
        "Times a node's checkpoint persist started failing.",
        stats.persist_failures,
        job_id,
    )
    yield _counter(
        "elastic_checkpoint_corrupt",
        "Checkpoint copies a node found failing their digest check (at a restore or before a persist).",
        stats.checkpoint_corrupt,
        job_id,
    )
    yield _counters(
        "elastic_integrity_detections",
        "Faults the integrity guard detected (docs/integrity.md), by kind: non_finite, mismatch, spike.",
        "kind",
        {kind: stats.integrity.get(kind, 0) for kind in ("non_finite", "mismatch", "spike")},
        job_id,
    )
    yield _counter(
        "elastic_integrity_rollbacks",
        "In-process rollbacks to a verified step after an integrity detection.",
        stats.integrity.get("rolled_back", 0),
        job_id,
    )
    yield from _gauge(
        "elastic_integrity_suspect_nodes",
        "Nodes excluded now as suspect hardware (named the odd replica --suspect-count times).",
        sum(1 for e in job.flapping.excluded.values() if e.cause.startswith("suspect hardware")),
        job_id,
    )
    yield _counter(
        "elastic_leader_changes", "Times a master took over the job.", stats.leader_changes, job_id
    )
    kinds = ("worker_failure", "hang", "dead", "left", "suspect", "excluded", "straggler")
    yield _counters(
        "elastic_node_verdicts",
        "The master's verdicts about nodes, by kind.",
        "kind",
        {kind: stats.verdicts.get(kind, 0) for kind in kinds},
        job_id,
    )
    recovery = HistogramMetricFamily(
        "elastic_recovery_seconds", "Recovery time by phase and cause.", labels=["job_id", "phase", "cause"]
    )
    # Every (phase, cause) series from the start, zero until observed: a dashboard or a rule over a series
    # that does not exist yet shows "no data" instead of 0, and increases from absent are invisible.
    empty = Histogram()
    for phase, cause in itertools.product(PHASES, CAUSES):
        hist = stats.recovery.get((phase, cause), empty)
        buckets = [(_bound(b), float(c)) for b, c in zip(RECOVERY_BUCKETS, hist.buckets, strict=True)]
        buckets.append(("+Inf", float(hist.count)))
        recovery.add_metric([job_id, phase, str(cause)], buckets, hist.total)
    yield recovery
    current = job.rdzv.current
    active = job.rdzv.phase is Phase.ACTIVE and current is not None
    yield from _gauge(
        "elastic_world_size",
        "Workers in the running round (0 between rounds).",
        current.world_size if active else 0,
        job_id,
    )
    yield from _gauge("elastic_round", "The current round's number.", job.rdzv.round, job_id)
    yield from _gauge(
        "elastic_spare_nodes",
        "Hot spares: nodes beyond the running round's maximum, ready to take a lost member's node rank.",
        job.rdzv.spares_count,
        job_id,
    )
    yield from _gauge(
        "elastic_committed_step", "Newest checkpoint step every rank holds.", job.committed_step, job_id
    )
    persisted = max(
        (n.persisted_step for n in job.nodes.values() if n.persisted_step is not None), default=None
    )
    yield from _gauge(
        "elastic_persisted_step", "Newest step some node made durable on disk.", persisted, job_id
    )
    yield from _gauge(
        "elastic_persisted_checkpoint_age_seconds",
        "Seconds since the newest persisted step last moved forward.",
        now - job.checkpoints.persisted_at if job.checkpoints.persisted_at is not None else None,
        job_id,
    )


def _bound(value: float) -> str:
    return repr(float(value))


def _node_metrics(job: Any, job_id: str, now: float) -> Iterator[Metric]:
    nodes = list(job.nodes.values())
    by_state = GaugeMetricFamily("elastic_nodes", "Nodes by state.", labels=["job_id", "state"])
    counts = dict.fromkeys(_NODE_STATES, 0)
    for node in nodes:
        counts[node.state.value] += 1
    counts["excluded"] = len(job.excluded_nodes) + len(job.flapping.excluded)
    for state, count in counts.items():
        by_state.add_metric([job_id, state], count)
    yield by_state
    ages = {n.node_id: job.heartbeat_age(n.node_id, now) for n in nodes}
    ages = {k: v for k, v in ages.items() if v is not None}
    times = {n.node_id: n.step_time_s for n in nodes if n.step_time_s is not None}
    median = statistics.median(times.values()) if times else None
    scores = {k: v / median for k, v in times.items()} if median else {}
    omitted = max(len(ages), len(times)) - NODE_SERIES_CAP
    yield from _gauge(
        "elastic_node_series_omitted",
        "Nodes left out of per-node series by the cap.",
        max(0, omitted),
        job_id,
    )
    yield _per_node(
        "elastic_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.", ages, job_id
    )
    yield _per_node(
        "elastic_node_step_time_seconds", "The node's step time (its slowest worker's median).", times, job_id
    )
    yield _per_node(
        "elastic_node_straggler_score", "The node's step time / the median node's.", scores, job_id
    )
    flagged = GaugeMetricFamily("elastic_stragglers", "Nodes flagged as stragglers now.", labels=["job_id"])
    flagged.add_metric([job_id], len(job.stragglers.flagged))
    yield flagged
    for name, doc, values in (
        ("elastic_heartbeat_age_seconds", "Heartbeat ages over all nodes.", ages),
        ("elastic_step_time_seconds", "Step times over all nodes.", times),
    ):
        family = GaugeMetricFamily(name, doc, labels=["job_id", "stat"])
        if values:
            family.add_metric([job_id, "max"], max(values.values()))
            family.add_metric([job_id, "median"], statistics.median(values.values()))
        yield family


def _per_node(name: str, doc: str, values: dict[str, float], job_id: str) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["job_id", "node"])
    top = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))[:NODE_SERIES_CAP]  # the worst first
    for node_id, value in top:
        family.add_metric([job_id, node_id], value)
    return family


def add_metrics_route(app: FastAPI, service: Any, failures: PeerFailureLimiter) -> None:
    """Serve ``GET /metrics`` on ``app``, behind the job's token (``Authorization: Bearer``; no job
    header, which Prometheus cannot send), with the gate's count of wrong tokens per address
    (``failures``: 429 after as many as ``/v1`` allows)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(service))
    token = service.tokens  # a rotated --token-file is followed (elastic.control.token_source)

    @app.get(METRICS_PATH, response_class=Response, summary="Prometheus metrics (text format)")
    async def metrics(request: Request) -> Response:
        given = bearer_token(request.headers.get("authorization", "").encode())
        peer = request.client.host if request.client is not None else ""
        refusal = check_token(given, peer, token, failures)
        if refusal is not None:
            body = ErrorBody(error=refusal.code, message=refusal.message)
            return JSONResponse(
                status_code=refusal.status,
                content=body.model_dump(),
                headers={k.decode(): v.decode() for k, v in refusal.headers},
            )
        mark_authenticated(request.scope)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class MetricsPortOnly:
    """ASGI middleware: on the separate metrics listener (``--metrics-port``), serve ``/metrics`` only."""

    def __init__(self, app, port: int) -> None:
        self.app, self.port = app, port

    async def __call__(self, scope, receive, send):
        on_metrics_port = scope["type"] == "http" and (scope.get("server") or (None, None))[1] == self.port
        if on_metrics_port and scope["path"] != METRICS_PATH:
            body = ErrorBody(error=ErrorCode.NOT_FOUND, message="this listener serves /metrics only")
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 404, "headers": headers})
            await send({"type": "http.response.body", "body": body.model_dump_json().encode()})
            return
        await self.app(scope, receive, send)
