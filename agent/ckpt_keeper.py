"""The agent's checkpoint keeper: owns the node's shared-memory checkpoint folder and persists it to disk.

Workers flash-save into the folder (see :mod:`elastic.checkpoint`): a file appears there by rename
once complete, so the folder only ever shows whole checkpoints, and it outlives the worker that wrote
it. The keeper:

* **start**: takes ``<root>/elastic-<job>-<node>/`` (mode 0700, ``root`` is ``/dev/shm``) by an exclusive
  ``flock`` of its ``.lock`` file, held until stop (:mod:`agent.shm_lock`): a held lock is a live agent
  of the same job and node, an error; a free one means its previous owner is gone, however it ended
  (killed, an unreaped zombie, another PID namespace), and its leftovers are removed (takeover). Other
  ``elastic-*`` folders whose lock is free are removed too (crashed agents with another node id); a
  folder without a lock file (an older agent's) is judged by its owner record (host, pid, start time).
* **persists** each checkpoint a worker reports with its location (only the node of group rank 0 asks,
  see :func:`elastic.checkpoint.save`) in a background thread, to the folder the report names (the
  script's checkpoint folder, by default ``ELASTIC_CKPT_DIR`` = the agent's ``--ckpt-dir``), else to
  ``ckpt_dir``: copy to a temp file, fsync, then commit it fenced by the worker's round
  (:mod:`agent.ckpt_fence`: rename, fsync the folder, move ``latest`` never backwards, prune only older
  files); the newest ``keep`` are kept. A node's sharded save (``<folder>/sharded``, reported by local
  rank 0 of every node) is replicated to peers (:mod:`agent.replication`) and its part persisted to
  ``<target>/sharded`` (:mod:`agent.sharded_persist`: the node completing a step commits it).
* **sweeps** temp files of dead writers from the folder (a worker killed mid-save leaves a
  checkpoint-sized one): the agent calls :meth:`CheckpointKeeper.sweep` whenever it has stopped its
  workers; the bytes reclaimed are logged.
* **reports** :meth:`CheckpointKeeper.persist_status`: the step last made durable and the error of the
  last persist, or of one that made no progress for ``stall_s`` (a hung disk), for the heartbeats.
* **stop**: persists what is still pending, and the newest checkpoint in memory if it is newer than the
  last persist request (a ``persist=False`` save, or a request lost with its worker), then removes the
  folder. The stop is bounded: it gives up a persist that made no progress for ``stall_s`` (default
  30 s), or that still runs ``stop_cap_s`` (default 600 s) after the stop began, logs and records the
  error, and goes on (the thread is abandoned; nothing it finishes later is published).

Persist policy when a persist is still running at the next save: the worker is never blocked (its report
is queued by the kernel). Reports wait in a slot per kind (replicated file, sharded save) that each newer
report of the kind replaces; when the running
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

from agent import ckpt_fence, sharded_persist, shm_lock
from elastic import ckpt_layout as layout
from elastic import shard_layout

log = logging.getLogger("elastic.agent")

DEFAULT_ROOT = Path("/dev/shm")
DEFAULT_KEEP = 3
SHM_DIR_ENV = "ELASTIC_SHM_DIR"
PERSIST_DELAY_ENV = "ELASTIC_PERSIST_DELAY_S"
FOLDER_PREFIX = "elastic-"
OWNER_FILE = ".owner"
#: A persist that wrote nothing for this long is reported as stalled, and given up at stop.
DEFAULT_STALL_S = 30.0
#: The stop gives up a persist still running this long after the stop began, even one making progress.
DEFAULT_STOP_CAP_S = 600.0
_JOIN_SLICE_S = 0.2
_COPY_CHUNK = 8 << 20
_SYNC_EVERY = 256 << 20
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class _Request:
    """A checkpoint to persist: its step, file in memory (a sharded save: the node's data folder, and
    ``save_id``), target folder and the worker's round."""

    step: int
    source: Path
    target: Path
    round: int | None
    save_id: str = ""  # a sharded save's (agent.sharded_persist); "" for a replicated checkpoint file

    @property
    def kind(self) -> str:
        return "sharded" if self.save_id else "file"


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
        stall_s: float = DEFAULT_STALL_S,
        stop_cap_s: float = DEFAULT_STOP_CAP_S,
        lock_timeout_s: float = ckpt_fence.DEFAULT_LOCK_TIMEOUT_S,
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
        self.stall_s = stall_s
        self.stop_cap_s = stop_cap_s
        self.lock_timeout_s = lock_timeout_s
        self.persisted_step: int | None = None  # step of the last checkpoint this keeper made durable
        self.persist_error = ""  # why the last persist failed; "" once one succeeds
        self.requests = 0  # persist requests received
        self.persisted = 0
        self.skipped = 0  # reports replaced by a newer one before their persist started
        self.superseded = 0  # persists not published: a newer round committed to the folder
        self.failures = 0
        self.swept_bytes = 0  # temp files of dead writers removed from the memory folder
        self.persist_seconds = (0, 0.0)  # (persists that ended without error, their total time): metrics
        self._cond = threading.Condition()
        # One slot per kind (replicated file, sharded save), each replaced by a newer report.
        self._pending: dict[str, _Request] = {}
        self._last_request: dict[str, _Request] = {}
        self._current: _Request | None = None  # the persist running now
        self._progress_at = time.monotonic()  # when the running persist last wrote (or began)
        self._busy = False
        self._stopping = threading.Event()
        self._abandon = threading.Event()  # set when a stop gives the running persist up
        self._thread: threading.Thread | None = None
        self._started = False
        self._lock_fd: int | None = None
        #: Peer replication of sharded saves (agent.replication), attached by the agent when enabled.
        self.replicator = None
        self.replica_server = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> CheckpointKeeper:
        """Remove stale folders, take this node's (see the module doc), start the persist thread."""
        self._remove_stale()
        try:
            self._lock_fd = shm_lock.acquire(self.folder)
        except shm_lock.FolderHeldError:
            holder = _Owner.read(self.folder)
            who = f"pid {holder.pid} on {holder.host}" if holder else "owner record not written yet"
            raise KeeperError(
                f"another agent ({who}) of job {self.job_id} node {self.node_id} holds {self.folder}; "
                "give each agent its own --node-id"
            ) from None
        except OSError as exc:
            raise KeeperError(f"cannot create {self.folder}: {exc}") from exc
        self._started = True
        try:
            self._take_over()
            record = json.dumps(_Owner.me(self.job_id, self.node_id).__dict__).encode()
            layout.atomic_write(self.folder / OWNER_FILE, lambda f: f.write(record), durable=False)
        except OSError as exc:
            self.stop()
            raise KeeperError(f"cannot set up {self.folder}: {exc}") from exc
        self._thread = threading.Thread(target=self._persist_loop, name="ckpt-keeper", daemon=True)
        self._thread.start()
        log.info("checkpoint memory: %s", self.folder)
        return self

    def worker_env(self) -> dict[str, str]:
        """What the workers need to flash-save here."""
        return {SHM_DIR_ENV: str(self.folder)}

    def stop(self) -> None:
        """Persist what is pending and the newest memory checkpoint (a running pause ends; bounded, see the
        module doc), stop the thread, remove the folder and release it. Idempotent."""
        if self._thread is not None:
            self._queue_newest()
            self._stopping.set()
            with self._cond:
                # The stop ends a test pause: stalls count from here at the earliest.
                self._progress_at = max(self._progress_at, time.monotonic())
                self._cond.notify_all()
            self._join_bounded()
            self._thread = None
            log.info(
                "checkpoint keeper: %d persist requests, %d persisted, %d skipped for a newer one, "
                "%d superseded by a newer round, %d failed; %s of dead writers' temp files reclaimed",
                self.requests,
                self.persisted,
                self.skipped,
                self.superseded,
                self.failures,
                _mib(self.swept_bytes),
            )
        self._stopping.set()
        if self.replicator is not None:
            self.replicator.stop()
        if self.replica_server is not None:
            self.replica_server.close()
        if self._started:
            shutil.rmtree(self.folder, ignore_errors=True)
            self._started = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # after the removal: nobody takes the folder over half-removed
            self._lock_fd = None

    def _queue_newest(self) -> None:
        """At stop: queue the newest memory checkpoint (of each kind) when it is newer than the last persist
        request (a ``persist=False`` save, or a request lost with its worker), to where that request went."""
        with self._cond:
            for kind, last in list(self._last_request.items()):
                if kind == "sharded":
                    saves = shard_layout.committed(self.folder / shard_layout.SHARDED_SUBDIR)[:1]
                    newest = [_Request(s, data, last.target, last.round, sid) for s, sid, data in saves]
                else:
                    files = layout.checkpoint_files(self.folder)[:1]
                    newest = [_Request(s, path, last.target, last.round) for s, path in files]
                if not newest or newest[0].step <= last.step:
                    continue
                log.info(
                    "persisting the newest %s checkpoint in memory (step %d) at stop", kind, newest[0].step
                )
                self._queue(newest[0])

    def _queue(self, request: _Request) -> None:
        """Put ``request`` in its kind's slot (the caller holds ``_cond``)."""
        if request.kind in self._pending:
            self.skipped += 1
        self._pending[request.kind] = self._last_request[request.kind] = request
        self._cond.notify_all()

    def _join_bounded(self) -> None:
        """Wait for the persist thread; give the running persist up when it stalls or the cap passes."""
        thread = self._thread
        if thread is None:
            return
        cap = time.monotonic() + self.stop_cap_s
        while True:
            thread.join(_JOIN_SLICE_S)  # a slice, to look at the running persist's progress
            if not thread.is_alive():
                return
            with self._cond:
                current, stalled = self._current, time.monotonic() - self._progress_at
            if current is None or (stalled < self.stall_s and time.monotonic() < cap):
                continue
            self._abandon.set()  # ends a wait for the fence lock; a late finish publishes nothing
            why = f"no progress for {stalled:.0f}s" if stalled >= self.stall_s else "the stop's cap passed"
            self._fail(current, f"gave up at stop ({why}); the disk may lack this checkpoint")
            return

    def sweep(self, *, workers_stopped: bool = False) -> int:
        """Remove temp files of dead writers from the memory folder (a worker killed mid-save leaves a
        checkpoint-sized one); returns the bytes reclaimed, and logs them. ``workers_stopped``: no worker
        runs, so no temp file there can have a live writer, whatever its name says."""
        if not self._started:
            return 0
        freed = layout.remove_temp_files(self.folder, writers_stopped=workers_stopped)
        if workers_stopped:  # a sharded save's temp folder: its writers are all gone now
            freed += shard_layout.remove_temp_dirs(self.folder / shard_layout.SHARDED_SUBDIR)
        if freed:
            with self._cond:
                self.swept_bytes += freed
            log.info("removed temp files of killed writes from %s: %s reclaimed", self.folder, _mib(freed))
        return freed

    def persist_status(self) -> tuple[int | None, str]:
        """``(persisted step, error)`` for the heartbeats: the error of the last persist if it failed, or
        of the running one if it made no progress for ``stall_s`` (hung storage); "" when all is well."""
        with self._cond:
            error, current = self.persist_error, self._current
            stalled = time.monotonic() - self._progress_at
            if not error and current is not None and stalled >= self.stall_s:
                error = f"step {current.step} to {current.target}: no progress for {stalled:.0f}s"
            return self.persisted_step, error

    def queue_depth(self) -> int:
        """Persists waiting or running now (0 to 3: one slot per kind, plus the running one)."""
        with self._cond:
            return len(self._pending) + int(self._busy)

    def _take_over(self) -> None:
        """Remove what a dead previous owner left in the folder (all but the lock we now hold)."""
        previous = _Owner.read(self.folder)
        freed = 0
        for entry in self.folder.iterdir():
            if entry.name == shm_lock.LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
                continue
            try:
                freed += entry.lstat().st_size
            except FileNotFoundError:
                continue
            entry.unlink(missing_ok=True)
        if previous is not None:
            log.info(
                "took over the checkpoint memory of a dead agent (pid %d on %s): %s, %s freed",
                previous.pid,
                previous.host,
                self.folder,
                _mib(freed),
            )

    def __enter__(self) -> CheckpointKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _remove_stale(self) -> None:
        """Remove other agents' folders whose owner is gone (this node's own folder is taken in start)."""
        try:
            entries = [e for e in self.root.iterdir() if e.name.startswith(FOLDER_PREFIX) and e.is_dir()]
        except FileNotFoundError:
            raise KeeperError(f"the shared-memory root {self.root} does not exist") from None
        for folder in entries:
            if folder == self.folder:
                continue
            try:
                fd = shm_lock.try_lock(folder / shm_lock.LOCK_FILE)
            except FileNotFoundError:
                if self._dead_by_owner_record(folder):  # an older agent's folder, without a lock file
                    _discard(folder)
                continue
            except OSError:
                continue  # not ours to judge (e.g. another user's)
            if fd is None:
                continue  # its agent lives
            try:
                _discard(folder)
            finally:
                os.close(fd)

    @staticmethod
    def _dead_by_owner_record(folder: Path) -> bool:
        owner = _Owner.read(folder)
        # No record: not a folder of ours, or one still being set up. Another host's (a shared /dev/shm):
        # its pids mean nothing here.
        return owner is not None and owner.host == socket.gethostname() and not owner.alive()

    # -- reports ----------------------------------------------------------------------------------
    def on_checkpoint(
        self,
        local_rank: int,
        step: int,
        location: str,
        persist_to: str = "",
        round_number: int | None = None,
    ) -> None:
        """A worker reports a complete checkpoint; a location in this folder asks for a persist to
        ``persist_to`` (default ``ckpt_dir``). ``round_number``: the worker's round (``ELASTIC_ROUND``),
        which fences the commit; None from a worker that does not send it.

        Called from the progress channel's thread; never blocks on I/O.
        """
        target = Path(persist_to) if persist_to else self.ckpt_dir
        if location and Path(location).parent == self.folder / shard_layout.SHARDED_SUBDIR:
            # A node's sharded save, committed by its local rank 0: replicated to the ring successors,
            # and its part persisted to <target>/sharded (agent.sharded_persist).
            if self.replicator is not None:
                self.replicator.on_saved(step)
            self._on_sharded(step, Path(location), target, round_number)
            return
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
            self.requests += 1
            self._queue(_Request(step, path, target, round_number))

    def _on_sharded(self, step: int, link: Path, target: Path | None, round_number: int | None) -> None:
        if target is None or not target.is_absolute():
            return
        try:
            match = shard_layout.DATA_DIR.match(os.readlink(link))
        except OSError:
            match = None
        if match is None or int(match.group(1)) != step:
            log.info("sharded checkpoint of step %d was replaced in memory before its persist; skipped", step)
            return
        request = _Request(
            step,
            link.parent / match.group(0),
            target / shard_layout.SHARDED_SUBDIR,
            round_number,
            match.group(2),
        )
        with self._cond:
            self.requests += 1
            self._queue(request)

    def replication_fields(self) -> dict[str, object]:
        """What the heartbeats say about peer replication (empty when it is off)."""
        if self.replicator is None or self.replica_server is None:
            return {}
        status = self.replicator.status()
        return {
            "replicas": self.replicator.replicas,
            "replication_port": self.replica_server.port,
            "replicated_step": status.replicated_step,
            "replication_lag": status.lag,
            "replication_error": status.error,
        }

    def set_replica_targets(self, targets: list[str]) -> None:
        """The replication endpoints of this node's ring successors, from the master's reply."""
        if self.replicator is not None:
            self.replicator.set_targets(targets)

    def wait_persisted(self, step: int, timeout: float) -> bool:
        """Block until the checkpoint of ``step`` is the last one persisted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.persisted_step == step and not self._busy, timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is pending or being persisted; False on timeout (for tests and tools)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    # -- the persist thread -----------------------------------------------------------------------
    def _persist_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending) or self._stopping.is_set())
                if not self._pending or self._abandon.is_set():
                    return  # stopping, nothing left (or given up)
                request = self._pending.pop(min(self._pending))  # "file" before "sharded": either order works
                self._busy, self._current, self._progress_at = True, request, time.monotonic()
            started = time.monotonic()
            try:
                self._persist(request)
            except OSError as exc:  # disk full, EIO, the fence lock held too long...
                if not self._abandon.is_set():  # a persist given up at stop was reported by the stop
                    self._fail(request, str(exc))
            else:
                count, total = self.persist_seconds
                self.persist_seconds = (count + 1, total + time.monotonic() - started)
            finally:
                with self._cond:
                    self._busy, self._current = False, None
                    self._cond.notify_all()

    def _fail(self, request: _Request, message: str) -> None:
        text = f"step {request.step} to {request.target}: {message}"
        with self._cond:
            self.failures += 1
            self.persist_error = text
        log.warning("could not persist the checkpoint of %s", text)

    def _persist(self, request: _Request) -> None:
        if request.save_id:
            self._persist_sharded(request)
            return
        started = time.monotonic()
        try:
            # Open first: the worker may prune or recycle the file any time; an open file under the
            # shared lock stays readable and unchanged.
            src = layout.open_shared(request.source)
        except FileNotFoundError:
            log.info("checkpoint of step %d was replaced in memory before its persist; skipped", request.step)
            return
        with src:
            request.target.mkdir(parents=True, exist_ok=True)
            final = request.target / request.source.name
            tmp = layout.write_temp(final, lambda dst: self._copy(src, dst, request.step))
        if self._abandon.is_set():  # the stop gave this persist up: publish nothing behind its back
            tmp.unlink(missing_ok=True)
            return
        decision = ckpt_fence.commit(
            request.target,
            tmp,
            final,
            round_=request.round,
            step=request.step,
            keep=self.keep,
            lock_timeout_s=self.lock_timeout_s,
            cancel=self._abandon,
        )
        if not decision.publish:
            with self._cond:
                self.superseded += 1
            log.info("not persisting the checkpoint of step %d: %s", request.step, decision.why)
            return
        with self._cond:
            self.persisted_step, self.persist_error = request.step, ""
            self.persisted += 1
        log.debug(
            "persisted the checkpoint of step %d to %s in %.2fs (%s)",
            request.step,
            final,
            time.monotonic() - started,
            decision.why,
        )

    def _persist_sharded(self, request: _Request) -> None:
        started = time.monotonic()
        try:
            outcome = sharded_persist.persist(
                request.source,
                request.target,
                step=request.step,
                save_id=request.save_id,
                round_=request.round,
                keep=self.keep,
                copy=lambda src, dst: self._copy(src, dst, request.step),
                lock_timeout_s=self.lock_timeout_s,
                cancel=self._abandon,
            )
        except FileNotFoundError:
            log.info(
                "sharded checkpoint of step %d was replaced in memory before its persist; skipped",
                request.step,
            )
            return
        if not outcome.published:
            if not self._abandon.is_set():
                with self._cond:
                    self.superseded += 1
                log.info("not persisting the sharded checkpoint of step %d: %s", request.step, outcome.why)
            return
        with self._cond:
            self.persisted += 1
            self.persist_error = ""
            if outcome.committed:
                self.persisted_step = request.step
            self._cond.notify_all()
        log.debug(
            "persisted this node's part of the sharded checkpoint of step %d to %s in %.2fs%s",
            request.step,
            request.target,
            time.monotonic() - started,
            " (the step is complete there)" if outcome.committed else "",
        )

    def _copy(self, src: BinaryIO, dst: BinaryIO, step: int) -> None:
        first = True
        unsynced = 0
        while chunk := src.read(_COPY_CHUNK):
            dst.write(chunk)
            unsynced += len(chunk)
            if unsynced >= _SYNC_EVERY:
                # Flush as we go: the final fsync then stays short, so that a long silence means a hung
                # disk (see stall_s), not a large checkpoint's last flush.
                dst.flush()
                os.fdatasync(dst.fileno())
                unsynced = 0
            self._progress_at = time.monotonic()
            if first and self.persist_delay_s and step >= self.persist_delay_from_step:
                dst.flush()  # the torn temp file is visible on disk during the pause
                self._stopping.wait(self.persist_delay_s)
            first = False


def _discard(folder: Path) -> None:
    """Remove a dead agent's folder: renamed away first, so that a new folder of that name is never hit."""
    log.info("removing the checkpoint memory of a dead agent: %s", folder)
    trash = folder.with_name(f".{folder.name}.{os.getpid()}.removing")
    try:
        folder.rename(trash)
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)


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
