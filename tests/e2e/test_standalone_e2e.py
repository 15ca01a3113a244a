"""End-to-end tests of ``elastic-run --standalone``, with real processes and gloo.

Every test starts the real CLI (``python -m agent``) through the ``launch`` fixture, which kills every
process tree it started at teardown. Waiting is always polling with a deadline (``Proc.wait_for``,
``wait_until``), never a bare sleep. Small helper worker scripts are written to ``tmp_path`` where the
check is about the launcher rather than about training, because they start in a fraction of the time
that importing torch takes on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import e2e
import psutil
import pytest
from e2e import REPO, TRAIN_SCRIPT, base_env, elastic_run_argv, wait_until

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

# The worker environment contract (elastic/contract.py; docs/protocol.md, "Worker environment").
CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
)

TWO_WORKERS = ("--standalone", "--nproc-per-node", "2")

# Generous: other test suites share the 2 cores, and each torch worker takes seconds to import.
RUN_TIMEOUT_S = 120

# A worker that idles until stopped; options: --grandchild (spawn a sleeping child first) and
# --ignore-term (log SIGTERM and keep running, so that only SIGKILL ends it).
SLEEPER = """
import os, signal, subprocess, sys, time

rank = os.environ["RANK"]
if "--ignore-term" in sys.argv:
    def on_term(signum, frame):
        print(f"rank={rank} got SIGTERM, ignoring it", flush=True)
    signal.signal(signal.SIGTERM, on_term)
line = f"ready rank={rank} pid={os.getpid()}"
if "--grandchild" in sys.argv:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    line += f" grandchild={child.pid}"
print(line, flush=True)
end = time.monotonic() + 300
while time.monotonic() < end:
    time.sleep(0.5)  # the worker's "work"; the launcher is what stops it
"""

# Writes the worker's environment to DIR/env_<RANK>.json.
ENV_DUMPER = """
import json, os, sys
from pathlib import Path

out = Path(sys.argv[1]) / f"env_{os.environ['RANK']}.json"
out.write_text(json.dumps(dict(os.environ)))
print(f"dumped rank={os.environ['RANK']} args={sys.argv[2:]}", flush=True)
"""

# Rank 1 fails through torch's @record, which writes TORCHELASTIC_ERROR_FILE. Its stderr goes to
# /dev/null first, so the summary can only learn the message from the error file.
RECORD_FAILER = """
import os, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank = os.environ["RANK"]
    print(f"ready rank={rank}", flush=True)
    if rank == "1":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        raise ValueError("recorded root cause 4242")
    end = time.monotonic() + 300
    while time.monotonic() < end:
        time.sleep(0.5)  # rank 0 keeps working until the agent stops it

main()
"""


# -- helpers ----------------------------------------------------------------------------------------------
def write_script(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def stderr_to(path: Path, argv: list[str]) -> list[str]:
    """``argv`` with its stderr sent to ``path`` (the launch fixture merges it into stdout otherwise).

    ``exec`` keeps the PID, so the launched Proc is still elastic-run itself.
    """
    return ["/bin/sh", "-c", f'exec "$@" 2>{shlex.quote(str(path))}', "sh", *argv]


def ranks_ready(proc, nproc: int, timeout: float = 60) -> dict[int, re.Match[str]]:
    """Wait until every local rank printed its ``ready`` line; return the lines by rank."""
    found: dict[int, re.Match[str]] = {}
    for rank in range(nproc):
        found[rank] = proc.wait_for(
            rf"^\[rank{rank}\]:ready rank={rank} pid=(\d+)(?: grandchild=(\d+))?$", timeout
        )
    return found


def wait_no_survivors(proc, timeout: float) -> None:
    """Poll until no descendant ever recorded by ``proc.descendants()`` is alive."""
    deadline = time.monotonic() + timeout
    while proc.survivors():
        if time.monotonic() > deadline:
            details = []
            for pid in proc.survivors():
                try:
                    details.append(f"{pid}: {psutil.Process(pid).cmdline()}")
                except psutil.Error:
                    continue
            raise AssertionError(f"processes survive {timeout}s later: {details}")
        time.sleep(0.05)


def read_env_dumps(folder: Path, nproc: int, pattern: str = "env_{rank}.json") -> dict[int, dict[str, str]]:
    envs = {}
    for rank in range(nproc):
        path = folder / pattern.format(rank=rank)
        assert path.is_file(), f"rank {rank} wrote no environment dump at {path}"
        envs[rank] = json.loads(path.read_text())
    return envs


def check_contract(
    envs: dict[int, dict[str, str]],
    *,
    nproc: int,
    max_restarts: int,
    run_id: str | None = None,
    omp: str = "1",
) -> None:
    """Every contract variable present and consistent, for one node running ``nproc`` workers."""
    assert sorted(envs) == list(range(nproc))
    for rank, env in envs.items():
        missing = [name for name in CONTRACT if name not in env]
        assert not missing, f"rank {rank} lacks {missing}"
        assert env["RANK"] == str(rank)
        assert env["GROUP_RANK"] == "0"
        assert env["LOCAL_RANK"] == str(rank)  # one node: local rank == global rank
        assert int(env["RANK"]) == int(env["GROUP_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + int(
            env["LOCAL_RANK"]
        )
        assert env["WORLD_SIZE"] == str(nproc)
        assert env["LOCAL_WORLD_SIZE"] == str(nproc)
        assert env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_RANK"] == env["RANK"]
        assert env["ROLE_WORLD_SIZE"] == env["WORLD_SIZE"]
        assert env["ROLE_NAME"] == "default"
        assert 0 < int(env["MASTER_PORT"]) < 65536
        assert env["MASTER_ADDR"]
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == str(max_restarts)
        assert env["TORCHELASTIC_RUN_ID"]
        if run_id is not None:
            assert env["TORCHELASTIC_RUN_ID"] == run_id
        assert Path(env["TORCHELASTIC_ERROR_FILE"]).is_absolute()
        assert env["OMP_NUM_THREADS"] == omp
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        assert len({env[name] for env in envs.values()}) == 1, f"{name} differs between ranks"
    error_files = {env["TORCHELASTIC_ERROR_FILE"] for env in envs.values()}
    assert len(error_files) == nproc, f"TORCHELASTIC_ERROR_FILE is not distinct per rank: {error_files}"


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the complete checkpoint files (``step_<N>.pt``; temp files of unfinished saves excluded)."""
    if not ckpt_dir.is_dir():
        return []
    matches = (re.fullmatch(r"step_(\d+)\.pt", p.name) for p in ckpt_dir.iterdir())
    return sorted(int(m.group(1)) for m in matches if m)


def rank_of(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).environ()["RANK"])
    except (psutil.Error, KeyError, ValueError):
        return None


# -- 1. a standalone run finishes -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_standalone_run_finishes_with_final_step(launch, tmp_path):
    steps = 5
    proc = launch(
        elastic_run_argv(
            *TWO_WORKERS,
            str(TRAIN_SCRIPT),
            "--steps",
            str(steps),
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
        ),
        name="run",
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    out = proc.output()
    assert re.search(rf"^\[rank0\]:done step={steps}$", out, re.M), out[-4000:]
    # Every worker line carries its rank's prefix, like torchrun.
    assert re.search(r"^\[rank0\]:start rank=0 world=2 restart=0 resumed_step=0$", out, re.M)
    assert re.search(r"^\[rank1\]:start rank=1 world=2 restart=0 resumed_step=0$", out, re.M)
    step_lines = [line for line in out.splitlines() if re.search(r"step=\d+ loss=", line)]
    assert len(step_lines) == steps
    assert all(line.startswith("[rank0]:step=") for line in step_lines), step_lines
    assert max(checkpoint_steps(tmp_path / "ckpt")) == steps


# A worker whose child starts its own session and loses its parent (a daemon's double fork), so that it is
# in neither the worker's process group nor its tree; the escapee ignores SIGTERM. The worker then succeeds.
ESCAPING_WORKER = """
import os, signal, time
read_end, write_end = os.pipe()
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(write_end, str(os.getpid()).encode())
        time.sleep(300)
    os._exit(0)
os.waitpid(middle, 0)
print("escaped", os.read(read_end, 32).decode(), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_worker_child_that_escaped_its_session_does_not_outlive_the_agent(launch, tmp_path):
    script = tmp_path / "escaping.py"
    script.write_text(ESCAPING_WORKER)
    proc = launch(elastic_run_argv("--standalone", "--nproc-per-node", "1", str(script)), name="run")
    pid = int(proc.wait_for(r"^\[rank0\]:escaped (\d+)$", RUN_TIMEOUT_S).group(1))
    escaped = psutil.Process(pid)  # pinned by its start time: a later process with the PID is not it
    try:
        assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
        # The agent (a child subreaper) inherited it, stopped it with the worker and reaped it.
        assert not escaped.is_running(), f"the escaped child {pid} outlived elastic-run"
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            escaped.kill()  # checks the start time first


# -- 2. SIGKILL of one worker: restart, resume, finish ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killed_worker_restarts_group_and_resumes_from_checkpoint(launch, tmp_path):
    steps, every = 24, 4
    ckpt = tmp_path / "ckpt"
    proc = launch(
        elastic_run_argv(
            *TWO_WORKERS,
            "--max-restarts",
            "3",
            str(TRAIN_SCRIPT),
            "--steps",
            str(steps),
            "--ckpt-dir",
            str(ckpt),
            "--ckpt-every",
            str(every),
            "--step-time",
            "0.25",
        ),
        name="run",
    )

    def steps_seen() -> list[int]:
        return [int(s) for s in re.findall(r"^\[rank0\]:step=(\d+) ", proc.output(), re.M)]

    # Past at least two checkpoints, and with steps left to do after the restart.
    wait_until(
        lambda: (steps_seen() and max(steps_seen()) >= 2 * every + 1) or proc.popen.poll() is not None,
        RUN_TIMEOUT_S,
        "a step past the second checkpoint",
    )
    assert proc.popen.poll() is None, f"elastic-run exited early:\n{proc.output()[-4000:]}"
    pids = proc.worker_pids()
    assert len(pids) == 2, pids
    by_rank = {rank_of(pid): pid for pid in pids}
    assert set(by_rank) == {0, 1}, by_rank
    saved_before_kill = max(checkpoint_steps(ckpt), default=0)
    assert saved_before_kill >= every
    kill_offset = len(proc.output())
    os.kill(by_rank[1], signal.SIGKILL)

    restarted = {
        rank: proc.wait_for(
            rf"^\[rank{rank}\]:start rank={rank} world=2 restart=(\d+) resumed_step=(\d+)$",
            RUN_TIMEOUT_S,
            after=kill_offset,
        )
        for rank in (0, 1)
    }
    for rank, match in restarted.items():
        assert match.group(1) == "1", f"rank {rank} sees restart count {match.group(1)}"
        resumed = int(match.group(2))
        assert resumed >= saved_before_kill, (
            f"rank {rank} resumed from step {resumed}, before the checkpoint of step {saved_before_kill}"
        )
        # Flash checkpoints are taken every step (memory), so the restart may resume past the last disk save.
        assert resumed <= steps
    assert restarted[0].group(2) == restarted[1].group(2), "every rank restores the same step"
    resumed = int(restarted[0].group(2))
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    out = proc.output()
    assert re.search(rf"^\[rank0\]:done step={steps}$", out, re.M), out[-4000:]
    assert "restart=2" not in out
    # The new workers continued right after the resumed step (the step did not go back past it).
    after_restart = [int(s) for s in re.findall(r"^\[rank0\]:step=(\d+) ", out[restarted[0].end() :], re.M)]
    assert after_restart == list(range(resumed + 1, steps + 1)), after_restart


# -- 3. a script that always fails -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_always_failing_script_exhausts_restarts_with_summary(launch, tmp_path):
    err = tmp_path / "stderr.log"
    proc = launch(
        stderr_to(
            err,
            elastic_run_argv(
                *TWO_WORKERS,
                "--max-restarts",
                "2",
                # The same failure every time is a crash loop (exit 3 at the second: test_crash_loop_e2e.py);
                # this test is about spending the budget.
                "--crash-loop-window",
                "0",
                str(TRAIN_SCRIPT),
                "--fail-always",
                "--ckpt-dir",
                str(tmp_path / "ckpt"),
            ),
        ),
        name="run",
    )
    code = proc.wait(240)
    out, errors = proc.output(), err.read_text()
    assert code != 0, out + errors
    # max_restarts + 1 = 3 attempts, with restart counts 0, 1, 2.
    starts = re.findall(r"^\[rank0\]:start rank=0 world=2 restart=(\d+) ", out, re.M)
    assert starts == ["0", "1", "2"], out
    lines = [line for line in errors.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    summary = lines[-1]
    assert summary.startswith("elastic-run: job failed: "), errors[-4000:]
    assert re.search(r"\brank [01]\b", summary), summary
    assert "RuntimeError: injected failure" in summary, summary
    assert "Traceback" not in summary


# -- 4. SIGKILL of elastic-run leaves no orphans -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_of_elastic_run_leaves_no_training_workers(launch, tmp_path):
    agent_tmp = tmp_path / "t"  # short: the progress socket's path must stay under 108 bytes
    agent_tmp.mkdir()

    def agent_folders() -> list[str]:
        return [p.name for p in agent_tmp.iterdir() if p.name.startswith(("elastic-agent-", "elastic-run-"))]

    proc = launch(
        elastic_run_argv(
            *TWO_WORKERS,
            str(TRAIN_SCRIPT),
            "--steps",
            "1000",
            "--step-time",
            "0.2",
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
        ),
        name="run",
        env=base_env(TMPDIR=str(agent_tmp)),
    )
    proc.wait_for(r"^\[rank0\]:step=2 ", RUN_TIMEOUT_S)
    assert "started 2 workers (attempt round1, warm)" in proc.output()  # forked from the zygote
    assert len(proc.worker_pids()) == 2  # also records every descendant (zygote and reaper included)
    assert proc.worker_pids("warm-start zygote"), "the zygote is not among the descendants"
    assert agent_folders(), "the agent's temp folders (progress socket, error files) are in its TMPDIR"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    wait_no_survivors(proc, 5.0)
    # The agent cannot remove them after a SIGKILL; its reaper does.
    wait_until(lambda: not agent_folders(), 5.0, "the reaper to remove the agent's temp folders")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_of_elastic_run_kills_workers_and_grandchildren(launch, tmp_path):
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    proc = launch(elastic_run_argv(*TWO_WORKERS, str(script), "--grandchild"), name="run")
    ready = ranks_ready(proc, 2)
    grandchildren = {int(m.group(2)) for m in ready.values()}
    known = {p.pid for p in proc.descendants()}
    assert grandchildren <= known, (grandchildren, known)
    assert {int(m.group(1)) for m in ready.values()} <= known
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    wait_no_survivors(proc, 5.0)


# -- 5. SIGTERM / SIGINT of elastic-run ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_workers_within_grace(launch, tmp_path, sig):
    grace = 10.0
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    proc = launch(
        elastic_run_argv(*TWO_WORKERS, "--stop-grace", str(grace), str(script), "--grandchild"),
        name="run",
    )
    ranks_ready(proc, 2)
    assert len(proc.descendants()) >= 4  # two workers and their children (plus the reaper)
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    code = proc.wait(grace + 20)
    elapsed = time.monotonic() - sent
    assert code == 128 + sig, proc.output()[-4000:]
    # Workers that obey SIGTERM end at once: the agent must not sit out the grace period.
    assert elapsed < grace, f"exit took {elapsed:.1f}s (grace {grace}s)"
    wait_no_survivors(proc, 5.0)


@pytest.mark.timeout(120)
def test_sigterm_while_the_zygote_imports_torch_exits_before_joining(launch, tmp_path):
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    proc = launch(elastic_run_argv(*TWO_WORKERS, str(script)), name="run")
    proc.wait_for(r"joining once the warm-start zygote has imported torch", RUN_TIMEOUT_S)
    proc.descendants()  # remember the zygote and the reaper
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM, proc.output()[-4000:]
    assert "received SIGTERM before joining; exiting" in proc.output()
    assert "node_joined" not in proc.output() and "started 2 workers" not in proc.output()
    wait_no_survivors(proc, 5.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_kills_workers_that_ignore_it_after_grace(launch, tmp_path):
    grace = 3.0
    script = write_script(tmp_path, "sleeper.py", SLEEPER)
    proc = launch(
        elastic_run_argv(
            *TWO_WORKERS,
            "--stop-grace",
            str(grace),
            str(script),
            "--ignore-term",
            "--grandchild",
        ),
        name="run",
    )
    ranks_ready(proc, 2)
    proc.descendants()
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    # The workers got SIGTERM first ...
    for rank in (0, 1):
        proc.wait_for(rf"^\[rank{rank}\]:rank={rank} got SIGTERM, ignoring it$", 30)
    code = proc.wait(grace + 30)
    elapsed = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, proc.output()[-4000:]
    # ... and SIGKILL only once the grace period was over; then elastic-run exits promptly.
    assert elapsed >= grace - 0.5, f"workers were killed after {elapsed:.1f}s, before the {grace}s grace"
    assert elapsed < grace + 10, f"exit took {elapsed:.1f}s (grace {grace}s)"
    wait_no_survivors(proc, 5.0)


# -- 6. bad input --------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args",
    [
        ["--standalone", "no/such/script.py"],
        ["--standalone", "--nnodes", "3:2", str(TRAIN_SCRIPT)],
        ["--standalone", "--nproc-per-node", "0", str(TRAIN_SCRIPT)],
        ["--standalone", "--no-such-flag", str(TRAIN_SCRIPT)],
    ],
    ids=["missing-script", "nnodes-min-above-max", "nproc-zero", "unknown-flag"],
)
def test_bad_input_is_a_one_line_error(args):
    result = subprocess.run(
        elastic_run_argv(*args), env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elastic-run: error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""


# -- 7. the worker environment contract ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["warm", "exec"])
def test_env_contract_of_training_workers(launch, tmp_path, mode):
    proc = launch(
        elastic_run_argv(
            *TWO_WORKERS,
            *(["--no-warm-start"] if mode == "exec" else []),
            "--max-restarts",
            "5",
            "--rdzv-id",
            "contract-job-7",
            str(TRAIN_SCRIPT),
            "--steps",
            "1",
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
            "--dump-env",
            str(tmp_path / "env_{rank}.json"),
        ),
        name="run",
        env=base_env(ELASTIC_TOKEN="job-control-secret"),
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    assert f"started 2 workers (attempt round1, {mode})" in proc.output()
    envs = read_env_dumps(tmp_path, 2)
    # base_env() removes OMP_NUM_THREADS: unset and nproc > 1 gives 1, as torchrun.
    check_contract(envs, nproc=2, max_restarts=5, run_id="contract-job-7")
    for env in envs.values():
        assert "ELASTIC_TOKEN" not in env, "the job-control token must not reach user code"
        assert "job-control-secret" not in json.dumps(env)


@pytest.mark.timeout(120)
def test_env_contract_keeps_user_omp_num_threads(launch, tmp_path):
    script = write_script(tmp_path, "dump_env.py", ENV_DUMPER)
    out = tmp_path / "envs"
    out.mkdir()
    proc = launch(
        elastic_run_argv(*TWO_WORKERS, str(script), str(out)),
        name="run",
        env=base_env(OMP_NUM_THREADS="3"),
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    envs = read_env_dumps(out, 2)
    check_contract(envs, nproc=2, max_restarts=int(envs[0]["TORCHELASTIC_MAX_RESTARTS"]), omp="3")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how",
    ["nproc_per_node-flag", "nproc_per_node-equals", "PET-env"],
)
def test_torchrun_spellings(launch, tmp_path, how):
    script = write_script(tmp_path, "dump_env.py", ENV_DUMPER)
    out = tmp_path / "envs"
    out.mkdir()
    if how == "PET-env":
        flags: list[str] = []
        env = base_env(PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS="4", PET_RDZV_ID="pet-job")
    else:
        flags = (
            ["--nproc_per_node", "2", "--max_restarts", "4", "--rdzv_id", "pet-job"]
            if how == "nproc_per_node-flag"
            else ["--nproc_per_node=2", "--max_restarts=4", "--rdzv_id=pet-job"]
        )
        env = base_env()
    proc = launch(elastic_run_argv("--standalone", *flags, str(script), str(out)), name="run", env=env)
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    check_contract(read_env_dumps(out, 2), nproc=2, max_restarts=4, run_id="pet-job")


@pytest.mark.timeout(120)
def test_module_mode(launch, tmp_path):
    modules = tmp_path / "mods"
    modules.mkdir()
    write_script(modules, "elastic_e2e_dump_mod.py", ENV_DUMPER)
    out = tmp_path / "envs"
    out.mkdir()
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(modules), env["PYTHONPATH"]])
    proc = launch(
        elastic_run_argv(*TWO_WORKERS, "-m", "elastic_e2e_dump_mod", str(out), "--extra", "x"),
        name="run",
        env=env,
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    for rank in (0, 1):
        assert f"[rank{rank}]:dumped rank={rank} args=['--extra', 'x']" in proc.output()
    envs = read_env_dumps(out, 2)
    check_contract(envs, nproc=2, max_restarts=int(envs[0]["TORCHELASTIC_MAX_RESTARTS"]))


@pytest.mark.timeout(120)
def test_no_python_mode(launch, tmp_path):
    proc = launch(
        elastic_run_argv(
            *TWO_WORKERS,
            "--no-python",
            "sh",
            "-c",
            'echo "shell rank=$RANK world=$WORLD_SIZE arg=$0"',
            "argzero",
        ),
        name="run",
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    for rank in (0, 1):
        assert re.search(rf"^\[rank{rank}\]:shell rank={rank} world=2 arg=argzero$", proc.output(), re.M), (
            proc.output()[-4000:]
        )


# -- 8. the worker's error file reaches the failure summary --------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_error_file_written_by_record_shows_in_summary(launch, tmp_path):
    script = write_script(tmp_path, "record_failer.py", RECORD_FAILER)
    err = tmp_path / "stderr.log"
    proc = launch(
        stderr_to(err, elastic_run_argv(*TWO_WORKERS, "--max-restarts", "0", str(script))),
        name="run",
    )
    code = proc.wait(RUN_TIMEOUT_S)
    errors = err.read_text()
    assert code != 0, proc.output() + errors
    lines = [line for line in errors.splitlines() if line.strip()]
    summary = lines[-1]
    assert summary.startswith("elastic-run: job failed: "), errors[-4000:]
    assert re.search(r"\brank 1\b", summary), summary
    # The worker's stderr was /dev/null: the message can only have come from its error file.
    assert "ValueError: recorded root cause 4242" in summary, summary
