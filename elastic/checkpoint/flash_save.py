"""The writer of flash saves: the state's bytes into a reused shared-memory segment, at memory speed.

One :class:`FlashWriter` per shared-memory folder and process (local rank 0 of a node writes). A save:

1. describes the state (:func:`elastic.checkpoint.flash_format.plan`: tree, tensors, storages and their
offsets);
2. takes a segment of the exact size from :class:`elastic.checkpoint.segments.SegmentPool` (recycled and
already
   faulted in, except at the first save, which also pre-faults a second one: the double buffer);
3. writes header and description, and copies each host storage's bytes into the mapping with
   ``Tensor.copy_`` (torch's intra-op threads; no pickling of tensor data);
4. commits by rename and reports (the ``on_commit`` callback), and the pool retires the surplus file.

Device storages (GPU) are copied asynchronously (:mod:`elastic.checkpoint.device_copy`): the save returns once
the host storages are in the segment and the device copies are queued; a background thread waits for
them, copies them from the staging buffer into the segment, commits and reports. The next save, a
load, or :func:`wait_all` waits for that thread first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic import errors
from elastic.checkpoint import device_copy, flash_format, layout
from elastic.checkpoint.segments import Acquired, Segment, SegmentPool

log = logging.getLogger(__name__)


class AsyncSaveError(errors.CheckpointError):
    """The background part of an earlier save (device copies, commit) failed; that save is lost."""


@dataclass(frozen=True)
class SaveStats:
    """What one save cost; the first save pays for the segments' pages (``prefault_s``)."""

    step: int
    size: int
    fresh_bytes: int  # shared memory newly allocated (this save's segment and the spare)
    prefault_s: float  # seconds spent faulting that memory in
    asynchronous: bool  # device copies were still running when save returned


class FlashWriter:
    """Writes flash saves into one folder; see the module doc."""

    def __init__(
        self,
        directory: Path,
        keep: int,
        free_bytes: Callable[[Path], int],
        copier: device_copy.DeviceCopier | None = None,
    ) -> None:
        self.directory = directory
        self.pool = SegmentPool(directory, keep, free_bytes)
        #: Claims the storages of the devices it handles (tests: a fake device); else per device type.
        self.copier = copier
        self.history: list[SaveStats] = []  # the first save and the last few
        self._lock = threading.Lock()
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None

    def save(self, state: dict[str, Any], step: int, on_commit: Callable[[], None]) -> Path:
        """Write ``state`` as ``step_<step>.pt``; ``on_commit()`` runs once it is visible.

        Raises:
            flash_format.Unsupported: the state needs torch.save (nothing was written).
            segments.NoSpaceError: the folder cannot hold it (nothing was written).
            AsyncSaveError: the previous save's background part failed.
        """
        self.wait()
        plan = flash_format.plan(state)
        final = self.directory / layout.step_file_name(step)
        with self._lock:
            acquired = self.pool.acquire(final, plan.size)
            segment = acquired.segment
            device_slots: dict[device_copy.DeviceCopier, list[flash_format.StorageSlot]] = {}
            try:
                assert segment.mm is not None
                buffer = segment.mm
                host_slots = []
                for slot in plan.storages:
                    if not slot.nbytes:
                        continue  # an empty storage: nothing to copy
                    copier = self._copier(slot.source.device)
                    (host_slots if copier is None else device_slots.setdefault(copier, [])).append(slot)
                flash_format.write_frame(buffer, plan, step, flash_format.new_content_id())
                for slot in host_slots:
                    _destination(buffer, slot).copy_(slot.source)
                pending = [
                    (copier.start([s.source for s in slots]), slots) for copier, slots in device_slots.items()
                ]
            except BaseException:
                self.pool.abort(segment)
                raise
            if not pending:
                spare = self._commit(segment, final, plan.size, on_commit)
            else:
                spare = None
                self._background = threading.Thread(
                    target=self._finish,
                    args=(segment, final, plan.size, pending, on_commit),
                    name=f"elastic-flash-save-{step}",
                )
                self._background.start()
        self._record(step, plan.size, acquired, spare, bool(pending))
        return final

    def wait(self) -> None:
        """Wait for the background part of the last save; raise AsyncSaveError if it failed."""
        thread = self._background
        if thread is not None:
            thread.join()
            self._background = None
        error, self._background_error = self._background_error, None
        if error is not None:
            raise AsyncSaveError(f"an earlier flash save failed in the background: {error}") from error

    def forget_removed(self) -> None:
        """Unmap segments whose files were removed meanwhile (e.g. pruned by a torch.save fallback)."""
        with self._lock:
            self.pool.forget_removed()

    def close(self) -> None:
        """Wait for the background part, then unmap every segment (their files stay)."""
        try:
            self.wait()
        finally:
            with self._lock:
                self.pool.close()

    # -- internals -------------------------------------------------------------------------------
    def _copier(self, device: torch.device) -> device_copy.DeviceCopier | None:
        if self.copier is not None and self.copier.handles(device):
            return self.copier
        return None if device.type == "cpu" else device_copy.copier_for(device)

    def _commit(
        self, segment: Segment, final: Path, size: int, on_commit: Callable[[], None]
    ) -> Acquired | None:
        held = self.pool.commit(segment, final)
        # The first save (or the first after the folder lost files): pre-fault the double buffer's
        # second segment now, so the next save recycles instead of faulting fresh pages in.
        spare = self.pool.ensure_double_buffer(size, held)
        on_commit()  # last: the agent's persist starts on this report and competes for the CPU
        return spare

    def _finish(
        self,
        segment: Segment,
        final: Path,
        size: int,
        pending: list[tuple[device_copy.PendingCopy, list[flash_format.StorageSlot]]],
        on_commit: Callable[[], None],
    ) -> None:
        with self._lock:
            try:
                assert segment.mm is not None
                for copy, slots in pending:
                    for slot, host in zip(slots, copy.wait(), strict=True):
                        _destination(segment.mm, slot).copy_(host)
            except BaseException as exc:  # noqa: BLE001 - reported to the next save or wait()
                log.error("flash save of %s failed in the background: %s", final.name, exc)
                self._background_error = exc
                self.pool.abort(segment)
                return
            try:
                self._commit(segment, final, size, on_commit)
            except BaseException as exc:  # noqa: BLE001 - the rename failed (nothing published) or later
                log.error("flash save of %s failed in the background: %s", final.name, exc)
                self._background_error = exc

    def _record(
        self, step: int, size: int, acquired: Acquired, spare: Acquired | None, pending: bool
    ) -> None:
        fresh = acquired.fresh_bytes + (spare.fresh_bytes if spare else 0)
        seconds = acquired.prefault_s + (spare.prefault_s if spare else 0.0)
        stats = SaveStats(step, size, fresh, seconds, pending)
        if fresh:
            log.info(
                "flash save of step %d: %.1f MiB of shared memory allocated and pre-faulted in %.2f s",
                step,
                fresh / (1 << 20),
                seconds,
            )
        self.history = [*self.history[:1], *self.history[1:][-7:], stats]


def _destination(buffer: Any, slot: flash_format.StorageSlot) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)


_writers: dict[Path, FlashWriter] = {}
_writers_lock = threading.Lock()


def writer_for(directory: Path, keep: int, free_bytes: Callable[[Path], int]) -> FlashWriter:
    """This process's writer of ``directory`` (made on first use; its segments stay mapped)."""
    key = directory.resolve()
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = FlashWriter(directory, keep, free_bytes)
        return writer


def wait_all() -> None:
    """Wait for every writer's background part (before a load reads the folder)."""
    for writer in list(_writers.values()):
        writer.wait()


def close_all() -> None:
    """Close every writer: unmap the segments, so their memory goes once their files are removed."""
    with _writers_lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        writer.close()


def history(directory: Path) -> list[SaveStats]:
    """What this process's saves into ``directory`` cost: the first save and the last few ([]: none)."""
    writer = _writers.get(Path(directory).resolve())
    return list(writer.history) if writer is not None else []
