"""Record a hung worker's Python stack before the agent kills it.

Two ways, the first that works:

1. ``py-spy dump --pid PID --nonblocking`` when ``py-spy`` is on PATH (it needs the right to read the
   worker's memory: root, CAP_SYS_PTRACE or ``kernel.yama.ptrace_scope=0``); its output is saved as
   ``stack-py-spy.txt``;
2. faulthandler: every worker arms it on its first ``elastic.report()`` (see :mod:`elastic.report`),
   writing to ``stack.txt``, the file the agent names in ``ELASTIC_STACK_FILE``; the agent sends SIGUSR1,
   then SIGCONT so that a stopped worker runs the handler, and waits (bounded) for the dump to land.

Both files sit next to the worker's logs: ``<log dir>/<attempt>/rank<N>/`` with ``--log-dir``, else in the
worker group's error folder, a temporary folder removed at the agent's exit: a dump taken there is copied
to a folder that is kept (``$TMPDIR/elastic-run-stacks-*/<attempt>/rank<N>/``, one per agent, private), and
that copy is the path the agent's lines and the failure summary name. The agent also logs the stack itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.report import STACK_SIGNAL

STACK_FILE_NAME = "stack.txt"
PYSPY_FILE_NAME = "stack-py-spy.txt"
#: Bound on one dump (py-spy run, or faulthandler's write); the dumps of several workers run in parallel.
DUMP_TIMEOUT_S = 10.0
_POLL_S = 0.02
_SETTLE_S = 0.1  # a faulthandler dump is complete when the file stopped growing for this long


def stack_file_path(root: Path, attempt: str, global_rank: int) -> Path:
    """Where the worker with ``global_rank`` writes its faulthandler dump during ``attempt``."""
    return root / attempt / f"rank{global_rank}" / STACK_FILE_NAME


@dataclass(frozen=True)
class StackDump:
    global_rank: int
    pid: int
    path: Path | None  # where the stack was saved (None: it could not be taken)
    how: str  # "py-spy" | "faulthandler" | ""
    text: str
    error: str = ""


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    except (OSError, ValueError, IndexError):
        return False
    return False


def _py_spy(pid: int, global_rank: int, stack_file: Path, timeout_s: float) -> StackDump | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--nonblocking"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None  # typically no permission to read the worker's memory; faulthandler is next
    path = stack_file.with_name(PYSPY_FILE_NAME)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(done.stdout)
    except OSError:
        return StackDump(global_rank, pid, None, "py-spy", done.stdout)
    return StackDump(global_rank, pid, path, "py-spy", done.stdout)


def _faulthandler(pid: int, global_rank: int, stack_file: Path, timeout_s: float) -> StackDump:
    try:
        before = stack_file.stat().st_size
    except OSError:
        return StackDump(
            global_rank, pid, None, "", "", "the worker never armed a stack dump (no elastic.report() call)"
        )
    if not catches_signal(pid, STACK_SIGNAL):
        return StackDump(global_rank, pid, None, "", "", f"the worker does not handle {STACK_SIGNAL.name}")
    try:
        _signal_main_thread(pid, STACK_SIGNAL)
        os.kill(pid, signal.SIGCONT)  # a stopped worker runs the handler only once continued
    except ProcessLookupError:
        return StackDump(global_rank, pid, None, "", "", "the worker exited")
    deadline = time.monotonic() + timeout_s
    size, stable_since = before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)  # the dump is written by the worker's signal handler: nothing to wait on
        with contextlib.suppress(OSError):
            now_size = stack_file.stat().st_size
            if now_size != size:
                size, stable_since = now_size, time.monotonic()
        if size > before and time.monotonic() - stable_since >= _SETTLE_S:
            break
    try:
        with open(stack_file, errors="replace") as f:
            f.seek(before)
            text = f.read()
    except OSError as exc:
        return StackDump(global_rank, pid, None, "", "", f"cannot read {stack_file}: {exc}")
    if not text:
        return StackDump(global_rank, pid, None, "", "", f"no dump within {timeout_s:g}s")
    return StackDump(global_rank, pid, stack_file, "faulthandler", text)


def _signal_main_thread(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the main thread of ``pid`` (tgkill), not to the process.

    The kernel hands a process-directed signal to any thread that wants it, and a stopped main thread does
    not: faulthandler then runs on a native thread (gloo's, OpenMP's) and walks the main thread's frames
    while it runs again, which can cut the stack short. On the main thread it dumps a consistent stack."""
    tgkill = getattr(_libc(), "tgkill", None)  # glibc >= 2.30
    if tgkill is None or tgkill(pid, pid, int(sig)) != 0:
        err = ctypes.get_errno() if tgkill is not None else 0
        if err == errno.ESRCH:
            raise ProcessLookupError(err, os.strerror(err))
        os.kill(pid, sig)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def dump_stack(pid: int, global_rank: int, stack_file: Path, timeout_s: float = DUMP_TIMEOUT_S) -> StackDump:
    """Record the Python stack of worker ``pid`` (py-spy, else faulthandler); never raises. A dump in a
    folder removed at exit is copied to a kept one (:func:`kept_copy`), whose path the result names."""
    dump = _py_spy(pid, global_rank, stack_file, timeout_s) or _faulthandler(
        pid, global_rank, stack_file, timeout_s
    )
    if dump.path is None or not removed_at_exit(dump.path):
        return dump
    try:
        return dataclasses.replace(dump, path=kept_copy(dump.path))
    except OSError as exc:  # the dump is still in the log lines; say why the file is not kept
        return dataclasses.replace(dump, error=f"not kept ({exc.strerror or exc})")


#: The name prefix of the worker group's default error folder (agent.workers.group: a temporary folder
#: the agent removes at exit, also when killed).
TEMPORARY_ROOT_PREFIX = "elastic-run-errors-"
#: The name prefix of the folder where such dumps are kept.
KEPT_PREFIX = "elastic-run-stacks-"
_kept_root: Path | None = None
_kept_lock = threading.Lock()


def removed_at_exit(path: Path) -> bool:
    """True when ``path`` lies in the worker group's temporary error folder."""
    return any(part.startswith(TEMPORARY_ROOT_PREFIX) for part in path.parts)


def kept_copy(path: Path) -> Path:
    """Copy ``path`` (``.../<attempt>/rank<N>/<file>``) into this agent's kept stack folder, created on the
    first call (private: 0700); returns the copy's path."""
    global _kept_root
    with _kept_lock:
        if _kept_root is None:
            _kept_root = Path(tempfile.mkdtemp(prefix=KEPT_PREFIX))
        target = _kept_root.joinpath(*path.parts[-3:])
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, target)
    return target


def dump_stacks(targets: list[tuple[int, int, Path]], timeout_s: float = DUMP_TIMEOUT_S) -> list[StackDump]:
    """:func:`dump_stack` for every ``(pid, global_rank, stack_file)``, in parallel, in the given order."""
    results: list[StackDump | None] = [None] * len(targets)

    def one(i: int, pid: int, rank: int, path: Path) -> None:
        results[i] = dump_stack(pid, rank, path, timeout_s)

    threads = [
        threading.Thread(target=one, args=(i, *t), name=f"stack-dump-{t[1]}", daemon=True)
        for i, t in enumerate(targets)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 1.0
    for t in threads:
        t.join(timeout=max(deadline - time.monotonic(), 0.0))
    return [
        r if r is not None else StackDump(targets[i][1], targets[i][0], None, "", "", "timed out")
        for i, r in enumerate(results)
    ]
