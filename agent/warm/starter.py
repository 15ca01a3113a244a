"""Warm worker starts: fork workers from a zygote that has already imported torch.

A restarted worker spends most of its start-up in ``import torch`` (3-5 s on a small machine), and a
worker that builds an optimizer as much again in ``import torch._dynamo``, which ``torch.optim`` does on
first use (torch 2.13: ~830 more modules). The :class:`WarmLauncher` starts one *zygote* per agent, in the
background: a ``python`` that imports torch and torch._dynamo (:data:`DEFAULT_PRELOAD`; checked after each
import: no thread started, native or Python, and CUDA untouched) and then waits on a Unix socket. For
each worker the agent sends the command, the complete environment, the cwd and the write ends of the
worker's stdout/stderr pipes (SCM_RIGHTS); the zygote forks, the child turns itself into
``python [-u] script args`` (or ``-m module``) and the zygote answers with the pid and a pidfd. The zygote
stays warm for the next restart.

What a warm worker gets, as an exec'd one does, and what stays different by nature of a fork, is
listed in :mod:`agent.warm._zygote_worker`, which sets the worker up; the protocol is
:mod:`agent.warm.zygote_ops`.

Only plain ``python [-u] script args`` and ``python [-u] -m module args`` commands with the interpreter the
zygote runs (the agent's ``sys.executable``) are started warm, and only when the worker's environment is
the zygote's except for the variables the agent sets per worker (:data:`PER_WORKER_VARIABLES`,
``TORCHELASTIC_*``, ``ELASTIC_*``; ``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads``): the
interpreter and the preloaded modules read hundreds of variables when they start (``PYTHON*``, locale,
``TORCH*``, ``HOME``, ``TMPDIR``...), which a fork cannot re-read. elastic-run's workers always qualify:
their environment is the agent's plus those variables. Otherwise, or after the zygote failed, the
:class:`~agent.workers.group.WorkerGroup` uses exec and logs why. A start that comes while the zygote is still
importing is worth delaying (:meth:`WarmLauncher.warm_up_left_s`): an exec'd worker would import torch from
scratch, so waiting is never slower, and it leaves the node's other cores to the job. The agent waits
(without blocking its event loop) for up to :data:`READY_WAIT_S` after the zygote's start, then execs.

The zygote runs with the worker's interpreter, which need not have this package installed, and must
import nothing of ours (a forked worker inherits every module the zygote imported). So its code travels
as source: the files of :data:`BUNDLE` (standard library only), joined in order into one text that
``python -c`` executes as ``__main__`` (each file imports the others only when it is *not* ``__main__``,
i.e. in the agent's tree). A forked worker is the zygote's child, not the agent's: its exit is watched
through a pidfd (:class:`WarmProcess`), and its return code comes from the zygote (which reaps it).

Linux only (pidfd, prctl, /proc). Like the rest of the agent, this module never imports torch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Mapping, Sequence
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import BinaryIO, Literal

from agent.warm import zygote_ops as ops
from agent.workers.launchers import Launcher, WorkerProcess, make_child_setup
from agent.workers.reaper import Reaper
from agent.workers.types import LauncherUnavailable, WorkerSpec
from elastic import contract
from elastic.autoprogress import without_site_path
from elastic.contract import OMP_NUM_THREADS, TORCHRUN_VARIABLES

__all__ = [
    "DEFAULT_PRELOAD",
    "PER_WORKER_VARIABLES",
    "READY_WAIT_S",
    "WarmLauncher",
    "env_difference",
    "parse_command",
]

logger = logging.getLogger(__name__)

_SPAWN_TIMEOUT_S = 10.0
#: Seconds after the zygote's start during which a start waits for it instead of exec'ing: torch and
#: torch._dynamo import in 3-5 s on a small idle machine, several times that on a loaded one.
READY_WAIT_S = 60.0
_CLOSE_TIMEOUT_S = 5.0
# A spawn request is one datagram; the kernel limits its size (net.core.wmem_max, ~200 KiB by default).
_SEND_BUFFER_BYTES = 4 * 1024 * 1024

#: Modules the zygote imports (torch first; each must leave it single-threaded and CUDA untouched).
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
#: Overrides DEFAULT_PRELOAD for the agent: a comma-separated module list ("torch" for torch only).
PRELOAD_ENV = contract.WARM_PRELOAD


# -- which starts a zygote can take: the command's form, the environment's difference ------------------
#: Variables that may differ between the zygote and a warm worker: the ones the agent sets per worker,
#: none of which is read when torch or torch._dynamo is imported (checked with torch 2.13).
PER_WORKER_VARIABLES = frozenset(TORCHRUN_VARIABLES)
_PER_WORKER_PREFIXES = ("TORCHELASTIC_", "ELASTIC_")


def env_difference(zygote_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """The variables in which ``worker_env`` differs from ``zygote_env`` other than per-worker ones (empty:
    the worker can be forked from that zygote)."""
    differ = []
    for key in sorted(set(zygote_env) | set(worker_env)):
        value = worker_env.get(key)
        if value == zygote_env.get(key):
            continue
        if key == "PYTHONPATH" and (without_site_path(value) or "") == (zygote_env.get(key) or ""):
            continue  # only the exec path's sitecustomize folder: a warm worker gets the zygote's hooks
        if key == OMP_NUM_THREADS:
            if value is None or not value.isdigit() or int(value) < 1:
                differ.append(key)
        elif key not in PER_WORKER_VARIABLES and not key.startswith(_PER_WORKER_PREFIXES):
            differ.append(key)
    return differ


Mode = Literal["script", "module"]


def parse_command(argv: list[str], python: str) -> tuple[Mode, str, list[str], bool] | str:
    """``(mode, target, args, -u given)`` of a ``python [-u] script|-m module args`` command, else the
    reason it is not one (mode is "script" or "module")."""
    if not argv or argv[0] != python:
        return f"the command does not run this agent's interpreter {python}"
    rest = list(argv[1:])
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    if not rest:
        return "the command names no script"
    if rest[0] == "-m":
        if len(rest) < 2:
            return "the command names no module after -m"
        return "module", rest[1], rest[2:], unbuffered
    if rest[0].startswith("-"):
        return f"interpreter option {rest[0]!r} is not supported by warm starts (only -u and -m are)"
    return "script", rest[0], rest[1:], unbuffered


def start_problem(
    argv: list[str],
    cwd: str | None,
    envs: Sequence[Mapping[str, str]],
    *,
    python: str,
    zygote_env: Mapping[str, str],
) -> str | None:
    """Why workers with command ``argv``, working directory ``cwd`` and environments ``envs`` cannot be
    forked from a zygote running ``python`` in ``zygote_env``; None when they can."""
    parsed = parse_command(argv, python)
    if isinstance(parsed, str):
        return parsed
    mode, target, _, _ = parsed
    if mode == "script":
        problem = script_problem(os.path.join(cwd or os.getcwd(), target))
        if problem is not None:
            return problem
    for env in envs:
        differ = env_difference(zygote_env, env)
        if differ:
            shown = ", ".join(differ[:5]) + (", ..." if len(differ) > 5 else "")
            return (
                f"the worker environment differs from the zygote's in {shown} "
                "(read when the interpreter and torch start)"
            )
    return None


def script_problem(path: str) -> str | None:
    """Why the interpreter would not run ``path`` as plain source, or None."""
    if not os.path.isfile(path):
        return f"script {path!r} not found"
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC_NUMBER))
    except OSError as e:
        return f"cannot read script {path!r}: {e}"
    if head == MAGIC_NUMBER or zipfile.is_zipfile(path):
        return f"script {path!r} is a .pyc or zip file"
    return None


def current_umask() -> int | None:
    """This process's umask, read without changing it (racy os.umask would affect other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- the zygote's program: its source bundle, bootstrap and argument padding ------------------------------
_HERE = Path(__file__).parent
#: The zygote's source files, in execution order: its protocol, the worker half, the zygote proper.
BUNDLE = ("zygote_ops.py", "_zygote_worker.py", "_zygote_proc.py")
# `python -c` puts the current directory first on sys.path: import nothing from there, not even the
# standard library's names. A worker gets its own sys.path[0] (its script's folder, or the cwd).
_PROLOGUE = "import sys\nif sys.path and sys.path[0] == '':\n    del sys.path[0]\n"
#: Kept short: the zygote's argument area must not be longer than a worker's command line (see filler).
BOOTSTRAP = "import os;exec(os.environ.pop('_EZ'))"


def zygote_source() -> str:
    """The zygote's program: the prologue and the files of :data:`BUNDLE`."""
    parts = [_PROLOGUE]
    parts += [(_HERE / name).read_text(encoding="utf-8") for name in BUNDLE]
    return "\n".join(parts)


def filler(python: str, argv_hint: list[str] | tuple[str, ...] | None) -> list[str]:
    """An extra zygote argument that makes its argument area exactly as long as a worker's command line.

    A forked worker rewrites that area to show its own command in /proc/<pid>/cmdline; the area cannot
    change size, so a shorter command is padded with NULs (empty trailing arguments in psutil).
    """
    if not argv_hint:
        return []
    size = sum(len(os.fsencode(a)) + 1 for a in (python, "-c", BOOTSTRAP))
    target = sum(len(os.fsencode(a)) + 1 for a in argv_hint)
    if target <= size:
        return []
    return ["#" * (target - size - 1)]


# -- a warm worker seen from the agent, and the bookkeeping of its start ----------------------------------
class Pending:
    """A spawn request waiting for the zygote's answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: ops.Spawned | ops.SpawnFailed | None = None  # None after done: the zygote went away
        self.fds: list[int] = []
        self.exit: ExitBox | None = None


class ExitBox:
    """A warm worker's return code, as the zygote (its parent) reports it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._returncode: int | None = None

    def set(self, returncode: int | None) -> None:
        if not self._done.is_set():
            self._returncode = returncode
            self._done.set()

    def wait(self) -> int | None:
        """The return code; None when the zygote died before reporting it."""
        self._done.wait()
        return self._returncode


class WarmProcess:
    """A forked worker seen from the agent: not our child, so its exit is watched through a pidfd."""

    def __init__(self, pid: int, pidfd: int, stdout: BinaryIO, stderr: BinaryIO, exit_box: ExitBox) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd = pidfd
        self._pidfd_lock = threading.Lock()  # send_signal() never uses a closed (or reused) descriptor
        self._exit = exit_box
        self._returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        """Signal the worker through its pidfd: never another process that reuses the pid."""
        with self._pidfd_lock:
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, sig)

    def wait(self) -> int:
        if self._returncode is not None:
            return self._returncode
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        while not poller.poll():  # readable once the process has exited; retried on EINTR by Python
            pass
        returncode = self._exit.wait()
        with self._pidfd_lock:
            os.close(self._pidfd)
            self._pidfd = -1
        if returncode is None:
            # The zygote died before reporting; the worker died with it (PR_SET_PDEATHSIG=SIGKILL).
            returncode = -int(signal.SIGKILL)
        self._returncode = returncode
        return returncode


class WarmLauncher(Launcher):
    """Starts workers by forking them from a pre-started interpreter that has imported torch.

    The zygote is started by the constructor, which returns at once; the zygote imports torch in the
    background and takes starts once ready (:attr:`ready`, :meth:`wait_ready`). Until then, and whenever
    it cannot take a start, :meth:`unavailable_reason` says why and the worker group uses exec.

    Create it on a long-lived thread (the zygote dies when the creating *thread* exits, PR_SET_PDEATHSIG),
    and close it after the worker group. Thread-safe.
    """

    name = "warm"

    def __init__(
        self,
        reaper: Reaper | None = None,
        *,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        argv_hint: list[str] | tuple[str, ...] | None = None,
        preload: tuple[str, ...] | None = None,
        spawn_timeout_s: float = _SPAWN_TIMEOUT_S,
        ready_wait_s: float = READY_WAIT_S,
    ) -> None:
        """Start the zygote.

        ``env``: its environment, the base the workers' environments are built from (default: this
        process's). ``argv_hint``: the worker command line, if known: the zygote's own command line is then
        sized so that a worker's ``/proc/<pid>/cmdline`` has no padding. ``preload``: the modules to import
        (default: ``$ELASTIC_WARM_PRELOAD``, else :data:`DEFAULT_PRELOAD`). ``reaper``: the zygote's process
        group is registered with it (the workers' are registered by the group). ``ready_wait_s``: how long
        after the zygote's start a first start should wait for it rather than exec (:meth:`warm_up_left_s`).
        """
        if preload is None:
            from_env = os.environ.get(PRELOAD_ENV, "")
            preload = tuple(m.strip() for m in from_env.split(",") if m.strip()) or DEFAULT_PRELOAD
        self._python = python
        self._env = dict(os.environ if env is None else env)
        self._reaper = reaper
        self._spawn_timeout_s = spawn_timeout_s
        self._ready_wait_s = ready_wait_s
        self._lock = threading.Lock()
        self._launch_lock = threading.Lock()  # one spawn request in flight at a time
        self._state: Literal["starting", "ready", "failed", "closed"] = "starting"
        self._reason: str | None = None
        self._settled = threading.Event()  # set when ready or failed
        self._pending: dict[int, Pending] = {}
        self._exits: dict[int, ExitBox] = {}
        self._ids = itertools.count(1)
        self._started_at = time.monotonic()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._sock, zygote_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
            source = zygote_source()
            zygote_env = {
                **self._env,
                "_EZ": source,
                "_EZ_FD": str(zygote_sock.fileno()),
                "_EZ_PRELOAD": ",".join(preload),
            }
            self._proc = subprocess.Popen(
                [python, "-c", BOOTSTRAP, *filler(python, argv_hint)],
                env=zygote_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=make_child_setup(os.getpid()),
                pass_fds=(zygote_sock.fileno(),),
                close_fds=True,
            )
        except OSError as e:
            self._fail(f"cannot start the warm-start zygote: {e}")
            return
        finally:
            zygote_sock.close()
        if reaper is not None:
            reaper.register(self._proc.pid)
        self._reader = threading.Thread(target=self._read_loop, name="warm-zygote-reader", daemon=True)
        self._reader.start()

    # -- state --------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """PID of the zygote (None if it could not be started)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def ready(self) -> bool:
        """True while the zygote takes starts."""
        with self._lock:
            return self._state == "ready"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the zygote is ready or failed; True when ready."""
        self._settled.wait(timeout)
        return self.ready

    def warm_up_left_s(self) -> float:
        # Waiting for the zygote is never slower than exec'ing: a fresh interpreter imports torch from the
        # start, while the zygote is already part-way. Only a zygote stuck in its imports makes waiting a
        # loss, hence the bound.
        with self._lock:
            if self._state != "starting":
                return 0.0
        return max(0.0, self._started_at + self._ready_wait_s - time.monotonic())

    def wait_warm(self, timeout: float) -> bool:
        return self._settled.wait(timeout)

    def unavailable_reason(self, spec: WorkerSpec) -> str | None:
        with self._lock:
            state, reason = self._state, self._reason
        if state == "starting":
            waited = time.monotonic() - self._started_at
            return f"the zygote is not ready yet (importing torch for {waited:.1f}s)"
        if state != "ready":
            return reason or "the warm launcher is closed"
        return start_problem(list(spec.argv), spec.cwd, spec.envs, python=self._python, zygote_env=self._env)

    # -- starting a worker --------------------------------------------------------------------------
    def launch(self, argv: list[str], env: dict[str, str], cwd: str | None) -> WorkerProcess:
        parsed = parse_command(argv, self._python)
        if isinstance(parsed, str):
            raise LauncherUnavailable(parsed)
        mode, target, args, unbuffered = parsed
        request = {
            "argv": argv,
            "mode": mode,
            "target": target,
            "args": args,
            "env": env,
            "cwd": cwd or os.getcwd(),
            "umask": current_umask(),
            "unbuffered": unbuffered or bool(env.get("PYTHONUNBUFFERED")),
        }
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self._launch_lock:
                pending = self._request(request, [out_w, err_w])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)  # the zygote holds its own copies (sent with the request) until it forked
            os.close(err_w)
        assert isinstance(pending.reply, ops.Spawned) and pending.exit is not None
        return WarmProcess(
            pid=pending.reply.pid,
            pidfd=pending.fds[0],
            stdout=os.fdopen(out_r, "rb"),
            stderr=os.fdopen(err_r, "rb"),
            exit_box=pending.exit,
        )

    def _request(self, request: dict, fds: list[int]) -> Pending:
        pending = Pending()
        with self._lock:
            if self._state != "ready":
                raise LauncherUnavailable(self._reason or f"the zygote is {self._state}")
            req_id = next(self._ids)
            self._pending[req_id] = pending
        try:
            payload = ops.encode(ops.SpawnRequest(id=req_id, **request))
            socket.send_fds(self._sock, [payload], fds)
        except (OSError, ValueError, TypeError) as e:
            with self._lock:
                self._pending.pop(req_id, None)
            raise LauncherUnavailable(f"cannot send the spawn request to the zygote: {e}") from e
        if not pending.done.wait(self._spawn_timeout_s):
            with self._lock:
                self._pending.pop(req_id, None)
            self._fail(f"the zygote did not answer a spawn request within {self._spawn_timeout_s:g}s")
            self._kill_zygote()  # a late answer would be a worker nobody watches; it dies with the zygote
            raise LauncherUnavailable(self._reason or "the zygote did not answer")
        if pending.reply is None:
            raise LauncherUnavailable(self._reason or "the zygote exited")
        if not isinstance(pending.reply, ops.Spawned) or len(pending.fds) != 1:
            for fd in pending.fds:
                os.close(fd)
            error = (
                pending.reply.error
                if isinstance(pending.reply, ops.SpawnFailed)
                else "no pidfd came with its pid"
            )
            raise LauncherUnavailable(f"the zygote could not fork the worker: {error}")
        return pending

    # -- the zygote's messages ----------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 65536, 4)
            except OSError:
                data, fds = b"", []
            if not data:
                break
            for fd in fds:
                os.set_inheritable(fd, False)
            try:
                msg = ops.decode(data)
            except ops.MalformedMessage as e:
                logger.warning("warm start: dropped a malformed message from the zygote: %s", e)
                msg = None
            if not self._on_message(msg, fds):
                for fd in fds:
                    os.close(fd)
        self._on_zygote_gone()

    def _on_message(self, msg: object, fds: list[int]) -> bool:
        """Handle one message; False when its fds were not taken."""
        if isinstance(msg, ops.Ready):
            logger.info(  # before a waiter wakes: what it reads next follows this line in the log
                "warm start ready: zygote pid %s imported %s (torch %s) in %.1fs",
                msg.pid,
                ", ".join(msg.preloaded or ["torch"]),
                msg.torch,
                msg.import_s,
            )
            if msg.skipped:
                logger.info("warm start: not preloaded: %s", "; ".join(msg.skipped))
            with self._lock:
                if self._state == "starting":
                    self._state = "ready"
            self._settled.set()
        elif isinstance(msg, ops.Unavailable):
            self._fail(f"the zygote cannot serve: {msg.reason}")
        elif isinstance(msg, (ops.Spawned, ops.SpawnFailed)):
            with self._lock:
                pending = self._pending.pop(msg.id, None)
                if pending is not None and isinstance(msg, ops.Spawned):
                    pending.exit = self._exits[msg.pid] = ExitBox()
            if pending is None:
                if isinstance(msg, ops.Spawned):  # its requester gave up: nobody would watch this worker
                    with contextlib.suppress(OSError):
                        os.kill(msg.pid, signal.SIGKILL)
                return False
            pending.reply, pending.fds = msg, fds
            pending.done.set()
            return True
        elif isinstance(msg, ops.WorkerExited):
            with self._lock:
                box = self._exits.pop(msg.pid, None)
            if box is not None:
                box.set(msg.returncode)
        return False

    def _on_zygote_gone(self) -> None:
        returncode = None
        if self._proc is not None:
            try:
                returncode = self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                returncode = None
        with self._lock:
            closing = self._state == "closed"
            pending, self._pending = list(self._pending.values()), {}
            exits, self._exits = list(self._exits.values()), {}
        if not closing:
            how = f"with {returncode}" if returncode is not None else "its socket"
            self._fail(f"the zygote exited ({how}); workers are started with exec from now on")
        for p in pending:
            p.done.set()
        for box in exits:
            box.set(None)
        if self._reaper is not None and self._proc is not None and returncode is not None:
            self._reaper.unregister(self._proc.pid)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._state in ("failed", "closed"):
                return
            self._state, self._reason = "failed", reason
        self._settled.set()
        logger.warning("warm start unavailable: %s", reason)

    def _kill_zygote(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the zygote (it kills any worker it still has) and release everything; idempotent."""
        with self._lock:
            if self._state == "closed":
                return
            self._state, self._reason = "closed", "the warm launcher is closed"
        self._settled.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # EOF for the zygote; wakes our reader
        if self._proc is not None:
            try:
                self._proc.wait(timeout=_CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("zygote pid %d did not exit; killing it", self._proc.pid)
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=_CLOSE_TIMEOUT_S)
        self._sock.close()
        if self._reaper is not None and self._proc is not None:
            self._reaper.unregister(self._proc.pid)
