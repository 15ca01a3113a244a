"""torchrun 2.13 flag parity of ``elastic-run``: parsing helpers, the option/``PET_*`` parity with torchrun's
own parser, and end-to-end runs showing each flag's effect (or its one warning line).

The end-to-end runs use tiny worker scripts that do not import torch, started by the real CLI through the
``launch`` fixture (which kills every process tree it started); waiting is polling with deadlines.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import click
import e2e
import pytest
import torch
from click.core import ParameterSource
from e2e import REPO, base_env, elastic_run_argv

import agent.cli.main
import agent.cli.resolve
from agent.cli import torchrun as tc
from agent.observe.events import PREFIX, ConsoleEventLog, event_log_for
from agent.settings import DEFAULT_STOP_GRACE_S
from agent.workers.filtered_log import FilteredLog, open_filtered_logs
from agent.workers.output import OutputPolicy, Std, StdSpec

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

RUN_TIMEOUT_S = 90
SCRIPT = str(REPO / "scripts" / "train_script.py")  # exists; in-process CLI tests never run it


# -- (a) parsing helpers -------------------------------------------------------------------------------------
def test_parse_std_spec() -> None:
    assert tc.parse_std_spec("3") == StdSpec(default=Std.ALL)
    assert tc.parse_std_spec(" 0 ").empty
    spec = tc.parse_std_spec("0:1,1:2,12:3")
    assert [spec.for_rank(r) for r in (0, 1, 2, 12)] == [Std.OUT, Std.ERR, Std.NONE, Std.ALL]
    assert not spec.empty and tc.parse_std_spec("0:0,1:0").empty
    for bad in ("", "4", "0:4", "a", "0:1,", "1:"):
        with pytest.raises(ValueError):
            tc.parse_std_spec(bad)


def test_parse_local_ranks() -> None:
    assert tc.parse_local_ranks("") is None and tc.parse_local_ranks("  ") is None
    assert tc.parse_local_ranks("1") == {1}
    assert tc.parse_local_ranks("0, 2,2") == {0, 2}
    for bad in ("a", "1,", "-1", "1.5", ",0"):
        with pytest.raises(ValueError):
            tc.parse_local_ranks(bad)


def test_parse_filters_matches_torchrun_and_drops_empty_items() -> None:
    torchrun_type = next(
        a.type for a in _torchrun_actions() if a.dest == "duplicate_stdout_filters"
    )  # torchrun's comma_separated_list
    for text in ("apple,orange", "a,,b", "x,,,y", "one"):
        assert tc.parse_filters(text) == tuple(torchrun_type(text)), text
    assert tc.parse_filters("a,,b") == ("a,b",)
    assert tc.parse_filters("") == () and tc.parse_filters(",") == ()


def test_parse_signals() -> None:
    default = tc.parse_signals(tc.DEFAULT_SIGNALS)
    assert default.shutdown == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
    assert default.forward == frozenset()
    plan = tc.parse_signals("SIGUSR1, usr2,SIGHUP")
    assert plan.forward == {signal.SIGUSR1, signal.SIGUSR2}
    assert plan.shutdown == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # TERM, INT always
    assert tc.parse_signals("").handled == {signal.SIGTERM, signal.SIGINT}
    for bad, reason in (("SIGFOO", "unknown signal"), ("SIGKILL", "cannot"), ("SIGSTOP", "cannot")):
        with pytest.raises(ValueError, match=reason):
            tc.parse_signals(f"SIGTERM,{bad}")


def test_resolve_stop_grace() -> None:
    resolve = tc.resolve_stop_grace
    assert resolve(None, None, None, 5.0) == 5.0
    assert resolve(None, None, "12", 5.0) == 12.0  # TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    assert resolve(2.0, None, "12", 5.0) == 2.0  # an explicit flag beats the variable
    assert resolve(None, 3.0, "12", 5.0) == 3.0
    assert resolve(4.0, 4.0, None, 5.0) == 4.0
    with pytest.raises(ValueError, match="same setting"):
        resolve(1.0, 2.0, None, 5.0)
    for bad in ("x", "-1", "nan"):
        with pytest.raises(ValueError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
            resolve(None, None, bad, 5.0)


def test_virtual_local_rank_envs() -> None:
    assert tc.virtual_local_rank_envs(2, None, gpus=0) == ({"LOCAL_RANK": "0"}, {"LOCAL_RANK": "0"})
    assert tc.virtual_local_rank_envs(2, "7, 4", gpus=2) == (
        {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "7"},
        {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "4"},
    )
    assert [e["CUDA_VISIBLE_DEVICES"] for e in tc.virtual_local_rank_envs(2, None, gpus=2)] == ["0", "1"]
    with pytest.raises(ValueError, match="local rank 2"):
        tc.virtual_local_rank_envs(3, "0,1", gpus=2)


def test_compat_warnings_one_line_per_given_flag() -> None:
    assert tc.compat_warnings(tc.GivenFlags()) == []
    assert (
        tc.compat_warnings(tc.GivenFlags(log_dir=True, redirects=StdSpec(Std.ALL), tee=StdSpec(Std.OUT)))
        == []
    )
    given = tc.GivenFlags(
        redirects=StdSpec(Std.ALL),
        tee=StdSpec(Std.OUT),
        monitor_interval=5.0,
        start_method="fork",
        run_path=True,
        node_rank=1,
        logs_specs="custom",
        numa_binding="node",
        event_log_handler="dynamic_rendezvous",
        duplicate_stdout_filters=True,
        duplicate_stderr_filters=True,
        unknown_rdzv_keys=("timeout", "is_host"),
    )
    lines = tc.compat_warnings(given)
    assert len(lines) == 12 and all("\n" not in line for line in lines)
    flags = [line.split()[0] for line in lines]
    assert len(set(flags)) == len(flags), flags
    assert "timeout, is_host" in lines[6] and "no GPU" in lines[8]
    with_gpu = tc.compat_warnings(tc.GivenFlags(numa_binding="node", gpus=2))
    assert with_gpu == ["--numa-binding node is not implemented yet: workers are not bound"]


def test_output_policy() -> None:
    policy = OutputPolicy(console_ranks=frozenset({1}), redirects=tc.parse_std_spec("1:2"))
    assert not policy.shows(0, "stdout", logged=True)
    assert policy.shows(1, "stdout", logged=True)
    assert not policy.shows(1, "stderr", logged=True)  # redirected to the file only
    assert policy.shows(1, "stderr", logged=False)  # no file: a redirect would lose the output
    teed = OutputPolicy(redirects=tc.parse_std_spec("3"), tee=tc.parse_std_spec("0:2"))
    assert teed.shows(0, "stderr", logged=True) and not teed.shows(0, "stdout", logged=True)
    assert OutputPolicy().shows(5, "stderr", logged=True)


def test_filtered_log(tmp_path: Path) -> None:
    logs = open_filtered_logs(tmp_path, "round1", ("apple", "a,b"), ())
    assert list(logs) == ["stdout"]
    log = logs["stdout"]
    assert log.path == tmp_path / "round1" / "filtered_stdout.log"
    assert log.matches("an apple") and log.matches("x a,b y") and not log.matches("a b")
    log.write_line("[rank0]:an apple\n")
    log.close()
    log.write_line("[rank0]:dropped after close\n")
    assert log.path.read_text() == "[rank0]:an apple\n"
    assert open_filtered_logs(None, "round1", ("apple",), ("x",)) == {}
    assert isinstance(log, FilteredLog)


def test_console_event_log(capsys: pytest.CaptureFixture[str]) -> None:
    event_log_for("null", "n").record("workers_started", round=1)
    event_log_for("dynamic_rendezvous", "n").record("workers_started", round=1)
    assert capsys.readouterr().err == ""
    log = event_log_for("console", "node-a")
    assert isinstance(log, ConsoleEventLog)
    log.record("workers_started", round=3, pids=[1, 2])
    err = capsys.readouterr().err
    assert err.startswith(PREFIX) and err.count("\n") == 1
    event = json.loads(err[len(PREFIX) :])
    assert event["name"] == "workers_started" and event["node_id"] == "node-a"
    assert event["round"] == 3 and event["pids"] == [1, 2]


# -- the CLI in process (run_agent replaced: only the option resolution is under test) -----------------------
@pytest.fixture
def resolve(monkeypatch: pytest.MonkeyPatch):
    """``resolve(*args, **env) -> AgentSettings`` for ``elastic-run --standalone ARGS SCRIPT``."""
    for name in list(os.environ):
        if name.startswith("PET_") or name == tc.SHUTDOWN_TIMEOUT_ENV:
            monkeypatch.delenv(name)
    seen = []
    monkeypatch.setattr(agent.cli.main, "run_agent", lambda settings, embed: seen.append(settings) or 0)

    def _resolve(*args: str, **env: str):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            agent.cli.main.cli.main(
                args=["--standalone", *args, SCRIPT], prog_name="elastic-run", standalone_mode=False
            )
        return seen[-1]

    return _resolve


def test_shutdown_timeout_and_stop_grace(resolve) -> None:
    assert resolve().stop_grace_s == DEFAULT_STOP_GRACE_S
    assert resolve("--shutdown-timeout", "7").stop_grace_s == 7
    assert resolve("--shutdown_timeout", "7", "--stop-grace", "7").stop_grace_s == 7
    assert resolve("--stop-grace", "2").stop_grace_s == 2
    assert resolve(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="11").stop_grace_s == 11
    assert resolve("--stop-grace", "2", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="11").stop_grace_s == 2
    assert resolve(PET_SHUTDOWN_TIMEOUT="9").stop_grace_s == 9
    with pytest.raises(click.UsageError, match="same setting"):
        resolve("--stop-grace", "1", "--shutdown-timeout", "2")


def test_cli_resolves_torchrun_flags(resolve, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(agent.cli.resolve, "visible_gpus", lambda: 0)
    settings = resolve(
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path),
        "--local-ranks-filter",
        "1",
        "-r",
        "0:3",
        "--duplicate-stdout-filters",
        "a,,b,c",
        "--virtual-local-rank",
        "--signals-to-handle",
        "SIGTERM,SIGUSR1",
        "--event-log-handler",
        "console",
    )
    assert settings.output == OutputPolicy(
        console_ranks=frozenset({1}),
        redirects=StdSpec(by_rank=((0, Std.ALL),)),
        stdout_filters=("a,b", "c"),
    )
    assert settings.per_rank_env == ({"LOCAL_RANK": "0"}, {"LOCAL_RANK": "0"})
    assert settings.signals.forward == {signal.SIGUSR1}
    assert settings.event_log_handler == "console"
    # torchrun's --rdzv-conf timeouts apply unless elastic-run's own flags are given.
    assert resolve("--rdzv-conf", "join_timeout=60,last_call_timeout=1").job.join_timeout_s == 60
    assert resolve("--rdzv-conf", "join_timeout=60", "--join-timeout", "30").job.join_timeout_s == 30
    # No --log-dir: redirects and filters cannot apply (warned about), the console shows everything.
    assert resolve("-r", "3", "--duplicate-stderr-filters", "x").output == OutputPolicy()


def test_warnings_only_for_given_flags_once_each(resolve, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent")
    resolve()
    assert caplog.records == []
    resolve("--monitor-interval", "5", "--start-method", "fork", "--rdzv-conf", "timeout=5,is_host=1")
    resolve(PET_NODE_RANK="2", PET_LOGS_SPECS="custom", PET_RUN_PATH="1")  # PET_* counts as given
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split()[0] for m in messages] == [
        "--monitor-interval",
        "--start-method",
        "--rdzv-conf",
        "--run-path",
        "--node-rank",
        "--logs-specs",
    ], messages
    assert "timeout, is_host" in messages[2] and "--node-rank 2" in messages[4]


# -- (b) parity with torchrun's parser -----------------------------------------------------------------------
def _torchrun_actions():
    from torch.distributed.run import get_args_parser

    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def _param_for(option: str) -> click.Parameter | None:
    for param in agent.cli.main.cli.params:
        if option in getattr(param, "opts", []) + getattr(param, "secondary_opts", []):
            return param
    return None


def _env_value(param: click.Parameter) -> str:
    if isinstance(param.type, click.Choice):
        return str(param.type.choices[-1])
    return "1"


def test_every_torchrun_option_is_accepted_with_its_pet_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    missing, wrong_env = [], []
    for action in _torchrun_actions():
        params = {option: _param_for(option) for option in action.option_strings}
        absent = [option for option, param in params.items() if param is None]
        if absent:
            missing.extend(absent)
            continue
        assert len({p.name for p in params.values()}) == 1, f"{action.option_strings} name several options"
        param = next(iter(params.values()))
        assert param.name == action.dest, (
            f"{action.option_strings}: dest {param.name}, torchrun {action.dest}"
        )
        if type(action).__name__ not in ("env", "check_env"):
            continue  # torchrun reads no PET_ variable for it (--logs-specs, --numa-binding)
        variable = f"PET_{action.dest.upper()}"
        with monkeypatch.context() as m:
            m.setenv(variable, _env_value(param))
            ctx = agent.cli.main.cli.make_context("elastic-run", ["script.py"])
            if ctx.get_parameter_source(param.name) is not ParameterSource.ENVIRONMENT:
                wrong_env.append(variable)
    assert not wrong_env, f"not read from torchrun's PET_ variable: {wrong_env}"
    if missing:
        message = f"torchrun {torch.__version__} options elastic-run refuses: {missing}"
        if not torch.__version__.startswith("2.13."):
            warnings.warn(message, stacklevel=1)  # a newer torchrun: report, do not fail
        else:
            pytest.fail(message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args",
    [
        ["--local-ranks-filter", "one"],
        ["--signals-to-handle", "SIGTERM,SIGFOO"],
        ["--signals_to_handle", "SIGKILL"],
        ["-r", "0:7"],
        ["--stop-grace", "1", "--shutdown-timeout", "2"],
        ["--numa-binding", "nowhere"],
    ],
    ids=["ranks-filter", "unknown-signal", "sigkill", "redirects", "grace-conflict", "numa-mode"],
)
def test_bad_torchrun_flag_is_a_one_line_error(args: list[str]) -> None:
    result = subprocess.run(
        elastic_run_argv("--standalone", *args, SCRIPT),
        env=base_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastic-run: error: "), result.stderr


# -- (c) end to end ------------------------------------------------------------------------------------------
# Prints its view of the local rank, some lines to filter on both streams, then exits.
REPORTER = """
import os, sys
rank = os.environ["RANK"]
print(f"ready rank={rank} local={os.environ['LOCAL_RANK']} real={os.environ['ELASTIC_LOCAL_RANK']} "
      f"cvd={os.environ.get('CUDA_VISIBLE_DEVICES', '-')}", flush=True)
print(f"keep apple rank={rank}", flush=True)
print(f"list a,b rank={rank}", flush=True)
print(f"drop a b rank={rank}", flush=True)
print(f"err cherry rank={rank}", file=sys.stderr, flush=True)
print(f"err plum rank={rank}", file=sys.stderr, flush=True)
"""

# Waits for SIGUSR1 (handler installed before "ready"), says so and exits 0.
USR1_WAITER = """
import os, signal, threading
rank = os.environ["RANK"]
got = threading.Event()
signal.signal(signal.SIGUSR1, lambda signum, frame: got.set())
print(f"ready rank={rank}", flush=True)
if not got.wait(60):
    raise SystemExit(f"rank {rank}: no SIGUSR1 within 60s")
print(f"got SIGUSR1 rank={rank}", flush=True)
"""


def write_script(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _no_gpu_env() -> dict[str, str]:
    env = base_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(agent.cli.resolve.visible_gpus() > 0, reason="checks the no-GPU behaviour")
def test_console_filter_duplicates_virtual_rank_events_and_warnings(launch, tmp_path: Path) -> None:
    script = write_script(tmp_path, "reporter.py", REPORTER)
    logs = tmp_path / "logs"
    proc = launch(
        elastic_run_argv(
            *("--standalone", "--nproc-per-node", "2", "--no-warm-start", "--log-dir", str(logs)),
            *("--local-ranks-filter", "1", "--virtual-local-rank", "--event-log-handler", "console"),
            *("--duplicate-stdout-filters", "apple,a,,b", "--duplicate_stderr_filters", "cherry"),
            *("--numa-binding", "node", "--logs-specs", "custom", "--monitor-interval", "5"),
            *("--node-rank", "1", "--rdzv-conf", "timeout=30,join_timeout=60"),
            str(script),
        ),
        name="run",
        env=_no_gpu_env(),
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    out = proc.output()
    worker_lines = [line for line in out.splitlines() if line.startswith("[rank")]
    # Only local rank 1's lines, stdout and stderr, on the console ...
    assert worker_lines and all(line.startswith("[rank1]:") for line in worker_lines), worker_lines
    assert "[rank1]:err cherry rank=1" in worker_lines and "[rank1]:keep apple rank=1" in worker_lines
    # ... the log files have every rank; each worker sees LOCAL_RANK=0 and, no GPU, no CUDA_VISIBLE_DEVICES.
    for rank in (0, 1):
        stdout = lines_of(logs / "round1" / f"rank{rank}" / "stdout.log")
        assert stdout[0] == f"ready rank={rank} local=0 real={rank} cvd=-", stdout
        assert f"err plum rank={rank}" in lines_of(logs / "round1" / f"rank{rank}" / "stderr.log")
    # The filtered copies hold exactly the matching lines of both ranks, with the rank prefix.
    assert sorted(lines_of(logs / "round1" / "filtered_stdout.log")) == [
        "[rank0]:keep apple rank=0",
        "[rank0]:list a,b rank=0",
        "[rank1]:keep apple rank=1",
        "[rank1]:list a,b rank=1",
    ]
    assert sorted(lines_of(logs / "round1" / "filtered_stderr.log")) == [
        "[rank0]:err cherry rank=0",
        "[rank1]:err cherry rank=1",
    ]
    events = [json.loads(line[len(PREFIX) :]) for line in out.splitlines() if line.startswith(PREFIX)]
    names = [event["name"] for event in events]
    assert names[0] == "workers_started" and names[-1] == "job_finished", names
    assert events[-1]["succeeded"] is True and events[0]["ranks"] == [0, 1]
    for warning in (
        "--numa-binding node is ignored: no GPU",
        "--logs-specs custom is ignored",
        "--monitor-interval has no effect",
        "--node-rank 1 is ignored",
        "--rdzv-conf key(s) timeout ignored",
    ):
        assert out.count(warning) == 1, (warning, out[-4000:])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_redirects_and_virtual_rank_devices(launch, tmp_path: Path) -> None:
    script = write_script(tmp_path, "reporter.py", REPORTER)
    logs = tmp_path / "logs"
    env = base_env(CUDA_VISIBLE_DEVICES="7,4")  # fake devices: the workers never touch CUDA
    proc = launch(
        elastic_run_argv(
            *("--standalone", "--nproc-per-node", "2", "--no-warm-start", "--log-dir", str(logs)),
            *(
                "-r",
                "0:1,1:3",
                "--tee",
                "1:2",
                "--virtual_local_rank",
                "--start-method",
                "fork",
                "--run-path",
            ),
            str(script),
        ),
        name="run",
        env=env,
    )
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    worker_lines = [line for line in proc.output().splitlines() if line.startswith("[rank")]
    # Both ranks' stdout go to their files only; rank 1's stderr, redirected but also teed, is shown.
    assert worker_lines and all(re.match(r"\[rank[01]\]:err ", line) for line in worker_lines), worker_lines
    assert "[rank0]:err cherry rank=0" in worker_lines and "[rank1]:err cherry rank=1" in worker_lines
    for rank, device in ((0, "7"), (1, "4")):
        stdout = lines_of(logs / "round1" / f"rank{rank}" / "stdout.log")
        assert stdout[0] == f"ready rank={rank} local=0 real={rank} cvd={device}", stdout
        assert f"err cherry rank={rank}" in lines_of(logs / "round1" / f"rank{rank}" / "stderr.log")
    out = proc.output()
    assert out.count("--start-method fork has no effect") == 1 and out.count("--run-path has no effect") == 1
    assert "--redirects" not in out and "--tee" not in out  # with --log-dir both apply: nothing to warn


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["exec", "warm"])
def test_sigusr1_is_forwarded_to_the_workers_and_the_job_goes_on(launch, tmp_path: Path, mode: str) -> None:
    script = write_script(tmp_path, "usr1.py", USR1_WAITER)
    start = ["--no-warm-start"] if mode == "exec" else []
    proc = launch(
        elastic_run_argv(
            *("--standalone", "--nproc-per-node", "2", *start),
            *("--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "--event-log-handler", "console"),
            str(script),
        ),
        name="run",
    )
    for rank in (0, 1):
        proc.wait_for(rf"^\[rank{rank}\]:ready rank={rank}$", RUN_TIMEOUT_S)
    proc.wait_for(rf"started 2 workers \(attempt round1, {mode}\)", RUN_TIMEOUT_S)
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(RUN_TIMEOUT_S) == 0, proc.output()[-4000:]
    out = proc.output()
    for rank in (0, 1):
        assert re.search(rf"^\[rank{rank}\]:got SIGUSR1 rank={rank}$", out, re.M), out[-4000:]
    assert "forwarded SIGUSR1 to the workers" in out
    assert f'{PREFIX}{{"name": "signal_forwarded"' in out


def test_agent_modules_stay_free_of_torch() -> None:
    code = (
        "import agent.cli.main, agent.cli.torchrun, agent.cli.startup, "
        "agent.observe.events, agent.executor.loop, sys; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
