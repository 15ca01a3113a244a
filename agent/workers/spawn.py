"""Starting one worker: its error file, log files, the launch, and the threads forwarding its output."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import BinaryIO, cast

from agent.workers.errors_file import error_file_path, prepare_error_file
from agent.workers.filtered_log import FilteredLog
from agent.workers.launchers import Launcher
from agent.workers.output import STDERR_TAIL_LINES, RankLabel, start_forwarder
from agent.workers.reaper import Reaper
from agent.workers.tree import RunningWorker
from agent.workers.types import WorkerSpec
from elastic.contract import ERROR_FILE


def spawn_worker(
    spec: WorkerSpec,
    local_rank: int,
    global_rank: int,
    env: dict[str, str],
    launcher: Launcher,
    error_dir: Path,
    reaper: Reaper | None,
    filtered: dict[str, FilteredLog],
) -> RunningWorker:
    """Start local rank ``local_rank`` of ``spec`` with ``launcher``, registered with ``reaper``, its output
    forwarded (console, ``spec.log_dir``, the ``filtered`` logs); raises what the launcher raises."""
    error_file = error_file_path(error_dir, spec.attempt, global_rank)
    prepare_error_file(error_file)
    log_files = _open_logs(spec, global_rank)
    try:
        proc = launcher.launch(list(spec.argv), {**env, ERROR_FILE: str(error_file)}, spec.cwd)
    except BaseException:
        for log_file in log_files:
            if log_file is not None:
                log_file.close()
        raise
    if reaper is not None:
        reaper.register(proc.pid)
    worker = RunningWorker(
        local_rank=local_rank,
        global_rank=global_rank,
        proc=proc,
        error_file=error_file,
        stderr_tail=deque(maxlen=STDERR_TAIL_LINES),
    )
    # Both are pipes to the agent: every launcher guarantees it.
    stdout, stderr = cast(BinaryIO, proc.stdout), cast(BinaryIO, proc.stderr)
    logged = spec.log_dir is not None
    worker.label = RankLabel(global_rank)
    worker.readers = [
        start_forwarder(
            stdout,
            global_rank=global_rank,
            stream="stdout",
            log_file=log_files[0],
            console=spec.output.shows(local_rank, "stdout", logged),
            filtered=filtered.get("stdout"),
            label=worker.label,
        ),
        start_forwarder(
            stderr,
            global_rank=global_rank,
            stream="stderr",
            log_file=log_files[1],
            tail=worker.stderr_tail,
            console=spec.output.shows(local_rank, "stderr", logged),
            filtered=filtered.get("stderr"),
            label=worker.label,
        ),
    ]
    return worker


def _open_logs(spec: WorkerSpec, global_rank: int) -> tuple[BinaryIO | None, BinaryIO | None]:
    if spec.log_dir is None:
        return None, None
    folder = spec.log_dir / spec.attempt / f"rank{global_rank}"
    folder.mkdir(parents=True, exist_ok=True)
    stdout_log = open(folder / "stdout.log", "wb")  # noqa: SIM115 - the forwarder thread closes it
    try:
        stderr_log = open(folder / "stderr.log", "wb")  # noqa: SIM115 - the forwarder thread closes it
    except OSError:
        stdout_log.close()
        raise
    return stdout_log, stderr_log
