"""The agent's checkpoint keeper: owns the node's shared-memory checkpoint folder and persists it to disk.

Workers flash-save into the folder (see :mod:`elastic.checkpoint.replicated`): a file appears there by rename
once complete, so the folder only ever shows whole checkpoints, and it outlives the worker that wrote
it. The keeper:

* **start**: takes ``<root>/elastic-<job>-<node>/`` (``root`` is ``/dev/shm``) and removes dead agents'
  folders (:mod:`agent.checkpoints.shm_folder`: a lifetime lock, an owner record, takeover of a dead owner's).
* **persists** each checkpoint a worker reports with its location (only the node of group rank 0 asks,
  see :func:`elastic.checkpoint.save`) in a background thread, to the folder the report names (the
  script's checkpoint folder, by default ``ELASTIC_CKPT_DIR`` = the agent's ``--ckpt-dir``), else to
  ``ckpt_dir`` (:mod:`agent.checkpoints.persist`: a temp file, fsync, then a commit fenced by the worker's
  round); the newest ``keep`` are kept. A node's sharded save (``<folder>/sharded``, reported by local
  rank 0 of every node) is replicated to peers (:mod:`agent.checkpoints.replication`) and its part persisted
  to ``<target>/sharded`` (:mod:`agent.checkpoints.sharded_persist`: the node completing a step commits it).
* **sweeps** temp files of dead writers from the folder (a worker killed mid-save leaves a
  checkpoint-sized one): the agent calls :meth:`CheckpointKeeper.sweep` whenever it has stopped its
  workers; the bytes reclaimed are logged.
* **reports** :meth:`CheckpointKeeper.persist_status`: the step last made durable and the error of the
  last persist (failed, or superseded: not published because a newer round or submission of the job
  committed to the folder, :mod:`agent.checkpoints.fence`), or of one that made no progress for
  ``stall_s`` (a hung disk), for the heartbeats (the master's status and events show it); each persist's
  outcome is counted (:attr:`CheckpointKeeper.outcomes`, the agent's metrics) and a failed or superseded
  one is logged as a warning.
* **reports damage**: a checkpoint copy whose bytes fail their digest (:mod:`elastic.checkpoint.digest`),
  found by a worker's restore (its report comes through the progress channel) or by a persist (which then
  fails: damaged bytes are never persisted), goes into :attr:`CheckpointKeeper.findings`, which the
  heartbeats carry to the master (event ``checkpoint_corrupt``) until one that carried it is answered;
  so do the integrity guard's findings (``on_checkpoint(..., integrity=...)``: events
  ``integrity_detected``, ``integrity_rolled_back``).
* **stop**: persists what is still pending, and the newest checkpoint in memory if it is newer than the
  last persist request (a ``persist=False`` save, or a request lost with its worker), then removes the
  folder, unless the newest checkpoint asked for could not be made durable
  (:attr:`CheckpointKeeper.unpersisted`; one refused because a newer round of the same submission
  committed is no loss: the job went on from its step or a newer one): then the folder is kept, renamed
  out of the way of later agents (:func:`agent.checkpoints.shm_folder.keep_unpersisted`,
  :attr:`CheckpointKeeper.kept`), and the agent exits 1 saying how to persist it. The stop is bounded: it
  gives up a persist that made no progress for ``stall_s`` (default 30 s), or that still runs
  ``stop_cap_s`` (default 600 s) after the stop began, logs and records the error, and goes on (the
  thread is abandoned; nothing it finishes later is published).

Persist policy when a persist is still running at the next save: the worker is never blocked (its report
is queued by the kernel). Reports wait in a slot per kind (replicated file, sharded save) that each newer
report of the kind replaces; when the running persist finishes, the newest pending checkpoint is
persisted and the ones in between are skipped. The disk copy thus lags memory by about one persist
duration; a slow disk costs disk freshness, never training time.

Test hook: ``persist_delay_s`` (:mod:`agent.checkpoints.persist`) pauses a persist mid-copy; a stop ends it.
Standard library (and psutil) only: the agent never imports torch.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, TypedDict

from agent.checkpoints import fence as ckpt_fence
from agent.checkpoints import persist as ckpt_persist
from agent.checkpoints import shm_folder
from agent.checkpoints.persist import PERSIST_DELAY_ENV, Request, parse_persist_delay
from agent.checkpoints.shm_folder import DEFAULT_ROOT, folder_name, root_from
from elastic import contract
from elastic.checkpoint import layout, shard_layout
from elastic.checkpoint.digest import CheckpointCorruptError

log = logging.getLogger(__name__)

DEFAULT_KEEP = 3
SHM_DIR_ENV = contract.SHM_DIR
#: A persist that wrote nothing for this long is reported as stalled, and given up at stop.
DEFAULT_STALL_S = 30.0
#: The stop gives up a persist still running this long after the stop began, even one making progress.
DEFAULT_STOP_CAP_S = 600.0
_JOIN_SLICE_S = 0.2


class ReplicationFields(TypedDict, total=False):
    """What a heartbeat says about peer replication: keyword arguments of
    :class:`elastic.control.protocol.HeartbeatRequest` (none when replication is off)."""

    replicas: int
    replication_port: int
    replicated_step: int | None
    replication_lag: int | None
    replication_error: str


@dataclass(frozen=True)
class Finding:
    """One thing this node found wrong, reported once (the fields of
    :class:`elastic.control.protocol.Finding`): a damaged checkpoint copy, or with ``integrity`` (the
    fields of :class:`elastic.control.protocol.IntegrityFinding`) what the integrity guard found."""

    id: str
    step: int
    file: str
    found_by: str  # "restore", "persist" or "integrity"
    detail: str
    integrity: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        """The wire model's fields; ``integrity`` only when set (a master that predates it refuses it)."""
        fields = asdict(self)
        if self.integrity is None:
            del fields["integrity"]
        return fields


class FindingLog:
    """What this node found wrong (damaged checkpoint copies, the integrity guard's findings), kept until a
    heartbeat that carried them is answered (at most :data:`MAX_PENDING`, the newest; the older ones are
    counted and logged, never silently lost)."""

    MAX_PENDING = 16

    def __init__(self) -> None:
        self._token = secrets.token_hex(4)  # ids unique across agent restarts: the master dedupes by id
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: list[Finding] = []
        self.total = 0  # found since the agent started
        self.dropped = 0  # pushed out before a heartbeat delivered them

    def add_integrity(self, step: int, note: contract.IntegrityNote) -> Finding:
        """Record what a worker's integrity guard reported (elastic.report.report_integrity)."""
        fields = {
            "kind": note.kind,
            "ranks": list(note.ranks),
            "world_size": note.world_size,
            "named_here": note.named_here,
            "odd": note.odd,
            "recurring": note.recurring,
            "rolled_back_to": note.rolled_back_to,
            "samples": list(note.samples),
        }
        what = "detected" if note.rolled_back_to is None else f"rolled back to step {note.rolled_back_to}"
        again = " (recurring)" if note.recurring else ""
        detail = f"{note.kind} ranks={','.join(map(str, note.ranks)) or '-'} {what}{again}"
        with self._lock:  # this node's ranks report one verdict each: one finding, named if any was
            for i, found in enumerate(self._pending):
                same = found.integrity is not None and found.step == step and found.detail == detail
                if same and found.integrity is not None:
                    if note.named_here and not found.integrity["named_here"]:
                        self._pending[i] = replace(found, integrity={**found.integrity, "named_here": True})
                    return self._pending[i]
        return self.add(step, "", "integrity", detail, integrity=fields)

    def add(
        self, step: int, file: str, found_by: str, detail: str, integrity: dict[str, Any] | None = None
    ) -> Finding:
        """Record one finding (a damaged copy, unless ``integrity``)."""
        with self._lock:
            self._seq += 1
            self.total += 1
            found = Finding(
                f"{self._token}-{self._seq}", int(step), file[-1024:], found_by, detail[-1024:], integrity
            )
            self._pending.append(found)
            if len(self._pending) > self.MAX_PENDING:
                self.dropped += 1
                lost = self._pending.pop(0)
                log.error("finding %s (%s, step %d) was not delivered", lost.id, lost.found_by, lost.step)
        return found

    def pending(self) -> list[Finding]:
        """The reports no answered heartbeat carried yet, oldest first."""
        with self._lock:
            return list(self._pending)

    def delivered(self, ids: Iterable[str]) -> None:
        """A heartbeat that carried ``ids`` was answered: the master has them."""
        done = set(ids)
        if done:
            with self._lock:
                self._pending = [c for c in self._pending if c.id not in done]


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
        #: The job submission's incarnation (``Assignment.job_incarnation``), set by the agent before it
        #: starts a round's workers; it goes with their persist requests, to the fence
        #: (agent.checkpoints.fence).
        self.incarnation = ""
        #: ``(step, round, incarnation)`` of the newest save a worker reported (persisted or not): the
        #: fence's order for that step when the stop persists it (see :meth:`_queue_newest`).
        self._newest_save: tuple[int, int | None, str] | None = None
        #: At stop: the newest request of each kind whose checkpoint could not be made durable.
        self.unpersisted: list[Request] = []
        #: Where the memory folder was kept at stop (the newest checkpoint is not on disk), else None.
        self.kept: Path | None = None
        #: The last request of each kind that needs nothing more: published, or superseded by a newer round
        #: of the same submission (the job went on from its step or a newer one).
        self._settled: dict[str, Request] = {}
        self._cond = threading.Condition()
        # One slot per kind (replicated file, sharded save), each replaced by a newer report.
        self._pending: dict[str, Request] = {}
        self._last_request: dict[str, Request] = {}
        self._current: Request | None = None  # the persist running now
        self._progress_at = time.monotonic()  # when the running persist last wrote (or began)
        self._busy = False
        self._stopping = threading.Event()
        self._abandon = threading.Event()  # set when a stop gives the running persist up
        self._thread: threading.Thread | None = None
        self._started = False
        self._lock_fd: int | None = None
        #: Peer replication of sharded saves (agent.checkpoints.replication), attached by the agent when
        #: enabled.
        self.replicator = None
        self.replica_server = None
        #: What this node found wrong (damaged checkpoint copies, integrity findings), for the heartbeats.
        self.findings = FindingLog()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> CheckpointKeeper:
        """Take this node's folder (:func:`agent.checkpoints.shm_folder.take`), start the persist thread.

        Raises:
            agent.checkpoints.shm_folder.KeeperError: the folder cannot be taken or set up.
        """
        self._lock_fd = shm_folder.take(self.root, self.folder, self.job_id, self.node_id)
        self._started = True
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
                "%d superseded by a newer round or submission, %d failed; "
                "%s of dead writers' temp files reclaimed",
                self.requests,
                self.persisted,
                self.skipped,
                self.superseded,
                self.failures,
                shm_folder.mib(self.swept_bytes),
            )
        self._stopping.set()
        if self.replicator is not None:
            self.replicator.stop()
        if self.replica_server is not None:
            self.replica_server.close()
        if self._lock_fd is not None:
            self.unpersisted = self._unpersisted()
            if self.unpersisted:
                self.kept = shm_folder.keep_unpersisted(self.folder, self._lock_fd)
            else:
                shm_folder.release(self.folder, self._lock_fd)
            self._started, self._lock_fd = False, None

    def _unpersisted(self) -> list[Request]:
        """The newest request of each kind whose checkpoint did not reach the disk (failed, superseded by a
        newer submission, given up); a request replaced in memory by a newer save that was persisted does
        not count, nor one refused because a newer round of the same submission committed (a node that
        left, or was preempted, after its peers went on: they hold its step or a newer one, and keeping its
        folder and exiting 1 told the operator of a loss that was none: a chaos run's preemption)."""
        with self._cond:
            return [
                last
                for kind, last in sorted(self._last_request.items())
                if (done := self._settled.get(kind)) is None or done.step != last.step
            ]

    @property
    def outcomes(self) -> dict[str, int]:
        """Persist requests by outcome, for the metrics: persisted, skipped (replaced by a newer one before
        their persist began), superseded (not published: a newer round or submission committed), failed."""
        with self._cond:
            return {
                "persisted": self.persisted,
                "skipped": self.skipped,
                "superseded": self.superseded,
                "failed": self.failures,
            }

    def _queue_newest(self) -> None:
        """At stop: queue the newest memory checkpoint (of each kind) when it is newer than the last persist
        request (a ``persist=False`` save, or a request lost with its worker), to where that request went."""
        with self._cond:
            for last in list(self._last_request.values()):
                newest = ckpt_persist.newest_in(self.folder, last)
                if newest is None or newest.step <= last.step:
                    continue
                saved = self._newest_save
                if saved is not None and saved[0] == newest.step:
                    # Saved after the last persist request, maybe in a later round or submission (this node
                    # no longer asks for persists at another node rank): the fence must order it as that
                    # save, not as the last request, or it is refused as superseded by its own lineage.
                    newest = replace(newest, round=saved[1], incarnation=saved[2] or newest.incarnation)
                log.info(
                    "persisting the newest %s checkpoint in memory (step %d) at stop",
                    newest.kind,
                    newest.step,
                )
                self._queue(newest)

    def _queue(self, request: Request) -> None:
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
            log.info(
                "removed temp files of killed writes from %s: %s reclaimed",
                self.folder,
                shm_folder.mib(freed),
            )
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

    def __enter__(self) -> CheckpointKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reports ----------------------------------------------------------------------------------
    def on_checkpoint(
        self,
        local_rank: int,
        step: int,
        location: str,
        persist_to: str = "",
        round_number: int | None = None,
        corrupt: bool = False,
        integrity: contract.IntegrityNote | None = None,
    ) -> None:
        """A worker reports a complete checkpoint; a location in this folder asks for a persist to
        ``persist_to`` (default ``ckpt_dir``). ``round_number``: the worker's round (``ELASTIC_ROUND``),
        which fences the commit; None from a worker that does not send it. ``corrupt``: instead, the
        worker's restore found the copy ``location`` of ``step`` damaged (it failed its digest).
        ``integrity``: instead, what the worker's integrity guard found at ``step`` (a finding for the
        master, like a damaged copy).

        Called from the progress channel's thread; never blocks on I/O.
        """
        if integrity is not None:
            self.findings.add_integrity(step, integrity)
            return
        if corrupt:
            self.findings.add(
                step, location, "restore", f"local rank {local_rank}'s restore skipped it (digest mismatch)"
            )
            return
        with self._cond:  # the latest report is the newest save (as for persist requests, below)
            self._newest_save = (step, round_number, self.incarnation)
        target = Path(persist_to) if persist_to else self.ckpt_dir
        if location and Path(location).parent == self.folder / shard_layout.SHARDED_SUBDIR:
            # A node's sharded save, committed by its local rank 0: replicated to the ring successors,
            # and its part persisted to <target>/sharded (agent.checkpoints.sharded_persist).
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
            self._queue(Request(step, path, target, round_number, "", self.incarnation))

    def _on_sharded(self, step: int, link: Path, target: Path | None, round_number: int | None) -> None:
        if target is None or not target.is_absolute():
            return
        request = ckpt_persist.sharded_request(step, link, target, round_number, self.incarnation)
        if request is not None:
            with self._cond:
                self.requests += 1
                self._queue(request)

    def replication_fields(self) -> ReplicationFields:
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
            except CheckpointCorruptError as exc:  # damaged in memory: never persisted as the newest step
                self.findings.add(request.step, str(request.source), "persist", str(exc))
                self._fail(request, f"not persisted: the checkpoint in memory failed its digest check: {exc}")
            else:
                count, total = self.persist_seconds
                self.persist_seconds = (count + 1, total + time.monotonic() - started)
            finally:
                with self._cond:
                    self._busy, self._current = False, None
                    self._cond.notify_all()

    def _fail(self, request: Request, message: str) -> None:
        text = f"step {request.step} to {request.target}: {message}"
        with self._cond:
            self.failures += 1
            self.persist_error = text
        log.warning("could not persist the checkpoint of %s", text)

    def _persist(self, request: Request) -> None:
        outcome = ckpt_persist.persist(
            request,
            keep=self.keep,
            copy=lambda src, dst: self._copy(src, dst, request.step),
            lock_timeout_s=self.lock_timeout_s,
            cancel=self._abandon,
        )
        with self._cond:
            self.superseded += outcome.superseded
            if outcome.superseded:
                self.persist_error = f"step {request.step} to {request.target}: not persisted: {outcome.why}"
            if outcome.moved_on:
                self._settled[request.kind] = request
            if outcome.published:
                self._settled[request.kind] = request
                self.persisted += 1
                self.persist_error = ""
                if outcome.committed:
                    self.persisted_step = request.step
                self._cond.notify_all()

    def _copy(self, src: BinaryIO, dst: BinaryIO, step: int) -> None:
        pause = self.persist_delay_s and step >= self.persist_delay_from_step
        ckpt_persist.copy(
            src,
            dst,
            on_progress=self._note_progress,
            pause=(lambda: self._stopping.wait(self.persist_delay_s)) if pause else None,
        )

    def _note_progress(self) -> None:
        self._progress_at = time.monotonic()


def keeper_for(
    job_id: str, node_id: str, ckpt_dir: Path | None, keep: int, environ: Mapping[str, str]
) -> CheckpointKeeper:
    """The keeper of an agent, with its folder's root (``ELASTIC_SHM_ROOT``) and the test hook read from
    ``environ``."""
    delay, from_step = parse_persist_delay(environ.get(PERSIST_DELAY_ENV))
    return CheckpointKeeper(
        job_id,
        node_id,
        root=root_from(environ),
        ckpt_dir=ckpt_dir,
        keep=keep,
        persist_delay_s=delay,
        persist_delay_from_step=from_step,
    )
