"""The drain check before a join (agent.executor.slurm_state): sinfo's output as SLURM 22.05 prints it
(tests/data/slurm_sinfo_22.05.json, recorded on the test cluster by tests/data/slurm_make_sinfo.py), the
states that refuse a node, the cache and failing open. A fake clock and a recording runner: no process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent.executor.slurm_state import (
    DEFAULT_TTL_S,
    SlurmNodeState,
    SlurmUnavailableError,
    parse_sinfo,
    refusal,
    sinfo_argv,
    state_words,
)

RECORDED = json.loads((Path(__file__).parents[2] / "data" / "slurm_sinfo_22.05.json").read_text())


def test_recorded_outputs_parse_to_every_node_and_its_state() -> None:
    assert parse_sinfo(RECORDED["idle"]) == {"n1": "idle", "n2": "idle"}
    assert parse_sinfo(RECORDED["n1_draining_n2_drained"]) == {"n1": "draining", "n2": "drained"}
    assert parse_sinfo(RECORDED["n2_not_responding"]) == {"n1": "idle", "n2": "down*"}


@pytest.mark.parametrize(
    ("scenario", "node", "refused"),
    [
        ("idle", "n1", False),
        ("n1_allocated", "n1", False),  # training there: usable
        ("n2_drained", "n2", True),
        ("n1_draining_n2_drained", "n1", True),  # drain ordered while the job runs there
        ("n1_draining_n2_down", "n2", True),
        ("n1_failing", "n1", True),
        ("n1_failing", "n2", False),  # idle*: not responding for a moment after a resume, not drained
        ("n2_not_responding", "n2", True),  # a slurmd that stopped answering: down*
    ],
)
def test_drained_down_and_failed_nodes_are_refused(scenario: str, node: str, refused: bool) -> None:
    reason = refusal(parse_sinfo(RECORDED[scenario]), node)
    assert (reason is not None) is refused
    if refused:
        state = parse_sinfo(RECORDED[scenario])[node]
        assert reason == f"SLURM reports node {node} {state} (sinfo)"


def test_compound_states_of_newer_releases_and_flags_are_read_word_by_word() -> None:
    assert state_words("MIXED+DRAIN") == {"mixed", "drain"}
    assert state_words("idle~") == {"idle"}
    assert refusal({"g7": "mixed+drain"}, "g7") is not None
    assert refusal({"g7": "idle+planned"}, "g7") is None
    assert refusal({"g7": "drained"}, "g8") is None  # a node sinfo does not list: the caller decides


def test_malformed_and_repeated_lines_are_skipped() -> None:
    text = "\n  \nn1 idle\nn1 idle\ngarbage\nn2 draining extra\nn3 down\n"
    assert parse_sinfo(text) == {"n1": "idle", "n3": "down"}


class Sinfo:
    """A runner that answers with ``outputs`` in turn (a str: stdout; an exception: raised) and records
    every call."""

    def __init__(self, *outputs: str | Exception) -> None:
        self.outputs = list(outputs)
        self.calls: list[tuple[list[str], float]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> str:
        self.calls.append((list(argv), timeout_s))
        out = self.outputs.pop(0)
        if isinstance(out, Exception):
            raise out
        return out


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_drain_is_seen_once_the_cache_expires_and_not_before() -> None:
    runner, clock = Sinfo(RECORDED["idle"], RECORDED["n2_drained"]), Clock()
    state = SlurmNodeState("n2", run=runner, clock=clock)
    assert state.check().refused is None
    clock.now += DEFAULT_TTL_S / 2
    assert state.check().refused is None  # cached: sinfo ran once
    assert len(runner.calls) == 1
    clock.now += DEFAULT_TTL_S
    verdict = state.check()
    assert verdict.refused == "SLURM reports node n2 drained (sinfo)"
    assert verdict.warning is None
    assert [argv for argv, _ in runner.calls] == [sinfo_argv("n2")] * 2
    assert sinfo_argv("n2") == ["sinfo", "-h", "-N", "-n", "n2", "-o", "%N %T"]


def test_without_an_answer_the_check_fails_open_with_the_reason() -> None:
    runner, clock = Sinfo(SlurmUnavailableError("sinfo is not installed"), ""), Clock()
    state = SlurmNodeState("n1", run=runner, clock=clock)
    verdict = state.check()
    assert verdict.refused is None
    assert verdict.warning == "cannot read SLURM's state of node n1: sinfo is not installed"
    clock.now += DEFAULT_TTL_S
    verdict = state.check()  # sinfo answers, but does not list this node
    assert verdict.refused is None
    assert verdict.warning == "sinfo does not list node n1 (SLURMD_NODENAME)"
