"""The worker half of the warm-start zygote: the baseline every worker starts from, and how a forked
child turns itself into ``python [-u] script args`` / ``python [-u] -m module args``.

Part of the zygote's source bundle (:data:`agent.warm.starter.BUNDLE`, after :mod:`agent.warm.zygote_ops`,
before :mod:`agent.warm._zygote_proc`): standard library only, no ``from __future__`` import.

What a warm worker gets, as an exec'd one does: exactly the given environment (``os.environ`` and the C
environment), ``sys.argv``/``sys.orig_argv``, ``sys.path[0]``, a fresh ``__main__`` with ``__file__``,
``__loader__``, ``__spec__`` as the interpreter sets them, the cwd, its own session, PR_SET_PDEATHSIG,
stdin from /dev/null, stdout/stderr as pipes to the agent (``-u``: unbuffered, as the interpreter creates
them), the signal dispositions of a fresh interpreter that imported torch, an empty signal mask, no
inherited fds, fresh random state (``random``; numpy's if loaded; multiprocessing's authkey; torch's CPU
generator seeded as a fresh process seeds it: at random in torch >= 2.x, else the fixed default), torch's
intra-op threads from ``OMP_NUM_THREADS``, the interpreter's exit behaviour (``Py_Exit``: non-daemon
threads joined, atexit, module teardown, stdio flushed; SystemExit codes and messages, an uncaught
exception's traceback and exit 1, KeyboardInterrupt -> death by SIGINT) and ``/proc/<pid>/cmdline`` and
``environ`` showing the worker's command and environment (for ps, psutil and monitoring), and the progress
hooks of ``elastic.autoprogress`` installed (an exec'd worker's sitecustomize installs the same).

What stays different, by nature of a fork: a worker of non-zero rank waits until rank 0's TCPStore listens
before torch connects to it (the zygote wraps ``torch.distributed.rendezvous._create_c10d_store``; torch's own
retry sleeps up to 0.7 s, an exec'd worker is left to it); the objects the preloading created are frozen
(``gc.freeze()``, so no collection scans them or copies their pages; ``gc.get_freeze_count()`` is not 0);
``sys.modules`` already holds the preloaded modules, with what they did when imported (two logging-only atexit
callbacks; torch._dynamo sets ``TORCHINDUCTOR_CACHE_DIR`` in ``os.environ``, as it does in any worker that
builds an optimizer); ``hash()`` randomization (the str hash secret) is the zygote's, shared by all warm
workers (set ``PYTHONHASHSEED`` to control it; it must then be the same for agent and workers); the parent is
the zygote (``os.getppid()``); resource limits, CPU affinity and nice value are the agent's at zygote start;
module-level values that a preloaded module derived from the cwd at import are the zygote's cwd's
(multiprocessing's ORIGINAL_DIR and dynamo's debug_dir_root are recomputed; elastic-run runs workers in the
agent's cwd, which is the zygote's). CUDA is initialized only in the worker (the zygote never touches it), so
device selection works as usual.
"""

import builtins
import contextlib
import ctypes
import importlib
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
import traceback
import types
from typing import Any, NoReturn, cast

if __name__ != "__main__":  # imported in the agent's tree; the zygote runs the bundle as __main__
    from agent.warm.zygote_ops import SpawnRequest

_PR_SET_PDEATHSIG = 1
# torch's CPU generator seed before torch 2.x started seeding it at random (c10's default_rng_seed_val).
_TORCH_FIXED_DEFAULT_SEED = 67280421310721
# Exit code of a forked worker whose set-up failed before the user's code ran.
_SETUP_FAILED = 1
# Frames running the zygote's code (one namespace: the bundle), hidden from a worker's traceback.
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
        self.signals: dict[int, Any] = {}  # signal number -> the handler a fresh interpreter has
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
        self.signal_ = getattr(libc, "signal", None)
        if self.on_exit is not None:
            self.on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            self.on_exit.restype = ctypes.c_int


def _open_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))  # drops the fd that listdir itself had open
        except OSError:
            continue
        fds.add(int(name))
    return fds


# -- a forked worker ----------------------------------------------------------------------------------------
def _become_worker(
    req: SpawnRequest, out_fd: int, err_fd: int, sync_w: int, base: _Baseline, close_inherited
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
        os.chdir(req.cwd)
        if req.umask is not None:
            os.umask(req.umask)
        env = req.env
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(base.env_added)  # /proc/self/environ (below) shows what execve gave, as usual
        for key in base.env_removed:
            os.environ.pop(key, None)
        _set_cmdline(req.argv, environ=env)
        _reset_process_state(env, base)
        _new_stdio(req.unbuffered, base)
        run = _prepare_main(req)
        _install_progress_hooks(base)
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
    if sys.modules.get("tempfile") is not None:  # only modules the zygote imported: no import here
        import tempfile

        tempfile.tempdir = None  # recomputed from this worker's TMPDIR on first use
    if sys.modules.get("multiprocessing.process") is not None:
        import multiprocessing.process as mp_process

        mp_process.current_process().authkey = os.urandom(32)
        # Taken at its import, in the zygote's cwd.
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # type: ignore[attr-defined]  # not in typeshed
    # torch's config module, never imported by the agent: its settings are made at run time (typed Any).
    dynamo_config: Any = sys.modules.get("torch._dynamo.config")
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


def _install_progress_hooks(base: _Baseline) -> None:
    """The progress hooks of elastic.autoprogress (optimizer steps, forward passes, saves), registered before
    the user's code runs, as the exec path's sitecustomize does; imported here, in the worker (the zygote
    imports nothing of the library). Never fails the start: without the library, no hooks."""
    try:
        autoprogress = importlib.import_module("elastic.autoprogress")
        autoprogress.install(base.torch)
    except Exception:  # noqa: BLE001 - progress is advisory: the worker runs regardless
        pass


def _new_stdio(unbuffered: bool, base: _Baseline) -> None:
    """sys.stdin/stdout/stderr as the interpreter creates them at start-up (``-u`` or not)."""
    for fd, name, write in ((0, "stdin", False), (1, "stdout", True), (2, "stderr", True)):
        encoding, errors = base.stdio[name]
        buffering = 0 if unbuffered and write else -1
        buf = open(fd, "wb" if write else "rb", buffering=buffering, closefd=False)  # noqa: SIM115
        # open() gives the descriptor's FileIO itself when unbuffered, else a buffer over it (typeshed: both
        # are BinaryIO).
        buffered = cast("io.BufferedReader | io.BufferedWriter", buf)
        raw = cast(io.FileIO, buf if buffering == 0 else buffered.raw)
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
        stream.mode = "w" if write else "r"  # type: ignore[misc]  # open() sets it too; stubs: read-only
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
def _prepare_main(req: SpawnRequest):
    """Set sys.argv, sys.path[0] and a fresh ``__main__`` as the interpreter does; return the runner."""
    args = list(req.args)
    target = req.target
    sys.orig_argv = list(req.argv)
    main = types.ModuleType("__main__")
    # What the interpreter puts into __main__ at start-up (pylifecycle.c add_main_module).
    main.__dict__["__annotations__"] = {}
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if req.mode == "module":
        sys.argv = ["-m", *args]
        sys.path.insert(0, os.getcwd())

        def run_module() -> None:
            # What `python -m` calls (alter_argv=True).
            runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # private, not in typeshed

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
    main.__dict__["__cached__"] = None
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


def _exit(code: int, base: _Baseline) -> NoReturn:
    base.py_exit(code)  # finalizes the interpreter and calls exit(code)
    os._exit(code & 0xFF)  # not reached


def _exit_by_sigint(base: _Baseline) -> NoReturn:
    """An uncaught KeyboardInterrupt: finalize, then die by SIGINT (``Py_RunMain``'s ``exit_sigint``)."""
    if base.on_exit is not None and base.raise_ is not None and base.signal_ is not None:
        # exit(SIGINT) calls, after the interpreter's finalization and before C++ static destructors (on_exit
        # handlers run last registered first, each as f(status, arg)): signal(SIGINT, NULL = SIG_DFL), then
        # raise(SIGINT), whose extra argument is ignored. The finalization restores the disposition the
        # process started with, which is SIG_IGN under `nohup ... &`; CPython's exit_sigint sets SIG_DFL too.
        base.on_exit(ctypes.cast(base.raise_, ctypes.c_void_p), None)
        base.on_exit(ctypes.cast(base.signal_, ctypes.c_void_p), None)
        _exit(int(signal.SIGINT), base)
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # private, untyped: the interpreter's exit path
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)
