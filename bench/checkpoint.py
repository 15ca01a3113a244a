"""Checkpoint benchmark: how long a save blocks training, and how long a restore takes.

    python bench/checkpoint.py                  # ~100 MB and ~1 GB states, 3 repeats each
    python bench/checkpoint.py --smoke          # tiny sizes, one repeat (what the test runs)

For each state size (float32 tensors of a model-like dict) it measures, in this process:

* ``flash save``: ``elastic.save(state, step)`` under a real checkpoint keeper (the agent's component,
  run here in-process with its progress channel): the time the call blocks. The keeper's background
  persist to disk is timed separately (``persist (background)``) and not overlapped with the next save.
* ``torch.save to disk``: ``torch.save`` into a file on disk (lands in the page cache, no fsync), and
  ``disk save (fsync)``: the atomic disk save of ``elastic.save`` without an agent (write, fsync,
  rename, marker): what a save blocked for before the flash checkpoint.
* ``restore from memory``: ``elastic.load()`` from the shared-memory copy, and ``restore from disk``:
  from the persisted file with its pages evicted from the page cache first (posix_fadvise DONTNEED).
* ``memory copy``: ``Tensor.copy_`` of the whole state into preallocated tensors: the physical limit
  of any save that copies the state once.

Prints one table (median and range over the repeats); nothing is left behind (temp folders, /dev/shm).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from agent.channel import ProgressChannel  # noqa: E402
from agent.ckpt_keeper import CheckpointKeeper  # noqa: E402
from elastic import checkpoint  # noqa: E402
from elastic import ckpt_layout as layout  # noqa: E402

TENSORS_PER_STATE = 10
_FLASH_ENV = (
    "ELASTIC_SHM_DIR",
    "ELASTIC_AGENT_SOCKET",
    "ELASTIC_CKPT_DIR",
    "LOCAL_RANK",
    "GROUP_RANK",
    "RANK",
)


def make_state(megabytes: float) -> dict[str, torch.Tensor]:
    numel = int(megabytes * 1e6 / 4 / TENSORS_PER_STATE)
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(TENSORS_PER_STATE)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def timed(fn: Callable[[], object], repeats: int, before: Callable[[], object] | None = None) -> list[float]:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (it is fsynced, so they are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Row:
    def __init__(self, size_mb: float, name: str, times: list[float], size_bytes: int) -> None:
        self.size_mb, self.name, self.times, self.size_bytes = size_mb, name, times, size_bytes

    def cells(self) -> list[str]:
        median = statistics.median(self.times)
        spread = f"{min(self.times):.3f}-{max(self.times):.3f}"
        rate = self.size_bytes / median / 1e9 if median > 0 else float("inf")
        return [f"{self.size_mb:g} MB", self.name, f"{median:.3f}", spread, f"{rate:.2f}"]


def bench_size(megabytes: float, repeats: int, disk_root: Path) -> list[Row]:
    state = make_state(megabytes)
    size = nbytes(state)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=disk_root))
    rows: list[Row] = []
    saved = {name: os.environ.get(name) for name in _FLASH_ENV}
    keeper = CheckpointKeeper(f"bench-{os.getpid()}", "n0", keep=2).start()
    channel = ProgressChannel(on_checkpoint=keeper.on_checkpoint)
    try:
        channel.reset(1)
        os.environ.update(
            ELASTIC_SHM_DIR=str(keeper.folder),
            ELASTIC_AGENT_SOCKET=channel.path,
            ELASTIC_CKPT_DIR=str(work / "persisted"),  # where the keeper persists (elastic-run --ckpt-dir)
            LOCAL_RANK="0",
            GROUP_RANK="0",
            RANK="0",
            WORLD_SIZE="1",
        )
        os.environ.pop("ELASTIC_COMMITTED_STEP", None)
        flash, persist = [], []
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            checkpoint.save(state, step)
            flash.append(time.perf_counter() - start)
            # Not part of the blocking time: the keeper copies to disk while training goes on. It is
            # waited for here only so that the next measurement does not compete with it.
            start = time.perf_counter()
            if not keeper.wait_persisted(step, 600):
                raise RuntimeError("the keeper did not finish persisting within 600 s")
            persist.append(time.perf_counter() - start)
        rows.append(Row(megabytes, "flash save (blocking)", flash, size))
        rows.append(Row(megabytes, "  persist to disk (background)", persist, size))

        memory = timed(lambda: checkpoint.load(), repeats)
        rows.append(Row(megabytes, "restore from memory", memory, size))

        persisted = layout.checkpoint_files(work / "persisted")[0][1]
        os.environ.pop("ELASTIC_SHM_DIR")
        disk = timed(lambda: checkpoint.load(work / "persisted"), repeats, before=lambda: evict(persisted))
        rows.append(Row(megabytes, "restore from disk (cold cache)", disk, size))

        plain = work / "plain.pt"
        rows.append(
            Row(
                megabytes,
                "torch.save to disk (no fsync)",
                timed(lambda: torch.save(state, plain), repeats),
                size,
            )
        )
        plain.unlink()
        disk_dir = work / "v0"
        steps = iter(range(1, 10**6))
        v0 = timed(lambda: checkpoint.save(state, next(steps), disk_dir, keep=1), repeats)
        rows.append(Row(megabytes, "disk save (torch.save+fsync+rename)", v0, size))

        target = {name: torch.empty_like(t) for name, t in state.items()}
        for name, t in state.items():  # fault the pages in once: a reused buffer is the best case
            target[name].copy_(t)
        copy = timed(lambda: [target[name].copy_(t) for name, t in state.items()], repeats)
        rows.append(Row(megabytes, "memory copy (Tensor.copy_)", copy, size))
    finally:
        channel.close()
        keeper.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(work, ignore_errors=True)
    return rows


def print_table(rows: list[Row]) -> None:
    header = ["state", "operation", "median s", "min-max s", "GB/s"]
    table = [header] + [row.cells() for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, cells in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="100,1000", help="state sizes in MB, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="measurements per operation (default %(default)s)"
    )
    parser.add_argument(
        "--disk-dir", type=Path, default=None, help="folder on the disk to measure (default: temp)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one repeat: checks that it runs")
    args = parser.parse_args(argv)
    sizes = [2.0] if args.smoke else [float(s) for s in args.sizes.split(",")]
    repeats = 1 if args.smoke else args.repeats
    print(
        f"# checkpoint benchmark: torch {torch.__version__}, {os.cpu_count()} CPU cores, "
        f"{platform.platform()}, {torch.get_num_threads()} torch threads; "
        f"/dev/shm and {args.disk_dir or tempfile.gettempdir()}"
    )
    rows = []
    for size in sizes:
        rows += bench_size(size, repeats, args.disk_dir or Path(tempfile.gettempdir()))
    print_table(rows)


if __name__ == "__main__":
    main()
