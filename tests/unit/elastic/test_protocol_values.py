"""The wire protocol's closed sets of values (elastic.control.protocol): each enum keeps the wire values
agents and masters of earlier releases send and expect, shows its value in logs, and a field of the previous
revision that is no longer read (``WorkerProgress.status``) is accepted and dropped."""

from __future__ import annotations

from enum import Enum

import pytest

from elastic.control.job_settings import NODE_CHECK_MODES
from elastic.control.protocol import (
    Command,
    FailureKind,
    JobInfo,
    JobPhase,
    NodeCheckResult,
    NodeCheckStage,
    NodeState,
    NodeView,
    RoundReply,
    RoundStatus,
    WorkerFailure,
    WorkerProgress,
)

#: Every enum of the protocol and its wire values, as released: a value here never changes or goes.
WIRE_VALUES: dict[type[Enum], list[str]] = {
    NodeState: ["waiting", "starting", "running", "succeeded", "failed"],
    Command: ["continue", "rejoin", "stop", "exclude"],
    FailureKind: ["crash", "hang"],
    NodeCheckStage: ["", "setup", "init", "pairing", "matmul", "allreduce", "crash", "hang", "timeout"],
    RoundStatus: ["assigned", "waiting", "finished"],
    NodeView: ["waiting", "starting", "running", "succeeded", "failed", "excluded"],
    JobPhase: ["rendezvous", "training", "succeeded", "failed"],
}


@pytest.mark.parametrize("enum", list(WIRE_VALUES), ids=lambda e: e.__name__)
def test_each_enum_keeps_its_wire_values_and_prints_them(enum: type[Enum]) -> None:
    assert [m.value for m in enum] == WIRE_VALUES[enum]
    for member in enum:
        assert str(member) == f"{member}" == member.value == member, "logs and tables show the wire value"


def test_replies_serialise_the_values_as_plain_strings() -> None:
    reply = RoundReply(status="finished", round=3)
    assert reply.status is RoundStatus.FINISHED
    assert reply.model_dump_json(include={"status", "assignment", "outcome", "round"}) == (
        '{"status":"finished","assignment":null,"outcome":null,"round":3}'
    )
    failure = WorkerFailure.model_validate_json('{"rank": 1, "local_rank": 0, "kind": "hang"}')
    assert failure.kind is FailureKind.HANG and '"kind":"hang"' in failure.model_dump_json()
    assert NodeCheckResult(ok=True).model_dump(mode="json")["stage"] == ""
    assert JobInfo.model_fields["node_check"].default == "off" and NODE_CHECK_MODES == ("off", "on", "warn")


def test_an_unknown_value_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        WorkerFailure.model_validate({"rank": 0, "local_rank": 0, "kind": "melted"})


def test_worker_progress_accepts_and_drops_the_status_of_the_previous_revision() -> None:
    progress = WorkerProgress.model_validate({"local_rank": 0, "status": "running", "step": 4})
    assert progress == WorkerProgress(local_rank=0, step=4)
    assert "status" not in WorkerProgress.model_fields and "status" not in progress.model_dump_json()
    with pytest.raises(ValueError, match="colour"):
        WorkerProgress.model_validate({"local_rank": 0, "colour": "red"})  # other unknown fields: refused
