"""Human-readable rendering of :class:`elastic.control.protocol.JobStatus` as a table."""

from __future__ import annotations

from elastic.control.protocol import JobStatus, NodeStatus, describe_figures
from elastic.text import printable

COLUMNS = ("NODE", "RANK", "STATE", "HEARTBEAT AGE", "RESTARTS", "ROUND", "WORLD", "STEP TIME", "FLAGS")


def render_status(job: JobStatus) -> str:
    """The job headline, then one row per node, then the node-check figures, persist errors and each
    node's peer replication (replicated step and lag), then the round's waiting reason."""
    head = (
        f"job {job.job_id}: {job.phase}, round {job.round}, {job.nnodes} node(s), world size "
        f"{job.world_size}, restarts {job.restart_count}/{job.max_restarts}"
    )
    if job.committed_step is not None or job.persisted_step is not None:
        head += f"; checkpoint step {_or_dash(job.committed_step)}, on disk {_or_dash(job.persisted_step)}"
    if job.outcome is not None:
        head += f"; outcome: {job.outcome.summary} (exit {job.outcome.exit_code})"
    rows = [COLUMNS]
    for node in sorted(
        job.nodes, key=lambda n: (n.rank is None, n.rank if n.rank is not None else 0, n.node_id)
    ):
        age = "-" if node.heartbeat_age_s is None else f"{node.heartbeat_age_s:.1f}s"
        rank = "-" if node.rank is None else str(node.rank)
        world = str(job.world_size) if node.rank is not None else "-"
        rows.append(
            (
                node.node_id,
                rank,
                node.state,
                age,
                str(node.restarts),
                str(node.round),
                world,
                _step_time(node),
                _flags(node),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    checks = [
        f"node check {node.node_id}: {node.node_check_verdict}; {describe_figures(node.node_check)}"
        for node in sorted(job.nodes, key=lambda n: n.node_id)
        if node.node_check is not None and node.node_check_verdict
    ]
    persist = [
        f"persist error on node {node.node_id} (on disk: step {_or_dash(node.persisted_step)}): "
        f"{node.persist_error}"
        for node in sorted(job.nodes, key=lambda n: n.node_id)
        if node.persist_error
    ]
    replication = [_replication(node) for node in sorted(job.nodes, key=lambda n: n.node_id)]
    excluded = [
        _excluded(node)
        for node in sorted(job.nodes, key=lambda n: n.node_id)
        if node.readmit_in_s is not None
    ]
    reason = [f"round {job.round}: {job.waiting_reason}"] if job.waiting_reason else []
    # Summaries, errors and verdicts quote what nodes and workers sent: one line each, no terminal escapes.
    lines = [head, *lines, *checks, *persist, *filter(None, replication), *excluded, *reason]
    return "\n".join(printable(line) for line in lines)


def _replication(node: NodeStatus) -> str:
    """``replication on node N: step S replicated, lag L[, error: ...]``; '' where replication is off."""
    if node.replicated_step is None and node.replication_lag is None and not node.replication_error:
        return ""
    line = (
        f"replication on node {node.node_id}: step {_or_dash(node.replicated_step)} replicated, "
        f"lag {_or_dash(node.replication_lag)}"
    )
    return line + (f", error: {node.replication_error}" if node.replication_error else "")


def _excluded(node: NodeStatus) -> str:
    """``excluded node N: <reason> (in Ns; or: elastic-master readmit N)`` for a flapping exclusion."""
    return (
        f"excluded node {node.node_id}: {node.excluded_reason} (in {node.readmit_in_s:.0f}s; or: "
        f"elastic-master readmit {node.node_id})"
    )


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _step_time(node: NodeStatus) -> str:
    """Seconds per step; with the compute time (elastic.track_ddp) in parentheses when reported."""
    if node.step_time_s is None:
        return "-"
    text = f"{node.step_time_s:.3f}s"
    if node.compute_time_s is not None:
        text += f"({node.compute_time_s:.3f}s)"
    return text


def _flags(node: NodeStatus) -> str:
    """``straggler`` and the node check's verdict when it is not plain ok (comma-separated, no spaces)."""
    flags = []
    if node.straggler:
        flags.append("straggler")
    if node.readmit_in_s is not None:
        flags.append("flapping")
    verdict = node.node_check_verdict.split(":", 1)[0]
    if verdict and verdict != "ok":
        flags.append(f"check-{verdict}")
    return ",".join(flags)
