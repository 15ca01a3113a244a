"""Shared helpers of the benchmarks: launchers as parameters, processes we own, log parsing, statistics,
tables and the A B A B run order.

Process hygiene: every process is started in its own session; we remember every descendant we ever see
(PID + create time, so a recycled PID is never signalled) and every launched environment carries a
``BENCH_RUN_TAG`` so that :func:`cleanup` can find (and SIGKILL, by PID) exactly the processes this
benchmark started, even orphans whose parent died. Nothing is ever killed by name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from agent.executor import net

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "bench" / "workload.py"
RUN_TAG = f"bench-{uuid.uuid4().hex[:12]}"
TAG_ENV = "BENCH_RUN_TAG"

MACHINE_NOTE = (
    "Machine: {cores} CPU cores, no GPU, {system}{load}. Runs of the tools are alternated (A B A B) so that "
    "all see the same background load; medians are quoted with (min-max)."
)


# -- tools ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    """A launcher: its display name and the command line that replaces ``torchrun``."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    #: An elastic-run agent (it needs an ``elastic-master``), not torchrun.
    elastic: bool = False

    def environ(self, **extra: str) -> dict[str, str]:
        return bench_env(**dict(self.env), **extra)

    def cmd(self, *args: str) -> list[str]:
        return [*self.argv, *map(str, args)]


def elastic_tool(cmd: str | None = None) -> Tool:
    return Tool(
        "elastic-run", tuple(shlex.split(cmd)) if cmd else (sys.executable, "-m", "agent"), elastic=True
    )


#: elastic-run as it was before warm starts: every worker is exec'd and imports torch itself.
EXEC_TOOL = "elastic-run-exec"


def elastic_exec_tool(cmd: str | None = None) -> Tool:
    base = elastic_tool(cmd)
    return Tool(EXEC_TOOL, (*base.argv, "--no-warm-start"), elastic=True)


#: elastic-run with the workload inside ``elastic.run`` (bench/workload.py's in-process mode): live workers
#: keep their processes across a failure (in-process recovery).
INPROCESS_TOOL = "elastic-run-inprocess"


def elastic_inprocess_tool(cmd: str | None = None) -> Tool:
    # Cluster and the benchmarks launch agents with Tool.environ(), and an agent hands its environment on
    # to its workers: BENCH_INPROCESS (bench/workload.py's INPROCESS_ENV) reaches the workload.
    base = elastic_tool(cmd)
    return Tool(INPROCESS_TOOL, base.argv, (("BENCH_INPROCESS", "1"),), elastic=True)


def torchrun_tool(cmd: str | None = None) -> Tool:
    return Tool(
        "torchrun", tuple(shlex.split(cmd)) if cmd else (sys.executable, "-m", "torch.distributed.run")
    )


#: torchrun with the rendezvous store *not* shared with the workers (they host their own TCPStore).
NOSHARE_ENV = (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),)


def torchrun_noshare_tool(cmd: str | None = None) -> Tool:
    base = torchrun_tool(cmd)
    return Tool("torchrun-noshare", base.argv, NOSHARE_ENV)


def master_argv(cmd: str | None = None) -> list[str]:
    return shlex.split(cmd) if cmd else [sys.executable, "-m", "master"]


def base_parser(description: str, runs: int, tools: str = "elastic-run,torchrun") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--runs", type=int, default=runs, help="runs of each tool, alternated (default %(default)s)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one run each: checks the script works")
    p.add_argument("--elastic-cmd", default=None, help="elastic-run command line (default: python -m agent)")
    p.add_argument(
        "--torchrun-cmd",
        default=None,
        help="torchrun command line (default: python -m torch.distributed.run)",
    )
    p.add_argument(
        "--tools",
        default=tools,
        help=f"comma-separated, from elastic-run, {INPROCESS_TOOL} (the workload inside elastic.run), "
        f"{EXEC_TOOL} (elastic-run --no-warm-start: the 'before' of warm starts), torchrun, torchrun-noshare "
        "(torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) "
        "(default %(default)s)",
    )
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp folder, removed)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    return p


def selected_tools(args: argparse.Namespace) -> list[Tool]:
    wanted = [t.strip() for t in args.tools.split(",") if t.strip()]
    tools = {
        "elastic-run": elastic_tool(args.elastic_cmd),
        INPROCESS_TOOL: elastic_inprocess_tool(args.elastic_cmd),
        EXEC_TOOL: elastic_exec_tool(args.elastic_cmd),
        "torchrun": torchrun_tool(args.torchrun_cmd),
        "torchrun-noshare": torchrun_noshare_tool(args.torchrun_cmd),
    }
    unknown = set(wanted) - tools.keys()
    if unknown:
        raise SystemExit(f"unknown tool(s): {', '.join(sorted(unknown))}")
    return [tools[name] for name in wanted]


def alternate(items: Sequence, runs: int) -> Iterator[tuple[int, object]]:
    """A B A B ...: ``runs`` rounds, each item once per round, in order."""
    for i in range(runs):
        for item in items:
            yield i, item


@contextlib.contextmanager
def workdir(path: str | None) -> Iterator[Path]:
    if path:
        p = Path(path).resolve()
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        yield Path(tmp)


# -- processes --------------------------------------------------------------------------------------------
def free_port() -> int:
    """A free port on loopback, drawn as the agent draws its workers' store port (``ELASTIC_STORE_PORTS``):
    below the ephemeral range, so no outgoing connection takes it before the process meant to bind it does."""
    return net.free_port("127.0.0.1", net.store_ports(os.environ))


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("OMP_NUM_THREADS", None)
    env[TAG_ENV] = RUN_TAG
    env.update(extra)
    return env


_Identity = tuple[int, float]  # (pid, create_time)


def _identity(proc: psutil.Process) -> _Identity | None:
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return None


def same_process(ident: _Identity) -> psutil.Process | None:
    """The process ``ident`` names, if it still lives (not a zombie) and its PID was not recycled."""
    try:
        proc = psutil.Process(ident[0])
        if proc.create_time() != ident[1] or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def sigkill(ident: _Identity) -> bool:
    proc = same_process(ident)
    if proc is None:
        return False
    with contextlib.suppress(psutil.Error):
        proc.send_signal(signal.SIGKILL)
        return True
    return False


class Launched:
    """One command we started (own session), its output file, and every descendant we have seen."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None, name: str = "") -> None:
        self.argv = argv
        self.log = log
        self.name = name or Path(argv[0]).name
        self._fh = open(log, "wb")  # noqa: SIM115 - closed in kill()/reap()
        self.started = time.time()
        self.popen = subprocess.Popen(
            argv,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            env=env or bench_env(),
            cwd=REPO,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.ident: _Identity = (self.pid, psutil.Process(self.pid).create_time())
        self.known: dict[int, _Identity] = {}

    def track(self) -> list[psutil.Process]:
        """Live descendants (also remembered, to be found after the launcher itself is gone)."""
        proc = same_process(self.ident)
        if proc is None:
            return []
        try:
            children = proc.children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            ident = _identity(child)
            if ident:
                self.known[child.pid] = ident
        return children

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self) -> list[dict]:
        return parse_events(self.output())

    def kill_tree(self) -> float:
        """SIGKILL the launcher and every descendant at once (a node dying); returns the time of the kill."""
        return self.signal_tree(signal.SIGKILL)

    def signal_tree(self, sig: signal.Signals) -> float:
        """Send ``sig`` to the launcher and every descendant at once (SIGSTOP: a node that vanishes with
        its sockets open; :meth:`kill` still ends the stopped processes); returns the time it was sent."""
        self.track()
        targets = [self.ident, *self.known.values()]
        t = time.time()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)  # its own session: the group id is our child's PID
        for ident in targets:
            proc = same_process(ident)
            if proc is not None:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
        return t

    def reap(self, timeout: float = 10.0) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        self._fh.close()
        return self.popen.returncode

    def kill(self) -> None:
        """Kill everything we started through this launcher; safe to call twice."""
        for _ in range(3):  # descendants may still be spawning while we look
            self.kill_tree()
            if not any(same_process(i) for i in self.known.values()):
                break
            time.sleep(0.1)
        self.reap()


class Group:
    """The processes of one benchmark run; killed (and checked) when the run ends, even on errors."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[Launched] = []
        # A TMPDIR of the run's own: a node the benchmark SIGKILLs whole (agent and reaper) leaves its temp
        # folders there, as a lost machine takes its /tmp with it. Short: unix socket paths are limited.
        self.temp = Path(tempfile.mkdtemp(prefix="eb-"))

    def launch(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> Launched:
        env = dict(env or bench_env())
        if env.get("TMPDIR") == os.environ.get("TMPDIR"):  # unless the caller chose one
            env["TMPDIR"] = str(self.temp)
        proc = Launched(argv, self.folder / f"{name}.log", env=env, name=name)
        self.procs.append(proc)
        return proc

    def track(self) -> None:
        for proc in self.procs:
            proc.track()

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tagged_processes(tag: str = RUN_TAG) -> list[psutil.Process]:
    """Processes whose environment carries our run tag (only processes this benchmark started)."""
    out = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(TAG_ENV) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def cleanup(report: Callable[[str], None] | None = None) -> list[int]:
    """SIGKILL (by PID) any process of this benchmark run still alive; returns their PIDs."""
    leftovers = tagged_processes()
    for proc in leftovers:
        ident = _identity(proc)
        if ident:
            sigkill(ident)
    if leftovers and report:
        report(f"cleanup: killed {len(leftovers)} leftover process(es): {[p.pid for p in leftovers]}")
    return [p.pid for p in leftovers]


# -- logs -----------------------------------------------------------------------------------------------
_EVENT = re.compile(r"BENCH (start|init|step|done) ?((?:\S+=\S+ ?)*)")
_STEP = re.compile(r"BENCH step=(\d+) ((?:\S+=\S+ ?)*)")


def parse_events(text: str) -> list[dict]:
    """Every ``BENCH`` line as a dict: ``kind`` plus its numeric fields (``t`` is a float)."""
    out = []
    for line in text.splitlines():
        m = _STEP.search(line)
        if m:
            fields = {"kind": "step", "step": int(m.group(1))}
            rest = m.group(2)
        else:
            m = _EVENT.search(line)
            if not m:
                continue
            fields = {"kind": m.group(1)}
            rest = m.group(2)
        for item in rest.split():
            key, _, value = item.partition("=")
            try:
                fields[key] = float(value) if key == "t" else int(value)
            except ValueError:
                fields[key] = value
        if isinstance(fields.get("t"), float):  # a line garbled by other output is skipped
            out.append(fields)
    return out


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    *,
    interval: float = 0.05,
    tick: Callable[[], None] | None = None,
) -> object:
    """Poll ``predicate`` until it is truthy (returned) or ``timeout`` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        if tick:
            tick()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)  # polling log files: there is no event to wait on


def first(events: Iterable[dict], **match: object) -> dict | None:
    for ev in events:
        if all(_matches(ev.get(k), v) for k, v in match.items()):
            return ev
    return None


def _matches(value: object, want: object) -> bool:
    if callable(want):
        return value is not None and bool(want(value))
    return value == want


# -- statistics and tables ----------------------------------------------------------------------------
@dataclass
class Stat:
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        if not self.values:
            return "n/a"
        med = f"{self.median:.{digits}f}{unit}"
        if len(self.values) == 1:
            return med
        return f"{med} ({min(self.values):.{digits}f}-{max(self.values):.{digits}f})"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def save_block_result(
    kind: str, size: int, saves: Sequence[float], copies: Sequence[float], first: float, prefault: float
) -> dict[str, object]:
    """The JSON of a flash-save measurement (bench/checkpoint.py, bench/ckpt_sharded.py): how long a save
    blocked training against a plain copy of the same ``size`` bytes (medians, ranges), and the first save
    (``first`` seconds, ``prefault`` of them allocating and pre-faulting its buffers)."""
    block, base = statistics.median(saves), statistics.median(copies)
    return {
        "kind": kind,
        "bytes": size,
        "save_block_s": block,
        "memcpy_s": base,
        "block_over_memcpy": block / base if base > 0 else None,
        "save_block_range_s": [min(saves), max(saves)],
        "memcpy_range_s": [min(copies), max(copies)],
        "repeats": len(saves),
        "first_save_s": first,
        "first_save_prefault_s": prefault,
    }


def before_after(medians: dict[str, float | None], baseline: str, what: str) -> list[str]:
    """The warm-start before/after line: elastic-run with exec'd workers (before) and with warm starts
    (after), each against ``baseline``, from the medians of one run; nothing if a tool did not run."""
    if not {"elastic-run", EXEC_TOOL, baseline} <= medians.keys():
        return []
    before, after, base = medians[EXEC_TOOL], medians["elastic-run"], medians[baseline]
    fmt = lambda v: "n/a" if v is None else f"{v:.2f} s"  # noqa: E731
    return [
        "",
        f"Before/after warm starts ({what}): {EXEC_TOOL} (`--no-warm-start`) {fmt(before)} = "
        f"{ratio(before, base)} {baseline}; elastic-run {fmt(after)} = {ratio(after, base)} {baseline} "
        f"({fmt(base)}).",
    ]


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    out = [line(headers), "| " + " | ".join("-" * w for w in widths) + " |"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def machine_note(*, measured: bool = True) -> str:
    """The machine, and for a measurement its load average now and the commit measured."""
    system = f"Python {sys.version.split()[0]}, " + _torch()
    if not measured:
        return MACHINE_NOTE.format(cores=os.cpu_count(), system=system, load="")
    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
    load = f"; load average {load} (1/5/15 min, this benchmark's own processes included) at the end"
    note = MACHINE_NOTE.format(cores=os.cpu_count(), system=system, load=load)
    return f"{note} Code: {_git()}."


def _git() -> str:
    """The commit measured, and whether the working tree had changes (the product under test)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "agent", "master", "elastic"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {head or '?'}" + (
        " plus uncommitted changes to agent/, master/ or elastic/" if dirty else ""
    )


def _torch() -> str:
    try:
        from importlib.metadata import version

        return f"torch {version('torch')}"
    except Exception:  # noqa: BLE001 - informational only
        return "torch ?"


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(REPO)
    return "python " + " ".join(shlex.quote(a) for a in [str(script), *sys.argv[1:]])


def emit_report(args: argparse.Namespace, title: str, body: str) -> None:
    """Print the report and, with ``--markdown-out``, write it for ``run_all``."""
    when = time.strftime("%Y-%m-%d %H:%M")
    text = f"{body}\n\nMeasured: {when}, command: `{command_line()}`  \n{machine_note()}\n"
    print(f"\n## {title}\n\n{text}", flush=True)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text)


def add_json_option(p: argparse.ArgumentParser) -> None:
    """``--json FILE``: the runs as JSON too, for bench/figures.py."""
    p.add_argument(
        "--json", default=None, metavar="FILE", help="also write every run as JSON (bench/figures.py)"
    )


def write_json(
    args: argparse.Namespace,
    benchmark: str,
    runs: Sequence[object],
    tools: dict[str, dict[str, object]] | None = None,
) -> None:
    """With ``--json FILE``: ``{"benchmark": NAME, "command": ..., "runs": [one dict per run (its dataclass
    fields)]}``, plus ``"tools"`` (per-tool figures, :func:`tool_summary`) when given."""
    if getattr(args, "json", None):
        data: dict[str, object] = {
            "benchmark": benchmark,
            "command": command_line(),
            "runs": [asdict(r) for r in runs],
        }
        if tools is not None:
            data["tools"] = tools
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")


def nearest_rank(values: Sequence[float], pct: float) -> float | None:
    """The ``pct`` percentile of ``values`` by nearest rank (a value that occurred); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


def tool_summary(
    tools: Sequence[Tool], results: Sequence[object], seconds: str
) -> dict[str, dict[str, object]]:
    """Per tool: ``{"runs", "recovered", "median_s", "p99_s", "survivor_pids_unchanged"}``, the seconds
    being the ``seconds`` attribute of the recovered runs (``tool``, ``recovered`` and
    ``survivor_pid_unchanged`` are the other attributes read)."""
    out: dict[str, dict[str, object]] = {}
    for tool in tools:
        mine = [r for r in results if r.tool == tool.name]
        values = [getattr(r, seconds) for r in mine if r.recovered and getattr(r, seconds) is not None]
        out[tool.name] = {
            "runs": len(mine),
            "recovered": sum(1 for r in mine if r.recovered),
            "median_s": statistics.median(values) if values else None,
            "p99_s": nearest_rank(values, 99),
            "survivor_pids_unchanged": sum(1 for r in mine if r.survivor_pid_unchanged),
        }
    return out


def pids_unchanged(results: Sequence[object]) -> str:
    """``K/N``: of one tool's ``N`` runs, ``K`` whose survivor kept its process across the kill."""
    return f"{sum(1 for r in results if r.survivor_pid_unchanged)}/{len(results)}"


def step_timeline(events: Iterable[dict], rank: int, since: float) -> list[list[float]]:
    """``[[seconds since ``since``, step], ...]``: every step line of ``rank``, for the goodput timeline."""
    return [
        [round(e["t"] - since, 4), e["step"]] for e in events if e["kind"] == "step" and e["rank"] == rank
    ]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def finish(code: int = 0) -> int:
    left = cleanup(log)
    if left:
        log(f"WARNING: {len(left)} process(es) outlived their run and were killed at the end")
    return code


# -- multi-node jobs on one machine -------------------------------------------------------------------------
def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class Cluster:
    """Fake nodes of one job on this machine, for either tool, with torchrun's c10d flags for both.

    elastic-run: an ``elastic-master`` daemon on 127.0.0.1:PORT (started by :meth:`start`), then one agent
    per node with a distinct ``--node-id``. torchrun: the first node started with ``is_host=1`` hosts the
    c10d store on PORT (so it must be the node that survives), the others use ``is_host=0``.
    """

    def __init__(
        self,
        tool: Tool,
        group: Group,
        nnodes: str,
        worker_args: Sequence[str],
        *,
        nproc: int = 1,
        max_restarts: int = 3,
        rdzv_conf: str = "",
        master_args: Sequence[str] = (),
        master_cmd: str | None = None,
    ) -> None:
        self.tool, self.group, self.nnodes = tool, group, nnodes
        self.worker_args = [str(a) for a in worker_args]
        self.nproc, self.max_restarts, self.rdzv_conf = nproc, max_restarts, rdzv_conf
        self.master_args = [str(a) for a in master_args]
        self.master_cmd = master_cmd
        self.port = free_port()
        self.job = f"bench-{uuid.uuid4().hex[:6]}"
        self.token_file = group.folder / "token"
        self.master: Launched | None = None
        self.nodes: dict[str, Launched] = {}

    @property
    def elastic(self) -> bool:
        return self.tool.elastic

    def start(self, timeout: float = 60.0) -> bool:
        """elastic-run: start the master daemon and wait until it listens. torchrun: nothing to do."""
        if not self.elastic:
            return True
        argv = master_argv(self.master_cmd) + [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--job-id",
            self.job,
            "--nnodes",
            self.nnodes,
            "--token-file",
            str(self.token_file),
            "--max-restarts",
            str(self.max_restarts),
            *self.master_args,
        ]
        self.master = self.group.launch(argv, "master", env=bench_env())
        return bool(wait_until(lambda: port_open(self.port) or not self.master.alive(), timeout)) and (
            self.master.alive()
        )

    def node_argv(self, name: str, host_store: bool) -> list[str]:
        common = [
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-backend=c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv-id",
            self.job,
            "--max-restarts",
            str(self.max_restarts),
        ]
        if self.elastic:
            extra = ["--token-file", str(self.token_file), "--node-id", name]
        else:
            conf = f"is_host={1 if host_store else 0}" + (f",{self.rdzv_conf}" if self.rdzv_conf else "")
            extra = ["--rdzv-conf", conf]
        return self.tool.cmd(*common, *extra, str(WORKLOAD), *self.worker_args)

    def start_node(self, name: str, *, host_store: bool = False, wait_store: float = 60.0) -> Launched:
        """Start one node; for torchrun's store host, wait until its store accepts connections."""
        proc = self.group.launch(self.node_argv(name, host_store), name, env=self.tool.environ())
        self.nodes[name] = proc
        if host_store and not self.elastic:
            wait_until(lambda: port_open(self.port) or not proc.alive(), wait_store)
        return proc
