"""Tests of the agent's local worker group, with real worker processes.

Every process a test starts is recorded and SIGKILLed by PID at teardown if it is still alive, so a failing
test leaves nothing behind.
"""

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import psutil
import pytest
from e2e import gone, wait_until
from worker_exits import Exits

from agent.workers._reaper_proc import start_ticks
from agent.workers.errors_file import message_from_stderr, read_error_file
from agent.workers.group import WorkerExit, WorkerGroup, WorkerGroupError, WorkerSpec
from agent.workers.launchers import WorkerProcess
from agent.workers.reaper import Reaper
from agent.workers.tree import ProcessRef, RunningWorker, end_workers

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1"}


# -- helpers ----------------------------------------------------------------------------------------------
def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def spec_for(argv: list[str], nprocs: int = 1, **kwargs: object) -> WorkerSpec:
    envs = [{**BASE_ENV, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nprocs)]
    return WorkerSpec(argv=argv, envs=envs, global_ranks=list(range(nprocs)), **kwargs)  # type: ignore[arg-type]


def read_pid(path: Path) -> int:
    wait_until(lambda: path.exists() and path.read_text().strip().isdigit(), 10, f"pid file {path}")
    return int(path.read_text())


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """PIDs to SIGKILL at teardown if a test did not see them end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def group(leftovers: list[int]) -> Iterator[WorkerGroup]:
    g = WorkerGroup()
    yield g
    leftovers.extend(g.pids)
    g.close()


# -- output and exits ---------------------------------------------------------------------------------------
WORKER_PRINTS_AND_EXITS = """
    import os, sys, time
    rank = os.environ["RANK"]
    print(f"hello from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    sys.stdout.flush(); sys.stderr.flush()
    with open(os.environ["STAMP_DIR"] + f"/exit{rank}", "w") as f:
        f.write(repr(time.monotonic()))
    os._exit(int(os.environ["CODE"]))
"""


@pytest.mark.timeout(30)
def test_two_workers_output_is_prefixed_and_exits_are_seen_at_once(
    group: WorkerGroup, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    envs = [
        {**BASE_ENV, "RANK": "0", "CODE": "0", "STAMP_DIR": str(tmp_path)},
        {**BASE_ENV, "RANK": "1", "CODE": "3", "STAMP_DIR": str(tmp_path)},
    ]
    reported = Exits()
    group.start(WorkerSpec(argv=python(WORKER_PRINTS_AND_EXITS), envs=envs, global_ranks=[0, 1]), reported)
    assert len(group.pids) == 2

    exits: dict[int, WorkerExit] = {}
    latencies: list[float] = []
    for _ in range(2):
        exit_ = reported.next()
        seen_at = time.monotonic()
        exits[exit_.global_rank] = exit_
        latencies.append(seen_at - float((tmp_path / f"exit{exit_.global_rank}").read_text()))

    assert exits[0].returncode == 0 and exits[0].succeeded and exits[0].signal_name is None
    assert exits[1].returncode == 3 and not exits[1].succeeded
    assert [exits[r].pid for r in (0, 1)] == group.pids
    assert max(latencies) < 0.5, f"exits seen {latencies}s after the workers exited"
    assert group.running() == []
    assert reported.empty()  # each exit reported once

    group.stop()
    out, err = capfd.readouterr()
    assert "[rank0]:hello from 0\n" in out and "[rank1]:hello from 1\n" in out
    assert "[rank0]:warning from 0\n" in err and "[rank1]:warning from 1\n" in err
    assert "warning" not in out and "hello" not in err


@pytest.mark.timeout(30)
def test_exits_caused_by_stop_are_not_reported(group: WorkerGroup) -> None:
    reported = Exits()
    group.start(spec_for(python("import time; time.sleep(300)"), nprocs=2), reported)
    assert group.running() == [0, 1]
    pids = group.pids
    group.stop(grace_s=5)
    assert all(gone(pid) for pid in pids)
    assert reported.empty()  # stop() caused these exits


@pytest.mark.timeout(30)
def test_log_dir_gets_raw_output_and_the_console_survives_binary(
    group: WorkerGroup, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = """
        import sys
        print("to stdout")
        sys.stdout.flush()
        sys.stdout.buffer.write(b"\\xff\\xfe binary\\n")
        sys.stdout.buffer.write(b"no newline at the end")
        sys.stdout.buffer.flush()
        print("to stderr", file=sys.stderr)
    """
    exits = Exits()
    group.start(spec_for(python(code), log_dir=tmp_path / "logs", attempt="round3"), exits)
    assert exits.next().returncode == 0
    group.stop()

    folder = tmp_path / "logs" / "round3" / "rank0"
    assert (folder / "stdout.log").read_bytes() == b"to stdout\n\xff\xfe binary\nno newline at the end"
    assert (folder / "stderr.log").read_bytes() == b"to stderr\n"
    out, err = capfd.readouterr()
    assert "[rank0]:to stdout\n[rank0]:\ufffd\ufffd binary\n[rank0]:no newline at the end\n" in out
    assert "[rank0]:to stderr\n" in err


@pytest.mark.timeout(30)
def test_worker_sees_exactly_the_given_environment(
    group: WorkerGroup, capfd: pytest.CaptureFixture[str]
) -> None:
    env = {"PATH": "/usr/bin:/bin", "FOO": "bar baz", "ELASTIC_NODE_ID": "n1", "RANK": "5"}
    env_binary = shutil.which("env")
    assert env_binary is not None
    exits = Exits()
    group.start(WorkerSpec(argv=[env_binary], envs=[env], global_ranks=[5], attempt="round1"), exits)
    assert exits.next().returncode == 0
    group.stop()

    out, _ = capfd.readouterr()
    lines = [line.removeprefix("[rank5]:") for line in out.splitlines() if line.startswith("[rank5]:")]
    seen = dict(line.split("=", 1) for line in lines)
    error_file = group.error_dir / "round1" / "rank5" / "error.json"
    assert seen == {**env, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    assert error_file.parent.is_dir()


# -- failure root cause -------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_failure_info_finds_the_exception_on_stderr(group: WorkerGroup) -> None:
    code = """
        import sys
        print("some unrelated warning", file=sys.stderr)
        def train():
            raise RuntimeError("boom")
        train()
    """
    exits = Exits()
    group.start(spec_for(python(code)), exits)
    exit_ = exits.next()
    info = group.failure_info(exit_)
    assert (info.exit_code, info.signal) == (1, None)
    assert (info.local_rank, info.global_rank) == (0, 0)
    assert "RuntimeError: boom" in info.message


@pytest.mark.timeout(30)
def test_failure_info_prefers_the_error_file(group: WorkerGroup) -> None:
    code = """
        import json, os
        record = {"message": {"message": "ValueError: from the error file",
                              "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "0"}}}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump(record, f)
        raise RuntimeError("what stderr says")
    """
    exits = Exits()
    group.start(spec_for(python(code)), exits)
    info = group.failure_info(exits.next())
    assert info.message == "ValueError: from the error file"
    assert info.exit_code == 1


@pytest.mark.timeout(60)
def test_failure_info_reads_the_file_written_by_torch_record(group: WorkerGroup) -> None:
    code = """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise KeyError("missing shard")

        main()
    """
    exits = Exits()
    group.start(spec_for(python(code)), exits)
    info = group.failure_info(exits.next(timeout=50))
    assert info.message == "KeyError: 'missing shard'"


@pytest.mark.timeout(30)
def test_a_stale_error_file_is_removed_before_the_spawn(tmp_path: Path, leftovers: list[int]) -> None:
    stale = tmp_path / "round2" / "rank0" / "error.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"message": "from an earlier run"}))
    exits = Exits()
    with WorkerGroup(error_dir=tmp_path) as group:
        group.start(
            spec_for(
                python("import sys; print('IndexError: fresh', file=sys.stderr); sys.exit(2)"),
                attempt="round2",
            ),
            exits,
        )
        leftovers.extend(group.pids)
        info = group.failure_info(exits.next())
    assert (info.message, info.exit_code) == ("IndexError: fresh", 2)
    assert tmp_path.is_dir()  # a caller's error_dir is not removed


@pytest.mark.timeout(30)
def test_a_sigkilled_worker_is_reported_with_its_signal(group: WorkerGroup, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    exits = Exits()
    group.start(spec_for(python(f"import time; open({str(ready)!r}, 'w').close(); time.sleep(300)")), exits)
    wait_until(ready.exists, 10, "the worker to start")
    os.kill(group.pids[0], signal.SIGKILL)
    exit_ = exits.next()
    assert exit_.returncode == -signal.SIGKILL and exit_.signal_name == "SIGKILL"
    info = group.failure_info(exit_)
    assert (info.exit_code, info.signal) == (None, "SIGKILL")
    assert "SIGKILL" in info.message


def test_error_file_and_stderr_parsing() -> None:
    traceback = ["Traceback (most recent call last):", '  File "x.py"', "RuntimeError: boom", ""]
    assert message_from_stderr(traceback) == "RuntimeError: boom"
    assert message_from_stderr(["torch.distributed.DistBackendError: NCCL timeout", "W1 shutting down"]) == (
        "torch.distributed.DistBackendError: NCCL timeout"
    )
    assert message_from_stderr(["just a line", "  "]) == "just a line"
    assert message_from_stderr([]) is None


def test_error_file_formats(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    assert read_error_file(path) is None
    path.write_text(json.dumps({"message": "plain message"}))
    assert read_error_file(path) == "plain message"
    path.write_text(json.dumps({"message": {"message": "x" * 5000, "extraInfo": {}}}))
    message = read_error_file(path)
    assert message is not None and len(message) == 2000 and message.endswith("...")
    path.write_text("{not json")
    assert read_error_file(path) is None


# -- stop ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_stop_returns_as_soon_as_workers_exit(group: WorkerGroup) -> None:
    group.start(spec_for(python("import time; time.sleep(300)"), nprocs=2))
    pids = group.pids
    started = time.monotonic()
    group.stop(grace_s=20)
    assert time.monotonic() - started < 5
    assert all(gone(pid) for pid in pids)
    assert group.running() == []


@pytest.mark.timeout(30)
def test_a_worker_ignoring_sigterm_is_killed_after_the_grace(group: WorkerGroup, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(ready)!r}, "w").close()
        time.sleep(300)
    """
    group.start(spec_for(python(code)))
    wait_until(ready.exists, 10, "the worker to ignore SIGTERM")
    pid = group.pids[0]
    started = time.monotonic()
    group.stop(grace_s=0.5)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 5, elapsed
    assert gone(pid)


@pytest.mark.timeout(30)
def test_stop_kills_a_shell_workers_background_child(group: WorkerGroup, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    group.start(spec_for(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"]))
    grandchild = read_pid(pid_file)
    worker = group.pids[0]
    group.stop(grace_s=2)
    assert gone(worker) and gone(grandchild)


@pytest.mark.timeout(30)
def test_stop_kills_a_descendant_that_left_the_group_and_ignores_sigterm(
    group: WorkerGroup, tmp_path: Path, leftovers: list[int]
) -> None:
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen(
            [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "open({str(pid_file)!r} + '.tmp', 'w').close(); time.sleep(300)"],
            start_new_session=True,
        )
        while True:  # publish the pid only once the child ignores SIGTERM
            try:
                open({str(pid_file)!r} + ".tmp").close()
                break
            except FileNotFoundError:
                time.sleep(0.01)
        with open({str(pid_file)!r}, "w") as f:
            f.write(str(child.pid))
        time.sleep(300)
    """
    group.start(spec_for(python(code)))
    escaped = read_pid(pid_file)
    leftovers.append(escaped)
    assert os.getpgid(escaped) != group.pids[0]
    group.stop(grace_s=0.5)
    assert gone(escaped)


@pytest.mark.timeout(30)
def test_stop_is_idempotent_and_the_group_restarts(group: WorkerGroup) -> None:
    group.stop()  # nothing started yet
    exits = Exits()
    group.start(spec_for(python("import time; time.sleep(300)")), exits)
    with pytest.raises(WorkerGroupError, match="still running"):
        group.start(spec_for(python("pass")), exits)
    group.stop(grace_s=1)
    group.stop(grace_s=1)
    assert exits.empty()

    group.start(spec_for(python("import sys; sys.exit(4)"), attempt="1"), exits)
    assert exits.next().returncode == 4
    group.start(spec_for(python("pass"), attempt="2"), exits)  # all exited: start() cleans up by itself
    assert exits.next().returncode == 0


@pytest.mark.timeout(30)
def test_a_spawn_failure_raises_and_stops_the_others(group: WorkerGroup, tmp_path: Path) -> None:
    spec = WorkerSpec(argv=[str(tmp_path / "no-such-program")], envs=[BASE_ENV], global_ranks=[0])
    with pytest.raises(WorkerGroupError, match="cannot start worker"):
        group.start(spec)
    assert group.running() == []


def test_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="global_ranks"):
        WorkerSpec(argv=["x"], envs=[{}, {}], global_ranks=[0])
    with pytest.raises(ValueError, match="attempt"):
        WorkerSpec(argv=["x"], envs=[{}], global_ranks=[0], attempt="../up")


# -- the agent dies -----------------------------------------------------------------------------------------
FAKE_AGENT = """
    import json, sys, threading
    from agent.workers.reaper import Reaper
    from agent.workers.group import WorkerGroup, WorkerSpec

    worker = '''
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"grandchild {child.pid}", flush=True)
    time.sleep(300)
    '''
    reaper = Reaper() if sys.argv[1] == "reaper" else None
    group = WorkerGroup(reaper=reaper)
    env = {"PATH": "/usr/bin:/bin"}
    group.start(WorkerSpec(argv=[sys.executable, "-c", worker], envs=[env], global_ranks=[0]))
    print(json.dumps({"worker": group.pids[0], "reaper": reaper.pid if reaper else None}), flush=True)
    threading.Event().wait()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protection", ["reaper", "pdeathsig-only"])
def test_nothing_survives_a_sigkilled_agent(
    protection: str, tmp_path: Path, leftovers: list[int], agent_tmpdir: Path
) -> None:
    env = {**os.environ, "TMPDIR": str(agent_tmpdir)}  # without a reaper, its error folder stays behind
    with open(tmp_path / "agent.err", "wb") as agent_err:
        agent = subprocess.Popen(
            [*python(FAKE_AGENT), protection],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=agent_err,
            env=env,
        )
    leftovers.append(agent.pid)
    lines: queue.Queue[str] = queue.Queue()
    assert agent.stdout is not None
    stdout = agent.stdout
    threading.Thread(target=lambda: [lines.put(line.decode()) for line in stdout], daemon=True).start()

    pids: dict[str, int | None] = {}
    deadline = time.monotonic() + 30
    while "worker" not in pids or "grandchild" not in pids:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            pytest.fail(f"fake agent printed no pids; stderr: {(tmp_path / 'agent.err').read_text()}")
        if line.startswith("[rank0]:grandchild "):
            pids["grandchild"] = int(line.split()[-1])
        elif line.startswith("{"):
            pids.update(json.loads(line))
    leftovers.extend(pid for pid in pids.values() if pid is not None)

    agent.kill()
    agent.wait(timeout=10)
    stdout.close()
    worker, grandchild, reaper = pids["worker"], pids["grandchild"], pids["reaper"]
    assert worker is not None and grandchild is not None
    wait_until(lambda: gone(worker), 5, "the worker to die with the agent")
    if reaper is not None:
        wait_until(lambda: gone(grandchild) and gone(reaper), 5, "the reaper to kill the grandchild and exit")


@pytest.mark.timeout(30)
def test_reaper_close_kills_registered_groups_and_exits(leftovers: list[int]) -> None:
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    leftovers.append(victim.pid)
    reaper = Reaper()
    leftovers.append(reaper.pid)
    reaper.register(victim.pid)
    reaper.close()
    assert victim.wait(timeout=5) == -signal.SIGKILL
    assert gone(reaper.pid)
    reaper.close()  # idempotent


@pytest.mark.timeout(30)
def test_reaper_spares_unregistered_groups(leftovers: list[int]) -> None:
    survivor = subprocess.Popen(["sleep", "300"], start_new_session=True)
    leftovers.append(survivor.pid)
    with Reaper() as reaper:
        leftovers.append(reaper.pid)
        reaper.register(survivor.pid)
        reaper.unregister(survivor.pid)
    assert survivor.poll() is None
    survivor.kill()
    survivor.wait(timeout=5)


@pytest.mark.timeout(30)
def test_the_agent_side_never_imports_torch() -> None:
    code = (
        "import sys, agent.workers.group, agent.workers.reaper; sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=20).returncode == 0


# -- only the agent's own processes, also under PID reuse; escaped sessions -------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("guard", ["pidfd", "start-time"])
def test_a_worker_pid_now_held_by_another_process_is_not_signalled(guard: str, leftovers: list[int]) -> None:
    # The stop path as it meets a worker whose process was reaped and whose PID an unrelated process took
    # since (pid_max is 32768 here). Forcing the kernel to hand out one PID again is not deterministic, so
    # the reference is made as the stop path would hold it then: the pidfd (or the start time) of the
    # reaped worker, with the PID that the stranger holds now. The stranger leads its own session: the
    # worker's process group id is that PID too.
    worker = subprocess.Popen(["sleep", "300"], start_new_session=True)
    leftovers.append(worker.pid)
    worker_started = psutil.Process(worker.pid).create_time()
    pidfd = os.pidfd_open(worker.pid) if guard == "pidfd" else -1
    worker.kill()
    worker.wait(timeout=10)  # reaped: its PID is free for anyone
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    leftovers.append(stranger.pid)
    started = worker_started
    if guard == "start-time" and psutil.Process(stranger.pid).create_time() == started:
        started -= 1.0  # both in one clock tick: the worker held the PID at an earlier time all the same
    ref = ProcessRef(stranger.pid, started, pidfd)
    held = RunningWorker(0, 0, cast(WorkerProcess, stranger), Path("unused"), deque(), ref=ref)
    try:
        assert not ref.signal(signal.SIGTERM) and not ref.holds_pid()
        end_workers([held], grace_s=0.0)  # SIGTERM, SIGCONT and SIGKILL to the group and descendants
        assert stranger.poll() is None, "the stop path signalled a process that is not the worker"
    finally:
        ref.close()
        stranger.kill()
        stranger.wait(timeout=10)


ESCAPING_WORKER = """
    import os, signal, sys, time
    # A double fork: the middle process starts a session, forks the escapee and exits, so the escapee is
    # in neither the worker's process group nor its tree of children.
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the grace period's SIGKILL ends it
            os.write(write_end, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.waitpid(middle, 0)
    escaped = os.read(read_end, 32).decode()
    with open(sys.argv[1], "w") as f:
        f.write(escaped)
    time.sleep(300)
"""

FAKE_SUBREAPER_AGENT = """
    import json, os, sys, time
    import psutil
    from agent.warm.starter import WarmLauncher
    from agent.workers.group import WorkerGroup, WorkerSpec
    from agent.workers.launchers import become_child_subreaper

    assert become_child_subreaper()  # as elastic-run does at its start (agent.cli.startup)
    pid_file, worker, mode = sys.argv[1:4]
    env = {"PATH": "/usr/bin:/bin"}
    launcher = None
    if mode == "warm":  # forked from a zygote (no exec): the escapee's environment is the zygote's
        launcher = WarmLauncher(env=env, preload=())
        assert launcher.wait_ready(30), "the zygote did not start"
    group = WorkerGroup(launcher=launcher)
    group.start(WorkerSpec(argv=[sys.executable, worker, pid_file], envs=[env], global_ranks=[0]))
    assert group.launched_by == mode, group.launched_by
    deadline = time.monotonic() + 20
    while not os.path.exists(pid_file) or not open(pid_file).read().strip():
        assert time.monotonic() < deadline, "the worker published no pid"
        time.sleep(0.01)
    escaped = int(open(pid_file).read())
    parent = psutil.Process(escaped).ppid()
    group.stop(grace_s=0.5)
    left = [(c.pid, c.status()) for c in psutil.Process().children() if c.pid != (launcher and launcher.pid)]
    group.close()
    if launcher is not None:
        launcher.close()
    print(json.dumps({"agent": os.getpid(), "escaped": escaped, "parent": parent, "left": left}), flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exec", "warm"])
def test_an_escaped_session_child_is_stopped_with_the_worker_and_reaped(
    mode: str, tmp_path: Path, leftovers: list[int]
) -> None:
    pid_file = tmp_path / "escaped.pid"
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(ESCAPING_WORKER))
    agent = subprocess.run(
        [*python(FAKE_SUBREAPER_AGENT), str(pid_file), str(worker), mode],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=75,
    )
    if pid_file.exists() and pid_file.read_text().strip().isdigit():
        leftovers.append(int(pid_file.read_text()))
    assert agent.returncode == 0, agent.stderr
    seen = json.loads(agent.stdout.splitlines()[-1])
    assert seen["parent"] == seen["agent"], "the escapee was reparented to the subreaper agent"
    assert gone(seen["escaped"]), "the escaped session child outlived the worker's stop"
    assert seen["left"] == [], "the agent left a child behind (running or a zombie)"


@pytest.mark.timeout(30)
def test_the_reaper_spares_a_group_whose_leader_pid_changed_hands(leftovers: list[int]) -> None:
    # The sentinel's own protocol, as a Reaper writes it: the group's id with its leader's start time. Here
    # the PID is held by a stranger that started at another time (the worker was reaped, its PID reused).
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    leftovers.append(stranger.pid)
    ticks = start_ticks(stranger.pid)
    assert ticks is not None
    source = (REPO_ROOT / "agent" / "workers" / "_reaper_proc.py").read_text()
    sentinel = subprocess.Popen([sys.executable, "-I", "-S", "-c", source], stdin=subprocess.PIPE)
    leftovers.append(sentinel.pid)
    assert sentinel.stdin is not None
    sentinel.stdin.write(f"+{stranger.pid}:{ticks + 1}\n".encode())
    sentinel.stdin.close()  # as when the agent dies
    assert sentinel.wait(timeout=10) == 0
    assert stranger.poll() is None, "the sentinel killed a group that is not the worker's"
    stranger.kill()
    stranger.wait(timeout=10)
