"""The worker-side step report (elastic.report): the compute time is the step time minus the collective
wait, and the stack dump is armed only when the agent names a file."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from elastic.contract import Progress

pytestmark = pytest.mark.timeout(30)

# ``elastic.report`` is the function (``elastic`` re-exports it); the module is looked up by name.
report_module = importlib.import_module("elastic.report")


def test_a_step_report_carries_the_step_time_minus_the_collective_wait(monkeypatch):
    sent: list[Progress] = []
    monkeypatch.setattr(report_module, "_send", sent.append)
    monkeypatch.setattr(report_module, "_last", None)
    monkeypatch.setattr(report_module, "_tracking", False)
    clock = iter([100.0, 101.0, 103.0])
    monkeypatch.setattr(report_module.time, "monotonic", lambda: next(clock))

    report_module.report(1)
    report_module.add_comm_wait(0.25)  # what elastic.track_ddp's hook adds during step 2
    report_module.report(2)
    report_module.add_comm_wait(0.5)
    report_module.report(4)  # two steps at once: per step

    assert sent[0].compute_s is None
    assert sent[1].compute_s == pytest.approx(0.75)
    assert sent[2].compute_s == pytest.approx(0.75)


def test_the_first_report_arms_a_stack_dump_only_when_the_agent_names_a_file(monkeypatch, tmp_path: Path):
    path = tmp_path / "round1" / "rank0" / "stack.txt"
    monkeypatch.setenv(report_module.STACK_FILE_ENV, str(path))
    registered = []
    monkeypatch.setattr(report_module.faulthandler, "register", lambda *a, **k: registered.append(k))
    monkeypatch.setattr(report_module, "_armed", False)
    report_module._arm_stack_dump()
    assert path.exists() and registered and registered[0]["all_threads"] is True
    report_module._stack_file.close()


def test_a_worker_that_lives_on_dumps_its_stack_to_the_new_rounds_file(tmp_path, monkeypatch) -> None:
    import faulthandler
    import importlib
    import os
    import signal

    rep = importlib.import_module("elastic.report")  # ``elastic.report`` is the function

    first, second = tmp_path / "round1" / "stack", tmp_path / "round2" / "stack"
    monkeypatch.setattr(rep, "_stack_file", None)
    monkeypatch.setenv(rep.STACK_FILE_ENV, str(first))
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    rep._arm_stack_dump()
    try:
        monkeypatch.setenv(rep.STACK_FILE_ENV, str(second))
        rep.rearm_stack_dump()
        os.kill(os.getpid(), rep.STACK_SIGNAL)
        assert "test_a_worker_that_lives_on" in second.read_text()
        assert first.read_text() == ""
    finally:
        faulthandler.unregister(rep.STACK_SIGNAL)
        if rep._stack_file is not None:
            rep._stack_file.close()
