"""The agent's checkpoint keeper: owns the node's shared-memory checkpoint folder and persists it to disk.

Workers flash-save into the folder (see :mod:`elastic.checkpoint`): a file appears there by rename
once complete, so the folder only ever shows whole checkpoints, and it outlives the worker that wrote
it. The keeper:

* **start**: creates ``<root>/elastic-<job>-<node>/`` (mode 0700, ``root`` is ``/dev/shm``) with an
  owner record (host, pid, process start time). A folder of the same job and node left behind by a
  crashed agent is removed, and so is any ``elastic-*`` folder of this host whose owner is dead (a
  crashed agent with another node id). A live owner of the same job and node is an error.
* **persists** each checkpoint a worker reports with its location (only the node of group rank 0 asks,
  see :func:`elastic.checkpoint.save`) in a background thread, to the folder the report names (the
  script's checkpoint folder, by default ``ELASTIC_CKPT_DIR`` = the agent's ``--ckpt-dir``), else to
  ``ckpt_dir``: copy to a temp file, fsync, rename, fsync the folder, then move the ``latest`` marker;
  the newest ``keep`` are kept.
* **stop**: persists what is still pending, then removes the folder.

Persist policy when a persist is still running at the next save: the worker is never blocked (it only
sent a datagram). Reports wait in a single slot that each newer report replaces; when the running
persist finishes, the newest pending checkpoint is persisted and the ones in between are skipped. The
disk copy thus lags memory by about one persist duration; a slow disk costs disk freshness, never
training time. A pending file that its worker pruned meanwhile (memory keeps two) is skipped too: a
newer one exists and its report follows.

Test hook (the only one): ``persist_delay_s`` (``ELASTIC_PERSIST_DELAY_S``, read by the CLI, ``D`` or
``D@S``) pauses every persist of a step >= ``S`` for ``D`` seconds right after the first chunk of the
temp file is written, i.e. in the middle of the copy. A stop ends the pause.

Standard library (and psutil) only: the agent never imports torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import psutil

from elastic import ckpt_layout as layout

log = logging.getLogger("elastic.agent")

DEFAULT_ROOT = Path("/dev/shm")
DEFAULT_KEEP = 3
SHM_DIR_ENV = "ELASTIC_SHM_DIR"
PERSIST_DELAY_ENV = "ELASTIC_PERSIST_DELAY_S"
FOLDER_PREFIX = "elastic-"
OWNER_FILE = ".owner"
_COPY_CHUNK = 8 << 20
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class KeeperError(Exception):
    """The shared-memory folder cannot be set up (e.g. another live agent holds it)."""


def folder_name(job_id: str, node_id: str) -> str:
    """``elastic-<job>-<node>``, with characters outside ``[A-Za-z0-9_.-]`` replaced (the owner record
    keeps the exact ids)."""

    def clean(text: str) -> str:
        return _UNSAFE.sub("_", text)[:100] or "_"

    return f"{FOLDER_PREFIX}{clean(job_id)}-{clean(node_id)}"


def parse_persist_delay(text: str | None) -> tuple[float, int]:
    """``"D"`` or ``"D@S"`` → ``(D seconds, from step S)``; empty → no delay."""
    if not text:
        return 0.0, 0
    seconds, _, step = text.partition("@")
    try:
        delay, first = float(seconds), int(step or 0)
    except ValueError:
        raise ValueError(f"{PERSIST_DELAY_ENV} must be SECONDS or SECONDS@STEP, got {text!r}") from None
    if delay < 0:
        raise ValueError(f"{PERSIST_DELAY_ENV} must not be negative, got {text!r}")
    return delay, first


@dataclass(frozen=True)
class _Owner:
    job: str
    node: str
    host: str
    pid: int
    started: float  # process create time, so that a reused pid is not taken for the owner

    def alive(self) -> bool:
        try:
            return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
        except psutil.NoSuchProcess:
            return False
        except psutil.Error:
            return True  # cannot tell: leave it alone

    @classmethod
    def me(cls, job: str, node: str) -> _Owner:
        return cls(job, node, socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def read(cls, folder: Path) -> _Owner | None:
        try:
            data = json.loads((folder / OWNER_FILE).read_text())
            return cls(
                str(data["job"]),
                str(data["node"]),
                str(data["host"]),
                int(data["pid"]),
                float(data["started"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


class CheckpointKeeper:
    """Owns one node's shared-memory checkpoint folder; see the module doc for the contract."""

    def __init__(
        self,
        job_id: str,
        node_id: str,
        *,
        ckpt_dir: Path | None = None,
        keep: int = DEFAULT_KEEP,
        root: Path = DEFAULT_ROOT,
        persist_delay_s: float = 0.0,
        persist_delay_from_step: int = 0,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.job_id = job_id
        self.node_id = node_id
        self.ckpt_dir = ckpt_dir
        self.keep = keep
        self.root = Path(root)
        self.folder = self.root / folder_name(job_id, node_id)
        self.persist_delay_s = persist_delay_s
        self.persist_delay_from_step = persist_delay_from_step
        self.persisted_step: int | None = None  # step of the last checkpoint this keeper made durable
        self.skipped = 0  # reports replaced by a newer one before their persist started
        self._cond = threading.Condition()
        self._pending: tuple[int, Path, Path] | None = None  # step, memory file, target folder
        self._busy = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> CheckpointKeeper:
        """Remove stale folders, create this node's, start the persist thread."""
        self._remove_stale()
        owner = _Owner.me(self.job_id, self.node_id)
        try:
            self.folder.mkdir(mode=0o700, parents=False)
            self._started = True
            record = json.dumps(owner.__dict__).encode()
            layout.atomic_write(self.folder / OWNER_FILE, lambda f: f.write(record), durable=False)
        except OSError as exc:
            raise KeeperError(f"cannot create {self.folder}: {exc}") from exc
        self._thread = threading.Thread(target=self._persist_loop, name="ckpt-keeper", daemon=True)
        self._thread.start()
        log.info("checkpoint memory: %s", self.folder)
        return self

    def worker_env(self) -> dict[str, str]:
        """What the workers need to flash-save here."""
        return {SHM_DIR_ENV: str(self.folder)}

    def stop(self) -> None:
        """Persist what is pending (a running pause ends), stop the thread, remove the folder."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._started:
            shutil.rmtree(self.folder, ignore_errors=True)
            self._started = False

    def __enter__(self) -> CheckpointKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _remove_stale(self) -> None:
        host = socket.gethostname()
        try:
            entries = [e for e in self.root.iterdir() if e.name.startswith(FOLDER_PREFIX) and e.is_dir()]
        except FileNotFoundError:
            raise KeeperError(f"the shared-memory root {self.root} does not exist") from None
        for folder in entries:
            owner = _Owner.read(folder)
            ours = folder == self.folder or (
                owner is not None and (owner.job, owner.node) == (self.job_id, self.node_id)
            )
            if owner is None:
                if not ours:
                    continue  # not a folder of ours, or one still being set up: leave it
            elif owner.host == host and owner.alive():
                if ours:
                    raise KeeperError(
                        f"another agent (pid {owner.pid}) of job {self.job_id} node {self.node_id} holds "
                        f"{folder}; give each agent its own --node-id"
                    )
                continue
            elif not ours and owner.host != host:
                continue  # another host's folder (a shared /dev/shm): its pids mean nothing here
            log.info("removing the checkpoint memory of a dead agent: %s", folder)
            shutil.rmtree(folder, ignore_errors=True)

    # -- reports ----------------------------------------------------------------------------------
    def on_checkpoint(self, local_rank: int, step: int, location: str, persist_to: str = "") -> None:
        """A worker reports a complete checkpoint; a location in this folder asks for a persist to
        ``persist_to`` (default ``ckpt_dir``).

        Called from the progress channel's thread; never blocks on I/O.
        """
        target = Path(persist_to) if persist_to else self.ckpt_dir
        if not location or target is None or not target.is_absolute():
            return
        path = Path(location)
        if path.parent != self.folder or layout.step_of(path.name) != step:
            log.warning(
                "ignoring a checkpoint report of local rank %d outside %s: %s",
                local_rank,
                self.folder,
                location,
            )
            return
        with self._cond:
            # The latest report is the newest save (one writer per node), even at a lower step: after a
            # rollback to an earlier step, that is the run that goes on.
            if self._pending is not None:
                self.skipped += 1
            self._pending = (step, path, target)
            self._cond.notify_all()

    def wait_persisted(self, step: int, timeout: float) -> bool:
        """Block until the checkpoint of ``step`` is the last one persisted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.persisted_step == step and not self._busy, timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is pending or being persisted; False on timeout (for tests and tools)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    # -- the persist thread -----------------------------------------------------------------------
    def _persist_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._stopping.is_set())
                if self._pending is None:
                    return  # stopping, nothing left
                step, path, target = self._pending
                self._pending = None
                self._busy = True
            try:
                self._persist(step, path, target)
            except FileNotFoundError:
                log.info("checkpoint of step %d was replaced in memory before its persist; skipped", step)
            except OSError as exc:
                log.warning("could not persist the checkpoint of step %d to %s: %s", step, target, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _persist(self, step: int, source: Path, directory: Path) -> None:
        started = time.monotonic()
        # Open first: the worker may prune the file any time; an open file stays readable.
        with source.open("rb") as src:
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / source.name
            layout.atomic_write(target, lambda dst: self._copy(src, dst, step))
        layout.write_marker(directory, target)
        layout.prune(directory, target, self.keep)
        layout.remove_temp_files(directory)
        with self._cond:
            self.persisted_step = step
        log.debug(
            "persisted the checkpoint of step %d to %s in %.2fs", step, target, time.monotonic() - started
        )

    def _copy(self, src: BinaryIO, dst: BinaryIO, step: int) -> None:
        first = True
        while chunk := src.read(_COPY_CHUNK):
            dst.write(chunk)
            if first and self.persist_delay_s and step >= self.persist_delay_from_step:
                dst.flush()  # the torn temp file is visible on disk during the pause
                self._stopping.wait(self.persist_delay_s)
            first = False


def keeper_for(
    job_id: str, node_id: str, ckpt_dir: Path | None, keep: int, environ: Mapping[str, str]
) -> CheckpointKeeper:
    """The keeper of an agent, with the test hook read from ``environ``."""
    delay, from_step = parse_persist_delay(environ.get(PERSIST_DELAY_ENV))
    return CheckpointKeeper(
        job_id,
        node_id,
        ckpt_dir=ckpt_dir,
        keep=keep,
        persist_delay_s=delay,
        persist_delay_from_step=from_step,
    )
