"""Process-group setup for a worker started by elastic-run (or torchrun).

The launcher hands each worker its place in the world through torchrun's environment contract
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); :func:`init_process_group` reads it, picks
the backend for the device (nccl on GPUs, gloo on CPU) and joins the group through ``env://``.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from elastic import collectives
from elastic import contract as c
from elastic.report import report_done

#: Variables the launcher must set; without them the script was not started by elastic-run/torchrun.
REQUIRED_ENV = (c.RANK, c.WORLD_SIZE, c.LOCAL_RANK, c.MASTER_ADDR, c.MASTER_PORT)
PG_TIMEOUT_ENV = c.PG_TIMEOUT_S
# torch waits 30 minutes by default before a stuck collective fails. The agent detects dead workers and
# nodes itself and restarts the whole world, so a survivor blocked on a dead peer only needs to give up
# eventually; 5 minutes keeps a wedged worker from holding its GPU for half an hour.
DEFAULT_PG_TIMEOUT_S = 300.0


def backend_for_device(cuda_available: bool) -> str:
    """Return the collective backend for the device: ``"nccl"`` with CUDA, else ``"gloo"``."""
    return "nccl" if cuda_available else "gloo"


def _read_launcher_env(environ: Mapping[str, str]) -> tuple[int, int, int]:
    """Return (rank, world_size, local_rank); raise RuntimeError naming any missing variable."""
    missing = [name for name in REQUIRED_ENV if not environ.get(name)]
    if missing:
        raise RuntimeError(
            f"environment variable(s) {', '.join(missing)} not set: this script must be started by "
            "elastic-run (or torchrun), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
        )
    try:
        return int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"])
    except ValueError as exc:
        raise RuntimeError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {exc}") from exc


def _timeout_from_env(environ: Mapping[str, str]) -> datetime.timedelta:
    raw = environ.get(PG_TIMEOUT_ENV)
    if raw is None or raw == "":
        return datetime.timedelta(seconds=DEFAULT_PG_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{PG_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if seconds <= 0:
        raise ValueError(f"{PG_TIMEOUT_ENV} must be positive, got {raw!r}")
    return datetime.timedelta(seconds=seconds)


def init_process_group(
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    connect_timeout: datetime.timedelta | None = None,
) -> str:
    """Join the default process group described by the launcher's environment.

    Args:
        backend: collective backend; ``None`` picks :func:`backend_for_device` for this machine.
        timeout: collective timeout; ``None`` reads ``ELASTIC_PG_TIMEOUT_S`` (seconds), default 300 s.
        connect_timeout: how long forming the group may take (reaching rank 0's store, meeting every
            rank); ``None``: ``timeout``. In-process recovery gives up on a new group sooner than on a
            slow collective.

    Returns:
        The backend in use. Calling again once the group exists is a no-op returning its backend.

    Raises:
        RuntimeError: a launcher variable is missing or malformed (the message names it).
        ValueError: ``ELASTIC_PG_TIMEOUT_S`` is not a positive number.
    """
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed support")
    if dist.is_initialized():
        return str(dist.get_backend())
    rank, world_size, local_rank = _read_launcher_env(os.environ)
    if timeout is None:
        timeout = _timeout_from_env(os.environ)
    if backend is None:
        backend = backend_for_device(torch.cuda.is_available())
    if "nccl" in backend:
        # One GPU per local rank; setting it before init makes nccl and `.cuda()` use the right device.
        torch.cuda.set_device(local_rank)
    if connect_timeout is None:
        dist.init_process_group(
            backend=backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout
        )
        return backend
    store = _store(rank, world_size, connect_timeout)
    # The prefix env:// adds: a rank that forms its group the usual way (a new process) meets this one.
    prefixed = dist.PrefixStore("default_pg", store)
    dist.init_process_group(
        backend=backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
    )
    store.set_timeout(timeout)  # from now on the store serves the group's own waits
    return backend


def _store(rank: int, world_size: int, connect_timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (torchrun's contract); the others connect."""
    host, port = os.environ[c.MASTER_ADDR], int(os.environ[c.MASTER_PORT])
    if rank != 0:
        # torch retries a refused connection only after a 0.3-0.7 s back-off; rank 0 listens within ms.
        _wait_for_listener(host, port, connect_timeout.total_seconds())
    # A client counts itself in (wait_for_workers: it only adds to the store's worker count and returns):
    # a new rank 0 that forms with env:// (a spare taking a lost rank 0's place) waits for that count.
    return dist.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=connect_timeout, wait_for_workers=rank != 0
    )


def _wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a connection, after ``timeout_s``, or on an error other than a
    refusal (torch's own connect then reports it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=min(1.0, timeout_s)).close()
            return
        except ConnectionRefusedError:
            time.sleep(0.01)  # a poll with a deadline: nothing to wait on for another process's listen()
        except OSError:
            return


def destroy_process_group() -> None:
    """Tear down the default process group; does nothing when none was initialized.

    Also tells the agent that this worker's training is over (:func:`elastic.report.report_done`), so
    that the teardown is not judged as a hang for lack of steps.
    """
    report_done()
    if dist.is_available() and dist.is_initialized():
        collectives.settle()  # gloo's threads must let go of our tensors while Python can still free them
        dist.destroy_process_group()
