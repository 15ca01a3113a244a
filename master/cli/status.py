"""``elastic-master status``'s views of :class:`elastic.control.protocol.JobStatus`: a table
(:func:`render_status`) and, with ``--watch``, a live terminal view (rich).

:func:`render_watch` turns one status into a renderable (a pure function, tested with rich's recording
console); :func:`watch` fetches and redraws it every interval until Ctrl-C, on the terminal's alternate
screen so that the shell's screen comes back as it was. Every value that a node or a worker sent is
passed as plain :class:`rich.text.Text` (never as markup) after :func:`elastic.text.printable`, so that
it can neither restyle the view nor move the cursor.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

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
    lost = [f"goodput {_goodput_text(job)}; {text}"] if (text := _badput_text(job)) else []
    # Summaries, errors and verdicts quote what nodes and workers sent: one line each, no terminal escapes.
    lines = [head, *lines, *checks, *persist, *filter(None, replication), *excluded, *reason, *lost]
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
    if node.excluded_reason.startswith("suspect hardware"):  # master.job.flapping.FlapCounter.note_suspect
        flags.append("suspect-hardware")
    elif node.excluded_reason.startswith("straggler "):  # --straggler-policy (master.job.stragglers)
        flags.append("straggler-evicted")
    elif node.readmit_in_s is not None:
        flags.append("flapping")
    verdict = node.node_check_verdict.split(":", 1)[0]
    if verdict and verdict != "ok":
        flags.append(f"check-{verdict}")
    return ",".join(flags)


#: Events the view lists (the newest).
EVENTS_SHOWN = 8
#: Screen lines the view keeps for everything but the node rows (headline, reason, events, borders).
_OTHER_LINES = EVENTS_SHOWN + 14


def _text(value: object, style: str = "") -> Text:
    return Text(printable(str(value)), style=style)


def _or_dash(value: object | None) -> str:
    return "-" if value is None else str(value)


def _node_order(node: NodeStatus) -> tuple:
    return (node.rank is None, node.rank if node.rank is not None else 0, node.node_id)


def _job_step(job: JobStatus) -> int | None:
    """The step every ranked node has reached (the slowest one's), if they report steps."""
    steps = [n.step for n in job.nodes if n.rank is not None and n.step is not None]
    return min(steps) if steps else None


def _checkpoint_text(job: JobStatus) -> str:
    """``committed step 120 (30 steps behind), on disk step 110 (40 steps behind)``."""
    step = _job_step(job)

    def age(value: int | None) -> str:
        if value is None:
            return "-"
        behind = f" ({step - value} steps behind)" if step is not None and step >= value else ""
        return f"step {value}{behind}"

    return f"committed {age(job.committed_step)}, on disk {age(job.persisted_step)}"


def _goodput_text(job: JobStatus) -> str:
    ratio = getattr(job, "goodput_ratio", None)  # served by masters that measure goodput
    return "-" if ratio is None else f"{ratio:.1%}"


def _badput_text(job: JobStatus) -> str:
    """Where the time that was not productive went, largest bucket first ('' when none yet)."""
    buckets = sorted(((v, k) for k, v in getattr(job, "badput_s", {}).items() if v >= 0.05), reverse=True)
    if not buckets:
        return ""
    return "lost: " + ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}s" for seconds, name in buckets)


def _state_style(node: NodeStatus) -> str:
    if node.state in ("failed", "excluded"):
        return "red"
    if node.straggler or node.persist_error:
        return "yellow"
    return "green" if node.state in ("running", "succeeded") else ""


def render_watch(job: JobStatus, *, max_nodes: int = 50, footer: str = "") -> RenderableType:
    """The headline (phase, round, world, restarts, goodput, checkpoints), the round's waiting reason,
    the nodes (at most ``max_nodes`` rows, by rank), the recent events and ``footer``."""
    head = Text()
    head.append(f"job {printable(job.job_id)}", style="bold")
    head.append(
        f"  {job.phase}, round {job.round}, {job.nnodes} node(s), world size {job.world_size}, "
        f"restarts {job.restart_count}/{job.max_restarts}, goodput {_goodput_text(job)}"
    )
    lines: list[RenderableType] = [head, _text(f"checkpoint: {_checkpoint_text(job)}")]
    if badput := _badput_text(job):
        lines.append(_text(badput))
    if job.outcome is not None:
        style = "green" if job.outcome.succeeded else "red"
        lines.append(_text(f"outcome: {job.outcome.summary} (exit {job.outcome.exit_code})", style))
    if job.waiting_reason:
        lines.append(_text(f"round {job.round}: {job.waiting_reason}", "cyan"))

    nodes = Table(expand=False, box=None, header_style="bold", pad_edge=False)
    for column in (
        "NODE",
        "RANK",
        "STATE",
        "HEARTBEAT AGE",
        "STEP",
        "STEP TIME",
        "RESTARTS",
        "ON DISK",
        "FLAGS",
    ):
        nodes.add_column(column, no_wrap=True)
    ordered = sorted(job.nodes, key=_node_order)
    for node in ordered[:max_nodes]:
        age = "-" if node.heartbeat_age_s is None else f"{node.heartbeat_age_s:.1f}s"
        step_time = "-" if node.step_time_s is None else f"{node.step_time_s:.3f}s"
        flags = ",".join(
            flag
            for flag, on in (("straggler", node.straggler), ("persist-failing", bool(node.persist_error)))
            if on
        )
        nodes.add_row(
            _text(node.node_id),
            _text(_or_dash(node.rank)),
            _text(node.state, _state_style(node)),
            _text(age),
            _text(_or_dash(node.step)),
            _text(step_time),
            _text(node.restarts),
            _text(_or_dash(node.persisted_step)),
            _text(flags, "yellow"),
        )
    lines.append(nodes)
    if len(ordered) > max_nodes:
        rest = ordered[max_nodes:]
        states: dict[str, int] = {}
        for node in rest:
            states[node.state] = states.get(node.state, 0) + 1
        summary = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
        lines.append(_text(f"... and {len(rest)} more node(s): {summary}", "dim"))

    events = Table(expand=False, box=None, header_style="bold", pad_edge=False, title_justify="left")
    events.add_column("AGO", no_wrap=True, justify="right")
    events.add_column("EVENT", no_wrap=True)
    events.add_column("MESSAGE", overflow="fold")
    for event in job.events[-EVENTS_SHOWN:]:
        events.add_row(_text(f"{event.age_s:.0f}s"), _text(event.kind), _text(event.message))
    lines += [Text(""), _text("recent events", "bold"), events]
    if footer:
        lines += [Text(""), _text(footer, "dim")]
    return Group(*lines)


def watch(
    fetch: Callable[[], JobStatus],
    interval: float,
    console: Console | None = None,
    errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Redraw the view of ``fetch()`` every ``interval`` seconds until Ctrl-C (then 0). A fetch that raises
    one of ``errors`` keeps the last view, with the error in the footer, and is retried."""
    console = console or Console()
    last: JobStatus | None = None
    with Live(console=console, screen=True, auto_refresh=False, transient=True) as live:
        try:
            while True:
                problem = ""
                try:
                    last = fetch()
                except errors as exc:
                    problem = f"; cannot reach the master ({exc}), retrying"
                when = time.strftime("%H:%M:%S")
                footer = f"updated {when}, every {interval:g}s{problem}; Ctrl-C to quit"
                max_nodes = max(console.size.height - _OTHER_LINES, 5)
                view = render_watch(last, max_nodes=max_nodes, footer=footer) if last else _text(footer)
                live.update(view, refresh=True)
                time.sleep(interval)  # the refresh period itself, not a wait for some event
        except KeyboardInterrupt:
            return 0
