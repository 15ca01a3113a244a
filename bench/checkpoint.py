"""Checkpoint benchmark: how long a save blocks training, and how long a restore takes.

    python bench/checkpoint.py                      # ~100 MB and ~1 GB states, 5 repeats each
    python bench/checkpoint.py --json /tmp/c.json   # also writes the save-vs-memcpy rows as JSON
    python bench/checkpoint.py --smoke              # tiny sizes, one repeat (what the test runs)

For each state size (float32 tensors of a model-like dict) and each kind of checkpoint (``--kinds``;
``replicated`` = ``elastic.save``; a ``sharded`` kind plugs into :data:`KINDS`) it measures, in this
process as the worker, with the agent's checkpoint keeper and progress channel in a process of their
own (bench/ckpt_agent.py):

* ``first save``: the first ``elastic.save(state, step)``: it allocates and pre-faults the shared
  memory segments (the double buffer); ``of which pre-faulting`` is that part.
* ``flash save (blocking)``: the later saves (steady state: segments reused), the time the call blocks,
  alternated with ``memory copy (Tensor.copy_)``: a copy of the same bytes (each storage, at the same
  offsets) into a pre-faulted buffer of this process, the physical limit of any save that copies the
  state once; ``save / memcpy`` is the ratio of the medians (the target: at most 1.25). The keeper's
  background persist to disk is timed separately (``persist (background)``) and waited for before the
  next measurement.
* ``torch.save to disk``: ``torch.save`` into a file on disk (lands in the page cache, no fsync), and
  ``disk save (fsync)``: the atomic disk save of ``elastic.save`` without an agent (write, fsync,
  rename, marker): what a save blocked for before the flash checkpoint.
* ``restore from memory``: ``elastic.load()`` from the shared-memory copy, alternated with its
  references on the same bytes: the memory copy above and the digest check (xxh3) a restore makes; and
  ``restore from disk``: from the persisted file with its pages evicted from the page cache first
  (posix_fadvise DONTNEED). The sharded kind restores from own memory, from a peer's replica (with its
  references: loopback TCP moving the peer's bytes, and their digest check) and from disk.

The restore targets (issue "Restores at memory speed") are rows of their own:
``restore_own_memory_over_memcpy`` (replicated, from the node's own memory: at most 2x the memcpy plus
the digest check) and
``restore_peer_over_tcp`` (sharded, a replaced node's shards from a peer's memory: at most 1.5x loopback
TCP plus the digest check), each with the references measured in the same run.

Prints the tables (median and range over the repeats); nothing is left behind (temp folders, /dev/shm).
With ``--json FILE`` it writes ``{"rows": [{"kind", "bytes", "save_block_s", "memcpy_s",
"block_over_memcpy", ...}, {"row": "restore_own_memory_over_memcpy", "kind", "bytes", "restore_s",
"reference_s", "digest_s", "ratio", "target_ratio", "met", ...}, {"row": "restore_peer_over_tcp", ...}],
"operations": [...], "machine": {...}}``; ``ratio`` is (restore - digest) / reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import ckpt_replication, common  # noqa: E402
from elastic.checkpoint import digest, flash, layout  # noqa: E402
from elastic.checkpoint import replicated as checkpoint  # noqa: E402

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


class FlashEnv:
    """An agent's side of flash checkpoints: a real keeper and progress channel in a process of their
    own (bench/ckpt_agent.py, as under elastic-run), and this process's worker environment pointing at
    them (restored, and everything removed, on exit)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.persisted = work / "persisted"  # where the keeper persists (elastic-run --ckpt-dir)
        self._saved = {name: os.environ.get(name) for name in _FLASH_ENV}
        self.agent = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "ckpt_agent.py"), f"bench-{os.getpid()}", "n0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            self.folder = Path(self._expect("folder"))
            socket_path = self._expect("socket")
        except BaseException:
            self._kill()
            raise
        os.environ.update(
            ELASTIC_SHM_DIR=str(self.folder),
            ELASTIC_AGENT_SOCKET=socket_path,
            ELASTIC_CKPT_DIR=str(self.persisted),
            LOCAL_RANK="0",
            GROUP_RANK="0",
            RANK="0",
            WORLD_SIZE="1",
        )
        os.environ.pop("ELASTIC_COMMITTED_STEP", None)

    def _expect(self, word: str) -> str:
        assert self.agent.stdout is not None
        line = self.agent.stdout.readline()
        if not line.startswith(f"{word} "):
            raise RuntimeError(f"bench/ckpt_agent.py said {line!r}, expected {word!r}")
        return line.strip().partition(" ")[2]

    def _send(self, line: str) -> None:
        assert self.agent.stdin is not None
        self.agent.stdin.write(line + "\n")
        self.agent.stdin.flush()

    def wait_persisted(self, step: int) -> None:
        self._send(f"wait {step}")
        if self._expect("persisted") != str(step):
            raise RuntimeError("the keeper did not finish persisting within 600 s")

    def _kill(self) -> None:
        self.agent.kill()  # our own child, by its pid
        self.agent.wait()

    def close(self) -> None:
        flash.close_all()  # unmap the segments: their memory goes with the keeper's folder
        try:
            self._send("quit")
            self._expect("stopped")
            self.agent.wait(60)
        except (OSError, RuntimeError, subprocess.TimeoutExpired):
            self._kill()
        finally:
            for stream in (self.agent.stdin, self.agent.stdout):
                if stream is not None:
                    stream.close()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def memcpy_baseline(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    """A copy of the bytes a flash save copies (each storage, at its offset in the file) into a buffer of
    this process that is faulted in beforehand: what a save at memory speed costs."""
    plan = flash.plan(state)
    buffer = torch.zeros(plan.size, dtype=torch.uint8)  # zeros: every page faulted in now

    def copy() -> None:
        for slot in plan.storages:
            buffer[slot.offset : slot.offset + slot.nbytes].copy_(slot.source)

    copy()
    return copy


def bench_replicated(megabytes: float, repeats: int, work: Path) -> tuple[list[Row], dict]:
    """``elastic.save`` of a replicated state: first save, steady saves against the memcpy baseline,
    persist, restores, and the disk saves it replaced."""
    state = make_state(megabytes)
    size = nbytes(state)
    rows: list[Row] = []
    env = FlashEnv(work)
    try:
        start = time.perf_counter()
        checkpoint.save(state, 1)
        first = time.perf_counter() - start
        first_stats = flash.history(env.folder)[0]
        env.wait_persisted(1)
        copy = memcpy_baseline(state)
        saves, persist, memcpy = [], [], []
        for step in range(2, repeats + 2):  # alternated: both see the same background load
            start = time.perf_counter()
            checkpoint.save(state, step)
            saves.append(time.perf_counter() - start)
            # Not part of the blocking time: the keeper copies to disk while training goes on. It is
            # waited for here only so that the next measurement does not compete with it.
            start = time.perf_counter()
            env.wait_persisted(step)
            persist.append(time.perf_counter() - start)
            memcpy.append(timed(copy, 1)[0])
        rows.append(Row(megabytes, "first save (allocates the segments)", [first], size))
        rows.append(Row(megabytes, "  of which pre-faulting", [first_stats.prefault_s], size))
        rows.append(Row(megabytes, "flash save (blocking)", saves, size))
        rows.append(Row(megabytes, "memory copy (Tensor.copy_)", memcpy, size))
        rows.append(Row(megabytes, "  persist to disk (background)", persist, size))

        # Alternated with its references, measured on the same bytes: the memcpy above, and the digest
        # check a restore makes (xxh3 over the newest file in memory, mapped).
        newest = layout.checkpoint_files(env.folder)[0][1]
        memory, restore_copies, digests = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            restored = checkpoint.load()
            memory.append(time.perf_counter() - start)
            del restored  # freed outside the measurement: the restore ends when load returns
            restore_copies.append(timed(copy, 1)[0])
            digests.append(timed(lambda: digest.file_digest_raw(newest), 1)[0])
        del copy
        rows.append(Row(megabytes, "restore from memory", memory, size))
        rows.append(Row(megabytes, "  memory copy of the same bytes", restore_copies, size))
        rows.append(Row(megabytes, "  digest check of the same bytes (xxh3)", digests, size))

        persisted = layout.checkpoint_files(env.persisted)[0][1]
        os.environ.pop("ELASTIC_SHM_DIR")
        disk = timed(lambda: checkpoint.load(env.persisted), repeats, before=lambda: evict(persisted))
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
    finally:
        env.close()
    result = common.save_block_result("replicated", size, saves, memcpy, first, first_stats.prefault_s)
    result["first_save_fresh_bytes"] = first_stats.fresh_bytes
    result["restore_rows"] = [
        restore_row(OWN_MEMORY_ROW, "replicated", size, memory, restore_copies, digests)
    ]
    return rows, result


#: The restore targets (issue "Restores at memory speed"): a restore takes at most this many times its
#: reference (measured in the same run, on the same bytes) plus the digest check of those bytes.
OWN_MEMORY_ROW, OWN_MEMORY_TARGET = "restore_own_memory_over_memcpy", 2.0
PEER_ROW, PEER_TARGET = "restore_peer_over_tcp", 1.5


def restore_row(
    row: str, kind: str, size: int, restores: list[float], references: list[float], digests: list[float]
) -> dict:
    """One restore-target row: medians of the restore, its reference (a memcpy of the bytes, or loopback
    TCP moving them) and the digest check over them; ``ratio`` is (restore - digest) / reference, and
    ``met`` says whether restore <= target x reference + digest."""
    restore, reference, check = (statistics.median(v) for v in (restores, references, digests))
    target = OWN_MEMORY_TARGET if row == OWN_MEMORY_ROW else PEER_TARGET
    return {
        "row": row,
        "kind": kind,
        "bytes": size,
        "restore_s": restore,
        "reference_s": reference,
        "digest_s": check,
        "ratio": (restore - check) / reference if reference > 0 else None,
        "target_ratio": target,
        "met": restore <= target * reference + check,
        "restore_range_s": [min(restores), max(restores)],
        "repeats": len(restores),
    }


SHARDED_RANKS = 2


def bench_sharded(megabytes: float, repeats: int, work: Path) -> tuple[list[Row], dict]:
    """``elastic.save_sharded`` flash saves, ``megabytes`` per rank, all ranks (one torch thread each)
    saving at once into one node's shared memory (bench/ckpt_sharded.py), against their memcpy."""
    shm = Path(tempfile.mkdtemp(prefix="elastic-bench-sharded-", dir="/dev/shm"))
    out = work / "sharded.json"
    port = str(common.free_port())
    env = {k: v for k, v in os.environ.items() if k not in _FLASH_ENV}
    script = str(REPO / "bench" / "ckpt_sharded.py")
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    script,
                    str(r),
                    str(SHARDED_RANKS),
                    port,
                    str(shm),
                    str(megabytes),
                    str(repeats),
                    str(out),
                ],
                env=env,
            )
            for r in range(SHARDED_RANKS)
        ]
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise RuntimeError(f"sharded bench ranks exited {codes}")
        result = json.loads(out.read_text())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    size = result["bytes"]
    rows = [
        Row(megabytes, f"sharded first save ({SHARDED_RANKS} ranks)", [result["first_save_s"]], size),
        Row(megabytes, "sharded flash save (blocking, per rank)", [result["save_block_s"]], size),
        Row(megabytes, "memory copy (per rank, all at once)", [result["memcpy_s"]], size),
    ]
    restore = _sharded_restore(megabytes, repeats, work)
    result["restore"] = {k: statistics.median(v) if isinstance(v, list) else v for k, v in restore.items()}
    peer = restore_row(
        PEER_ROW,
        "sharded",
        restore["peer_bytes"],
        restore["peer_memory_s"],
        restore["loopback_tcp_s"],
        restore["peer_digest_s"],
    )
    result["restore_rows"] = [peer]
    for key, name in (
        ("own_memory_s", "sharded restore from own memory"),
        ("peer_memory_s", "sharded restore, a node's shards from a peer's replica"),
        ("disk_s", "sharded restore from disk (page cache evicted)"),
    ):
        rows.append(
            Row(megabytes, f"{name} ({SHARDED_RANKS} nodes)", restore[key], restore["bytes"] * SHARDED_RANKS)
        )
        if key == "peer_memory_s":
            moved = restore["peer_bytes"]
            rows.append(
                Row(megabytes, "  loopback TCP moving the peer's bytes", restore["loopback_tcp_s"], moved)
            )
            rows.append(
                Row(megabytes, "  digest check of the peer's bytes (xxh3)", restore["peer_digest_s"], moved)
            )
    replication = ckpt_replication.bench_replication(megabytes * SHARDED_RANKS, repeats)
    result["replication"] = replication
    moved = replication["bytes"]
    rows += [
        Row(
            megabytes * SHARDED_RANKS,
            "replication push to a peer (loopback, sha256)",
            [replication["push_s"]],
            moved,
        ),
        Row(
            megabytes * SHARDED_RANKS, "loopback TCP, the same bytes", [replication["loopback_tcp_s"]], moved
        ),
        Row(
            megabytes * SHARDED_RANKS,
            "lag-bound wait per save, saves back to back",
            [replication["lag_wait_s"]],
            moved,
        ),
    ]
    return rows, result


def _sharded_restore(megabytes: float, repeats: int, work: Path) -> dict:
    """``elastic.load_sharded`` from own memory, a peer's replica and disk (bench/ckpt_sharded.py restore)."""
    shm = Path(tempfile.mkdtemp(prefix="elastic-bench-restore-", dir="/dev/shm"))
    out = work / "restore.json"
    port = str(common.free_port())
    env = {k: v for k, v in os.environ.items() if k not in _FLASH_ENV}
    script = str(REPO / "bench" / "ckpt_sharded.py")
    args = [port, str(shm), str(megabytes), str(repeats), str(out), str(work / "disk")]
    try:
        procs = [
            subprocess.Popen([sys.executable, script, "restore", str(r), str(SHARDED_RANKS), *args], env=env)
            for r in range(SHARDED_RANKS)
        ]
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise RuntimeError(f"sharded restore bench ranks exited {codes}")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(shm, ignore_errors=True)


#: Kinds of checkpoint measured, by ``--kinds`` name: each returns its table rows and one JSON row with
#: at least kind, bytes, save_block_s, memcpy_s and block_over_memcpy.
KINDS: dict[str, Callable[[float, int, Path], tuple[list[Row], dict]]] = {
    "replicated": bench_replicated,
    "sharded": bench_sharded,
}


def bench_size(
    megabytes: float, repeats: int, disk_root: Path, kind: str = "replicated"
) -> tuple[list[Row], dict]:
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=disk_root))
    try:
        return KINDS[kind](megabytes, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(rows: list[Row]) -> None:
    header = ["state", "operation", "median s", "min-max s", "GB/s"]
    table = [header] + [row.cells() for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, cells in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def print_comparison(results: list[dict]) -> None:
    headers = ["kind", "state", "save blocks (median s)", "memcpy (median s)", "save / memcpy"]
    headers.append("first save s (of which pre-fault)")
    lines = []
    for r in results:
        ratio = r["block_over_memcpy"]
        first = r.get("first_save_s")
        lines.append(
            [
                r["kind"],
                f"{r['bytes'] / 1e6:.0f} MB",
                f"{r['save_block_s']:.4f}",
                f"{r['memcpy_s']:.4f}",
                "n/a" if ratio is None else f"{ratio:.2f}x",
                "n/a" if first is None else f"{first:.3f} ({r.get('first_save_prefault_s', 0.0):.3f})",
            ]
        )
    print()
    print(common.table(headers, lines))


def print_restore_targets(results: list[dict]) -> None:
    """The restore-target rows: each restore against its reference measured in the same run."""
    headers = ["row", "kind", "bytes", "restore s", "reference s", "digest s", "(restore - digest) / ref"]
    headers.append("target")
    lines = []
    for r in (row for result in results for row in result.get("restore_rows", [])):
        reference = "memcpy" if r["row"] == OWN_MEMORY_ROW else "loopback TCP"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        target = f"<= {r['target_ratio']:g}x {reference} + digest: {'met' if r['met'] else 'NOT met'}"
        lines.append(
            [
                r["row"],
                r["kind"],
                f"{r['bytes'] / 1e6:.0f} MB",
                f"{r['restore_s']:.3f}",
                f"{r['reference_s']:.3f}",
                f"{r['digest_s']:.3f}",
                ratio,
                target,
            ]
        )
    if lines:
        print()
        print(common.table(headers, lines))


def machine() -> dict:
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default="100,1000", help="state sizes in MB, comma-separated (default %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="measurements per operation (default %(default)s)"
    )
    parser.add_argument(
        "--disk-dir", type=Path, default=None, help="folder on the disk to measure (default: temp)"
    )
    parser.add_argument(
        "--kinds", default="replicated,sharded", help=f"checkpoint kinds, comma-separated, of {sorted(KINDS)}"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one repeat: checks that it runs")
    args = parser.parse_args(argv)
    sizes = [2.0] if args.smoke else [float(s) for s in args.sizes.split(",")]
    repeats = 1 if args.smoke else args.repeats
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kind(s) {unknown}; known: {sorted(KINDS)}")
    before = machine()
    print(
        f"# checkpoint benchmark: torch {torch.__version__}, {os.cpu_count()} CPU cores, "
        f"{platform.platform()}, {torch.get_num_threads()} torch threads; "
        f"/dev/shm and {args.disk_dir or tempfile.gettempdir()}; load average "
        + "/".join(f"{v:.2f}" for v in before["load_average"])
    )
    rows, results = [], []
    for kind in kinds:
        for size in sizes:
            table, result = bench_size(size, repeats, args.disk_dir or Path(tempfile.gettempdir()), kind)
            rows += table
            results.append(result)
    print_table(rows)
    print_comparison(results)
    print_restore_targets(results)
    after = machine()
    print("# load average at the end: " + "/".join(f"{v:.2f}" for v in after["load_average"]))
    if args.json is not None:
        operations = [
            {
                "state_mb": row.size_mb,
                "operation": row.name.strip(),
                "median_s": statistics.median(row.times),
                "min_s": min(row.times),
                "max_s": max(row.times),
            }
            for row in rows
        ]
        machine_info = {**after, "load_average_start": before["load_average"]}
        restores = [row for result in results for row in result.pop("restore_rows", [])]
        document = {"rows": results + restores, "operations": operations, "machine": machine_info}
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
