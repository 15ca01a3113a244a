"""Figures of the benchmarks, as SVG (matplotlib, the ``bench`` extra): what people would rather look at
than read.

* ``recovery-times.svg``: the distribution of kill -> first step per tool, one panel per benchmark
  (bench/recovery.py: a worker's crash; bench/node_loss.py: a whole node's loss); each run a dot, the
  median a bar; runs that did not recover are counted in the tool's label.
* ``goodput-timeline.svg``: goodput over a recovery run's time (bench/recovery.py): the share of the
  wall time so far that went into steps that count (each step number once: a step redone after the
  restart counts once; the time per step is the run's median step interval), with the kill marked.

It reads the benchmarks' ``--json FILE`` output::

    python bench/recovery.py --json recovery.json
    python bench/node_loss.py --json node_loss.json
    python bench/figures.py --out docs/figures recovery.json node_loss.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

TITLES = {"recovery": "worker crash (bench/recovery.py)", "node_loss": "node loss (bench/node_loss.py)"}


def load(paths: list[Path]) -> list[dict]:
    """The benchmarks' JSON documents (``{"benchmark": name, "runs": [...]}``)."""
    documents = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or "benchmark" not in data or "runs" not in data:
            raise ValueError(f"{path}: not the --json output of bench/recovery.py or bench/node_loss.py")
        documents.append(data)
    return documents


def recovery_times(document: dict) -> dict[str, tuple[list[float], int]]:
    """Tool -> (kill -> first step of each recovered run, count of runs that did not recover)."""
    out: dict[str, tuple[list[float], int]] = {}
    for run in document["runs"]:
        times, failed = out.setdefault(run["tool"], ([], 0))
        if run.get("recovered") and run.get("to_step") is not None:
            times.append(float(run["to_step"]))
        else:
            out[run["tool"]] = (times, failed + 1)
    return out


def goodput_timeline(timeline: list[list[float]]) -> list[tuple[float, float]]:
    """``[(t, goodput at t), ...]`` at every step line of a ``[[t, step], ...]`` timeline (t from the
    launch): steps that count so far (each step number once) times the median step interval, over t."""
    intervals = [
        b[0] - a[0] for a, b in zip(timeline, timeline[1:], strict=False) if b[1] == a[1] + 1 and b[0] > a[0]
    ]
    if not intervals:
        return []
    per_step = statistics.median(intervals)
    seen: set[int] = set()
    points = []
    for t, step in timeline:
        seen.add(int(step))
        if t > 0:
            points.append((t, min(len(seen) * per_step / t, 1.0)))
    return points


def _pyplot():
    import matplotlib

    matplotlib.use("svg")  # no display; and the same output on every machine
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = (
        "elastic-run"  # stable ids: a figure redrawn from the same data is the same
    )
    return plt


def draw_recovery_times(documents: list[dict], out: Path) -> Path:
    """One panel per benchmark document: a dot per run and a bar at the median, per tool."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(documents), figsize=(5.0 * len(documents), 3.6), squeeze=False)
    for ax, document in zip(axes[0], documents, strict=True):
        times = recovery_times(document)
        for x, (values, _) in enumerate(times.values()):
            ax.scatter([x] * len(values), values, s=18, alpha=0.7)
            if values:
                median = statistics.median(values)
                ax.hlines(median, x - 0.3, x + 0.3, colors="black")
                ax.annotate(f"{median:.2f} s", (x + 0.32, median), va="center", fontsize=8)
        labels = [
            tool + (f"\n({failed} not recovered)" if failed else "") for tool, (_, failed) in times.items()
        ]
        ax.set_xticks(range(len(times)), labels, fontsize=8)
        ax.set_xlim(-0.6, len(times) - 0.2)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("kill -> first step (s)")
        ax.set_title(TITLES.get(document["benchmark"], document["benchmark"]), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "recovery-times.svg"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def draw_goodput_timeline(document: dict, out: Path, tool: str = "elastic-run") -> Path | None:
    """The goodput over time of ``tool``'s first recovered run in ``document`` (None when it has none)."""
    run = next(
        (r for r in document["runs"] if r["tool"] == tool and r.get("recovered") and r.get("timeline")), None
    )
    points = goodput_timeline(run["timeline"]) if run else []
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    ax.plot([t for t, _ in points], [g for _, g in points], drawstyle="steps-post", label=tool)
    if run.get("kill_at") is not None:
        ax.axvline(run["kill_at"], color="red", linestyle="--", linewidth=1, label="worker killed")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("goodput (useful step time / wall time)")
    ax.set_title(
        f"goodput of one {TITLES.get(document['benchmark'], document['benchmark'])} run", fontsize=10
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "goodput-timeline.svg"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "json", nargs="+", type=Path, help="--json output of bench/recovery.py, bench/node_loss.py"
    )
    p.add_argument("--out", type=Path, default=Path("docs/figures"), help="folder (default %(default)s)")
    args = p.parse_args(argv)
    try:
        documents = load(args.json)
    except (OSError, ValueError) as exc:
        print(f"figures: error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    written = [draw_recovery_times(documents, args.out)]
    recovery = next((d for d in documents if d["benchmark"] == "recovery"), None)
    if recovery is not None:
        written.append(draw_goodput_timeline(recovery, args.out))
    for path in filter(None, written):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
