"""The agent stream against hostile frames after a valid upgrade (docs/protocol.md, "The agent stream";
docs/security.md, "Slow and hostile clients"): a short run of the wire fuzzer (bench/fuzz_wire.py) against
a real ``elastic-master`` process. Malformed, cut, deep (20,000 levels), non-finite, oversized, mistyped and
unknown-operation frames, frames in pieces and several per write, connections cut mid-frame, and calls the
job refuses: every line gets its documented reply, a frame over the limit closes its stream, no 5xx, no
traceback in the master's output, the node heartbeating on its own stream is answered 200 between every two
cases, and ``GET /v1/status`` never changes. The named cases of the issue are in
tests/integration/test_agent_stream.py (a NaN heartbeat, a 20,000-deep frame)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import common as c
from bench.fuzz_wire import STREAM_KINDS, WireConfig, run_wire_fuzz

CASES = 400


@pytest.mark.timeout(240)
def test_fuzzing_the_agent_stream_finds_no_5xx_no_traceback_and_no_change(tmp_path: Path) -> None:
    tally = run_wire_fuzz(WireConfig(cases=CASES, seed=5, surfaces=("stream",)), tmp_path)
    assert (tally.server_errors, dict(tally.failures)) == (0, {}), "\n".join(tally.examples)
    assert set(tally.cases) == set(STREAM_KINDS), tally.cases  # every kind of frame was sent
    assert tally.sentinel_beats >= CASES and tally.state_checks >= CASES // 50
    assert tally.closed_streams == tally.cases["oversize"] > 0  # each frame over the limit closed its stream
    assert not c.tagged_processes(), "the fuzz left a master running"
