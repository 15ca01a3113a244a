"""Safety of the flash-checkpoint path around the agent's keeper (agent/checkpoints/keeper.py and its
helpers): temp files of dead writers are swept, persists into a shared folder are fenced by round, persist
failures and hangs are visible and bounded, and a restarted agent takes over its dead predecessor's
shared-memory folder by its lock.

Real files, locks and processes: tests/support/keeper_proc.py is another agent's keeper in a process of its
own.
Roots are temp folders; every process a test starts is ended by its pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from e2e import REPO, SUPPORT, base_env, wait_until

from agent.checkpoints.fence import FENCE_FILE, Decision, decide
from agent.checkpoints.keeper import CheckpointKeeper
from agent.checkpoints.shm_folder import OWNER_FILE, KeeperError
from elastic.checkpoint import layout
from elastic.control.job_settings import JobSettings
from elastic.control.protocol import HeartbeatRequest, JoinRequest, NodeState
from master.cli.status import render_status
from master.job.job import Job

KEEPER_PROC = SUPPORT / "keeper_proc.py"


def worker_save(folder: Path, step: int, payload: bytes | None = None) -> Path:
    """What elastic.save does in a worker: write under a temp name, rename (the commit)."""
    path = folder / layout.step_file_name(step)
    layout.atomic_write(path, lambda f: f.write(payload or f"state of step {step}".encode()), durable=False)
    return path


def temp_files(folder: Path) -> list[Path]:
    return (
        sorted(p for p in folder.iterdir() if p.name.endswith(layout.TMP_SUFFIX)) if folder.is_dir() else []
    )


def latest(folder: Path) -> str:
    return (folder / layout.LATEST_MARKER).read_text()


def steps(folder: Path) -> list[int]:
    return [step for step, _ in layout.checkpoint_files(folder)]


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(done.stdout)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


class KeeperProc:
    """tests/support/keeper_proc.py: a keeper in another process (see its doc for the arguments)."""

    def __init__(self, *args: object) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, str(KEEPER_PROC), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=base_env(),
            cwd=REPO,
        )
        self.pid = self.popen.pid
        self.folder = Path(self.expect("folder ").removeprefix("folder "))

    def expect(self, prefix: str) -> str:
        """The next output line, which must start with ``prefix`` (the test's timeout bounds the read)."""
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().rstrip("\n")
        assert line.startswith(prefix), f"expected {prefix!r} from keeper_proc, got {line!r}"
        return line

    def finish(self) -> None:
        """Stop its keeper (the stop finishes its persist) and wait for its exit."""
        assert self.popen.stdin is not None
        self.popen.stdin.write("stop\n")
        self.popen.stdin.flush()
        self.expect("stopped")
        assert self.popen.wait(30) == 0

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def keeper_procs() -> Iterator[list[KeeperProc]]:
    procs: list[KeeperProc] = []
    yield procs
    for proc in procs:
        proc.kill()


# == 1. temp files of dead writers ========================================================================
@pytest.mark.timeout(30)
def test_temp_names_carry_host_and_pid_and_only_dead_writers_leftovers_are_removed(tmp_path: Path) -> None:
    final = tmp_path / layout.step_file_name(3)
    ours = layout.temp_path(final)
    assert layout.parse_temp_name(ours.name) == layout.TempName(final.name, layout.host_tag(), os.getpid())
    host, gone = layout.host_tag(), dead_pid()

    def make(name: str, size: int, mtime: float | None = None) -> Path:
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return path

    live = make(ours.name, 100)  # this live process writes it
    dead = make(f".{final.name}.{host}.{gone}.00ab.tmp", 5000)  # its writer exited
    reused = make(f".{final.name}.{host}.{os.getpid()}.00cd.tmp", 7000, mtime=1e6)  # pid since reused
    other_host = make(f".{final.name}.another-host.{gone}.00ef.tmp", 10)  # its pid means nothing here
    legacy = make(f".{final.name}.{gone}.0a0b.tmp", 20)  # an older name, without a host
    user = make(".notes.tmp", 30)

    assert layout.remove_temp_files(tmp_path) == 12000
    assert not dead.exists() and not reused.exists()
    assert temp_files(tmp_path) == sorted([live, other_host, legacy, user])
    # Where every writer is known to have stopped (the agent's memory after a stop), names need not tell.
    assert layout.remove_temp_files(tmp_path, writers_stopped=True) == 60
    assert temp_files(tmp_path) == [live], "a live writer's temp file is never removed"


@pytest.mark.timeout(60)
def test_the_keeper_sweeps_the_temp_file_of_a_writer_killed_mid_save_and_counts_its_bytes(root: Path) -> None:
    keeper = CheckpointKeeper("job1", "node-a", root=root).start()
    # A writer stopped for good in the middle of a save: no cleanup of its own.
    code = (
        "import sys, threading; from pathlib import Path; from elastic.checkpoint import layout\n"
        "def write(f):\n"
        "    f.write(bytes(8 << 20)); f.flush(); print('writing', flush=True); threading.Event().wait()\n"
        "layout.atomic_write(Path(sys.argv[1]) / layout.step_file_name(7), write, durable=False)\n"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", code, str(keeper.folder)], stdout=subprocess.PIPE, text=True, env=base_env()
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
        assert len(temp_files(keeper.folder)) == 1
        assert keeper.sweep() == 0, "its writer lives: a save in progress"
        writer.kill()
        writer.wait()
        assert keeper.sweep() == 8 << 20
        assert temp_files(keeper.folder) == []
        assert keeper.swept_bytes == 8 << 20
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
        if writer.stdout is not None:
            writer.stdout.close()
        keeper.stop()


# == 2. the newest save reaches the disk =================================================================
@pytest.mark.timeout(30)
def test_stop_persists_the_newest_memory_checkpoint_newer_than_the_last_request(
    root: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    keeper = CheckpointKeeper("job1", "node-a", ckpt_dir=ckpt, root=root).start()
    keeper.on_checkpoint(0, 4, str(worker_save(keeper.folder, 4)), round_number=1)
    assert keeper.wait_idle(10)
    worker_save(keeper.folder, 5)  # saves whose requests never came (persist=False, or lost)
    worker_save(keeper.folder, 6)
    keeper.stop()
    assert latest(ckpt) == "step_0000000006.pt"
    assert steps(ckpt) == [6, 4]

    # A node that was never asked to persist (not the node of group rank 0) writes nothing at its stop.
    other = CheckpointKeeper("job1", "node-b", ckpt_dir=tmp_path / "other", root=root).start()
    worker_save(other.folder, 9)
    other.stop()
    assert not (tmp_path / "other").exists()


@pytest.mark.timeout(30)
def test_the_stop_persists_a_save_of_a_later_submission_under_that_submission(
    root: Path, tmp_path: Path
) -> None:
    """A node asked for persists in the job's first incarnation; after a master restart without a durable
    store (a new incarnation) it is no longer the persisting node, and its workers only report their saves.
    Its stop persists its newest save as a save of the new incarnation: the fence takes it beside the other
    node's commit of the same step, instead of refusing it as the old submission's (and failing the job)."""
    ckpt = tmp_path / "ckpt"
    keeper = CheckpointKeeper("job1", "node-b", ckpt_dir=ckpt, root=root).start()
    keeper.incarnation = "inc-1"
    keeper.on_checkpoint(0, 4, str(worker_save(keeper.folder, 4)), round_number=1)
    assert keeper.wait_idle(10)
    keeper.incarnation = "inc-2"  # the restarted master's first round
    worker_save(keeper.folder, 6)
    keeper.on_checkpoint(0, 6, "", round_number=1)  # reported, no persist asked: another node persists
    other = CheckpointKeeper("job1", "node-a", ckpt_dir=ckpt, root=root).start()
    other.incarnation = "inc-2"
    other.on_checkpoint(0, 6, str(worker_save(other.folder, 6)), round_number=1)
    assert other.wait_idle(10)
    other.stop()
    keeper.stop()
    assert latest(ckpt) == "step_0000000006.pt"
    assert keeper.unpersisted == [] and keeper.superseded == 0, keeper.unpersisted


# == 3. persists fenced by round ==========================================================================
def test_commit_decisions_never_move_latest_backwards_and_drop_superseded_rounds() -> None:
    assert decide(2, 8, None, None) == Decision(True, True, "newest")
    assert decide(2, 9, 2, 8).move_latest
    assert decide(2, 8, 2, 8).move_latest, "the same step saved again in the round"
    older_round = decide(1, 9, 2, 8)
    assert (older_round.publish, older_round.move_latest) == (False, False)
    assert "superseded by round 2" in older_round.why
    for round_ in (2, 3):  # an older step is published, but latest stays, even for a newer round
        assert (decide(round_, 5, 2, 8).publish, decide(round_, 5, 2, 8).move_latest) == (True, False)
    assert decide(None, 9, 2, 8).move_latest, "a worker without a round: the step rule alone"


@pytest.mark.timeout(90)
def test_two_keepers_on_one_folder_never_move_latest_backwards_nor_delete_the_newer_files(
    root: Path, tmp_path: Path, keeper_procs: list[KeeperProc]
) -> None:
    ckpt = tmp_path / "ckpt"
    # The node that held rank 0 in round 1 is slow: its persist of step 5 pauses mid-copy.
    slow = KeeperProc(root, "job1", "node-old", "--ckpt-dir", ckpt, "--step", 5, "--round", 1, "--delay", 600)
    keeper_procs.append(slow)
    slow.expect("requested")
    torn = wait_until(lambda: temp_files(ckpt), 30, "the slow persist to be in progress")
    # Rank 0 moved: the node of round 2 persists steps 6, 7 and 8 meanwhile.
    new = CheckpointKeeper("job1", "node-new", ckpt_dir=ckpt, keep=2, root=root).start()
    try:
        for step in (6, 7, 8):
            new.on_checkpoint(0, step, str(worker_save(new.folder, step)), round_number=2)
            assert new.wait_idle(10)
        assert temp_files(ckpt) == torn, "the other writer's persist in progress was left alone"
        assert latest(ckpt) == "step_0000000008.pt"

        slow.finish()  # its stop ends the pause: the persist of step 5 (round 1) completes now

        assert latest(ckpt) == "step_0000000008.pt", "latest never moves backwards"
        assert steps(ckpt) == [8, 7], "no newer file deleted; the superseded round's step 5 not published"
        assert temp_files(ckpt) == []
        assert json.loads((ckpt / FENCE_FILE).read_text()) == {"round": 2}

        # An older step of the newest round (e.g. a slow persist of this node) lands, latest stays.
        new.on_checkpoint(0, 7, str(worker_save(new.folder, 7, b"step 7 again")), round_number=2)
        assert new.wait_idle(10)
        assert latest(ckpt) == "step_0000000008.pt"
        assert steps(ckpt) == [8, 7] and (ckpt / "step_0000000007.pt").read_bytes() == b"step 7 again"
        assert new.persist_status() == (7, "")
    finally:
        new.stop()


# == 4. persist failures are visible, a hung persist does not block the stop ================================
@pytest.mark.timeout(30)
def test_a_failed_persist_is_reported_until_a_persist_succeeds(root: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where the checkpoint folder's parent should be")
    keeper = CheckpointKeeper("job1", "node-a", ckpt_dir=blocked / "ckpt", root=root).start()
    try:
        keeper.on_checkpoint(0, 1, str(worker_save(keeper.folder, 1)))
        assert keeper.wait_idle(10)
        persisted, error = keeper.persist_status()
        assert persisted is None
        assert error.startswith(f"step 1 to {blocked / 'ckpt'}: ") and "Not a directory" in error
        assert keeper.failures == 1

        keeper.on_checkpoint(0, 2, str(worker_save(keeper.folder, 2)), str(tmp_path / "fine"))
        assert keeper.wait_idle(10)
        assert keeper.persist_status() == (2, ""), "a success clears the error"
    finally:
        keeper.stop()


@pytest.mark.timeout(30)
def test_a_hung_persist_is_reported_and_the_stop_gives_it_up_within_its_bound(
    root: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    keeper = CheckpointKeeper("job1", "node-a", ckpt_dir=ckpt, root=root, stall_s=1.0).start()
    # A checkpoint whose read never returns, as on a hung NFS mount: a FIFO that nobody writes.
    fifo = keeper.folder / layout.step_file_name(1)
    os.mkfifo(fifo)
    handle = tmp_path / "fifo"
    os.link(fifo, handle)  # to release the thread once the test is done with it
    thread = keeper._thread
    assert thread is not None
    keeper.on_checkpoint(0, 1, str(fifo), round_number=1)

    error = wait_until(lambda: keeper.persist_status()[1], 10, "the stalled persist to be reported")
    assert error.startswith(f"step 1 to {ckpt}: no progress for "), error
    started = time.monotonic()
    keeper.stop()
    took = time.monotonic() - started
    assert took < keeper.stall_s + 2.0, f"the stop took {took:.1f}s"
    assert "gave up at stop (no progress for" in keeper.persist_error
    assert not keeper.folder.exists()

    # The abandoned persist, once its read returns, publishes nothing.
    os.close(os.open(handle, os.O_WRONLY | os.O_NONBLOCK))
    thread.join(10)
    assert not thread.is_alive()
    assert not ckpt.exists() or [p.name for p in ckpt.iterdir() if p.name != FENCE_FILE] == []


def heartbeat(node: str, round_: int, **fields: object) -> HeartbeatRequest:
    return HeartbeatRequest(node_id=node, round=round_, state=NodeState.RUNNING, **fields)


@pytest.mark.timeout(10)
def test_the_master_shows_persisted_step_and_persist_errors_with_one_event_per_change() -> None:
    settings = JobSettings(job_id="j", min_nodes=1, max_nodes=1, last_call_s=0.0)
    job = Job(settings, now=0.0)
    join = JoinRequest(node_id="a", host="h", nproc=1, store_port=2000, min_nodes=1, max_nodes=1)
    secret = job.join(join, 0.0).node_secret
    job.tick(0.0)
    round_ = job.rdzv.round
    job.heartbeat(heartbeat("a", round_, persisted_step=4), 1.0, secret)
    status = job.status(1.0)
    node = status.nodes[0]
    assert (status.persisted_step, node.persisted_step, node.persist_error) == (4, 4, "")

    failing = "step 5 to /ckpt: [Errno 28] No space left on device"
    for now, step in ((2.0, 5), (3.0, 6)):  # fails at every heartbeat: one event, not one per step
        error = failing.replace("5", str(step))
        job.heartbeat(heartbeat("a", round_, persisted_step=4, persist_error=error), now, secret)
    assert [e.message for e in job.events if e.kind == "persist_failed"] == [
        "node a: checkpoint persist failed: " + failing
    ]
    table = render_status(job.status(3.0))
    assert "; checkpoint step -, on disk 4" in table.splitlines()[0]
    assert (
        "persist error on node a (on disk: step 4): step 6 to /ckpt: [Errno 28] No space left on device"
    ) in table.splitlines()
    assert "persist" not in json.dumps(job.snapshot()["nodes"]), "soft state: never stored"

    job.heartbeat(heartbeat("a", round_, persisted_step=7), 4.0, secret)
    assert [e.kind for e in job.events][-1] == "persist_recovered"
    assert job.status(4.0).nodes[0].persist_error == ""


# == 5. taking over the memory folder of a dead predecessor =================================================
@pytest.mark.timeout(60)
def test_a_zombie_predecessor_that_held_the_lock_is_taken_over(
    root: Path, keeper_procs: list[KeeperProc]
) -> None:
    # The previous agent of this node: it held the folder's lock and ended without a stop; its parent
    # (this test) does not reap it, so its pid stays in use by a zombie.
    zombie = KeeperProc(root, "job1", "node-a", "--exit-without-stop")
    keeper_procs.append(zombie)
    wait_until(
        lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 30, "the predecessor to exit"
    )
    worker_save(zombie.folder, 3)  # the memory it left
    # A dead agent of another node id: its lock is free, whatever pid its record names (a live one).
    other = root / "elastic-job1-node-b"
    other.mkdir()
    (other / ".lock").touch()
    record = {"job": "job1", "node": "node-b", "host": "h", "pid": os.getpid(), "started": 0.0}
    (other / OWNER_FILE).write_text(json.dumps(record))

    with CheckpointKeeper("job1", "node-a", root=root) as keeper:
        assert keeper.folder == zombie.folder
        assert layout.checkpoint_files(keeper.folder) == []
        assert json.loads((keeper.folder / OWNER_FILE).read_text())["pid"] == os.getpid()
        assert psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, "still unreaped"
        assert not other.exists(), "a dead agent's folder of another node is removed too"


@pytest.mark.timeout(60)
def test_a_predecessor_whose_recorded_pid_means_nothing_here_is_taken_over(
    root: Path, keeper_procs: list[KeeperProc]
) -> None:
    previous = KeeperProc(root, "job1", "node-a", "--exit-without-stop")
    keeper_procs.append(previous)
    assert previous.popen.wait(30) == 0
    # Another PID namespace: its recorded pid names some live, unrelated process here (this test).
    record = json.loads((previous.folder / OWNER_FILE).read_text())
    record.update(pid=os.getpid(), started=psutil.Process().create_time())
    (previous.folder / OWNER_FILE).write_text(json.dumps(record))
    worker_save(previous.folder, 3)

    with CheckpointKeeper("job1", "node-a", root=root) as keeper:
        assert layout.checkpoint_files(keeper.folder) == []


@pytest.mark.timeout(60)
def test_a_live_holder_is_refused_with_a_one_line_error(root: Path, keeper_procs: list[KeeperProc]) -> None:
    holder = KeeperProc(root, "job1", "node-a")
    keeper_procs.append(holder)
    worker_save(holder.folder, 3)

    with pytest.raises(KeeperError) as refused:
        CheckpointKeeper("job1", "node-a", root=root).start()

    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"another agent (pid {holder.pid} on ") and "job job1 node node-a" in message
    assert message.endswith("give each agent its own --node-id")
    assert layout.checkpoint_files(holder.folder) != [], "the live agent's memory is untouched"
    holder.finish()
    assert not holder.folder.exists()


@pytest.mark.timeout(30)
def test_two_keepers_of_one_node_in_one_process_cannot_both_hold_the_folder(root: Path) -> None:
    first = CheckpointKeeper("job1", "node-a", root=root).start()
    try:
        results: list[BaseException] = []

        def second() -> None:
            try:
                CheckpointKeeper("job1", "node-a", root=root).start()
            except KeeperError as exc:
                results.append(exc)

        thread = threading.Thread(target=second)
        thread.start()
        thread.join(10)
        assert len(results) == 1, "the lock is per open file, so even this process is refused"
    finally:
        first.stop()
