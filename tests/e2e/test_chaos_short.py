"""The chaos harness's short form: bench/chaos.py injects one fault of each cheap kind, in a
seeded order, every 10 s against 3 fake nodes with two etcd-backed masters, and its final check passes:
the job exits 0, every sample of each finished epoch is consumed exactly once in the surviving lineage,
the final weights equal a fault-free run's bitwise, and nothing is left behind. Goodput is
printed, not asserted, and so are the issue's targets (0 steps lost, 0 unrecovered): the longer runs in
docs/benchmarks.md measure them. A seed's schedule is checked to replay exactly (no job needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_runs import run_bench

from bench.chaos_schedule import CHEAP_KINDS, ROOT_KINDS, as_json, schedule
from master.job.accounting import BADPUT_BUCKETS

SEED = 7
INTERVAL = 10
#: One injection per cheap kind: the first injections of any schedule are one of each.
DURATION = INTERVAL * len(CHEAP_KINDS)


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["restart", "inprocess"])
def test_chaos_short_run_passes_its_final_check(tmp_path: Path, mode: str) -> None:
    data = tmp_path / "chaos.json"
    argv = [
        "bench/chaos.py", "--mode", mode, "--seed", str(SEED), "--interval", str(INTERVAL),
        "--duration", str(DURATION), "--kinds", ",".join(CHEAP_KINDS),
        "--workdir", str(tmp_path / "work"), "--json", str(data),
    ]  # fmt: skip
    proc, left = run_bench(argv, timeout=560)
    print(proc.stdout[-2500:])  # the schedule first, the goodput and badput figures last
    result = json.loads(data.read_text())
    why = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["faults_by_kind"] == dict.fromkeys(sorted(CHEAP_KINDS), 1), why
    assert result["exit_ok"] and result["samples_exactly_once"] and result["weights_equal"], why
    assert result["leaked"] == 0, why
    assert list(result["master_badput_s"]) == list(BADPUT_BUCKETS), "the master's buckets on /metrics"
    assert proc.returncode == 0, why
    assert not left, f"processes left behind by bench/chaos.py: {left}"


@pytest.mark.parametrize("seed", [0, 7, 3988090833])
def test_a_seed_replays_the_same_schedule_whose_first_injections_cover_every_kind(seed: int) -> None:
    kinds = (*CHEAP_KINDS, *ROOT_KINDS)
    first, again = schedule(seed, 1800, 15, kinds), schedule(seed, 1800, 15, kinds)
    assert as_json(first) == as_json(again)  # the same faults at the same times, parameters included
    assert len(first) == 120 and [i.at for i in first[:2]] == [15, 30]
    assert sorted(f.kind for i in first[: len(kinds)] for f in i.faults) == sorted(kinds)
    assert any(len(i.faults) == 2 for i in first)  # one injection in ten is a pair
    assert schedule(seed + 1, 1800, 15, kinds) != first
