"""The warm-start zygote: an interpreter that has imported torch and forks workers from that state.

Started once per agent by :class:`agent.warm.WarmLauncher` as ``python -c <bootstrap>``, where the bootstrap
executes this source from the environment variable ``_EZ``; the control socket's fd number is in ``_EZ_FD``
and the modules to import in ``_EZ_PRELOAD`` (comma-separated: torch first, then e.g. torch._dynamo, which
torch.optim imports on first use). Standard library only, plus those imports; after each one the zygote
checks that it is still safe to fork (one thread, no new native threads, CUDA untouched).

Protocol: a ``SOCK_SEQPACKET`` Unix socket to the agent, one JSON object per message.

* zygote -> agent, once: ``{"op": "ready", ...}`` after ``import torch`` passed the fork-safety checks, or
  ``{"op": "unavailable", "reason": ...}`` (the zygote then exits);
* agent -> zygote: ``{"op": "spawn", "id", "argv", "mode", "target", "args", "env", "cwd", "umask",
  "unbuffered"}`` with the worker's stdout and stderr write ends attached (SCM_RIGHTS);
* zygote -> agent: ``{"op": "spawned", "id", "pid"}`` with a pidfd of the worker attached, or
  ``{"op": "spawn_failed", "id", "error"}``;
* zygote -> agent: ``{"op": "exit", "pid", "returncode"}`` when a worker exited (the zygote is its parent
  and reaps it; ``returncode`` is negative for a signal, as in ``Popen``).

On EOF (the agent closed the socket or died) the zygote SIGKILLs the process groups of its live workers,
reaps them and exits. The zygote itself has PR_SET_PDEATHSIG=SIGKILL towards the agent, and every worker
has it towards the zygote, so an agent SIGKILL takes zygote and workers down; the agent's reaper also
has every worker's process group (and the zygote's) registered.

A forked worker is set up to look like ``python [-u] script args`` / ``python [-u] -m module args``
exec'd by the agent: see :func:`_become_worker`. What cannot be made identical, and why, is documented
in ``agent/warm.py``.
"""

import sys

# `python -c` puts the current directory first on sys.path: import nothing from there. A worker gets its
# own sys.path[0] (the script's folder, or the cwd for -m) after the fork.
if sys.path and sys.path[0] == "":
    del sys.path[0]

import builtins  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.machinery  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402

_PR_SET_PDEATHSIG = 1
# A spawn request carries the worker's whole environment; the agent refuses (and execs) bigger ones.
_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# torch's CPU generator seed before torch 2.x started seeding it at random (c10's default_rng_seed_val).
_TORCH_FIXED_DEFAULT_SEED = 67280421310721
# Exit code of a forked worker whose set-up failed before the user's code ran.
_SETUP_FAILED = 1
# Frames running this module's code, hidden from a worker's traceback.
_OWN_GLOBALS = globals()


class _Baseline:
    """The zygote's state right after ``import torch``: what every forked worker starts from."""

    def __init__(
        self, torch: types.ModuleType, ctrl_fd: int, env_added: dict[str, str], env_removed: set[str]
    ) -> None:
        self.pid = os.getpid()
        self.torch = torch
        self.env = dict(os.environ)
        # What the interpreter and the preloaded modules changed in their own environment when they started
        # (LC_CTYPE from PEP 538; TORCHINDUCTOR_CACHE_DIR from torch._dynamo): a fresh worker does the same.
        self.env_added = env_added
        self.env_removed = env_removed
        # File descriptors that the import left open (libraries' own); every other one is closed in a worker.
        self.fds = _open_fds() - {ctrl_fd}
        self.signals = {}
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            with contextlib.suppress(OSError, ValueError):
                handler = signal.getsignal(sig)
                if handler is not None:
                    self.signals[sig] = handler
        self.stdio = {
            name: (getattr(sys, name).encoding, getattr(sys, name).errors)
            for name in ("stdin", "stdout", "stderr")
        }
        seed = torch.initial_seed()
        # A fresh interpreter gets either torch's fixed default seed or a random one, depending on the
        # torch version; a worker gets what a fresh interpreter would.
        self.torch_seed_fixed = seed == _TORCH_FIXED_DEFAULT_SEED
        # Resolved before any fork, so that a worker runs no dynamic loading in its set-up.
        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl = libc.prctl
        self.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self.prctl.restype = ctypes.c_int
        self.py_exit = ctypes.pythonapi.Py_Exit
        self.py_exit.argtypes = [ctypes.c_int]
        self.py_exit.restype = None
        self.on_exit = getattr(libc, "on_exit", None)
        self.raise_ = getattr(libc, "raise", None)
        if self.on_exit is not None:
            self.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self.on_exit.restype = ctypes.c_int


# -- the zygote ---------------------------------------------------------------------------------------------
def main() -> int:
    env_added = _interpreter_env_changes()
    ctrl_fd = int(os.environ.pop("_EZ_FD"))
    preload = [m for m in os.environ.pop("_EZ_PRELOAD", "torch").split(",") if m and m != "torch"]
    env_before = dict(os.environ)
    ctrl = socket.socket(fileno=ctrl_fd)
    started = time.monotonic()
    # The imports create ~300k objects; cyclic collections while they run cost 10-15% of the import time.
    gc.disable()
    try:
        import torch
    except BaseException as e:  # noqa: BLE001 - any failure only disables the warm path
        _send(ctrl, {"op": "unavailable", "reason": f"import torch failed: {type(e).__name__}: {e}"})
        return 1
    threads = _native_threads()  # BLAS pools started by the import stop themselves at fork
    problem = _fork_safety_problem(torch, threads, "torch")
    loaded, skipped = ["torch"], []
    for name in preload:
        if problem is not None:
            break
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional preload that fails is skipped
            skipped.append(f"{name} ({type(e).__name__}: {e})")
            continue
        loaded.append(name)
        problem = _fork_safety_problem(torch, threads, name)
    if problem is not None:
        _send(ctrl, {"op": "unavailable", "reason": problem})
        return 1
    _install_store_wait()
    # The fork-server recipe of the gc docs: the preloaded objects move to the permanent generation, so no
    # collection (in the zygote or a worker) scans them or touches their pages (copy-on-write).
    gc.freeze()
    gc.enable()
    env_added.update({k: v for k, v in os.environ.items() if env_before.get(k) != v})
    env_removed = set(env_before) - set(os.environ)
    base = _Baseline(torch, ctrl_fd, env_added, env_removed)
    _set_cmdline([sys.executable, "-c", "# elastic-run warm-start zygote"], environ=None)
    ready = {
        "op": "ready",
        "pid": base.pid,
        "import_s": round(time.monotonic() - started, 3),
        "torch": torch.__version__,
        "preloaded": loaded,
        "skipped": skipped,
        "native_threads": threads,
    }
    if not _send(ctrl, ready):
        return 0
    return _serve(ctrl, base)


def _install_store_wait() -> None:
    """Make a worker of non-zero rank wait until rank 0's TCPStore listens before torch connects to it.

    torch's TCPStore client retries a refused connection only after a back-off of 0.3-0.7 s. A warm worker
    reaches ``init_process_group`` within tens of milliseconds, often before rank 0 (which hosts the store
    with torchrun's env contract) listens, and would lose that back-off in most restarts. A connect probe
    every 10 ms makes torch's first attempt succeed; the store ignores a probe that closes at once.
    """
    rdzv = sys.modules.get("torch.distributed.rendezvous")
    original = getattr(rdzv, "_create_c10d_store", None)
    if original is None:  # torch without distributed support, or a layout we do not know: leave it be
        return

    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if rank != 0:
            _wait_for_listener(hostname, port, timeout.total_seconds())
        return original(hostname, port, rank, world_size, timeout, *args, **kwargs)

    _create_c10d_store.__doc__ = original.__doc__
    _create_c10d_store.__wrapped__ = original
    rdzv._create_c10d_store = _create_c10d_store


def _wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a connection, on any error other than a refusal (torch reports
    it), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(1.0, timeout_s)).close()
            return
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)
        except OSError:
            return


def _fork_safety_problem(torch: types.ModuleType, native_threads: int, imported: str) -> str | None:
    """Why forking workers from this process would be unsafe after importing ``imported``, or None."""
    if threading.active_count() != 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return f"importing {imported} started Python threads ({names}); forking from it is unsafe"
    if _native_threads() > native_threads:
        return f"importing {imported} started native threads; forking from it is unsafe"
    if torch.cuda.is_initialized():
        return f"importing {imported} initialized CUDA; a forked worker could not use it"
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is not available (Linux >= 5.3 and Python >= 3.9 are needed)"
    return None


def _interpreter_env_changes() -> dict[str, str]:
    """Variables this interpreter set in its own environment at start-up, as every interpreter started
    with the same locale variables does (PEP 538's locale coercion sets LC_CTYPE=C.UTF-8)."""
    try:
        with open("/proc/self/environ", "rb") as f:  # what execve() received
            raw = f.read()
    except OSError:
        return {}
    received = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            received[os.fsdecode(key)] = os.fsdecode(value)
    return {k: v for k, v in os.environ.items() if received.get(k) != v}


def _open_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))  # drops the fd that listdir itself had open
        except OSError:
            continue
        fds.add(int(name))
    return fds


def _native_threads() -> int:
    """Threads of this process, Python's and native ones (BLAS pools stop themselves at fork)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _serve(ctrl: socket.socket, base: _Baseline) -> int:
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # worker pid -> pidfd
    try:
        while True:
            for key, _ in sel.select():
                if key.data is None:
                    try:
                        data, fds, flags, _ = socket.recv_fds(ctrl, _MAX_REQUEST_BYTES, 8)
                    except OSError:
                        data, fds, flags = b"", [], 0
                    if not data:
                        _close_all(fds)
                        return 0  # the agent is gone or closed us: the finally kills the workers
                    spawned = _handle(ctrl, sel, children, data, fds, flags, base)
                    if spawned is not None:
                        pid, pidfd = spawned
                        children[pid] = pidfd
                        sel.register(pidfd, selectors.EVENT_READ, pid)
                else:
                    pid = key.data
                    pidfd = children.pop(pid)
                    sel.unregister(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    exit_msg = {"op": "exit", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)}
                    if not _send(ctrl, exit_msg):
                        return 0
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _handle(
    ctrl: socket.socket,
    sel: selectors.BaseSelector,
    children: dict[int, int],
    data: bytes,
    fds: list[int],
    flags: int,
    base: _Baseline,
) -> tuple[int, int] | None:
    """Serve one request; returns ``(pid, pidfd)`` of a new worker, or None."""
    try:
        req = json.loads(data)
        req_id = req["id"]
    except (ValueError, KeyError, TypeError):
        _close_all(fds)
        return None  # not ours; nothing to answer
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 2 or req.get("op") != "spawn":
        _close_all(fds)
        _send(ctrl, {"op": "spawn_failed", "id": req_id, "error": "malformed or truncated spawn request"})
        return None
    out_fd, err_fd = fds
    try:
        if not os.path.isdir(req["cwd"]):
            raise FileNotFoundError(f"working directory {req['cwd']!r} not found")
        sync_r, sync_w = os.pipe()
        try:
            pid = _fork()
        except BaseException:
            os.close(sync_r)
            os.close(sync_w)
            raise
    except (OSError, KeyError, TypeError) as e:
        _close_all(fds)
        _send(ctrl, {"op": "spawn_failed", "id": req_id, "error": f"{type(e).__name__}: {e}"})
        return None
    if pid == 0:
        os.close(sync_r)

        def close_inherited() -> None:
            # Close through their owners: a stale object must never close a recycled fd number later.
            sel.close()
            os.close(ctrl.detach())
            _close_all(children.values())

        _become_worker(req, out_fd, err_fd, sync_w, base, close_inherited)  # never returns
    os.close(sync_w)
    _close_all(fds)
    # The worker closes its end once it leads its own session: from then on the agent may signal its group.
    with contextlib.suppress(OSError):
        os.read(sync_r, 1)
    os.close(sync_r)
    pidfd = os.pidfd_open(pid)  # the worker is at least a zombie until we reap it: no pid reuse race
    try:
        payload = json.dumps({"op": "spawned", "id": req_id, "pid": pid}).encode()
        socket.send_fds(ctrl, [payload], [pidfd])
    except OSError:
        pass  # the agent is gone; the next recv sees EOF and the worker is killed
    return pid, pidfd


def _fork() -> int:
    with warnings.catch_warnings():  # restored in parent and child alike when the block ends
        # Python >= 3.12 warns about forking a process with threads; ours are BLAS pools that stop at fork.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _send(ctrl: socket.socket, msg: dict) -> bool:
    try:
        ctrl.sendmsg([json.dumps(msg).encode()])
    except OSError:
        return False
    return True


def _close_all(fds) -> None:
    for fd in list(fds):
        with contextlib.suppress(OSError):
            os.close(fd)


# -- a forked worker ----------------------------------------------------------------------------------------
def _become_worker(
    req: dict, out_fd: int, err_fd: int, sync_w: int, base: _Baseline, close_inherited
) -> None:
    """Turn this forked child into the worker ``req`` describes and run it; never returns."""
    try:
        base.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != base.pid:  # the zygote died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)
        os.setsid()  # own session and process group, as start_new_session=True gives the exec path
        os.close(sync_w)
        close_inherited()
        _redirect_stdio(out_fd, err_fd, base)
        _reset_signals(base)
        os.chdir(req["cwd"])
        if req.get("umask") is not None:
            os.umask(req["umask"])
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(base.env_added)  # /proc/self/environ (below) shows what execve gave, as usual
        for key in base.env_removed:
            os.environ.pop(key, None)
        _set_cmdline(req["argv"], environ=env)
        _reset_process_state(env, base)
        _new_stdio(req.get("unbuffered", True), base)
        run = _prepare_main(req)
    except BaseException:  # noqa: BLE001 - report anything, then exit like a failed start
        with contextlib.suppress(BaseException):
            text = "elastic-run warm start: worker set-up failed:\n" + traceback.format_exc()
            os.write(2, text.encode("utf-8", "backslashreplace"))
        os._exit(_SETUP_FAILED)
    _run_and_exit(run, base)


def _redirect_stdio(out_fd: int, err_fd: int, base: _Baseline) -> None:
    """stdin from /dev/null, stdout/stderr to the agent's pipes; every other inherited fd closed."""
    null = os.open(os.devnull, os.O_RDWR)
    for src, dst in ((null, 0), (out_fd, 1), (err_fd, 2)):
        os.dup2(src, dst)
    keep = base.fds | {0, 1, 2}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _reset_signals(base: _Baseline) -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    for sig, handler in base.signals.items():
        if signal.getsignal(sig) is not handler:
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(sig, handler)


def _reset_process_state(env: dict, base: _Baseline) -> None:
    """What a fresh interpreter would have differently from a copy of the zygote."""
    import random

    random.seed()  # also done by random's own at-fork hook; explicit for clarity
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None  # recomputed from this worker's TMPDIR on first use
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.current_process().authkey = os.urandom(32)
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # taken at its import, in the zygote's cwd
    dynamo_config = sys.modules.get("torch._dynamo.config")
    if dynamo_config is not None and hasattr(dynamo_config, "default_debug_dir_root"):
        with contextlib.suppress(Exception):
            dynamo_config.debug_dir_root = dynamo_config.default_debug_dir_root()  # from the cwd at import
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = base.torch
    if base.torch_seed_fixed:
        torch.default_generator.manual_seed(_TORCH_FIXED_DEFAULT_SEED)
    else:
        torch.default_generator.seed()
    threads = env.get("OMP_NUM_THREADS")
    if threads != base.env.get("OMP_NUM_THREADS") and threads is not None:
        # OpenMP read OMP_NUM_THREADS when torch was imported in the zygote; apply the worker's value.
        torch.set_num_threads(int(threads))


def _new_stdio(unbuffered: bool, base: _Baseline) -> None:
    """sys.stdin/stdout/stderr as the interpreter creates them at start-up (``-u`` or not)."""
    for fd, name, write in ((0, "stdin", False), (1, "stdout", True), (2, "stderr", True)):
        encoding, errors = base.stdio[name]
        buffering = 0 if unbuffered and write else -1
        buf = open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)  # noqa: SIM115
        raw = buf if buffering == 0 else buf.raw
        raw.name = f"<{name}>"
        line_buffering = not unbuffered and (raw.isatty() or fd == 2)
        stream = io.TextIOWrapper(
            buf,
            encoding=encoding,
            errors=errors,
            newline="\n",
            line_buffering=line_buffering,
            write_through=unbuffered,
        )
        stream.mode = "w" if write else "r"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _set_cmdline(argv: list[str], environ: dict | None) -> None:
    """Show ``argv`` (and ``environ``) in /proc/self/cmdline (and /proc/self/environ), for ps and psutil.

    Rewrites the process's original argument and environment areas in place (what setproctitle does). The
    areas keep their size: a shorter text is padded with NULs, a longer one is cut at an entry boundary.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    except (OSError, ValueError, IndexError):
        return
    _fill_area(arg_start, arg_end, [os.fsencode(a) for a in argv])
    if environ is not None:
        _fill_area(env_start, env_end, [os.fsencode(f"{k}={v}") for k, v in environ.items()])


def _fill_area(start: int, end: int, items: list[bytes]) -> None:
    size = end - start
    if size <= 0:
        return
    out = bytearray()
    for item in items:
        if len(out) + len(item) + 1 > size:
            break
        out += item + b"\0"
    if not out and items:  # not even the first entry fits: show its start
        out = bytearray(items[0][: size - 1] + b"\0")
    ctypes.memmove(start, bytes(out.ljust(size, b"\0")), size)


# -- running the user's program -----------------------------------------------------------------------------
def _prepare_main(req: dict):
    """Set sys.argv, sys.path[0] and a fresh ``__main__`` as the interpreter does; return the runner."""
    args = list(req["args"])
    target = req["target"]
    sys.orig_argv = list(req["argv"])
    main = types.ModuleType("__main__")
    # What the interpreter puts into __main__ at start-up (pylifecycle.c add_main_module).
    main.__dict__["__annotations__"] = {}
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if req["mode"] == "module":
        sys.argv = ["-m", *args]
        sys.path.insert(0, os.getcwd())

        def run_module() -> None:
            runpy._run_module_as_main(target)  # what `python -m` calls (alter_argv=True)

        return run_module

    sys.argv = [target, *args]
    # `python dir/x.py`: __file__ is the path joined to the cwd (not normalized), sys.path[0] the folder of
    # the resolved script.
    filename = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
    sys.path.insert(0, os.path.dirname(os.path.realpath(filename)))
    try:
        with open(filename, "rb") as f:
            source = f.read()
    except OSError as e:  # what the interpreter says and does for a script it cannot open
        sys.stderr.write(f"{sys.executable}: can't open file {filename!r}: [Errno {e.errno}] {e.strerror}\n")
        sys.stderr.flush()
        os._exit(2)
    main.__file__ = filename
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", filename)

    def run_script() -> None:
        # No frame of ours may keep __main__'s globals alive into Py_Exit: module teardown must free them
        # (an unclosed file is flushed then), so the module is looked up here and not captured.
        exec(compile(source, filename, "exec", dont_inherit=True), sys.modules["__main__"].__dict__)

    return run_script


def _run_and_exit(run, base: _Baseline) -> None:
    """Run the program and end the process like ``Py_RunMain``; never returns.

    The interpreter's own ``Py_Exit`` does the exit: it waits for non-daemon threads, runs atexit
    callbacks, tears modules down (flushing unclosed files) and flushes stdio, as a real exit does.
    """
    try:
        run()
        error = None
    except BaseException as e:  # noqa: BLE001 - every outcome is handled below, as the interpreter does
        error = e
    if error is None:
        _exit(0, base)
    if isinstance(error, SystemExit):
        code = _system_exit_code(error)
        del error
        _exit(code, base)
    # Hide this module's frames: the traceback starts at the user's code (or at runpy for -m), as usual.
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_globals is _OWN_GLOBALS:
        tb = tb.tb_next
    error.__traceback__ = tb
    _print_exception(error, tb)
    interrupted = isinstance(error, KeyboardInterrupt)
    del error, tb
    if interrupted:
        _exit_by_sigint(base)
    _exit(1, base)


def _system_exit_code(exc: SystemExit) -> int:
    """The exit status of an uncaught SystemExit (pythonrun.c ``_Py_HandleSystemExit``)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -(2**63) <= code < 2**63 else -1
    with contextlib.suppress(Exception):
        stream = sys.stderr
        if stream is not None:
            stream.write(f"{code}\n")
            stream.flush()
    return 1


def _print_exception(error: BaseException, tb) -> None:
    """``PyErr_Print`` for an uncaught exception: sys.last_*, then sys.excepthook."""
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = error
    hook = getattr(sys, "excepthook", None)
    try:
        if hook is None:
            raise RuntimeError("lost sys.excepthook")
        hook(type(error), error, tb)
    except BaseException as hook_error:  # noqa: BLE001 - as the interpreter: report both
        with contextlib.suppress(BaseException):
            sys.stderr.write("Error in sys.excepthook:\n")
            traceback.print_exception(hook_error)
            sys.stderr.write("\nOriginal exception was:\n")
            traceback.print_exception(type(error), error, tb)
    with contextlib.suppress(BaseException):
        sys.stderr.flush()


def _exit(code: int, base: _Baseline) -> None:
    base.py_exit(code)  # finalizes the interpreter and calls exit(code)
    os._exit(code & 0xFF)  # not reached


def _exit_by_sigint(base: _Baseline) -> None:
    """An uncaught KeyboardInterrupt: finalize, then die by SIGINT (``Py_RunMain``'s ``exit_sigint``)."""
    if base.on_exit is not None and base.raise_ is not None:
        # exit(SIGINT) calls raise(SIGINT) after the interpreter's finalization (which restored SIGINT's
        # default action), before C++ static destructors; the extra on_exit argument is ignored.
        base.on_exit(ctypes.cast(base.raise_, ctypes.c_void_p), None)
        _exit(int(signal.SIGINT), base)
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
