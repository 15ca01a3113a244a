"""API fuzzing: stateful, schema-driven requests against a real ``elastic-master`` process.

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
from bench.fuzz_engine import FuzzConfig, run_fuzz  # noqa: E402
from bench.fuzz_report import report, verdict  # noqa: E402

#: Successes every ``/v1`` operation must reach in a full run.
MIN_SUCCESSES = 50
MIN_REQUESTS = 10_000


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
