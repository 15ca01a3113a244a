"""The processes bench/gpu_check.py measures in: its training worker and its one-shot children.

    python3 bench/gpu_probes.py --worker --steps N --device cuda:0 --backend gloo --state-dir D [--inprocess]
    python3 bench/gpu_probes.py --child flash|reform|blocked|digest ... --out RESULT.json

The worker (parts 1 and 2, started by elastic-run or torchrun) is a small DDP job on CUDA or CPU tensors
that prints bench/common.py's ``BENCH`` lines, its CUDA context creation and process-group set-up in
integer microseconds on its ``init`` line. The children (parts 3 to 5) each measure one thing and write
their figures as JSON. Top-level imports are the standard library only: bench/gpu_check.py imports this
module in a process that must stay light, and torch is imported where it is used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a file, from the source tree, without an install
    sys.path.insert(0, str(REPO))

SCRIPT = Path(__file__).resolve()
SHM = Path("/dev/shm")


def median(values: list[float]) -> float | None:
    """The median of ``values``; None when empty."""
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a store of our own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def integrity_digest() -> Callable[[dict], Any] | None:
    """The integrity guard's digest of a state dict, where this tree has it (the trust issue adds the
    checkpoint digest): point this at it when it lands. None: not in this tree."""
    return None


# -- the worker of parts 1 and 2 (started by elastic-run or torchrun) ----------------------------------------
def emit(kind: str, **fields: object) -> None:
    """``BENCH kind k=v ... t=<time.time()>`` in one write(2): ranks sharing a stdout never interleave.
    The format is bench/common.py's (its parse_events reads it); durations go as integer microseconds."""
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"BENCH {kind} {text} t={time.time():.6f}\n".encode())


def _device(spec: str, local_rank: int) -> Any:
    import torch

    return torch.device("cuda", local_rank) if spec == "cuda:local" else torch.device(spec)


def _sync(x: Any) -> None:
    """Wait for the device (``.item()`` copies to the host once the queued work is done)."""
    x.sum().item()


def worker_main(a: argparse.Namespace) -> int:
    """A small DDP job on ``--device`` (CUDA tensors with gloo or nccl, or CPU); rank 0 keeps the step
    count in ``--state-dir`` so that a restarted world resumes. ``--inprocess``: inside ``elastic.run``."""
    import torch

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    state_dir = Path(a.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    step_file = state_dir / "step"
    resumed = int(step_file.read_text()) if step_file.exists() else 0
    if not a.inprocess:
        emit(
            "start",
            restart=restart,
            resumed=resumed,
            rank=rank,
            world=world,
            pid=os.getpid(),
            ppid=os.getppid(),
        )
    device = _device(a.device, local_rank)
    began = time.perf_counter()
    if device.type == "cuda":  # the CUDA context: what a kept process does not pay again
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    cuda_us = int((time.perf_counter() - began) * 1e6) if device.type == "cuda" else 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, a.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(a.hidden, a.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(a.hidden, 1),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 64, generator=gen).to(device)
    y = x[:, :1].sin()
    if a.inprocess:
        return _inprocess(a, model, optimizer, x, y, device, cuda_us)
    import torch.distributed as dist

    began = time.perf_counter()
    # NCCL with device_id: the communicator is created now (eagerly), not at the first collective.
    dist.init_process_group(a.backend, **({"device_id": device} if a.backend == "nccl" else {}))
    step_t = torch.tensor([resumed], device=device)
    dist.broadcast(step_t, src=0)  # rank 0's step rules; also the group's first collective
    step = int(step_t.item())
    pg_us = int((time.perf_counter() - began) * 1e6)
    emit("init", restart=restart, rank=rank, world=world, cuda_us=cuda_us, pg_us=pg_us)
    ddp = _ddp(model, device)
    while step < a.steps:
        _train_step(ddp, optimizer, x, y, a.step_time)
        step += 1
        if rank == 0:
            tmp = step_file.with_name(f".step.{os.getpid()}")
            tmp.write_text(str(step))
            os.replace(tmp, step_file)
        emit("step", step=step, world=world, rank=rank, restart=restart)
    dist.barrier()
    emit("done", step=step, rank=rank)
    dist.destroy_process_group()
    return 0


def _ddp(model: Any, device: Any) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _train_step(ddp: Any, optimizer: Any, x: Any, y: Any, step_time: float) -> None:
    import torch

    if step_time:
        time.sleep(step_time)  # simulated compute beyond the tiny model's
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    optimizer.step()
    loss.item()  # the step is done on the device before its line is printed


def _inprocess(
    a: argparse.Namespace, model: Any, optimizer: Any, x: Any, y: Any, device: Any, cuda_us: int
) -> int:
    """The loop inside ``elastic.run``: a survivor keeps its process (and CUDA context) across a fault.
    ``pg_us`` of a re-formation is from leaving the broken step to the next ``train`` call."""
    import torch.distributed as dist

    import elastic

    marks: dict[str, Any] = {"left": None, "ready": time.perf_counter(), "first": True}

    def train(world: Any) -> int:
        pg_us = int((time.perf_counter() - (marks["left"] or marks["ready"])) * 1e6)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        rank, size = world.rank, world.world_size
        emit(
            "start",
            restart=restart,
            resumed=world.step,
            rank=rank,
            world=size,
            pid=os.getpid(),
            ppid=os.getppid(),
        )
        emit(
            "init",
            restart=restart,
            rank=rank,
            world=size,
            cuda_us=cuda_us if marks["first"] else 0,
            pg_us=pg_us,
        )
        marks["first"] = False
        ddp = _ddp(model, device)
        step = world.step
        try:
            while step < a.steps:
                _train_step(ddp, optimizer, x, y, a.step_time)
                step += 1
                emit("step", step=step, world=size, rank=rank, restart=restart)
                world.commit(step)
        except BaseException:
            marks["left"] = time.perf_counter()
            raise
        dist.barrier()
        emit("done", step=step, rank=rank)
        return step

    try:
        elastic.run(train, {"model": model, "optimizer": optimizer}, backend=a.backend)
    finally:
        elastic.destroy_process_group()
    return 0


# -- the children of parts 3 to 5 ----------------------------------------------------------------------------
def _group_control(backend: str) -> Any:
    """In-process recovery's control of the default group (form, release, drop): the one internal name
    this script uses, ``elastic.inprocess.pg_control.GroupControl``."""
    from elastic.inprocess.pg_control import GroupControl

    return GroupControl(backend)


def _timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(repeats):
        sync()
        began = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - began)
    return out


def _as_bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


def child_flash(a: argparse.Namespace) -> dict[str, Any]:
    """Part 3: flash saves of ``--size-mb`` on ``--device`` and their baselines (see the module doc)."""
    import torch

    import elastic
    from bench.checkpoint import FlashEnv

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    numel = int(a.size_mb * 1e6 / 4 / 10)
    state = {f"layer{i}.weight": torch.randn(numel, device=device) for i in range(10)}
    tensors = list(state.values())
    size = sum(t.numel() * t.element_size() for t in tensors)
    fig: dict[str, Any] = {"mb": round(size / 1e6, 1)}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-flash-"))
    env = FlashEnv(work)
    try:
        sync()
        began = time.perf_counter()
        elastic.save(state, 1)
        fig["first_save_s"] = time.perf_counter() - began
        env.wait_persisted(1)
        saves = []
        for step in range(2, a.repeats + 2):
            sync()
            began = time.perf_counter()
            elastic.save(state, step)
            saves.append(time.perf_counter() - began)  # what training waits for
            env.wait_persisted(step)  # not part of it: the agent's background persist
        fig["save_block_s"] = median(saves)
        fig.update(_copy_baselines(tensors, size, device, a.repeats))
        loaded: list[Any] = []
        fig["load_s"] = median(_timed(lambda: loaded.append(elastic.load()), a.repeats, sync))
        restored = loaded[-1][0]
        moved = lambda: [v.to(device, non_blocking=True) for v in restored.values()]  # noqa: E731
        fig["load_to_device_s"] = median(_timed(moved, a.repeats, sync))
    finally:
        env.close()
        shutil.rmtree(work, ignore_errors=True)
    fig.update(_sharded_saves(state, device, a.repeats, sync))
    fig["save_over_copy"] = round(fig["save_block_s"] / fig["copy_s"], 2) if fig.get("copy_s") else None
    return fig


def _copy_baselines(tensors: list[Any], size: int, device: Any, repeats: int) -> dict[str, Any]:
    """The same bytes copied once, as fast as they go: device -> pinned host (non_blocking, CUDA events)
    and back, or on CPU a copy into a pre-faulted buffer."""
    import torch

    if device.type != "cuda":
        buffer = torch.zeros(size, dtype=torch.uint8)

        def copy() -> None:
            offset = 0
            for t in tensors:
                buffer[offset : offset + t.nbytes].copy_(_as_bytes(t))
                offset += t.nbytes

        copy()
        return {"copy_s": median(_timed(copy, repeats, lambda: None)), "copy": "memcpy"}
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(size, dtype=torch.uint8, device=device)

    def d2h() -> None:
        offset = 0
        for t in tensors:
            host[offset : offset + t.nbytes].copy_(_as_bytes(t), non_blocking=True)
            offset += t.nbytes

    def events(fn: Callable[[], None]) -> tuple[float, float]:
        """(host seconds until done, device seconds by CUDA events) of one run of ``fn``, medians."""
        walls, gpu = [], []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            start.record()
            fn()
            end.record()
            end.synchronize()
            walls.append(time.perf_counter() - began)
            gpu.append(start.elapsed_time(end) / 1000)
        return median(walls), median(gpu)

    d2h()
    torch.cuda.synchronize(device)
    copy_s, copy_event_s = events(d2h)
    h2d_s, h2d_event_s = events(lambda: back.copy_(host, non_blocking=True))
    return {
        "copy": "pinned d2h",
        "copy_s": copy_s,
        "copy_event_s": copy_event_s,
        "d2h_gb_s": round(size / copy_event_s / 1e9, 2) if copy_event_s else None,
        "pinned_h2d_s": h2d_s,
        "pinned_h2d_event_s": h2d_event_s,
    }


def _sharded_saves(
    state: dict[str, Any], device: Any, repeats: int, sync: Callable[[], None]
) -> dict[str, Any]:
    """``elastic.save_sharded`` of the same state at world 1 into a shared-memory folder of its own."""
    import elastic

    shm = Path(tempfile.mkdtemp(prefix="gpu-check-sharded-", dir=SHM))
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        ELASTIC_LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        ELASTIC_SHM_DIR=str(shm),
    )
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    try:
        elastic.init_process_group("nccl" if device.type == "cuda" else "gloo")
        sync()
        began = time.perf_counter()
        elastic.save_sharded({"model": state}, 1)
        first = time.perf_counter() - began
        saves = []
        for step in range(2, repeats + 2):
            sync()
            began = time.perf_counter()
            elastic.save_sharded({"model": state}, step)
            saves.append(time.perf_counter() - began)
        return {"sharded_first_save_s": first, "sharded_save_block_s": median(saves)}
    finally:
        elastic.destroy_process_group()
        shutil.rmtree(shm, ignore_errors=True)


def _world_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _form_and_reduce(control: Any, device: Any) -> float:
    """Seconds to form the default group and run its first all-reduce (NCCL: creates the communicator)."""
    import torch
    import torch.distributed as dist

    began = time.perf_counter()
    control.form()
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    _sync(x)
    return time.perf_counter() - began


def child_reform(a: argparse.Namespace) -> dict[str, Any]:
    """Part 4 at world 1: form, release + drop, form again (``--repeats`` times)."""
    import torch
    import torch.distributed as dist

    device = torch.device(a.device)
    _world_env(0, 1, free_port())
    fig: dict[str, Any] = {}
    if device.type == "cuda":
        began = time.perf_counter()
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
        fig["cuda_context_ms"] = round((time.perf_counter() - began) * 1000, 1)
    if a.backend == "nccl":  # for reference: torch's eager NCCL init (device_id), then its first all-reduce
        began = time.perf_counter()
        dist.init_process_group("nccl", device_id=device)
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        _sync(x)
        fig["eager_init_ms"] = round((time.perf_counter() - began) * 1000, 1)
        dist.destroy_process_group()
    control = _group_control(a.backend)
    forms, drops = [], []
    for _ in range(a.repeats + 1):
        os.environ["MASTER_PORT"] = str(free_port())  # as the agent hands out: a fresh store per round
        forms.append(_form_and_reduce(control, device))
        began = time.perf_counter()
        control.release()
        control.drop()
        drops.append(time.perf_counter() - began)
    fig["first_form_ms"] = round(forms[0] * 1000, 1)
    fig["reform_ms"] = round(median(forms[1:]) * 1000, 1)
    fig["release_drop_ms"] = round(median(drops) * 1000, 1)
    return fig


def child_blocked(a: argparse.Namespace) -> dict[str, Any]:
    """Part 4 at world 2: rank 1 stops itself once the group works; rank 0 blocks in an all-reduce, is
    released from another thread after ``--hold-s``, and re-forms a group of one on ``--port2``."""
    import torch
    import torch.distributed as dist

    device = torch.device(a.device)
    _world_env(a.rank, 2, a.port)
    control = _group_control(a.backend)
    form_s = _form_and_reduce(control, device)
    if a.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # vanished with its sockets open; the parent SIGKILLs it
        return {}
    released_at: list[float] = []

    def release_later() -> None:
        time.sleep(a.hold_s)  # how long the survivor stays blocked before the agent's word would come
        released_at.append(time.perf_counter())
        control.release()

    threading.Thread(target=release_later, daemon=True).start()
    x = torch.ones(1, device=device)
    raised = ""
    began = time.perf_counter()
    try:
        dist.all_reduce(x)
        _sync(x)
    except Exception as exc:  # noqa: BLE001 - reported: which error a released collective raises
        raised = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"
            if str(exc)
            else type(exc).__name__
        )
    back = time.perf_counter()
    released = bool(released_at) and back >= released_at[0]
    fig: dict[str, Any] = {
        "form_ms": round(form_s * 1000, 1),
        "released": released,
        "release_to_return_ms": round((back - released_at[0]) * 1000, 1) if released else None,
        "raised": raised or "nothing (returned)",
    }
    began = time.perf_counter()
    control.drop()
    fig["drop_ms"] = round((time.perf_counter() - began) * 1000, 1)
    _world_env(0, 1, a.port2)
    fig["reform_alone_ms"] = round(_form_and_reduce(control, device) * 1000, 1)
    control.drop()
    return fig


def child_digest(a: argparse.Namespace) -> dict[str, Any]:
    """Part 5: the integrity guard's digest of ``--size-mb`` of parameters on ``--device``."""
    import torch

    digest = integrity_digest()
    assert digest is not None
    device = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    numel = int(a.size_mb * 1e6 / 4 / 10)
    state = {f"layer{i}.weight": torch.randn(numel, device=device) for i in range(10)}
    size = sum(t.nbytes for t in state.values())
    digest(state)
    took = median(_timed(lambda: digest(state), a.repeats, sync))
    return {"mb": round(size / 1e6, 1), "digest_s": took, "s_per_gb": took / (size / 1e9)}


CHILDREN: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "flash": child_flash,
    "reform": child_reform,
    "blocked": child_blocked,
    "digest": child_digest,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--worker", action="store_true", help="the training worker (parts 1 and 2)")
    mode.add_argument("--child", choices=sorted(CHILDREN), help="one measurement (parts 3 to 5)")
    p.add_argument("--inprocess", action="store_true", help="worker: the loop inside elastic.run")
    p.add_argument("--out", help="child: write its figures (JSON) here")
    p.add_argument("--steps", type=int, default=10, help="worker: stop after this step")
    p.add_argument("--step-time", type=float, default=0.0, help="worker: seconds of sleep per step")
    p.add_argument("--device", default="cpu", help="cpu, cuda:N or (worker) cuda:local (cuda:LOCAL_RANK)")
    p.add_argument("--backend", default="gloo", help="gloo or nccl")
    p.add_argument("--state-dir", default=".", help="worker: where rank 0 keeps its step count")
    p.add_argument("--hidden", type=int, default=256, help="worker: hidden width of the MLP")
    p.add_argument("--size-mb", type=float, default=64.0, help="flash, digest: state size in MB")
    p.add_argument("--repeats", type=int, default=3, help="children: repeats of each timing")
    p.add_argument("--rank", type=int, default=0, help="blocked: this rank (0 or 1)")
    p.add_argument("--port", type=int, default=0, help="blocked: the world-2 store's port")
    p.add_argument("--port2", type=int, default=0, help="blocked: the port rank 0 re-forms alone on")
    p.add_argument("--hold-s", type=float, default=1.0, help="blocked: seconds blocked before the release")
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a)
    result = CHILDREN[a.child](a)
    if a.out and result:
        Path(a.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
