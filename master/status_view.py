"""Human-readable rendering of :class:`elastic.protocol.JobStatus` as a table."""

from __future__ import annotations

from elastic.protocol import JobStatus

COLUMNS = ("NODE", "RANK", "STATE", "HEARTBEAT AGE", "RESTARTS", "ROUND", "WORLD")


def render_status(job: JobStatus) -> str:
    """The job headline, then one row per node."""
    head = (
        f"job {job.job_id}: {job.phase}, round {job.round}, {job.nnodes} node(s), world size "
        f"{job.world_size}, restarts {job.restart_count}/{job.max_restarts}"
    )
    if job.outcome is not None:
        head += f"; outcome: {job.outcome.summary} (exit {job.outcome.exit_code})"
    rows = [COLUMNS]
    for node in sorted(
        job.nodes, key=lambda n: (n.rank is None, n.rank if n.rank is not None else 0, n.node_id)
    ):
        age = "-" if node.heartbeat_age_s is None else f"{node.heartbeat_age_s:.1f}s"
        rank = "-" if node.rank is None else str(node.rank)
        world = str(job.world_size) if node.rank is not None else "-"
        rows.append((node.node_id, rank, node.state, age, str(node.restarts), str(node.round), world))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join([head, *lines])
