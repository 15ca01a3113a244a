"""The crash-loop stop end to end (``master.job.crash_loop``; docs/failures.md, "Crash loops"): the real
``elastic-run --standalone`` CLI, its embedded master and real worker processes.

A deterministic failure stops the job at once with exit code 3 (failed for good) and the root cause on the
last line, instead of spending ``--max-restarts``. The workers here are small torch-free scripts, so that
the tests measure the launcher, not torch's import. A single worker SIGKILL is still charged once and the
job recovers and exits 0: ``test_killed_worker_restarts_group_and_resumes_from_checkpoint`` in
tests/e2e/test_standalone_e2e.py checks that (restart=1, then the job finishes).
"""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import e2e
import pytest
from e2e import elastic_run_argv

from elastic.exit_codes import ExitCode

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

pytestmark = pytest.mark.slow

# Generous: other suites share the 2 cores. Derived from nothing measured: a bound, not an assertion.
RUN_TIMEOUT_S = 120

# Prints its start line, then imports a module that does not exist (a typo, a missing dependency).
IMPORT_FAILER = """
import os
print(f"start rank={os.environ['RANK']} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
import elastic_crash_loop_no_such_module  # noqa: F401
"""

# Trains (step 1 reported to the agent), then fails at step 2 with the same ValueError on every attempt.
STEP_FAILER = """
import os, time
import elastic

print(f"start rank={os.environ['RANK']} restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
for step in range(1, 100):
    time.sleep(0.2)  # the step's "work"
    if step == 2:
        raise ValueError(f"bad batch at step {step} (pid {os.getpid()})")
    elastic.report(step)
"""


def run_to_end(launch, tmp_path: Path, source: str, *flags: str) -> tuple[int, str, list[str]]:
    """Run ``source`` as the training script of a two-worker standalone job; (exit code, stdout, the
    non-empty stderr lines)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    err = tmp_path / "stderr.log"
    argv = elastic_run_argv(
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", *flags, str(script)
    )
    proc = launch(["/bin/sh", "-c", f'exec "$@" 2>{shlex.quote(str(err))}', "sh", *argv], name="run")
    code = proc.wait(RUN_TIMEOUT_S)
    return code, proc.output(), [line for line in err.read_text().splitlines() if line.strip()]


def starts(out: str) -> list[str]:
    """The restart counts of rank 0's start lines: one per start of the workers."""
    return re.findall(r"^\[rank0\]:start rank=0 restart=(\d+)$", out, re.M)


@pytest.mark.timeout(180)
def test_a_script_failing_at_import_stops_after_one_start_with_exit_code_3(launch, tmp_path):
    code, out, errors = run_to_end(launch, tmp_path, IMPORT_FAILER)

    assert code == ExitCode.FAILED_FOR_GOOD, "\n".join(errors[-20:])
    assert starts(out) == ["0"], out
    last = errors[-1]
    assert last.startswith("elastic-run: job failed: deterministic (crash loop): "), last
    assert "ModuleNotFoundError: No module named 'elastic_crash_loop_no_such_module'" in last, last
    assert "known start-up error (import)" in last, last


@pytest.mark.timeout(180)
def test_without_the_start_up_rule_an_import_error_is_charged_then_stops_as_a_loop(launch, tmp_path):
    """--no-stop-on-startup-error: the first failure is charged (a file may appear late); the same failure
    again is still a crash loop."""
    code, out, errors = run_to_end(launch, tmp_path, IMPORT_FAILER, "--no-stop-on-startup-error")

    assert code == ExitCode.FAILED_FOR_GOOD, "\n".join(errors[-20:])
    assert starts(out) == ["0", "1"], out
    assert "the same failure 2 times" in errors[-1], errors[-1]


@pytest.mark.timeout(240)
def test_the_same_error_at_step_2_every_time_stops_after_the_second_failure(launch, tmp_path):
    code, out, errors = run_to_end(launch, tmp_path, STEP_FAILER)

    assert code == ExitCode.FAILED_FOR_GOOD, "\n".join(errors[-20:])
    assert starts(out) == ["0", "1"], out
    last = errors[-1]
    assert last.startswith("elastic-run: job failed: deterministic (crash loop): "), last
    assert "ValueError: bad batch at step 2" in last, last
    assert "the same failure 2 times" in last and "(after steps)" in last, last
