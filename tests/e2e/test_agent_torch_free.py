"""The agent process never loads torch: ``elastic-run`` starts workers (and its warm-start zygote, which
imports torch on purpose) without importing it itself, so it starts fast and a broken torch install
fails workers, not the agent.

A process that imported torch has torch's shared libraries mapped (``libtorch_cpu.so``, ``libc10.so``), so
the check reads ``/proc/<pid>/maps`` of the running agent while its worker, which imported torch, waits.
The same check on the worker proves that it sees torch where torch is.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import e2e
import psutil
import pytest
from e2e import elastic_run_argv, wait_until

launch = e2e.launch  # the fixture: starts processes, kills their trees at teardown

# Imports torch, says so, then idles until the test lets it finish (bounded, should the test die first).
WORKER = """
import os, sys, time
import torch

folder = sys.argv[1]
open(os.path.join(folder, "ready"), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def torch_libraries(pid: int) -> set[str]:
    """torch's shared libraries mapped into process ``pid``."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    paths = {line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6}
    return {p for p in paths if "/torch/lib/" in p or Path(p).name.startswith(("libtorch", "libc10"))}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_agent_process_never_loads_torch(launch, tmp_path: Path) -> None:
    script = tmp_path / "torch_worker.py"
    script.write_text(textwrap.dedent(WORKER))
    folder = tmp_path / "marks"
    folder.mkdir()
    proc = launch(elastic_run_argv("--standalone", "--nproc-per-node", "1", str(script), str(folder)))
    wait_until(lambda: (folder / "ready").exists() or proc.popen.poll() is not None, 180, "the worker")
    assert (folder / "ready").exists(), proc.output()

    workers = proc.worker_pids("torch_worker.py")
    assert workers, "no worker process found"
    assert torch_libraries(workers[0]), "the check does not see torch in the worker that imported it"
    assert psutil.Process(proc.pid).cmdline()[1:3] == ["-m", "agent"]  # the agent itself, no wrapper
    assert torch_libraries(proc.pid) == set(), "the agent process loaded torch"

    (folder / "go").touch()
    assert proc.wait(60) == 0, proc.output()
