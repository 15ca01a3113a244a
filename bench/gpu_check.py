"""GPU evidence: one prepared command that runs the CUDA and NCCL paths on a real GPU.

    python3 bench/gpu_check.py --json gpu.json                 # on a GPU machine: at most ~5 minutes
    python3 bench/gpu_check.py --budget-s 240 --json gpu.json  # skips the parts that would not fit
    python3 bench/gpu_check.py --dry-run --small --json F      # the CPU twins only (what the suite runs)
    python3 bench/gpu_check.py --prepare-wheels wheels --python-version 3.12   # beforehand, with a network
    python3 bench/gpu_check.py --wheels wheels --json gpu.json # on the GPU machine: installs what is missing

It runs from the source tree (no install). Its first second checks what the parts need: the Python
modules of the agent and master (one line per missing one), torch's version and the CUDA it was built
for, the GPUs and driver (``nvidia-smi``) and ``/dev/shm``. Then the parts, each printing its table rows
as it ends and rewriting ``--json FILE`` (a run stopped at its time limit keeps every finished part); a
part whose estimate does not fit in what is left of ``--budget-s`` is skipped with a line saying so:

1. Training to the end on CUDA: README's default job (``elastic-run --standalone --nproc-per-node 1
   scripts/train_script.py``, NCCL picked by ``elastic.init_process_group``); 2 workers on the one GPU
   (gloo over CUDA tensors: NCCL refuses two ranks on one device); NCCL with 2 workers on 2 GPUs when 2
   are visible.
2. Worker SIGKILL -> next step, 2 workers on the one GPU, killing worker 1 so that worker 0 can keep its
   CUDA context: torchrun, elastic-run (process restart, warm start on) and elastic-run with
   ``elastic.run`` (in process), ``--runs`` kills each (one launch per tool, killed again after each
   recovery). Each worker reports its CUDA context creation and its process-group set-up (group init and
   first collective; in process: leaving the broken step until the next ``train`` call) apart. The
   warm-start zygote is checked: a restarted worker is its child and the zygote never initialised the
   CUDA driver (no /dev/nvidia* open in it; whether libcuda is mapped is reported), and with a preload
   that initialises CUDA (``ELASTIC_WARM_PRELOAD``) it refuses to fork and the agent exec's the worker,
   which trains.
3. Flash save of a 1 GB state living on the GPU: how long ``elastic.save`` and ``elastic.save_sharded``
   block, against a pinned device-to-host copy of the same bytes (``non_blocking``, timed with CUDA
   events), and the restore (``elastic.load`` then host-to-device, against a pinned host-to-device copy).
   The state shrinks, with a line saying so, when ``/dev/shm`` holds less than 3 times it.
4. In-process release and re-form (``elastic.inprocess``' group control) with NCCL at world 1: forming a
   group (and its first all-reduce, which creates the communicator), aborting it, forming a new one; at
   world 2 where 2 GPUs are visible: a survivor blocked in an all-reduce on a vanished (stopped) peer is
   released, then re-forms alone. Also a plain ``init_process_group("nccl", device_id=...)`` (eager
   communicator) for reference.
5. The integrity guard's digest cost per GB of parameters on the GPU, where the guard exists.

Without a GPU (or with ``--dry-run``) every CUDA check prints a skip line and its CPU twin runs instead
(gloo, CPU tensors, the zygote's check with a preload that marks CUDA initialised, the flash save of CPU
state) and prints a figure; tests/e2e/test_gpu_check_dry_run.py runs that with ``--small``.

JSON: ``{"benchmark": "gpu_check", "command", "mode", "machine": {...}, "parts": [{"part", "title",
"estimate_s", "elapsed_s"}], "rows": [{"part", "check", "device" ("cuda" | "cpu"), "status" ("ok" | "fail"
| "skip" | "absent"), "figures": {name: number or string}, "note"}]}``.

The workers of parts 1 and 2 and the measurements of parts 3 to 5 run in processes of their own
(bench/gpu_probes.py), so that a crash or a hang costs one part only. Until this script has run on a GPU,
its CUDA paths are written from torch's documented API and unmeasured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a file, from the source tree, without an install
    sys.path.insert(0, str(REPO))

from bench.gpu_probes import SCRIPT as PROBES  # noqa: E402 - standard library only
from bench.gpu_probes import SHM, free_port, integrity_digest, median  # noqa: E402

#: Platforms of ``--prepare-wheels`` (pip download): the manylinux tags a current x86-64 image takes.
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
DEFAULT_BUDGET_S = 300.0


def requirements() -> list[str]:
    """pyproject's dependencies except torch (the image brings its own CUDA build)."""
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    reqs = re.findall(r"^\s*\"([^\"]+)\"", block.group(1), re.M) if block else []
    return [r for r in reqs if not re.match(r"torch\b", r)]


def agent_modules() -> dict[str, str]:
    """What the agent and the master import beyond torch, by import name, with the requirement that
    brings each (starlette comes with fastapi; it is checked on its own because a stock image may have
    one without the other)."""
    names = [re.split(r"[<>=!~ \[;]", r)[0].strip() for r in requirements()]
    found = {n.replace("-", "_").lower(): n for n in names}
    return found | ({"starlette": "fastapi"} if "fastapi" in names else {})


#: agent_modules() of this tree.
AGENT_MODULES = agent_modules()


# -- result rows, the table and the JSON ------------------------------------------------------------------
@dataclass
class Row:
    """One check of one part, on one device kind."""

    part: int
    check: str
    device: str  # "cuda" or "cpu" (the CPU twin)
    status: str  # "ok", "fail", "skip" (not run: no GPU, no time, a module missing) or "absent"
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def cells(self) -> list[str]:
        figures = ", ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        return [str(self.part), self.check, self.device, self.status, figures or "-", self.note or "-"]


HEADERS = ["part", "check", "device", "status", "figures", "note"]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(rows: list[Row]) -> str:
    cells = [r.cells() for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(HEADERS)]
    line = lambda cs: "| " + " | ".join(c.ljust(w) for c, w in zip(cs, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(HEADERS), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, cells)])


class Report:
    """The rows so far; each is printed when added, and ``--json`` is rewritten after each part."""

    def __init__(self, args: argparse.Namespace, machine: dict[str, Any], mode: str) -> None:
        self.args, self.machine, self.mode = args, machine, mode
        self.rows: list[Row] = []
        self.parts: list[dict[str, Any]] = []

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(" | ".join(row.cells()), flush=True)

    def part_done(self, number: int, title: str, estimate_s: float, elapsed_s: float) -> None:
        self.parts.append(
            {"part": number, "title": title, "estimate_s": estimate_s, "elapsed_s": round(elapsed_s, 3)}
        )
        self.write()

    def write(self) -> None:
        if not self.args.json:
            return
        data = {
            "benchmark": "gpu_check",
            "command": "python3 " + " ".join(shlex.quote(a) for a in sys.argv),
            "mode": self.mode,
            "machine": self.machine,
            "parts": self.parts,
            "rows": [asdict(r) for r in self.rows],
        }
        path = Path(self.args.json)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)  # a run killed mid-write leaves the previous part's file


def say(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the first second: what is there ----------------------------------------------------------------------
def missing_modules() -> list[str]:
    return [name for name in AGENT_MODULES if importlib.util.find_spec(name) is None]


def torch_build() -> tuple[str | None, str | None]:
    """torch's version and the CUDA version it was built for (None: a CPU build), without importing it
    (that takes seconds): from its distribution metadata and ``torch/version.py``."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version: str | None = version("torch")
    except PackageNotFoundError:
        torch_version = "?"
    cuda = None
    with contextlib.suppress(OSError):
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        m = re.search(r"^cuda\b[^=\n]*=\s*['\"]?([^'\"\n]+)", text, re.M)
        if m and m.group(1).strip() != "None":
            cuda = m.group(1).strip()
    return torch_version, cuda


def nvidia_smi() -> tuple[list[str], str | None, str]:
    """The GPUs ``nvidia-smi`` lists (name, memory), the driver version, and why none when none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], None, "nvidia-smi not found"
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return [], None, f"nvidia-smi failed: {exc}"
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        return [], None, f"nvidia-smi lists no GPU ({(out.stderr or out.stdout).strip()[:120]})"
    gpus, driver = [], None
    for ln in lines:
        parts = [p.strip() for p in ln.split(",")]
        gpus.append(f"{parts[0]} ({parts[2]})" if len(parts) > 2 else parts[0])
        driver = parts[1] if len(parts) > 1 else driver
    return gpus, driver, ""


def shm_bytes() -> tuple[int, int]:
    """(free, total) bytes of /dev/shm; (0, 0) when it is missing."""
    try:
        st = os.statvfs(SHM)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def preflight() -> dict[str, Any]:
    """Print one line per thing missing (and what is there); returns the machine's description."""
    torch_version, cuda = torch_build()
    gpus, driver, why = nvidia_smi()
    free, total = shm_bytes()
    missing = missing_modules()
    say(f"python {sys.version.split()[0]} at {sys.executable}")
    if torch_version is None:
        say("MISSING: torch (nothing can run)")
    else:
        say(
            f"torch {torch_version}, built for CUDA {cuda}" if cuda else f"torch {torch_version}: a CPU build"
        )
    for name in missing:
        say(f"MISSING: {name} (the agent and master need it: parts 1 and 2 skip; see --wheels)")
    if gpus:
        for i, gpu in enumerate(gpus):
            say(f"GPU {i}: {gpu}, driver {driver}")
    else:
        say(f"MISSING: GPU ({why}): a dry run, CPU twins only")
    if total == 0:
        say("MISSING: /dev/shm (flash checkpoints need it: part 3 skips)")
    else:
        say(f"/dev/shm: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    return {
        "python": sys.version.split()[0],
        "torch": torch_version,
        "torch_cuda": cuda,
        "gpus": gpus,
        "driver": driver,
        "shm_free_bytes": free,
        "shm_total_bytes": total,
        "missing_modules": missing,
        "cpu_cores": os.cpu_count(),
    }


_PROBE = """
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": 0, "names": []}
if torch.cuda.is_available():
    out["devices"] = torch.cuda.device_count()
    out["names"] = [torch.cuda.get_device_name(i) for i in range(out["devices"])]
    out["capability"] = list(torch.cuda.get_device_capability(0))
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        out["nccl"] = f"unavailable: {exc}"
print("PROBE " + json.dumps(out))
"""


def probe_torch() -> dict[str, Any]:
    """torch's own view of the GPUs, in a child (this process never initialises CUDA)."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc), "devices": 0}
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"error": (out.stderr or out.stdout).strip()[-300:], "devices": 0}


# -- wheels to carry to a machine without a network ---------------------------------------------------------
def prepare_wheels(folder: Path, python_version: str) -> int:
    """Download the wheels of :func:`requirements` (and theirs) for ``python_version`` on x86-64 Linux."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--python-version",
        python_version,
    ]
    for platform in WHEEL_PLATFORMS:
        argv += ["--platform", platform]
    argv += ["--dest", str(folder), *requirements()]
    say("running: " + " ".join(shlex.quote(a) for a in argv))
    code = subprocess.call(argv)
    if code == 0:
        say(f"carry {folder} with the tree; there run: python3 bench/gpu_check.py --wheels {folder} ...")
    return code


def install_wheels(folder: Path, missing: list[str]) -> list[str]:
    """Install the requirements of the ``missing`` modules from ``folder`` (no index) into a folder of
    its own, put on this process's path and on the children's ``PYTHONPATH``; returns what is still
    missing."""
    if not missing:
        return []
    target = folder / f"site-{sys.version_info.major}.{sys.version_info.minor}"
    wanted = sorted({AGENT_MODULES[m] for m in missing})
    argv = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder)]
    argv += ["--target", str(target), "--upgrade", *wanted]
    say("installing the missing modules: " + " ".join(shlex.quote(a) for a in argv))
    if subprocess.call(argv) != 0:
        say("MISSING: the install from the wheels failed")
    if str(target) not in sys.path:
        sys.path.append(str(target))  # after site-packages: what the image has wins
    # Children (agents, workers) get it on PYTHONPATH: only what was missing was installed there.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(target)]))
    importlib.invalidate_caches()
    still = missing_modules()
    for name in still:
        say(f"MISSING: {name} (still, after installing from {folder})")
    return still


# -- child processes of our own ----------------------------------------------------------------------------
_LIVE: dict[int, subprocess.Popen] = {}


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def start_child(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            cwd=REPO,
            start_new_session=True,
        )
    _LIVE[proc.pid] = proc
    return proc


def stop_child(proc: subprocess.Popen) -> None:
    """SIGKILL our child's session (its own process group, by its pid) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    _LIVE.pop(proc.pid, None)


def stop_all_children() -> None:
    for proc in list(_LIVE.values()):
        stop_child(proc)


def run_child(args: list[str], work: Path, name: str, timeout: float) -> tuple[dict | None, str]:
    """``gpu_check.py --child ARGS --out F``: its JSON result (None if it failed) and its output's tail."""
    out, log = work / f"{name}.json", work / f"{name}.log"
    proc = start_child([sys.executable, str(PROBES), "--child", *args, "--out", str(out)], log)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    timed_out = proc.poll() is None
    stop_child(proc)
    tail = _tail(log)
    if timed_out:
        return None, f"timed out after {timeout:.0f} s; {tail}"
    if proc.returncode != 0 or not out.exists():
        return None, f"exit {proc.returncode}; {tail}"
    return json.loads(out.read_text()), tail


def outcome(
    part: int, check: str, device: str, result: dict | None, failure: str, ok: bool = True, note: str = ""
) -> Row:
    """The row of a child's ``result`` (None: it failed, ``failure`` says how)."""
    good = result is not None and ok
    return Row(part, check, device, "ok" if good else "fail", result or {}, note if good else failure)


def _tail(log: Path, lines: int = 3) -> str:
    with contextlib.suppress(OSError):
        text = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return " / ".join(ln.strip()[-200:] for ln in text[-lines:])
    return ""


# -- the parts -----------------------------------------------------------------------------------------------
@dataclass
class Context:
    args: argparse.Namespace
    gpu: bool
    gpus: int
    work: Path
    missing: list[str]
    report: Report
    #: time.monotonic() by which the current part should end (its estimate, twice over, within the budget)
    part_deadline: float = 0.0

    def deadline_s(self) -> float:
        """Seconds left to the current part."""
        return self.part_deadline - time.monotonic()

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    def skip_cuda(self, part: int, checks: list[str], why: str) -> None:
        for check in checks:
            self.report.add(Row(part, check, "cuda", "skip", note=why))


@dataclass
class Part:
    number: int
    title: str
    run: Callable[[Context], None]
    #: the checks it reports, as (check, device), on a GPU (True) or as a dry run: for its skip lines
    checks: Callable[[bool], list[tuple[str, str]]]
    needs: tuple[str, ...] = ()


# Part 1 -----------------------------------------------------------------------------------------------------
P1_DEFAULT = "README's default job, 1 worker (nccl on CUDA)"
P1_ONE_GPU = "2 workers on one GPU, gloo over CUDA tensors"
P1_TWO_GPUS = "2 workers on 2 GPUs, nccl"
P1_TWIN_DEFAULT = "README's default job, 1 worker (gloo)"


def _bench_common() -> ModuleType:
    """bench.common, imported by parts 1 and 2 only: it needs psutil."""
    from bench import common

    return common


def elastic_job(
    ctx: Context, name: str, argv_tail: list[str], nproc: int, env: dict[str, str] | None = None
) -> tuple[int | None, float, str, int]:
    """``elastic-run --standalone --nproc-per-node N ARGV...`` to its end (``--job-timeout``): exit code
    (None: timed out), seconds, output, and the agent's pid."""
    c = _bench_common()
    tool = c.elastic_tool()
    argv = tool.cmd("--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", *argv_tail)
    folder = ctx.work / name
    folder.mkdir(parents=True, exist_ok=True)
    with c.Group(folder) as group:
        began = time.monotonic()
        proc = group.launch(argv, "job", env=tool.environ(**(env or {})))
        try:
            code: int | None = proc.popen.wait(ctx.args.job_timeout)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - began
        return code, took, proc.output(), proc.pid


def worker_argv(steps: int, device: str, backend: str, state_dir: Path, *extra: str) -> list[str]:
    flags = f"--worker --steps {steps} --device {device} --backend {backend}".split()
    return [str(PROBES), *flags, "--state-dir", str(state_dir), *extra]


def _job_row(part: int, check: str, device: str, code: int | None, took: float, out: str, done: str) -> Row:
    m = re.findall(done, out)
    figures: dict[str, Any] = {"wall_s": round(took, 2), "exit": code if code is not None else "timeout"}
    if m:
        figures["steps"] = int(m[-1])
    ok = code == 0 and bool(m)
    note = "" if ok else _last_error(out)
    return Row(part, check, device, "ok" if ok else "fail", figures, note)


def _last_error(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"Error|error:|Traceback|failed", ln)]
    return (errors or lines or ["no output"])[-1][-240:]


def part1(ctx: Context) -> None:
    a = ctx.args
    steps = a.train_steps
    ckpt = ctx.work / "p1-ckpt"
    default = ["scripts/train_script.py", "--steps", str(steps), "--ckpt-dir", str(ckpt)]
    done_default = r"done step=(\d+)"
    done_worker = r"BENCH done step=(\d+) rank=0"
    if not ctx.gpu:
        ctx.skip_cuda(1, [P1_DEFAULT, P1_ONE_GPU, P1_TWO_GPUS], "no GPU")
        code, took, out, _ = elastic_job(ctx, "p1-default", default, 1)
        ctx.report.add(_job_row(1, P1_TWIN_DEFAULT, "cpu", code, took, out, done_default))
        return
    code, took, out, _ = elastic_job(ctx, "p1-default", default, 1)
    ctx.report.add(_job_row(1, P1_DEFAULT, "cuda", code, took, out, done_default))
    argv = worker_argv(steps, "cuda:0", "gloo", ctx.work / "p1-one-gpu")
    code, took, out, _ = elastic_job(ctx, "p1-one-gpu", argv, 2)
    ctx.report.add(_job_row(1, P1_ONE_GPU, "cuda", code, took, out, done_worker))
    if ctx.gpus < 2:
        ctx.report.add(Row(1, P1_TWO_GPUS, "cuda", "skip", note=f"{ctx.gpus} GPU visible"))
        return
    argv = worker_argv(steps, "cuda:local", "nccl", ctx.work / "p1-two-gpus")
    code, took, out, _ = elastic_job(ctx, "p1-two-gpus", argv, 2)
    ctx.report.add(_job_row(1, P1_TWO_GPUS, "cuda", code, took, out, done_worker))


# Part 2 -----------------------------------------------------------------------------------------------------
P2_TOOLS = ("torchrun", "elastic-run", "elastic-run-inprocess")
#: Launches of one tool in part 2: one, and one more for the kills left when a launch did not recover.
MAX_LAUNCHES = 2
P2_ZYGOTE = "zygote: restarted worker forked from it, CUDA driver never initialised in it"
P2_POISON = "zygote refuses to fork after a preload initialised CUDA; worker exec'd and trains"


def p2_check(tool: str) -> str:
    return f"worker SIGKILL -> next step, 2 workers on one device: {tool}"


_POISON_MODULE = '''"""Written by bench/gpu_check.py: imported by the warm-start zygote (ELASTIC_WARM_PRELOAD)
to initialise CUDA there, which the zygote must notice and refuse to fork from."""
import torch

if torch.cuda.is_available():
    torch.cuda.init()
else:  # the CPU twin: torch.cuda.is_initialized() reads this flag, which a real initialisation sets
    torch.cuda._initialized = True
'''


def _cuda_driver_state(pid: int) -> dict[str, Any]:
    """Signs of the CUDA driver in process ``pid`` (None: unreadable): its device files open (``cuInit``
    opens /dev/nvidiactl and /dev/nvidia-uvm: the driver was initialised, forking is unsafe from then on)
    and its library mapped (loaded, perhaps by a link dependency, not necessarily initialised)."""
    fds: int | None = 0
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                fds += os.readlink(f"/proc/{pid}/fd/{name}").startswith("/dev/nvidia")
    except OSError:
        fds = None
    try:
        with open(f"/proc/{pid}/maps") as f:
            mapped: bool | None = any("libcuda.so" in line for line in f)
    except OSError:
        mapped = None
    return {"nvidia_device_fds": fds, "libcuda_mapped": mapped}


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def recovery_runs(ctx: Context, tool_name: str, device: str, runs: int, deadline: float) -> tuple[Row, dict]:
    """One launch of ``tool_name`` with 2 workers; SIGKILL rank 1 ``runs`` times, each time once rank 0
    has stepped twice since the last recovery (a launch that fails to recover is started again while
    the deadline allows). Returns the row and what the zygote check needs."""
    c = _bench_common()
    a = ctx.args
    tool = {"torchrun": c.torchrun_tool(), "elastic-run": c.elastic_tool()}.get(tool_name) or c.elastic_tool()
    inprocess = tool_name == "elastic-run-inprocess"
    results: list[dict] = []
    notes: list[str] = []
    zygote: dict[str, Any] = {}
    launch = 0
    while len(results) < runs and time.monotonic() < deadline and launch < MAX_LAUNCHES:
        launch += 1
        folder = ctx.work / f"p2-{tool_name}-{launch}"
        folder.mkdir(parents=True, exist_ok=True)
        extra = ["--rdzv-backend=c10d"] if tool_name == "torchrun" else []
        worker = worker_argv(10**6, device, "gloo", folder / "state", "--step-time", str(a.step_time))
        argv = tool.cmd(
            "--standalone", "--nproc-per-node", "2", "--max-restarts", str(runs + 2), *extra, *worker
        )
        if inprocess:
            argv.append("--inprocess")
        with c.Group(folder) as group:
            proc = group.launch(argv, "launcher", env=tool.environ())
            since = 0.0
            while len(results) < runs:
                left = deadline - time.monotonic()
                got = _one_kill(c, proc, since, min(a.recovery_timeout, max(left, 1.0)), a.start_timeout)
                if isinstance(got, str):
                    notes.append(got)
                    break
                results.append(got)
                since = got["t_step"]
                if tool_name == "elastic-run" and not zygote:
                    zygote = _zygote_state(got["r1_pid"], got["r1_ppid"], proc.pid)
            c.cleanup()
    ok = [r for r in results if r["recovered"]]
    figures: dict[str, Any] = {"recovered": f"{len(ok)}/{runs}"}
    med = median([r["to_step_s"] for r in ok])
    if med is not None:
        figures["kill_to_step_s"] = round(med, 3)
        figures["max_s"] = round(max(r["to_step_s"] for r in ok), 3)
    figures["survivor_pid_kept"] = f"{sum(r['survivor_pid_kept'] for r in ok)}/{len(ok)}"
    for key in ("r0_cuda_ms", "r0_pg_ms", "r1_cuda_ms", "r1_pg_ms"):
        value = median([r[key] for r in ok if r.get(key) is not None])
        if value is not None:
            figures[key] = round(value, 1)
    status = "ok" if len(ok) == runs else "fail"
    row = Row(2, p2_check(tool_name), "cpu" if device == "cpu" else "cuda", status, figures, "; ".join(notes))
    return row, {**zygote, "runs": results}


def _one_kill(c: Any, proc: Any, since: float, timeout: float, start_timeout: float) -> dict | str:
    """Wait for rank 0's second step after ``since``, SIGKILL rank 1, wait for rank 0's first step after
    the re-formed world's start; a dict of figures, or why not."""

    def ready() -> tuple[dict, Any] | None:
        events = proc.events()
        steps = [e for e in events if e["kind"] == "step" and e["rank"] == 0 and e["t"] > since]
        starts = [e for e in events if e["kind"] == "start" and e["rank"] == 1]
        if len(steps) < 2 or not starts:
            return None
        proc.track()
        ident = proc.known.get(starts[-1]["pid"])
        return (starts[-1], ident) if ident else None

    found = c.wait_until(lambda: ready() or (not proc.alive() and "exited"), start_timeout, tick=proc.track)
    if not found or found == "exited":
        why = f"exit {proc.popen.poll()}" if found else "timeout"
        return f"rank 0 did not step twice after {since:.1f} ({why})"
    _, ident = found
    pid_before = [e["pid"] for e in proc.events() if e["kind"] == "start" and e["rank"] == 0][-1]
    t_kill = time.time()
    c.sigkill(ident)

    def recovered() -> dict | None:
        events = [e for e in proc.events() if e["t"] > t_kill]
        start = c.first(events, kind="start", rank=0)
        if start is None:
            return None
        step = c.first([e for e in events if e["t"] >= start["t"]], kind="step", rank=0)
        r1 = c.first(events, kind="start", rank=1)
        if step is None or r1 is None:
            return None
        return {"start": start, "step": step, "r1": r1, "events": events}

    got = c.wait_until(lambda: recovered() or (not proc.alive() and "exited"), timeout, tick=proc.track)
    if not got or got == "exited":
        return f"no step within {timeout:.0f} s of the kill" if not got else f"exit {proc.popen.poll()}"
    events = got["events"]
    r0_init = c.first(events, kind="init", rank=0)
    r1_init = c.first(events, kind="init", rank=1)
    ms = lambda ev, key: None if ev is None or key not in ev else ev[key] / 1000  # noqa: E731 - us -> ms
    return {
        "recovered": True,
        "to_step_s": got["step"]["t"] - t_kill,
        "t_step": got["step"]["t"],
        "survivor_pid_kept": got["start"]["pid"] == pid_before,
        "r0_cuda_ms": ms(r0_init, "cuda_us"),
        "r0_pg_ms": ms(r0_init, "pg_us"),
        "r1_cuda_ms": ms(r1_init, "cuda_us"),
        "r1_pg_ms": ms(r1_init, "pg_us"),
        "r1_pid": got["r1"]["pid"],
        "r1_ppid": got["r1"].get("ppid"),
    }


def _zygote_state(worker: int, parent: int | None, agent: int) -> dict[str, Any]:
    """Read while the restarted worker lives: was it forked by the zygote (its parent is not the agent
    but a child of it), and the signs of the CUDA driver in that zygote."""
    forked = parent is not None and parent != agent and _ppid(parent) == agent
    return {"forked_by_zygote": forked, **(_cuda_driver_state(parent) if forked and parent else {})}


def part2(ctx: Context) -> None:
    device, kind = ("cuda:0", "cuda") if ctx.gpu else ("cpu", "cpu")
    if not ctx.gpu:
        ctx.skip_cuda(2, [*map(p2_check, P2_TOOLS), P2_ZYGOTE, P2_POISON], "no GPU")
    tools = [t for t in P2_TOOLS if t in ctx.args.tools.split(",")]
    for tool in (t for t in P2_TOOLS if t not in tools):
        ctx.report.add(Row(2, p2_check(tool), kind, "skip", note="not in --tools"))
    per_tool = max(20.0, (ctx.deadline_s() - 25.0) / max(len(tools), 1))
    zygote: dict[str, Any] = {}
    for tool in tools:
        row, info = recovery_runs(ctx, tool, device, ctx.args.runs, time.monotonic() + per_tool)
        ctx.report.add(row)
        zygote = info if tool == "elastic-run" else zygote
    z_ok = zygote.get("forked_by_zygote") is True and zygote.get("nvidia_device_fds") == 0
    figures = {k: v for k, v in zygote.items() if k != "runs"}
    if "elastic-run" not in tools:
        ctx.report.add(Row(2, P2_ZYGOTE, kind, "skip", note="elastic-run not in --tools"))
    else:
        ctx.report.add(Row(2, P2_ZYGOTE, kind, "ok" if z_ok else "fail", figures))
    ctx.report.add(poison_check(ctx, device, kind))


def poison_check(ctx: Context, device: str, kind: str) -> Row:
    """elastic-run with a warm-start preload that initialises CUDA: the zygote must refuse (the worker is
    exec'd: its parent is the agent) and the job trains to its end."""
    folder = ctx.work / "p2-poison-module"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu_check_cuda_preload.py").write_text(_POISON_MODULE)
    env = {
        "ELASTIC_WARM_PRELOAD": "torch,gpu_check_cuda_preload",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(folder), os.environ.get("PYTHONPATH")])),
    }
    argv = worker_argv(3, device, "gloo", ctx.work / "p2-poison-state")
    code, took, out, agent = elastic_job(ctx, "p2-poison", argv, 1, env)
    c = _bench_common()
    start = c.first(c.parse_events(out), kind="start", rank=0)
    exec_d = start is not None and start.get("ppid") == agent
    reason = bool(re.search(r"CUDA", out)) and bool(re.search(r"exec", out, re.I))
    trained = code == 0 and "BENCH done" in out
    figures = {"worker_execd": exec_d, "reason_logged": reason, "trained": trained, "wall_s": round(took, 2)}
    ok = exec_d and trained
    return Row(2, P2_POISON, kind, "ok" if ok else "fail", figures, "" if ok else _last_error(out))


# Part 3 -----------------------------------------------------------------------------------------------------
P3_CHECK = "flash save of state on the device: elastic.save / save_sharded vs a pinned copy; restore"


def flash_size_mb(ctx: Context) -> tuple[float, str]:
    """The state's size, shrunk to a third of /dev/shm's free space when that is less than 3 times it."""
    want = ctx.args.size_mb if ctx.gpu else ctx.args.twin_size_mb
    free, _ = shm_bytes()
    if free and free < 3 * want * 1e6:
        shrunk = max(1.0, free / 3 / 1e6 // 1)
        why = f"state shrunk from {want:g} MB to {shrunk:g} MB: /dev/shm has {free / 1e6:.0f} MB free"
        return shrunk, why
    return want, ""


def part3(ctx: Context) -> None:
    if not ctx.gpu:
        ctx.skip_cuda(3, [P3_CHECK], "no GPU")
    if shm_bytes()[1] == 0:
        ctx.report.add(Row(3, P3_CHECK, ctx.device, "skip", note="no /dev/shm"))
        return
    size, shrunk = flash_size_mb(ctx)
    if shrunk:
        say(shrunk)
    args = ["flash", "--device", "cuda:0" if ctx.gpu else "cpu", "--size-mb", str(size)]
    args += ["--repeats", str(ctx.args.repeats)]
    result, tail = run_child(args, ctx.work, "p3-flash", max(30.0, ctx.deadline_s()))
    ctx.report.add(outcome(3, P3_CHECK, ctx.device, result, tail, note=shrunk))


# Part 4 -----------------------------------------------------------------------------------------------------
P4_W1 = "group release and re-form in process, world 1"
P4_W2 = "world 2: survivor blocked on a vanished peer is released, re-forms alone"


def part4(ctx: Context) -> None:
    backend = "nccl" if ctx.gpu else "gloo"
    if not ctx.gpu:
        ctx.skip_cuda(4, [f"{P4_W1} (nccl)", f"{P4_W2} (nccl)"], "no GPU")
    device = "cuda:0" if ctx.gpu else "cpu"
    args = ["reform", "--backend", backend, "--device", device, "--repeats", str(ctx.args.repeats)]
    result, tail = run_child(args, ctx.work, "p4-world1", max(30.0, ctx.deadline_s() / 2))
    ctx.report.add(outcome(4, f"{P4_W1} ({backend})", ctx.device, result, tail))
    if ctx.gpu and ctx.gpus < 2:
        ctx.report.add(Row(4, f"{P4_W2} (nccl)", "cuda", "skip", note=f"{ctx.gpus} GPU visible"))
        return
    ctx.report.add(world2(ctx, backend))


def world2(ctx: Context, backend: str) -> Row:
    """Two ranks: rank 1 stops itself (SIGSTOP: its sockets stay open) after the first all-reduce; rank 0's
    next all-reduce blocks until the group is released, then rank 0 re-forms a group of one."""
    check = f"{P4_W2} ({backend})"
    port, port2 = free_port(), free_port()
    procs, outs = [], []
    for rank in (0, 1):
        device = f"cuda:{rank}" if ctx.gpu else "cpu"
        out = ctx.work / f"p4-world2-rank{rank}.json"
        argv = [sys.executable, str(PROBES), "--child", "blocked", "--backend", backend, "--device", device]
        argv += ["--rank", str(rank), "--port", str(port), "--port2", str(port2), "--out", str(out)]
        procs.append(start_child(argv, ctx.work / f"p4-world2-rank{rank}.log"))
        outs.append(out)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[0].wait(max(30.0, ctx.deadline_s()))
    finally:
        for proc in procs:  # rank 1 is stopped: SIGKILL ends it all the same
            stop_child(proc)
    if procs[0].returncode != 0 or not outs[0].exists():
        return Row(4, check, ctx.device, "fail", note=_tail(ctx.work / "p4-world2-rank0.log"))
    result = json.loads(outs[0].read_text())
    return outcome(
        4, check, ctx.device, result, "the collective stayed blocked", bool(result.get("released"))
    )


# Part 5 -----------------------------------------------------------------------------------------------------
P5_CHECK = "integrity guard: digest cost per GB of parameters"


def part5(ctx: Context) -> None:
    if integrity_digest() is None:
        note = "no integrity guard in this tree (the checkpoint digest of the trust issue)"
        ctx.report.add(Row(5, P5_CHECK, "cuda", "skip" if not ctx.gpu else "absent", note=note))
        if not ctx.gpu:
            ctx.report.add(Row(5, P5_CHECK, "cpu", "absent", note=note))
        return
    if not ctx.gpu:
        ctx.skip_cuda(5, [P5_CHECK], "no GPU")
    size = ctx.args.size_mb if ctx.gpu else ctx.args.twin_size_mb
    args = ["digest", "--device", "cuda:0" if ctx.gpu else "cpu", "--size-mb", str(size)]
    result, tail = run_child([*args, "--repeats", str(ctx.args.repeats)], ctx.work, "p5", 120)
    ctx.report.add(outcome(5, P5_CHECK, ctx.device, result, tail))


#: Seconds each part takes, on a GPU machine and as a dry run on 2 cores (with --small): launches of
#: elastic-run or torchrun (~10 s each on a GPU machine), kills (a few seconds each for the process
#: restart paths), child processes (a torch import each, plus 1 GB copies on a GPU).
ESTIMATES = {1: (75.0, 25.0), 2: (130.0, 60.0), 3: (40.0, 15.0), 4: (30.0, 15.0), 5: (15.0, 1.0)}


def _p1_checks(gpu: bool) -> list[tuple[str, str]]:
    cuda = [(P1_DEFAULT, "cuda"), (P1_ONE_GPU, "cuda"), (P1_TWO_GPUS, "cuda")]
    return cuda if gpu else [*cuda, (P1_TWIN_DEFAULT, "cpu")]


def _p2_checks(gpu: bool) -> list[tuple[str, str]]:
    checks = [*map(p2_check, P2_TOOLS), P2_ZYGOTE, P2_POISON]
    return [(c, "cuda") for c in checks] + ([] if gpu else [(c, "cpu") for c in checks])


def _p4_checks(gpu: bool) -> list[tuple[str, str]]:
    cuda = [(f"{P4_W1} (nccl)", "cuda"), (f"{P4_W2} (nccl)", "cuda")]
    return cuda if gpu else [*cuda, (f"{P4_W1} (gloo)", "cpu"), (f"{P4_W2} (gloo)", "cpu")]


def _one(check: str) -> Callable[[bool], list[tuple[str, str]]]:
    return lambda gpu: [(check, "cuda")] + ([] if gpu else [(check, "cpu")])


PARTS = [
    Part(1, "training to the end on CUDA", part1, _p1_checks, tuple(AGENT_MODULES)),
    Part(2, "worker SIGKILL -> next step; the zygote", part2, _p2_checks, tuple(AGENT_MODULES)),
    Part(3, "flash save of device state", part3, _one(P3_CHECK), ("psutil",)),
    Part(4, "group release and re-form in process", part4, _p4_checks),
    Part(5, "integrity guard digest", part5, _one(P5_CHECK)),
]


# -- the command ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="FILE", help="write the results here, rewritten after each part")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="skip parts that would not fit")
    p.add_argument("--dry-run", action="store_true", help="the CPU twins even where a GPU is visible")
    p.add_argument(
        "--small", action="store_true", help="small sizes, one kill per tool (the suite's dry run)"
    )
    p.add_argument("--parts", default="1,2,3,4,5", help="comma-separated parts to run (default %(default)s)")
    p.add_argument("--tools", default=",".join(P2_TOOLS), help="part 2's launchers (default %(default)s)")
    p.add_argument("--runs", type=int, default=5, help="part 2: kills per tool (default %(default)s)")
    p.add_argument("--size-mb", type=float, default=1000.0, help="parts 3, 5 on a GPU: state size in MB")
    p.add_argument("--twin-size-mb", type=float, default=64.0, help="parts 3, 5 CPU twins: state size in MB")
    p.add_argument("--repeats", type=int, default=3, help="parts 3-5: repeats of each timing")
    p.add_argument("--train-steps", type=int, default=50, help="part 1: steps of each job")
    p.add_argument("--step-time", type=float, default=0.05, help="part 2: seconds of sleep per step")
    p.add_argument(
        "--job-timeout", type=float, default=120.0, help="part 1: seconds before a job counts as hung"
    )
    p.add_argument(
        "--start-timeout", type=float, default=60.0, help="part 2: seconds to the steps before a kill"
    )
    p.add_argument(
        "--recovery-timeout", type=float, default=45.0, help="part 2: seconds from a kill to a step"
    )
    p.add_argument("--workdir", help="keep logs here (default: a temporary folder, removed)")
    p.add_argument("--wheels", metavar="DIR", help="install the missing modules from these wheels first")
    p.add_argument("--prepare-wheels", metavar="DIR", help="download the wheels a stock torch image lacks")
    p.add_argument("--python-version", default="3.12", help="with --prepare-wheels (default %(default)s)")
    a = p.parse_args(argv)
    if a.small:
        a.runs, a.twin_size_mb, a.repeats, a.train_steps = 1, 8.0, 2, 5
    return a


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        yield Path(tmp)


def run_parts(a: argparse.Namespace, machine: dict[str, Any], gpus: int, began: float) -> Report:
    gpu = gpus > 0
    report = Report(a, machine, "gpu" if gpu else "dry-run")
    wanted = {int(p) for p in a.parts.split(",") if p.strip()}
    print(" | ".join(HEADERS), flush=True)
    with _workdir(a.workdir) as work:
        ctx = Context(a, gpu, gpus, work, machine["missing_modules"], report)
        try:
            for part in (p for p in PARTS if p.number in wanted):
                estimate = ESTIMATES[part.number][0 if gpu else 1]
                left = a.budget_s - (time.monotonic() - began)
                lacking = [m for m in part.needs if m in ctx.missing]
                why = ""
                if lacking:
                    why = f"missing {', '.join(lacking)} (see --wheels)"
                elif estimate > left:
                    why = f"would not fit: estimate {estimate:.0f} s, {max(left, 0):.0f} s left of --budget-s"
                say(
                    f"part {part.number}: {part.title}"
                    + (f": skipped, {why}" if why else f" (~{estimate:.0f} s)")
                )
                t0 = time.monotonic()
                if why:
                    for check, device in part.checks(gpu):
                        report.add(Row(part.number, check, device, "skip", note=why))
                else:
                    ctx.part_deadline = t0 + min(left, 2 * estimate)
                    try:
                        part.run(ctx)
                    except Exception as exc:  # noqa: BLE001 - one broken part must not cost the others
                        report.add(
                            Row(
                                part.number,
                                f"part {part.number} crashed",
                                ctx.device,
                                "fail",
                                note=repr(exc)[:300],
                            )
                        )
                report.part_done(part.number, part.title, estimate, time.monotonic() - t0)
        finally:
            stop_all_children()
            if "bench.common" in sys.modules:
                sys.modules["bench.common"].cleanup()
    return report


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.prepare_wheels:
        return prepare_wheels(Path(a.prepare_wheels), a.python_version)
    began = time.monotonic()
    machine = preflight()
    if a.wheels and machine["missing_modules"]:
        machine["missing_modules"] = install_wheels(Path(a.wheels), machine["missing_modules"])
    if machine["torch"] is None:
        return 2
    probe = {} if a.dry_run else probe_torch()  # a torch import: seconds
    machine["torch_probe"] = probe
    gpus = int(probe.get("devices") or 0)
    if probe.get("error"):
        say(f"torch could not be probed: {probe['error']}")
    say(
        f"{gpus} CUDA device(s) for torch {probe.get('torch')} "
        f"(CUDA {probe.get('cuda')}, NCCL {probe.get('nccl')})"
        if gpus
        else "dry run: every CUDA check prints a skip line, its CPU twin runs"
    )
    # SIGTERM (a time limit): the finally blocks stop our children; the JSON holds every finished part.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run_parts(a, machine, gpus, began)
    print("\n" + table(report.rows), flush=True)
    failed = [r for r in report.rows if r.status == "fail"]
    say(f"done in {time.monotonic() - began:.0f} s: {len(failed)} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
