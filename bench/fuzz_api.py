"""API fuzzing (issue 16): stateful, schema-driven requests against a real ``elastic-master`` process.

The requests come from the master's own OpenAPI document, played by a hypothesis state machine that acts
as a fleet of nodes (joins feed their node secret into later requests) and mixes in batches of requests
the master must refuse (see ``bench/fuzz_engine.py``). Reported: per operation, the successes, refusals
and 5xx; the requests with and without valid credentials; the failures found (a 5xx, a crash, a response
the document does not describe, a refusal with the wrong status, a refusal that changed ``GET
/v1/status``). Targets: at least 10,000 requests, no 5xx, no crash, no failure, and every operation of
the node and script API (``/v1``) answered with success at least 50 times.

    python bench/fuzz_api.py                                 # 10,000 requests, seed 0
    python bench/fuzz_api.py --requests 2000 --seed 7 --json /tmp/fuzz.json
    python bench/fuzz_api.py --smoke                         # a few hundred requests
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common as c  # noqa: E402
from bench.fuzz_engine import API_OPS, UI_LOGIN, FuzzConfig, Tally, run_fuzz  # noqa: E402
from elastic.protocol import API_PREFIX  # noqa: E402

#: Successes every ``/v1`` operation must reach in a full run.
MIN_SUCCESSES = 50
MIN_REQUESTS = 10_000


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--requests", type=int, default=MIN_REQUESTS, help="requests to send (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (default %(default)s)")
    p.add_argument(
        "--runs", type=int, default=1, help="runs, with seeds SEED, SEED+1, ... (default %(default)s)"
    )
    p.add_argument("--smoke", action="store_true", help="a few hundred requests: checks the script works")
    p.add_argument("--workdir", default=None, help="keep the masters' logs here (default: a temp folder)")
    p.add_argument("--markdown-out", default=None, help="also write the report (markdown) to this file")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    args = p.parse_args(argv)
    requests, min_successes = args.requests, MIN_SUCCESSES
    if args.smoke:
        requests, min_successes, args.runs = 400, 1, 1
    parts, results, misses = [], [], []
    with c.workdir(args.workdir) as root:
        for run in range(args.runs):
            config = FuzzConfig(requests=requests, seed=args.seed + run)
            c.log(f"fuzz run {run + 1}/{args.runs}: {requests} requests, seed {config.seed}")
            started = time.monotonic()
            tally = run_fuzz(config, root / f"run{run}")
            took = time.monotonic() - started
            parts.append(report(tally, config, took, min_successes))
            results.append({"seed": config.seed, "seconds": round(took, 1), **tally.to_json()})
            misses += verdict(tally, requests, min_successes)
            c.cleanup(c.log)
    c.emit_report(args, "API fuzzing", "\n\n".join(parts))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "targets_met": not misses}, indent=2))
    return c.finish(1 if misses else 0)


if __name__ == "__main__":
    sys.exit(main())
