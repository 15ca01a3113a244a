"""Run every benchmark with its defaults and write the tables into ``docs/benchmarks.md``.

Each benchmark owns one section of the file, delimited by ``<!-- bench:NAME:begin -->`` and
``<!-- bench:NAME:end -->`` under its own heading; only those parts are replaced, so other sections of the
file (for example the checkpoint figures another benchmark writes) are kept as they are. A missing
section is appended at the end.

    python bench/run_all.py                         # everything, defaults (about an hour on 2 cores)
    python bench/run_all.py --only recovery,launch  # a subset; the other sections stay as they were
    python bench/run_all.py --smoke --no-write      # tiny sizes, print only
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402

DOC = c.REPO / "docs" / "benchmarks.md"
TITLE = "# Benchmarks: elastic-run vs torchrun"

#: (section key, heading, script) in the order they run and appear.
BENCHES = [
    ("recovery", "Worker-crash recovery", "recovery.py"),
    ("inprocess_exact", "In-process recovery: exact", "inprocess_exact.py"),
    ("integrity", "Integrity: detection and rollback", "integrity.py"),
    ("node_loss", "Node loss", "node_loss.py"),
    ("scale_up", "Scale-up admission", "scale_up.py"),
    ("rendezvous", "Rendezvous latency", "rendezvous.py"),
    ("launch", "Launch overhead", "launch.py"),
    ("fuzz_api", "API fuzzing", "fuzz_api.py"),
    ("failover", "Master failover", "failover.py"),
]

ABOUT = """Every figure compares `elastic-run` with `python -m torch.distributed.run` (torchrun) on the same
machine and the same workload ([bench/workload.py](../bench/workload.py): a small DDP MLP on CPU/gloo,
plain `init_process_group("gloo")`, deterministic data, an atomic checkpoint to disk after every step), runs
of the tools alternated (A B A B), medians quoted with (min-max), and how many runs of each tool succeeded
at all. The crash, node-loss and scale-up benchmarks also run `elastic-run-exec`: elastic-run with
`--no-warm-start` (every worker exec'd, as before warm starts), the "before" of the before/after table below.
Scripts are in [bench/](../bench/); each prints its table and can be run alone, `--smoke` runs it
with tiny sizes (that mode is what `tests/e2e/test_bench_smoke.py` checks). All processes a benchmark starts
carry a `BENCH_RUN_TAG` in their environment and are killed by PID at the end of each run; nothing is
killed by name.

{note}

**Overview written:** {when}, by `{command}`. Each section says when it was measured and with which
command; a partial run (`--only`) replaces only its own sections.

Checkpoint figures are in the [Checkpoint](#checkpoint) section of this file, written
by the flash-checkpoint benchmark.

### Targets

{targets}"""


def begin(key: str) -> str:
    return f"<!-- bench:{key}:begin -->"


def end(key: str) -> str:
    return f"<!-- bench:{key}:end -->"


def update_section(text: str, key: str, heading: str, body: str, *, top: bool = False) -> str:
    """Replace the body of section ``key`` in ``text``, or add the section (at the end, or with ``top``
    right under the title); everything else is kept."""
    block = f"{begin(key)}\n{body.strip()}\n{end(key)}"
    pattern = re.compile(re.escape(begin(key)) + r".*?" + re.escape(end(key)), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    if not text.strip():
        text = TITLE + "\n"
    section = f"## {heading}\n\n{block}\n"
    if top and text.startswith("# "):
        title, _, rest = text.partition("\n")
        return f"{title}\n\n{section}\n{rest.lstrip(chr(10))}".rstrip("\n") + "\n"
    return text.rstrip("\n") + f"\n\n{section}"


def run_one(script: str, extra: list[str], timeout: float) -> tuple[str, float]:
    """Run one benchmark script; returns (markdown report or an error note, seconds)."""
    with tempfile.NamedTemporaryFile("r", suffix=".md") as out:
        argv = [sys.executable, str(c.REPO / "bench" / script), *extra, "--markdown-out", out.name]
        c.log("running " + " ".join(argv[1:]))
        started = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=c.REPO, timeout=timeout, start_new_session=True)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - started
        c.cleanup(c.log)
        text = Path(out.name).read_text()
    if code != 0 or not text.strip():
        why = "timed out" if code is None else f"exited with {code}"
        return f"_`bench/{script}` {why} after {took:.0f} s; no table this time._", took
    return text, took


def section_body(text: str, key: str) -> str:
    match = re.search(re.escape(begin(key)) + r"(.*?)" + re.escape(end(key)), text, re.S)
    return match.group(1) if match else ""


def target_lines(text: str) -> str:
    """The ratio and target lines of every benchmark section now in the file (whenever it was measured)."""
    lines = []
    for key, heading, _ in BENCHES:
        body = section_body(text, key)
        stamp = re.search(r"Measured: ([0-9-]+ [0-9:]+)", body)
        when = f" (measured {stamp.group(1)})" if stamp else ""
        for line in body.splitlines():
            if re.search(r"target|ratio", line, re.I) and not line.lstrip().startswith("|"):
                lines.append(f"- {heading}{when}: {line.strip()}")
    return "\n".join(lines) or "_no target lines yet_"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--only", default="", help="comma-separated subset of: " + ", ".join(k for k, _, _ in BENCHES)
    )
    p.add_argument("--smoke", action="store_true", help="pass --smoke to every benchmark")
    p.add_argument("--runs", type=int, default=None, help="override every benchmark's --runs")
    p.add_argument("--doc", default=str(DOC), help="markdown file to update (default %(default)s)")
    p.add_argument("--no-write", action="store_true", help="print only; leave the markdown file alone")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per benchmark script")
    p.add_argument("--workdir", default=None, help="keep each benchmark's logs under this folder")
    p.add_argument(
        "--index-only",
        action="store_true",
        help="run nothing; rebuild the overview from the sections in the file",
    )
    args = p.parse_args(argv)
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    unknown = only - {k for k, _, _ in BENCHES}
    if unknown:
        raise SystemExit(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    extra = (["--smoke"] if args.smoke else []) + (["--runs", str(args.runs)] if args.runs else [])
    reports: dict[str, str] = {}
    for key, heading, script in BENCHES:
        if (only and key not in only) or args.index_only:
            continue
        keep = ["--workdir", str(Path(args.workdir).resolve() / key)] if args.workdir else []
        report, took = run_one(script, extra + keep, args.timeout)
        reports[key] = report
        c.log(f"{heading}: {took:.0f} s")
    if args.no_write:
        return c.finish(0)
    doc = Path(args.doc)
    text = doc.read_text() if doc.exists() else ""
    for key, heading, _ in BENCHES:
        if key in reports:
            text = update_section(text, key, heading, reports[key])
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    about = ABOUT.format(
        note=c.machine_note(measured=False),
        when=when,
        command=c.command_line(),
        targets=target_lines(text),
    )
    text = update_section(text, "about", "About these numbers", about, top=True)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    c.log(f"wrote {doc}")
    return c.finish(0)


if __name__ == "__main__":
    sys.exit(main())
