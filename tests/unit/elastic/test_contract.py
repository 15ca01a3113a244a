"""The typed messages of the worker<->agent and agent<->zygote contracts keep their wire forms."""

from __future__ import annotations

import json

import pytest

from agent.warm import zygote_ops as ops
from elastic.contract import IntegrityNote, MalformedDatagram, Progress, ProgressKind


def test_a_progress_report_round_trips_in_the_one_letter_wire_form() -> None:
    report = Progress(0, ProgressKind.CKPT, 7, sent_at=1.5, location="/dev/shm/x", save_s=0.25, round=3)
    wire = json.loads(report.encode())
    assert wire == {"k": "ckpt", "step": 7, "loc": "/dev/shm/x", "sv": 0.25, "rd": 3, "r": 0, "t": 1.5}
    assert Progress.decode(report.encode()) == report


def test_a_datagram_of_an_older_worker_decodes() -> None:
    report = Progress.decode(b'{"r": 1, "k": "step", "step": 4, "b": 0.5}')
    assert (report.local_rank, report.kind, report.step, report.compute_s) == (1, ProgressKind.STEP, 4, 0.5)
    assert report.round is None and report.sent_at is None


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"k": "step", "step": 1}',
        b'{"r": 0, "k": "bogus", "step": 1}',
        b'{"r": 0, "k": "ckpt", "step": 1, "sv": "soon"}',
    ],
)
def test_anything_else_is_malformed(data: bytes) -> None:
    with pytest.raises(MalformedDatagram):
        Progress.decode(data)


def test_a_save_time_that_is_no_duration_is_dropped_but_the_report_stays() -> None:
    report = Progress.decode(b'{"r": 0, "k": "ckpt", "step": 1, "sv": -1}')
    assert report.kind is ProgressKind.CKPT and report.save_s is None


def test_zygote_messages_round_trip_and_name_their_operation() -> None:
    request = ops.SpawnRequest(
        id=3,
        argv=["py", "x.py"],
        mode="script",
        target="x.py",
        args=[],
        env={"A": "1"},
        cwd="/",
        umask=18,
        unbuffered=True,
    )
    assert json.loads(ops.encode(request))["op"] == "spawn"
    assert ops.decode(ops.encode(request)) == request
    assert ops.decode(ops.encode(ops.WorkerExited(pid=5, returncode=-9))) == ops.WorkerExited(5, -9)


def test_a_malformed_spawn_request_keeps_its_id_for_the_answer() -> None:
    with pytest.raises(ops.MalformedMessage) as caught:
        ops.decode(b'{"op": "spawn", "id": 9, "argv": []}')
    assert caught.value.request_id == 9
    with pytest.raises(ops.MalformedMessage) as caught:
        ops.decode(b'{"op": "launch", "id": 2}')
    assert caught.value.request_id == 2


def test_an_integrity_note_round_trips_in_a_datagram_and_garbage_is_malformed() -> None:
    note = IntegrityNote("mismatch", (4,), 6, named_here=True, samples=tuple(range(2000)), odd=True)
    report = Progress(0, ProgressKind.INTEGRITY, 12, detail=note.to_detail(), rolled_back_to=11)
    back = Progress.decode(report.encode())
    assert back.rolled_back_to == 11
    parsed = IntegrityNote.from_detail(back.detail)
    assert parsed.ranks == (4,) and parsed.world_size == 6 and parsed.named_here and parsed.odd
    assert not parsed.recurring
    assert parsed.samples == tuple(range(256)), "at most MAX_NOTE_SAMPLES sample indices travel"
    with pytest.raises(MalformedDatagram):
        IntegrityNote.from_detail("spike ranks=-")  # not JSON: dropped by the agent
