"""``elastic-master status --watch``: the live view's content (rich's recording console) and the real command
in a real terminal (tmux, read with capture-pane) against a real master: it shows the nodes, the round and
why it waits, refreshes when a node joins, and exits 0 on Ctrl-C with the shell's screen restored."""

from __future__ import annotations

import io
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from e2e import REPO, launch, wait_until  # noqa: F401 - launch is a fixture
from fake_nodes import start_master
from rich.console import Console
from tools import require_tool

from elastic.control.protocol import JobStatus, NodeStatus, StatusEvent
from master.cli.status import render_watch

HOSTILE = "[red]forged[/red] <script>x</script> \x1b[2J"


def node(node_id: str, rank: int | None, **fields) -> NodeStatus:
    base = dict(
        node_id=node_id,
        rank=rank,
        state="running",
        heartbeat_age_s=0.4,
        restarts=0,
        round=2,
        host="h",
        nproc=2,
    )
    return NodeStatus(**{**base, **fields})


def job_status(nodes: list[NodeStatus], **fields) -> JobStatus:
    base = dict(
        job_id="j1",
        master_id="m",
        phase="training",
        round=2,
        world_size=2 * len(nodes),
        nnodes=len(nodes),
        restart_count=1,
        max_restarts=3,
        nodes=nodes,
    )
    return JobStatus(**{**base, **fields})


def rendered(job: JobStatus, **options) -> str:
    console = Console(record=True, width=160, file=io.StringIO(), color_system=None)
    console.print(render_watch(job, **options))
    return console.export_text()


@pytest.mark.timeout(20)
def test_the_view_shows_nodes_round_reason_checkpoints_and_events():
    job = job_status(
        [
            node("a", 0, step=130, step_time_s=0.25),
            node("b", 1, step=128, straggler=True, persisted_step=100),
        ],
        committed_step=120,
        persisted_step=100,
        goodput_ratio=0.875,
        waiting_reason="closed: 2 nodes, world size 4 (every member came back)",
        events=[StatusEvent(seq=7, age_s=3.0, kind="round_closed", message="round 2 closed: 2 nodes")],
    )
    text = rendered(job, footer="updated now")
    assert "job j1  training, round 2, 2 node(s), world size 4, restarts 1/3, goodput 87.5%" in text
    assert "checkpoint: committed step 120 (8 steps behind), on disk step 100 (28 steps behind)" in text
    assert "round 2: closed: 2 nodes, world size 4 (every member came back)" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["a"], ["b"])}
    assert rows["a"][:6] == ["a", "0", "running", "0.4s", "130", "0.250s"]
    assert rows["b"][-1] == "straggler" and rows["b"][-2] == "100"
    assert "3s  round_closed  round 2 closed: 2 nodes" in text
    assert "updated now" in text


@pytest.mark.timeout(20)
def test_what_nodes_sent_is_shown_as_text_never_as_markup_or_terminal_escapes():
    job = job_status(
        [node("a", 0)],
        events=[StatusEvent(seq=1, age_s=0.0, kind="node_left", message=f"node a left ({HOSTILE})")],
        waiting_reason=f"finished: the job failed ({HOSTILE})",
    )
    text = rendered(job)
    assert "[red]forged[/red] <script>x</script> \\x1b[2J" in text
    assert "\x1b" not in text


@pytest.mark.timeout(20)
def test_a_large_job_shows_the_first_nodes_by_rank_and_counts_the_rest():
    nodes = [node(f"n{i:03d}", i) for i in range(40)] + [node("late", None, state="waiting")]
    text = rendered(job_status(nodes), max_nodes=10)
    assert "n009" in text and "n010" not in text
    assert "... and 31 more node(s): 30 running, 1 waiting" in text
    assert "restarts 1/3, goodput -" in text, "no goodput measured yet"


# -- the real command in a real terminal ----------------------------------------------------------------
class Tmux:
    """A tmux server of the test's own (its own socket), killed at the end."""

    def __init__(self, tmux: str) -> None:
        self.tmux, self.socket = tmux, f"elastic-test-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        argv = [self.tmux, "-L", self.socket, *args]
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "view")

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def updated(screen: str) -> str:
    """The footer's ``updated HH:MM:SS`` (one value per refresh with a 1 s interval); "" when absent."""
    match = re.search(r"updated (\d\d:\d\d:\d\d)", screen)
    return match.group(1) if match else ""


def _refreshes_until(tmux: Tmux, text: str, footers: list[str]) -> str | None:
    """One look at the screen: appends a new footer to ``footers``; the screen once ``text`` is on it."""
    screen = tmux.screen()
    if (footer := updated(screen)) != footers[-1]:
        footers.append(footer)
    return screen if text in screen else None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watch_in_a_terminal_refreshes_as_nodes_join_and_exits_0_on_ctrl_c(launch, tmp_path: Path):  # noqa: F811
    tmux = Tmux(require_tool("tmux"))
    master = start_master(launch, tmp_path, f"watch-{uuid.uuid4().hex[:6]}", "2:3")
    master.join("alpha", (2, 3))
    done = tmp_path / "exit-code"
    view = shlex.join(
        [
            sys.executable,
            "-m",
            "master",
            "status",
            "--master",
            master.address,
            "--job-id",
            master.job_id,
            "--token-file",
            str(tmp_path / "token"),
            "--watch",
            "--interval",
            "1",  # the footer's "updated HH:MM:SS" then tells one refresh from the next
        ]
    )
    shell = f"cd {shlex.quote(str(REPO))} && printf 'shell before\\n' && {view}; echo $? > {done}; sleep 60"
    try:
        tmux("new-session", "-d", "-s", "view", "-x", "160", "-y", "45", shell)
        first = wait_until(lambda: "alpha" in (s := tmux.screen()) and s, 30, "the view with node alpha")
        assert "round 1: waiting for 1 more node (1 joined, 2 needed) until" in first
        assert "beta" not in first
        master.join("beta", (2, 3))
        # Count the refreshes (distinct footers) after the join until beta shows: at most 2.
        footers = [updated(tmux.screen())]
        seen = wait_until(lambda: _refreshes_until(tmux, "beta", footers), 30, "beta", interval=0.05)
        assert len(footers) - 1 <= 2, f"beta appeared only after {len(footers) - 1} refreshes: {footers}"
        assert "beta" in seen
        later = wait_until(lambda: "beta" in (s := tmux.screen()) and "closed" in s and s, 30, "the close")
        assert "round 1: closed: 2 nodes, world size 4" in later
        assert "training, round 1, 2 node(s), world size 4" in later
        assert re.search(r"restarts 0/\d+,\s+goodput \d+\.\d%", later), "the headline shows the goodput"
        tmux("send-keys", "-t", "view", "C-c")
        wait_until(done.exists, 20, "the view to exit after Ctrl-C")
        assert done.read_text().strip() == "0"
        restored = tmux.screen()
        assert "shell before" in restored, "the shell's screen is back (the view used the alternate screen)"
        assert "alpha" not in restored
    finally:
        tmux.close()


@pytest.mark.timeout(60)
def test_watch_outside_a_terminal_is_a_usage_error(launch, tmp_path: Path):  # noqa: F811
    master = start_master(launch, tmp_path, f"watch-{uuid.uuid4().hex[:6]}", "1:2")
    argv = [
        sys.executable, "-m", "master", "status", "--master", master.address, "--job-id", master.job_id,
        "--token-file", str(tmp_path / "token"), "--watch",
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[-1].startswith("elastic-master: error: --watch needs a terminal")
    )
