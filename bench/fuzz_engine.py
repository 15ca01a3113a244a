"""Stateful, schema-driven fuzzing of a real ``elastic-master`` process over a real socket.

Every request comes from the master's own OpenAPI document (``/openapi.json``): schemathesis turns each
operation into a hypothesis strategy, positive (valid by the schema) or negative (invalid). A hypothesis
rule-based state machine (:class:`bench.fuzz_machine.ApiMachine`) plays a fleet of nodes with them: a join
that succeeds puts its node id and ``node_secret`` in a bundle, and later requests for that node (round,
heartbeat, watch, leave, rejoin) carry the secret in ``X-Elastic-Node-Secret``, so that the requests reach the
job's logic instead of stopping at 404. Other rules send generated requests of any operation, and batches of
requests the master must refuse (no or a wrong token, another job, an oversized or malformed body, a wrong or
missing node secret, a duplicate join, data the schema forbids).

Every response goes through schemathesis' conformance checks against the document (no 5xx, a documented
status, a documented content type, headers and body schema), and every refusal must have the expected status.
A batch of refusals runs while no valid request does, between two *quiet* snapshots of ``GET /v1/status``;
every snapshot taken during and after the batch must equal the one before (see
:func:`bench.fuzz_target.stable_view` for the fields left out). A master that dies or drops a connection is a
crash; it is restarted, and so is a master whose job ended (nothing but "the job is over" would be left to
reach).

The parts: bench/fuzz_job.py (the fuzzed job's settings and operation names), bench/fuzz_target.py (the master
process, sending and checking requests, status snapshots), bench/fuzz_machine.py (the state machine),
bench/fuzz_refusals.py (the batches of refusals), bench/fuzz_tally.py (what a run found), bench/fuzz_report.py
(the report and the targets); this module runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from bench import common as c
from bench.fuzz_machine import machine_for
from bench.fuzz_tally import Tally
from bench.fuzz_target import Target


@dataclass(frozen=True)
class FuzzConfig:
    """How much to fuzz, with which seed, and how requests are grouped."""

    requests: int = 10_000
    seed: int = 0
    steps: int = 50  # steps of one example (a hypothesis stateful test case)
    examples: int = 25  # examples of one hypothesis run; runs repeat (next seed) until ``requests``
    batch_gap: int = 20
    batch_size: int = 60


def run_fuzz(config: FuzzConfig, folder: Path, progress: Callable[[str], None] = c.log) -> Tally:
    """Fuzz fresh masters until ``config.requests`` requests were sent; every process is killed at the end."""
    tally = Tally()
    folder.mkdir(parents=True, exist_ok=True)
    with c.Group(folder) as group:
        target = Target(folder, group, tally)
        machine = machine_for(target, config.batch_gap, config.batch_size)
        options = settings(
            max_examples=config.examples,
            stateful_step_count=config.steps,
            deadline=None,
            database=None,
            phases=[Phase.generate],  # the master's state outlives an example: shrinking would mislead
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            verbosity=Verbosity.quiet,  # failures are tallied, not raised: nothing for hypothesis to print
        )
        for run in _runs():
            seed(config.seed * 1_000_003 + run)(machine)
            try:
                run_state_machine_as_test(machine, settings=options)
            except Flaky:
                # Draws depend on the master's answers: an example may start like an earlier one and then
                # draw differently, which hypothesis calls flaky. Start a new run, as schemathesis does.
                tally.flaky_runs += 1
            failures = sum(tally.failures.values())
            progress(f"fuzz: {tally.requests} requests, {tally.server_errors} 5xx, {failures} failures")
            if tally.requests >= config.requests:
                break
        target.session.close()
    return tally


def _runs() -> Iterator[int]:
    run = 0
    while True:
        yield run
        run += 1
