"""The warm-start zygote: an interpreter that has imported torch and forks workers from that state.

Started once per agent by :class:`agent.warm.starter.WarmLauncher` as ``python -c <bootstrap>``, where the
bootstrap executes the zygote's source bundle (:data:`agent.warm.starter.BUNDLE`: this file last) from the
environment variable ``_EZ``; the control socket's fd number is in ``_EZ_FD``
and the modules to import in ``_EZ_PRELOAD`` (comma-separated: torch first, then e.g. torch._dynamo, which
torch.optim imports on first use). Standard library only, plus those imports; after each one the zygote
checks that it is still safe to fork (one thread, no new native threads, CUDA untouched).

Protocol: the operations of :mod:`agent.warm.zygote_ops` (documented in docs/protocol.md): ``ready`` or
``unavailable`` once, then ``spawn`` requests answered by ``spawned`` (with the worker's pidfd) or
``spawn_failed``, and ``exit`` when a worker exited (the zygote is its parent and reaps it).

On EOF (the agent closed the socket or died) the zygote SIGKILLs the process groups of its live workers,
reaps them and exits. The zygote itself has PR_SET_PDEATHSIG=SIGKILL towards the agent, and every worker
has it towards the zygote, so an agent SIGKILL takes zygote and workers down; the agent's reaper also
has every worker's process group (and the zygote's) registered.

A forked worker is set up to look like ``python [-u] script args`` / ``python [-u] -m module args``
exec'd by the agent: see :mod:`agent.warm._zygote_worker`. What cannot be made identical, and why, is
documented in ``agent/warm/starter.py``.
"""

import contextlib
import functools
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
import types
import warnings
from typing import Any

if __name__ != "__main__":  # imported in the agent's tree; the zygote runs the bundle as __main__
    from agent.warm._zygote_worker import _Baseline, _become_worker, _set_cmdline
    from agent.warm.zygote_ops import (
        MalformedMessage,
        Ready,
        Spawned,
        SpawnFailed,
        SpawnRequest,
        Unavailable,
        WorkerExited,
        decode,
        encode,
    )

# A spawn request carries the worker's whole environment; the agent refuses (and execs) bigger ones.
_MAX_REQUEST_BYTES = 4 * 1024 * 1024


# -- the zygote ---------------------------------------------------------------------------------------------
#: Signals a batch system sends to every process of a job step (SLURM's ``--signal=USR1@90`` pre-emption
#: warning reaches the agent's helpers too): meant for the agent, which outlives them; the zygote must not
#: die of one (their default action ends a process), and its workers get the inherited disposition back.
AGENT_ONLY_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def main() -> int:
    inherited = {sig: signal.signal(sig, signal.SIG_IGN) for sig in AGENT_ONLY_SIGNALS}
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
        _send(ctrl, Unavailable(reason=f"import torch failed: {type(e).__name__}: {e}"))
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
        _send(ctrl, Unavailable(reason=problem))
        return 1
    _install_store_wait()
    # The fork-server recipe of the gc docs: the preloaded objects move to the permanent generation, so no
    # collection (in the zygote or a worker) scans them or touches their pages (copy-on-write).
    gc.freeze()
    gc.enable()
    env_added.update({k: v for k, v in os.environ.items() if env_before.get(k) != v})
    env_removed = set(env_before) - set(os.environ)
    base = _Baseline(torch, ctrl_fd, env_added, env_removed)
    for sig, handler in inherited.items():  # a worker starts with what the zygote inherited, not SIG_IGN
        if handler is not None:
            base.signals[sig] = handler
    _set_cmdline([sys.executable, "-c", "# elastic-run warm-start zygote"], environ=None)
    ready = Ready(
        pid=base.pid,
        import_s=round(time.monotonic() - started, 3),
        torch=torch.__version__,
        preloaded=loaded,
        skipped=skipped,
        native_threads=threads,
    )
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
    # torch's module, which the agent's tree never imports: typed Any.
    rdzv: Any = sys.modules.get("torch.distributed.rendezvous")
    original = getattr(rdzv, "_create_c10d_store", None)
    if original is None:  # torch without distributed support, or a layout we do not know: leave it be
        return

    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if rank != 0:
            _wait_for_listener(hostname, port, timeout.total_seconds())
        return original(hostname, port, rank, world_size, timeout, *args, **kwargs)

    # Its doc and __wrapped__ only (the name stays this wrapper's).
    functools.update_wrapper(_create_c10d_store, original, assigned=("__doc__",), updated=())
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
                    exit_msg = WorkerExited(pid=pid, returncode=os.waitstatus_to_exitcode(status))
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
        req = decode(data)
    except MalformedMessage as e:
        req = e.request_id
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 2 or not isinstance(req, SpawnRequest):
        _close_all(fds)
        req_id = req.id if isinstance(req, SpawnRequest) else req
        if isinstance(req_id, int):  # else not ours: nothing to answer
            _send(ctrl, SpawnFailed(id=req_id, error="malformed or truncated spawn request"))
        return None
    req_id = req.id
    out_fd, err_fd = fds
    try:
        if not os.path.isdir(req.cwd):
            raise FileNotFoundError(f"working directory {req.cwd!r} not found")
        sync_r, sync_w = os.pipe()
        try:
            pid = _fork()
        except BaseException:
            os.close(sync_r)
            os.close(sync_w)
            raise
    except (OSError, KeyError, TypeError) as e:
        _close_all(fds)
        _send(ctrl, SpawnFailed(id=req_id, error=f"{type(e).__name__}: {e}"))
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
        payload = encode(Spawned(id=req_id, pid=pid))
        socket.send_fds(ctrl, [payload], [pidfd])
    except OSError:
        pass  # the agent is gone; the next recv sees EOF and the worker is killed
    return pid, pidfd


def _fork() -> int:
    with warnings.catch_warnings():  # restored in parent and child alike when the block ends
        # Python >= 3.12 warns about forking a process with threads; ours are BLAS pools that stop at fork.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _send(ctrl: socket.socket, msg: "Ready | Unavailable | SpawnFailed | WorkerExited") -> bool:
    try:
        ctrl.sendmsg([encode(msg)])
    except OSError:
        return False
    return True


def _close_all(fds) -> None:
    for fd in list(fds):
        with contextlib.suppress(OSError):
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
