"""The in-process end-to-end tests' shared parts: the example script under ``elastic.run``
(scripts/train_inprocess.py) and its arguments, its ``world`` lines, and the check that every sample was
trained exactly once."""

from __future__ import annotations

import re
from pathlib import Path

from e2e import REPO

SCRIPT = REPO / "scripts" / "train_inprocess.py"
WORLD_LINE = re.compile(
    r"^\[rank\d+\]:world rank=(\d+) world=(\d+) round=(\d+) restart=(\d+) step=(\d+) pid=(\d+) state=(\w+)$",
    re.M,
)


def worlds(output: str) -> list[dict[str, int | str]]:
    """Every ``world`` line: one per rank each time its group formed."""
    keys = ("rank", "world", "round", "restart", "step", "pid")
    return [
        {**dict(zip(keys, map(int, m[:6]), strict=True)), "state": m[6]} for m in WORLD_LINE.findall(output)
    ]


def script(tmp_path: Path, steps: int, step_time: float, *extra: str) -> list[str]:
    return [
        str(SCRIPT),
        "--steps",
        str(steps),
        "--step-time",
        str(step_time),
        "--batch-size",
        "64",
        "--num-samples",
        "1024",
        "--sample-log",
        str(tmp_path / "samples"),
        *extra,
    ]


def check_samples_once(folder: Path, steps: int, world: int) -> None:
    """Each step 1..steps was trained once per rank slot (the newest round that logged it counts), and
    no sample index appears twice in one epoch."""
    latest: dict[tuple[int, int], tuple[int, int, list[str]]] = {}  # (step, rank) -> (round, epoch, rows)
    for path in folder.glob("round*-rank*-pid*.log"):
        round_number, rank = map(int, re.match(r"round(\d+)-rank(\d+)-", path.name).groups())
        for line in path.read_text().splitlines():
            step, epoch, *rows = line.split()
            key = (int(step), rank)
            if key not in latest or latest[key][0] < round_number:
                latest[key] = (round_number, int(epoch), rows)
    assert sorted({s for s, _ in latest}) == list(range(1, steps + 1)), "a step is missing"
    by_epoch: dict[int, list[str]] = {}
    for (_, rank), (_, epoch, rows) in latest.items():
        if rank < world:
            by_epoch.setdefault(epoch, []).extend(rows)
    for epoch, rows in by_epoch.items():
        assert len(rows) == len(set(rows)), f"epoch {epoch}: a sample was trained twice"
