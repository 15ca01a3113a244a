"""Releasing and tearing down a broken default process group inside a live worker process.

In-process recovery must get a worker out of a collective whose peer vanished and then drop the group,
without ending the process. How depends on the backend, so each has a :class:`GroupControl`:

* gloo: ``ProcessGroupGloo.abort()`` does not wake a collective blocked on a peer that stopped without
  closing its sockets (SIGSTOP, a partition). Shutting down the group's own TCP connections does: the
  blocked receive sees end-of-file, as it does when the peer's kernel closes them after a SIGKILL, and
  the collective raises. The connections are the sockets the process opened while the group formed
  (gloo connects its full mesh then), told apart by their inode, so the script's own sockets are left
  alone.
* nccl: ``_abort_process_group`` aborts every communicator (a blocked kernel and its host wait return with
  an error) and forgets the default group, so a new one can form. The watchdog's own reaction to an error
  or a timeout must not end the process: :meth:`GroupControl.form` sets
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicators and raise in the training thread) before
  the group is created, where the process-restart path's default (1) tears the process down.

The torch calls go through :class:`DistApi`, so the decisions are unit-tested with a fake backend
(tests/unit/elastic/test_pg_control.py). The NCCL path is not measured on a GPU here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from elastic.contract import NCCL_ASYNC_ERROR_HANDLING

log = logging.getLogger(__name__)

#: The watchdog aborts the communicators and raises in the training thread; the process lives on.
NCCL_CLEANUP_ONLY = "2"
_FD_DIR = "/proc/self/fd"


def socket_links() -> dict[int, str]:
    """This process's socket descriptors and their ``socket:[inode]`` links."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"{_FD_DIR}/{name}")
                if link.startswith("socket:["):
                    found[int(name)] = link
    return found


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return True  # unknown: leave it alone


def shutdown_inet_sockets(sockets: dict[int, str]) -> int:
    """Shut down (both directions) each connected TCP socket of ``sockets`` whose descriptor still names
    the same inode; returns how many. The descriptors stay open: their owner closes them."""
    done = 0
    for fd, link in sockets.items():
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") != link:
                continue  # closed and reused for something else since
            dup = os.dup(fd)
        except OSError:
            continue
        with socket.socket(fileno=dup) as sock:  # closes the duplicate only
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or _listening(sock):
                continue  # a listener's thread would die of it (gloo's accept loop aborts the process)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
    return done


class DistApi(Protocol):
    """The torch.distributed calls the controls make (a fake in the unit tests)."""

    def is_initialized(self) -> bool: ...
    def init(self, backend: str, connect_timeout_s: float | None) -> None: ...
    def abort(self) -> None: ...
    def destroy(self) -> None: ...
    def forget_failed_init(self) -> None: ...


class TorchDist:
    """:class:`DistApi` over torch.distributed (the default group, initialised from the environment)."""

    def is_initialized(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def init(self, backend: str, connect_timeout_s: float | None) -> None:
        import datetime

        from elastic.distributed import init_process_group

        connect = None if connect_timeout_s is None else datetime.timedelta(seconds=connect_timeout_s)
        init_process_group(backend, connect_timeout=connect)

    def abort(self) -> None:
        from torch.distributed import distributed_c10d

        distributed_c10d._abort_process_group()

    def destroy(self) -> None:
        import torch.distributed as dist

        from elastic import collectives

        collectives.settle()
        dist.destroy_process_group()

    def forget_failed_init(self) -> None:
        """After an init that failed half-way: torch had numbered the group that never formed, so this
        rank's next group would name its store keys differently from the other ranks' and their formation
        would wait for ever. Destroying the default group resets that numbering (torch does it so that
        groups re-form after a failure); with none formed, a one-rank group is formed and destroyed, all
        through the public API."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.destroy_process_group()


@dataclass
class GroupControl:
    """Forms, releases and drops the default group of one backend; see the module docstring.

    :meth:`release` may be called from another thread while the main thread is blocked in a collective;
    the others run on the main thread.
    """

    backend: str
    api: DistApi = field(default_factory=TorchDist)
    links: Callable[[], dict[int, str]] = socket_links
    _group_sockets: dict[int, str] = field(default_factory=dict)
    _aborted: bool = False
    #: While :meth:`form` runs: the sockets that existed before it began (None otherwise).
    _forming_after: frozenset[str] | None = None

    def form(self, connect_timeout_s: float | None = None) -> None:
        """Initialise the default group from the environment (RANK, WORLD_SIZE, MASTER_ADDR...); forming it
        may take ``connect_timeout_s`` (None: the collective timeout). :meth:`release` from another thread
        makes a formation that waits for a rank that never comes raise."""
        if self.backend == "nccl":
            os.environ[NCCL_ASYNC_ERROR_HANDLING] = NCCL_CLEANUP_ONLY
        before = frozenset(self.links().values())
        self._forming_after = before
        try:
            self.api.init(self.backend, connect_timeout_s)
            self._aborted = False
            # Set before the formation ends: a release in between shuts these down as forming ones.
            self._group_sockets = {fd: link for fd, link in self.links().items() if link not in before}
        except BaseException:
            self.api.forget_failed_init()
            raise
        finally:
            self._forming_after = None

    def release(self) -> None:
        """Wake a collective blocked on a vanished peer: it raises. Idempotent; the group is unusable then.

        During :meth:`form` it wakes the formation instead: a round whose member never joins (one cut off,
        or kept in a collective of an older round) leaves the others waiting on the rendezvous store, and
        the next round's pause must get them out in process. The connections opened since the formation
        began (the store's, gloo's mesh so far) are shut down: the store's wait sees end-of-file and
        raises. Without that, the agent gave up after its grace and restarted the processes, whose
        in-memory state was lost."""
        before = self._forming_after
        if before is not None:
            forming = {fd: link for fd, link in self.links().items() if link not in before}
            count = shutdown_inet_sockets(forming)
            log.debug("released a forming %s group: %d connections shut down", self.backend, count)
            return
        if self.backend == "nccl":
            if not self._aborted and self.api.is_initialized():
                self._aborted = True
                self.api.abort()
            return
        count = shutdown_inet_sockets(self._group_sockets)
        log.debug("released the %s group: %d connections shut down", self.backend, count)

    def drop(self) -> None:
        """Tear the group down so that a new one can form; safe after :meth:`release` and when none exists."""
        self._aborted = False
        if not self.api.is_initialized():
            self._group_sockets = {}
            return
        if self.backend == "nccl":
            # An NCCL communicator whose peer died cannot be destroyed cleanly; the abort also forgets
            # the group.
            self.api.abort()
            return
        self.release()  # no gloo thread may be left waiting on a peer while the group is destroyed
        try:
            self.api.destroy()
        except Exception as exc:  # noqa: BLE001 - a broken group may fail to say goodbye; it is gone anyway
            log.debug("destroying the broken group raised %s", exc)
        self._group_sockets = {}
