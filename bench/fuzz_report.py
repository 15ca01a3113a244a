"""The report of an API fuzz run (bench/fuzz_api.py): a table per operation, what was found, and whether
the targets were met."""

from __future__ import annotations

from bench import common as c
from bench.fuzz_engine import FuzzConfig
from bench.fuzz_job import API_OPS, UI_LOGIN
from bench.fuzz_tally import Tally
from elastic.control.protocol import API_PREFIX


def api_operations(tally: Tally) -> list[str]:
    """``METHOD /v1/NAME`` of every operation of the node and script API (``NAME`` alone if never sent)."""
    labels = {op.rsplit("/", 1)[-1]: op for op in tally.statuses if f" {API_PREFIX}/" in op}
    return [labels.get(name, name) for name in API_OPS]


def verdict(tally: Tally, requests: int, min_successes: int) -> list[str]:
    """What misses a target (empty: every target met)."""
    misses = []
    if tally.requests < requests:
        misses.append(f"{tally.requests} requests, fewer than {requests}")
    if tally.server_errors or tally.crashes:
        misses.append(f"{tally.server_errors} responses 5xx, {tally.crashes} crashes")
    if tally.failures:
        misses.append("failures: " + ", ".join(f"{n} {kind}" for kind, n in sorted(tally.failures.items())))
    for op in api_operations(tally):
        if tally.successes(op) < min_successes:
            misses.append(f"{op}: {tally.successes(op)} successes, fewer than {min_successes}")
    return misses


def report(tally: Tally, config: FuzzConfig, took: float, min_successes: int) -> str:
    """The markdown report of one run that took ``took`` seconds."""
    rows = []
    for op in sorted(tally.statuses, key=lambda o: (f" {API_PREFIX}/" not in o, o)):
        statuses = tally.statuses[op]
        refused = sum(n for s, n in statuses.items() if 400 <= s < 500)
        errors = sum(n for s, n in statuses.items() if s >= 500)
        seen = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
        rows.append([op, sum(statuses.values()), tally.successes(op), refused, errors, seen])
    misses = verdict(tally, config.requests, min_successes)
    failures = sum(tally.failures.values())
    lines = [
        f"{tally.requests} requests in {took:.0f} s (seed {config.seed}) against `elastic-master --nnodes "
        f"1:3 --last-call 0` over 127.0.0.1: {tally.authorized} with valid credentials, "
        f"{tally.requests - tally.authorized} without (no or a wrong token or job id, or no status page "
        f"session); {tally.masters} master process(es) (a new one after each job that ended).",
        "",
        c.table(["operation", "requests", "successes", "4xx", "5xx", "statuses"], rows),
        "",
        f"Successes are 2xx, and `303` for `{UI_LOGIN}` (its only success). Refusals sent in "
        f"{tally.refusal_batches} batches: "
        + ", ".join(f"{kind} {n}" for kind, n in sorted(tally.refusals.items()))
        + f". `GET /v1/status` compared before and after each batch ({tally.state_checks} checks, "
        f"{tally.skipped_batches} batches skipped for want of a quiet status); hypothesis runs restarted "
        f"{tally.flaky_runs} time(s).",
        "",
        f"Found: {tally.server_errors} responses 5xx, {tally.crashes} crashes, {failures} failures"
        + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(tally.failures.items())) + ")" if failures else "")
        + ".",
        f"Target (>= {config.requests} requests, 0 5xx, 0 crashes, 0 failures, >= {min_successes} successes "
        f"per /v1 operation): " + ("met." if not misses else "NOT met: " + "; ".join(misses) + "."),
    ]
    if tally.examples:
        lines += ["", "First failures:", "", *[f"- {e}" for e in tally.examples]]
    return "\n".join(lines)
