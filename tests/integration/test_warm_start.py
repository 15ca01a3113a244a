"""Warm worker starts (agent.warm.starter): a worker forked from the zygote must look exactly like an exec'd
one.

Most checks run in both modes (``exec``: today's Popen path; ``warm``: forked from a zygote that imported
torch) and compare what the two workers saw. One zygote is shared by the module; tests that kill or
starve a zygote start their own. Every process a test starts is SIGKILLed by PID at teardown if it is
still alive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from e2e import gone, wait_until
from worker_exits import Exits

from agent.warm.starter import PER_WORKER_VARIABLES, READY_WAIT_S, WarmLauncher, env_difference, parse_command
from agent.workers.group import WorkerExit, WorkerGroup, WorkerSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
# The zygote's environment and the base of every worker's (as the agent's os.environ is for elastic-run).
# Test-only variables are named ELASTIC_TEST_*: like the agent's own, ELASTIC_* may differ per worker.
BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1"}
ZYGOTE_READY_TIMEOUT_S = 120
MODES = ["exec", "warm"]
#: What a fresh interpreter's SIGINT handler is: its default one, unless SIGINT was ignored when this process
#: started (`nohup ... &`), which every process it starts inherits.
SIGINT_AT_START = (
    signal.SIG_IGN if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else signal.default_int_handler
)


# -- helpers ----------------------------------------------------------------------------------------------
def write(path: Path, code: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def contract_envs(nproc: int = 2, assignment: dict | None = None, **extra: str) -> list[dict[str, str]]:
    """torchrun's worker environments, built from BASE_ENV by the agent's own code: by default those of node
    rank 1 of 2 in round 3; ``assignment`` overrides fields of that round."""
    from agent.workers.environment import worker_envs
    from elastic.control.protocol import Assignment

    fields: dict = dict(
        round=3,
        node_rank=1,
        nnodes=2,
        rank_offset=2,
        world_size=4,
        master_addr="127.0.0.1",
        master_port=29511,
        restart_count=2,
        max_restarts=5,
        members=["a", "b"],
    )
    fields.update(assignment or {})
    return worker_envs(
        BASE_ENV, Assignment(**fields), nproc, run_id="warm-test", extra={"ELASTIC_NODE_ID": "b", **extra}
    )


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """PIDs to SIGKILL at teardown if a test did not see them end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def zygote() -> Iterator[WarmLauncher]:
    launcher = WarmLauncher(env=BASE_ENV)
    try:
        assert launcher.wait_ready(ZYGOTE_READY_TIMEOUT_S), launcher.unavailable_reason(
            WorkerSpec(argv=[PY, "x.py"], envs=[BASE_ENV], global_ranks=[0])
        )
        yield launcher
    finally:
        launcher.close()


@pytest.fixture
def groups(
    tmp_path: Path, zygote: WarmLauncher, leftovers: list[int]
) -> Iterator[Callable[[str], WorkerGroup]]:
    """``groups(mode)``: a worker group starting workers by exec or from the shared zygote.

    All groups of a test share one error folder, so the same attempt gives the same TORCHELASTIC_ERROR_FILE.
    """
    made: list[WorkerGroup] = []

    def make(mode: str) -> WorkerGroup:
        group = WorkerGroup(error_dir=tmp_path / "errors", launcher=zygote if mode == "warm" else None)
        made.append(group)
        return group

    yield make
    for group in made:
        leftovers.extend(group.pids)
        group.close()


def run(group: WorkerGroup, spec: WorkerSpec, mode: str) -> list[WorkerExit]:
    """Start ``spec``, check it was started in ``mode``, and return every exit by local rank."""
    reported = Exits(timeout_s=60.0)
    group.start(spec, reported)
    assert group.launched_by == mode
    return sorted((reported.next() for _ in range(spec.nprocs)), key=lambda e: e.local_rank)


def rank_lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank{rank}]:"
    return [line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)]


# -- the worker's view of the world ---------------------------------------------------------------------
PROBE = """
    import ctypes, json, multiprocessing, os, random, signal, stat, sys, threading
    preloaded = "torch" in sys.modules
    import torch
    import torch._dynamo.config  # what torch.optim imports on first use

    def proc_list(name):
        with open(f"/proc/self/{name}", "rb") as f:
            return [os.fsdecode(x) for x in f.read().split(b"\\0") if x]

    def stream(s):
        raw = s.buffer if isinstance(s.buffer, __import__("io").FileIO) else s.buffer.raw
        return [type(s.buffer).__name__, raw.name, s.mode, s.encoding, s.errors, s.line_buffering,
                s.write_through]

    def umask():
        with open("/proc/self/status") as f:
            return [line.split()[1] for line in f if line.startswith("Umask:")][0]

    pdeathsig = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
    dump = {
        "env": dict(os.environ),
        "proc_environ": dict(x.split("=", 1) for x in proc_list("environ")),
        "proc_cmdline": proc_list("cmdline"),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path0": sys.path[0],
        "name": __name__,
        "file": __file__,
        "cached": __cached__,
        "package": __package__,
        "spec": None if __spec__ is None else __spec__.name,
        "loader": type(__loader__).__name__,
        "main_keys": sorted(k for k in globals() if k.startswith("__")),
        "main_module": sys.modules["__main__"].__dict__ is globals(),
        "cwd": os.getcwd(),
        "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
        "pdeathsig": pdeathsig.value,
        "stdin": [os.readlink("/proc/self/fd/0"), sys.stdin.read()],
        "stdout_stderr_pipes": [stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in (1, 2)],
        "stdio": [stream(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
        "dunder_stdio": [getattr(sys, f"__{n}__") is getattr(sys, n) for n in ("stdin", "stdout", "stderr")],
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                    if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "umask": umask(),
        "flags": list(sys.flags),
        "executable": sys.executable,
        "mp_original_dir": multiprocessing.process.ORIGINAL_DIR,
        "dynamo_debug_dir": torch._dynamo.config.debug_dir_root,
        "threads": threading.active_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_initialized": torch.cuda.is_initialized(),
        # Per-process noise: must differ between processes, in both modes alike.
        "noise": {
            "preloaded_torch": preloaded,
            "random": random.random(),
            "torch_seed": torch.initial_seed(),
            "torch_rand": torch.rand(1).item(),
            "authkey": multiprocessing.current_process().authkey.hex(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
        },
    }
    with open(os.environ["ELASTIC_TEST_PROBE_OUT"].format(rank=os.environ["RANK"]), "w") as f:
        json.dump(dump, f)
    print(f"probe rank {os.environ['RANK']} done")
"""


def probe_spec(tmp_path: Path, how: str, mode: str, out: Path) -> WorkerSpec:
    """Two workers of the probe, started as a script or as a module, with torchrun's environment."""
    root = tmp_path / "project"
    write(root / "sub" / "probe.py", PROBE)
    write(root / "probepkg" / "__init__.py", "")
    write(root / "probepkg" / "probe.py", PROBE)
    if how == "script":
        argv = [PY, "-u", "sub/probe.py", "--flag", "a b", ""]
    else:
        argv = [PY, "-u", "-m", "probepkg.probe", "--flag", "a b", ""]
    envs = contract_envs(ELASTIC_TEST_PROBE_OUT=str(out / mode / "rank{rank}.json"))
    (out / mode).mkdir(parents=True, exist_ok=True)
    return WorkerSpec(argv=argv, envs=envs, global_ranks=[2, 3], cwd=str(root), attempt="round3")


def load_dumps(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / mode / f"rank{r}.json").read_text()) for r in (2, 3)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["script", "module"])
@pytest.mark.parametrize("mode", MODES)
def test_the_worker_sees_torchruns_contract(
    mode: str,
    how: str,
    groups: Callable[[str], WorkerGroup],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    spec = probe_spec(tmp_path, how, mode, out)
    group = groups(mode)
    assert [e.returncode for e in run(group, spec, mode)] == [0, 0]
    group.stop()  # joins the output readers: an exit can overtake the worker's last lines
    root = Path(spec.cwd or "")
    error_dir = tmp_path / "errors" / "round3"
    for dump, env, rank in zip(load_dumps(out, mode), spec.envs, (2, 3), strict=True):
        expected_env = {**env, "TORCHELASTIC_ERROR_FILE": str(error_dir / f"rank{rank}" / "error.json")}
        # Set by the process itself, in both modes alike: LC_CTYPE by the interpreter (PEP 538 locale
        # coercion), TORCHINDUCTOR_CACHE_DIR by `import torch._dynamo`.
        own = {"LC_CTYPE", "TORCHINDUCTOR_CACHE_DIR"}
        assert {k: v for k, v in dump["env"].items() if k not in own} == expected_env
        assert dump["proc_environ"] == expected_env
        assert dump["env"]["RANK"] == str(rank) and dump["env"]["OMP_NUM_THREADS"] == "1"
        assert dump["proc_cmdline"] == [a for a in spec.argv if a]
        assert dump["orig_argv"] == spec.argv
        assert dump["name"] == "__main__" and dump["main_module"]
        assert dump["cwd"] == str(root)
        if how == "script":
            assert dump["argv"] == ["sub/probe.py", "--flag", "a b", ""]
            assert dump["file"] == str(root / "sub" / "probe.py")
            assert dump["path0"] == str(root / "sub")
            assert (dump["spec"], dump["package"], dump["cached"]) == (None, None, None)
        else:
            assert dump["argv"] == [str(root / "probepkg" / "probe.py"), "--flag", "a b", ""]
            assert dump["path0"] == str(root)
            assert (dump["spec"], dump["package"]) == ("probepkg.probe", "probepkg")
        assert dump["loader"] == "SourceFileLoader"
        assert dump["mp_original_dir"] == str(root)
        assert dump["dynamo_debug_dir"] == str(root / "torch_compile_debug")
        assert dump["session_leader"] and dump["pdeathsig"] == signal.SIGKILL
        assert dump["stdin"] == ["/dev/null", ""]
        assert dump["stdout_stderr_pipes"] == [True, True]
        assert dump["stdio"][1] == ["FileIO", "<stdout>", "w", "utf-8", dump["stdio"][1][4], False, True]
        assert dump["dunder_stdio"] == [True, True, True]
        assert dump["sigmask"] == []
        assert dump["signals"]["SIGINT"] == repr(SIGINT_AT_START)
        assert dump["signals"]["SIGTERM"] == repr(signal.SIG_DFL)
        assert dump["threads"] == 1 and dump["torch_threads"] == 1 and not dump["cuda_initialized"]
        assert dump["noise"]["preloaded_torch"] is (mode == "warm")
    out_text = capfd.readouterr().out
    assert rank_lines(out_text, 2) == ["probe rank 2 done"]
    assert rank_lines(out_text, 3) == ["probe rank 3 done"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["script", "module"])
def test_warm_and_exec_workers_see_the_same_process(
    how: str, groups: Callable[[str], WorkerGroup], tmp_path: Path, zygote: WarmLauncher
) -> None:
    out = tmp_path / "out"
    dumps = {}
    for mode in MODES:
        spec = probe_spec(tmp_path, how, mode, out)
        assert [e.returncode for e in run(groups(mode), spec, mode)] == [0, 0]
        dumps[mode] = load_dumps(out, mode)
    noise = [[d.pop("noise") for d in dumps[mode]] for mode in MODES]
    for d in [*dumps["exec"], *dumps["warm"]]:
        # The output path names the mode's folder; everything else in the environment is identical.
        d["env"].pop("ELASTIC_TEST_PROBE_OUT")
        d["proc_environ"].pop("ELASTIC_TEST_PROBE_OUT")
    assert dumps["warm"] == dumps["exec"]

    (exec0, exec1), (warm0, warm1) = noise
    assert warm0["ppid"] == warm1["ppid"] == zygote.pid
    assert exec0["ppid"] == exec1["ppid"] == os.getpid()
    for key in ("random", "authkey"):
        assert len({exec0[key], exec1[key], warm0[key], warm1[key]}) == 4, key
    # torch seeds each fresh process's CPU generator the same way (at random, or a fixed default, by
    # version): whatever two exec'd workers show, two warm ones show too.
    for key in ("torch_seed", "torch_rand"):
        assert (exec0[key] == exec1[key]) == (warm0[key] == warm1[key]), key


# -- exits and output ---------------------------------------------------------------------------------------
EXITS = """
    import atexit, os, signal, sys, threading, time
    print(f"hello from {os.environ['RANK']}")
    print("to stderr", file=sys.stderr)
    how = sys.argv[1]
    # Module teardown at a real interpreter exit flushes a file nobody closed (not after SIGKILL).
    unclosed = open(sys.argv[2], "w")
    unclosed.write("flushed at exit")

    def fail():
        raise RuntimeError("boom")

    if how == "ok":
        pass
    elif how == "code3":
        sys.exit(3)
    elif how == "message":
        sys.exit("goodbye message")
    elif how == "raise":
        fail()
    elif how == "interrupt":
        raise KeyboardInterrupt
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "finalize":
        # What a real interpreter exit also does: join non-daemon threads, run atexit callbacks.
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        sys.exit(5)
"""

EXPECTED_EXITS = {
    "ok": 0,
    "code3": 3,
    "message": 1,
    "raise": 1,
    "interrupt": -signal.SIGINT,
    "sigkill": -signal.SIGKILL,
    "finalize": 5,
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", list(EXPECTED_EXITS))
def test_exit_codes_output_and_failure_info_match(
    how: str, groups: Callable[[str], WorkerGroup], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path / "exits.py", EXITS)
    seen = {}
    for mode in MODES:
        flushed = tmp_path / f"unclosed-{mode}.txt"
        env = {**BASE_ENV, "RANK": "7"}
        spec = WorkerSpec(argv=[PY, "-u", str(script), how, str(flushed)], envs=[env], global_ranks=[7])
        group = groups(mode)
        (exit_,) = run(group, spec, mode)
        # The exit can overtake the worker's last lines; stopping the group joins its output readers.
        group.stop()
        info = group.failure_info(exit_) if exit_.returncode else None
        captured = capfd.readouterr()
        seen[mode] = (exit_.returncode, info and (info.exit_code, info.signal, info.message), captured)
        assert exit_.returncode == EXPECTED_EXITS[how], (mode, captured.err)
        assert rank_lines(captured.out, 7)[0] == "hello from 7"
        assert "[rank7]:to stderr" in captured.err.splitlines()
        assert flushed.read_text() == ("" if how == "sigkill" else "flushed at exit"), mode
        if how == "finalize":
            assert rank_lines(captured.out, 7)[1:] == ["thread done", "atexit ran"]
        if how == "message":
            assert info is not None and info.message == "goodbye message"
        if how == "raise":
            assert info is not None and (info.exit_code, info.message) == (1, "RuntimeError: boom")
            err = rank_lines(captured.err, 7)
            assert err[1] == "Traceback (most recent call last):"
            call_line = script.read_text().splitlines().index("    fail()") + 1
            assert err[2] == f'  File "{script}", line {call_line}, in <module>'
        if how == "sigkill":
            assert info is not None and (info.exit_code, info.signal) == (None, "SIGKILL")
    exec_code, exec_info, exec_out = seen["exec"]
    warm_code, warm_info, warm_out = seen["warm"]
    assert (warm_code, warm_info) == (exec_code, exec_info)
    assert rank_lines(warm_out.out, 7) == rank_lines(exec_out.out, 7)
    # Same traceback, line for line: none of the zygote's frames shows.
    assert rank_lines(warm_out.err, 7) == rank_lines(exec_out.err, 7)


@pytest.mark.timeout(120)
def test_a_syntax_error_and_log_files_match(groups: Callable[[str], WorkerGroup], tmp_path: Path) -> None:
    script = write(tmp_path / "bad.py", "print('never')\nx = = 1\n")
    tails = {}
    for mode in MODES:
        spec = WorkerSpec(
            argv=[PY, "-u", str(script)], envs=[BASE_ENV], global_ranks=[0], log_dir=tmp_path / mode
        )
        group = groups(mode)
        (exit_,) = run(group, spec, mode)
        assert exit_.returncode == 1
        assert group.failure_info(exit_).message == "SyntaxError: invalid syntax"
        group.stop()
        tails[mode] = (tmp_path / mode / "0" / "rank0" / "stderr.log").read_text()
    assert "SyntaxError: invalid syntax" in tails["warm"]
    assert tails["warm"] == tails["exec"]


# -- stop, restart and speed --------------------------------------------------------------------------------
STAMP = """
    import os, sys, time
    stamp = time.monotonic()
    preloaded = "torch" in sys.modules
    import torch
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo on first use
    with open(os.environ["ELASTIC_TEST_STAMP"], "w") as f:
        f.write(f"{stamp} {preloaded} {time.monotonic()}")
    print("ready", flush=True)
    if len(sys.argv) > 1:
        time.sleep(300)
"""


def time_to_first_line(group: WorkerGroup, spec: WorkerSpec, stamp: Path, mode: str) -> tuple[float, bool]:
    """Seconds from ``start()`` until the worker has imported torch and built an optimizer."""
    stamp.unlink(missing_ok=True)
    started = time.monotonic()
    exits = Exits(timeout_s=60.0)
    group.start(spec, exits)
    assert group.launched_by == mode
    assert exits.next().returncode == 0
    first, preloaded, torch_done = stamp.read_text().split()
    assert float(first) >= started
    return float(torch_done) - started, preloaded == "True"


@pytest.mark.timeout(180)
def test_a_warm_restart_is_much_faster_than_exec(
    groups: Callable[[str], WorkerGroup], tmp_path: Path
) -> None:
    script = write(tmp_path / "stamp.py", STAMP)
    stamp = tmp_path / "stamp"
    spec = WorkerSpec(
        argv=[PY, "-u", str(script)], envs=[{**BASE_ENV, "ELASTIC_TEST_STAMP": str(stamp)}], global_ranks=[0]
    )
    exec_s, exec_preloaded = time_to_first_line(groups("exec"), spec, stamp, "exec")
    warm = groups("warm")
    time_to_first_line(warm, spec, stamp, "warm")
    warm_s, warm_preloaded = time_to_first_line(warm, spec, stamp, "warm")  # the restart
    assert warm_preloaded and not exec_preloaded
    assert warm_s * 3 < exec_s, (warm_s, exec_s)


STORE_RACE = """
    import datetime, json, os, sys, time
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if rank == 0:
        time.sleep(1.0)  # rank 1 reaches init_process_group first: rank 0's store does not listen yet
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    create = sys.modules["torch.distributed.rendezvous"]._create_c10d_store
    with open(os.environ["ELASTIC_TEST_OUT"].format(rank=rank), "w") as f:
        json.dump({"sum": total.item(), "waits_for_store": hasattr(create, "__wrapped__")}, f)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_comes_first_waits_for_rank_0s_store(
    mode: str, groups: Callable[[str], WorkerGroup], tmp_path: Path
) -> None:
    """Warm workers of non-zero rank wait for rank 0's TCPStore to listen (torch's own retry would sleep
    up to 0.7 s); the process group still forms as it does for exec'd workers, which torch handles alone."""
    from agent.executor.net import free_port

    single_node = dict(node_rank=0, nnodes=1, rank_offset=0, world_size=2, members=["a"])
    out = str(tmp_path / "rank{rank}.json")
    envs = contract_envs(
        assignment={**single_node, "master_port": free_port("127.0.0.1")}, ELASTIC_TEST_OUT=out
    )
    script = write(tmp_path / "store_race.py", STORE_RACE)
    spec = WorkerSpec(argv=[PY, "-u", str(script)], envs=envs, global_ranks=[0, 1])
    assert [e.returncode for e in run(groups(mode), spec, mode)] == [0, 0]
    results = [json.loads(Path(out.format(rank=r)).read_text()) for r in (0, 1)]
    assert results == [{"sum": 2.0, "waits_for_store": mode == "warm"}] * 2


@pytest.mark.timeout(120)
def test_stop_ends_warm_workers_and_the_zygote_serves_the_next_start(
    groups: Callable[[str], WorkerGroup], tmp_path: Path, zygote: WarmLauncher
) -> None:
    script = write(tmp_path / "stamp.py", STAMP)
    stamp = tmp_path / "stamp"
    spec = WorkerSpec(
        argv=[PY, "-u", str(script), "sleep"],
        envs=[{**BASE_ENV, "ELASTIC_TEST_STAMP": str(stamp), "RANK": str(r)} for r in range(2)],
        global_ranks=[0, 1],
    )
    group = groups("warm")
    for _ in range(2):
        stamp.unlink(missing_ok=True)
        exits = Exits(timeout_s=60.0)
        group.start(spec, exits)
        assert group.launched_by == "warm"
        pids = group.pids
        wait_until(stamp.exists, 30, "the warm workers to start")
        started = time.monotonic()
        group.stop(grace_s=20)
        assert time.monotonic() - started < 5
        assert all(gone(pid) for pid in pids)
        assert group.running() == [] and exits.empty()  # stop() caused these exits
    assert zygote.ready and not gone(zygote.pid or 0)


@pytest.mark.timeout(120)
def test_a_usr1_sent_to_every_process_of_the_step_leaves_the_zygote_serving_default_workers(
    tmp_path: Path, leftovers: list[int]
) -> None:
    """SLURM's pre-emption warning (``--signal=USR1@90``) reaches every process of the job step, the
    zygote too: it ignores USR1/USR2 (before, it died and the warm path was lost), and its workers still
    start with the default disposition, as exec'd ones do."""
    script = write(
        tmp_path / "usr1.py",
        "import signal, sys\n"
        "sys.exit(0 if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL"
        " and signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL else 7)\n",
    )
    launcher = WarmLauncher(env=BASE_ENV)
    try:
        assert launcher.wait_ready(ZYGOTE_READY_TIMEOUT_S)
        assert launcher.pid is not None
        leftovers.append(launcher.pid)
        os.kill(launcher.pid, signal.SIGUSR1)
        os.kill(launcher.pid, signal.SIGUSR2)
        group = WorkerGroup(error_dir=tmp_path / "errors", launcher=launcher)
        try:
            spec = WorkerSpec(argv=[PY, str(script)], envs=[BASE_ENV], global_ranks=[0])
            assert [e.returncode for e in run(group, spec, "warm")] == [0]
        finally:
            group.close()
        assert not gone(launcher.pid), "the zygote outlived the signal"
    finally:
        launcher.close()


# -- fallbacks ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_commands_the_warm_path_cannot_run_are_execd(
    groups: Callable[[str], WorkerGroup], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.workers.group")
    script = write(tmp_path / "ok.py", "print('ok')")
    group = groups("warm")
    cases = [
        ([PY, "-c", "print('ok')"], BASE_ENV, "interpreter option '-c'"),
        ([PY, "-u", str(script)], {**BASE_ENV, "PYTHONPATH": str(tmp_path)}, "zygote's in PYTHONPATH"),
        ([PY, "-u", str(script)], {**BASE_ENV, "TMPDIR": str(tmp_path)}, "zygote's in TMPDIR"),
        (["/bin/echo", "ok"], BASE_ENV, "does not run this agent's interpreter"),
    ]
    for argv, env, reason in cases:
        caplog.clear()
        assert run(group, WorkerSpec(argv=argv, envs=[env], global_ranks=[0]), "exec")[0].returncode == 0
        lines = [r.getMessage() for r in caplog.records if "warm start not used" in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0], lines
    # The contract's per-worker variables and OMP_NUM_THREADS may differ: still warm.
    spec = WorkerSpec(argv=[PY, "-u", str(script)], envs=contract_envs(nproc=2), global_ranks=[0, 1])
    assert [e.returncode for e in run(group, spec, "warm")] == [0, 0]


@pytest.mark.timeout(180)
def test_fallback_to_exec_before_the_zygote_is_ready_and_after_it_died(
    tmp_path: Path, leftovers: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    script = write(tmp_path / "stamp.py", STAMP)
    stamp = tmp_path / "stamp"
    env = {**BASE_ENV, "ELASTIC_TEST_STAMP": str(stamp)}
    spec = WorkerSpec(argv=[PY, "-u", str(script), "sleep"], envs=[env], global_ranks=[0])
    launcher = WarmLauncher(env=BASE_ENV, preload=("torch", "torch._dynamo", "no_such_module_for_this_test"))
    assert launcher.pid is not None
    leftovers.append(launcher.pid)
    group = WorkerGroup(launcher=launcher)
    try:
        # Still importing torch: worth waiting for (the agent does so before it joins), up to a bound.
        assert 0 < group.launcher_warm_up_left_s() <= READY_WAIT_S
        group.start(spec)  # a start that does not wait is exec'd
        assert group.launched_by == "exec"
        assert any("not ready yet" in r.getMessage() for r in caplog.records)
        group.stop(grace_s=1)

        assert launcher.wait_ready(ZYGOTE_READY_TIMEOUT_S)
        assert group.launcher_warm_up_left_s() == 0
        messages = [r.getMessage() for r in caplog.records]
        assert any("imported torch, torch._dynamo (torch" in m for m in messages), messages
        assert any("not preloaded: no_such_module_for_this_test" in m for m in messages), messages
        stamp.unlink(missing_ok=True)
        exits = Exits(timeout_s=60.0)
        group.start(spec, exits)
        assert group.launched_by == "warm"
        warm_worker = group.pids[0]
        leftovers.append(warm_worker)
        wait_until(stamp.exists, 30, "the warm worker to start")

        # The zygote dies: its workers die with it (PR_SET_PDEATHSIG) and the exit is still reported.
        os.kill(launcher.pid, signal.SIGKILL)
        exit_ = exits.next(timeout=20)
        assert (exit_.pid, exit_.returncode) == (warm_worker, -signal.SIGKILL)
        wait_until(lambda: not launcher.ready, 10, "the launcher to notice the zygote's death")

        caplog.clear()
        stamp.unlink(missing_ok=True)
        group.start(spec)
        assert group.launched_by == "exec"
        messages = [r.getMessage() for r in caplog.records]
        assert any("warm start not used" in m and "zygote exited" in m for m in messages), messages
        wait_until(stamp.exists, 60, "the exec'd worker to start")
        assert psutil.Process(group.pids[0]).ppid() == os.getpid()
    finally:
        leftovers.extend(group.pids)
        group.close()
        launcher.close()


# -- the agent dies -----------------------------------------------------------------------------------------
WORKER_WITH_GRANDCHILD = """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"grandchild {child.pid}", flush=True)
    time.sleep(300)
"""

FAKE_AGENT = """
    import json, os, sys, threading
    from agent.workers.reaper import Reaper
    from agent.warm.starter import WarmLauncher
    from agent.workers.group import WorkerGroup, WorkerSpec

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    reaper = Reaper() if sys.argv[1] == "reaper" else None
    launcher = WarmLauncher(reaper, env=env)
    assert launcher.wait_ready(120), "zygote not ready"
    group = WorkerGroup(reaper=reaper, launcher=launcher)
    group.start(WorkerSpec(argv=[sys.executable, "-u", sys.argv[2]], envs=[env], global_ranks=[0]))
    pids = {"worker": group.pids[0], "zygote": launcher.pid, "reaper": reaper.pid if reaper else None}
    print(json.dumps({**pids, "launched_by": group.launched_by}), flush=True)
    threading.Event().wait()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protection", ["reaper", "pdeathsig-only"])
def test_nothing_survives_a_sigkilled_agent_with_warm_workers(
    protection: str, tmp_path: Path, leftovers: list[int], agent_tmpdir: Path
) -> None:
    worker = write(tmp_path / "worker.py", WORKER_WITH_GRANDCHILD)
    with open(tmp_path / "agent.err", "wb") as agent_err:
        agent = subprocess.Popen(
            [PY, "-c", textwrap.dedent(FAKE_AGENT), protection, str(worker)],
            env={**os.environ, "TMPDIR": str(agent_tmpdir)},  # without a reaper, its error folder stays
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=agent_err,
        )
    leftovers.append(agent.pid)
    lines: queue.Queue[str] = queue.Queue()
    assert agent.stdout is not None
    stdout = agent.stdout
    threading.Thread(target=lambda: [lines.put(line.decode()) for line in stdout], daemon=True).start()

    pids: dict = {}
    deadline = time.monotonic() + 150
    while "worker" not in pids or "grandchild" not in pids:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            pytest.fail(f"fake agent printed no pids; stderr: {(tmp_path / 'agent.err').read_text()}")
        if line.startswith("[rank0]:grandchild "):
            pids["grandchild"] = int(line.split()[-1])
        elif line.startswith("{"):
            pids.update(json.loads(line))
    assert pids.pop("launched_by") == "warm"
    leftovers.extend(pid for pid in pids.values() if pid is not None)
    assert psutil.Process(pids["worker"]).ppid() == pids["zygote"]

    agent.kill()
    agent.wait(timeout=10)
    stdout.close()
    wait_until(lambda: gone(pids["zygote"]), 5, "the zygote to die with the agent")
    wait_until(lambda: gone(pids["worker"]), 5, "the worker to die with the zygote")
    if protection == "reaper":
        wait_until(
            lambda: gone(pids["grandchild"]) and gone(pids["reaper"]), 5, "the reaper to kill the grandchild"
        )


# -- the agent side stays light -----------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_the_agent_never_imports_torch_and_starts_the_zygote_at_once() -> None:
    code = """
        import sys, time
        import agent.cli.main
        from agent.warm.starter import WarmLauncher
        started = time.monotonic()
        launcher = WarmLauncher()
        took = time.monotonic() - started
        assert launcher.wait_ready(120), "zygote not ready"
        launcher.close()
        assert "torch" not in sys.modules, "the agent imported torch"
        assert took < 1.0, f"WarmLauncher() took {took:.2f}s"
    """
    result = subprocess.run(
        [PY, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, timeout=170, capture_output=True
    )
    assert result.returncode == 0, result.stderr.decode()


def test_no_warm_start_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.cli.main

    seen = []
    monkeypatch.setattr(agent.cli.main, "run_agent", lambda settings, embed: seen.append(settings) or 0)
    script = str(REPO_ROOT / "scripts" / "train_script.py")
    for args in (["--standalone", script], ["--standalone", "--no-warm-start", script]):
        agent.cli.main.cli.main(args=args, prog_name="elastic-run", standalone_mode=False)
    assert [s.warm_start for s in seen] == [True, False]


# -- eligibility rules --------------------------------------------------------------------------------------
def test_parse_command() -> None:
    assert parse_command([PY, "-u", "x.py", "-u", "a"], PY) == ("script", "x.py", ["-u", "a"], True)
    assert parse_command([PY, "x.py"], PY) == ("script", "x.py", [], False)
    assert parse_command([PY, "-u", "-m", "pkg.mod", "-m"], PY) == ("module", "pkg.mod", ["-m"], True)
    for bad in (
        [PY, "-c", "pass"],
        [PY, "-u"],
        [PY, "-m"],
        [PY, "-X", "dev", "x.py"],
        ["/other/python", "x.py"],
    ):
        assert isinstance(parse_command(bad, PY), str), bad


def test_env_difference() -> None:
    from agent.workers.environment import CONTRACT

    base = {"PATH": "/bin", "HOME": "/root", "PYTHONPATH": "/a"}
    assert set(CONTRACT) <= PER_WORKER_VARIABLES
    per_worker = {name: "1" for name in CONTRACT} | {"TORCHELASTIC_ERROR_FILE": "/e", "ELASTIC_X": "y"}
    assert env_difference(base, {**base, **per_worker}) == []
    assert env_difference(base, {**base, "PYTHONPATH": "/b", "FOO": "x"}) == ["FOO", "PYTHONPATH"]
    assert env_difference(base, {k: v for k, v in base.items() if k != "HOME"}) == ["HOME"]
    assert env_difference({**base, "OMP_NUM_THREADS": "4"}, base) == ["OMP_NUM_THREADS"]  # unset in worker
    assert env_difference(base, {**base, "OMP_NUM_THREADS": "two"}) == ["OMP_NUM_THREADS"]
    assert env_difference(base, {**base, "OMP_NUM_THREADS": "3"}) == []
