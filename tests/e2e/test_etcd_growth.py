"""A short bench/etcd_growth.py: a real etcd, a real master, 20 and 200 fake nodes,
five membership changes each. etcd's state stays bounded: every value small, the database small, steady
heartbeats write nothing; and a change at 200 nodes should write at most 1.5 times what it writes at 20."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_runs import run_bench

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def growth(folder: Path) -> tuple[dict, dict]:
    """The bench's figures at 20 and at 200 nodes."""
    out = folder / "growth.json"
    argv = ["bench/etcd_growth.py", "--nodes", "20,200", "--changes", "5", "--steady-s", "5"]
    proc, left = run_bench([*argv, "--json", str(out), "--workdir", str(folder / "work")], timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not left, f"processes left behind by bench/etcd_growth.py: {left}"
    small, large = json.loads(Path(out).read_text())
    return small, large


# One test for both checks: the bench run is long, and the suite's workers share tests one by one (a
# module-scoped fixture would run the bench once in each worker that gets one of two tests).
@pytest.mark.timeout(600)
def test_etcd_state_stays_bounded_steady_heartbeats_write_nothing_and_200_nodes_write_as_20(
    tmp_path: Path,
) -> None:
    small, large = growth(tmp_path)
    for r in (small, large):
        assert r["ok"], r
        assert r["steady_revisions"] == 0, r
        assert r["largest_value"] < 64 * 1024, r
        assert r["db_size"] < 64 * 2**20, r
    # A membership change writes about as much at 200 nodes as at 20.
    ratio = large["median_bytes_per_change"] / small["median_bytes_per_change"]
    assert ratio <= 1.5, (ratio, small, large)
