"""``python -m elastic.node_check``: one node's health check, run by its agent in a check round.

The agent starts it as the node's single worker with torchrun's environment, the world being the nodes
(RANK = node rank, WORLD_SIZE = number of nodes). It

1. joins the process group (nccl on GPUs, gloo on CPUs) and forms pairs of nodes with ``new_group``:
   (0, 1), (2, 3), ...; with an odd count the last node pairs with node 0 as well;
2. times a matmul on the local device (best of several runs, so that a busy moment does not count);
3. times an allreduce within its pair (best of several runs);

and writes the figures as JSON (:class:`elastic.control.protocol.NodeCheckResult` fields) to the file named by
``ELASTIC_NODE_CHECK_RESULT``, for its agent to report to the master. A stage that raises is recorded as
the failed stage with its error, and the process exits 1.

Test hooks (fault injection; read from the environment, which the agent passes on unchanged):

* ``ELASTIC_NODE_CHECK_FAIL=1``: the matmul stage fails, as on a broken device;
* ``ELASTIC_NODE_CHECK_SLOWDOWN=F``: the matmul takes F times as long (a slow device).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastic import contract

if TYPE_CHECKING:  # torch is imported when the check runs, not when this module is
    import torch.distributed as dist

RESULT_ENV = contract.NODE_CHECK_RESULT
TIMEOUT_ENV = contract.NODE_CHECK_TIMEOUT_S
FAIL_ENV = "ELASTIC_NODE_CHECK_FAIL"
SLOWDOWN_ENV = "ELASTIC_NODE_CHECK_SLOWDOWN"
#: Collective timeout of the check's process groups; the agent kills the check some time after it.
DEFAULT_TIMEOUT_S = 60.0

REPEATS = 8
CPU_MATMUL_N, GPU_MATMUL_N = 512, 4096
CPU_ALLREDUCE_ELEMENTS, GPU_ALLREDUCE_ELEMENTS = 1 << 20, 1 << 26  # fp32: 4 MiB, 256 MiB


def pairs(world: int) -> list[tuple[int, ...]]:
    """The allreduce groups: consecutive pairs, and (0, last) for the odd one out."""
    groups: list[tuple[int, ...]] = [(i, i + 1) for i in range(0, world - 1, 2)]
    if world > 1 and world % 2:
        groups.append((0, world - 1))
    return groups


def partner_of(rank: int, world: int) -> int | None:
    """The node whose allreduce with ``rank`` is timed (node 0 is timed with node 1)."""
    for group in pairs(world):
        if rank in group:
            return group[1] if group[0] == rank else group[0]
    return None


def _best_time(run: Callable[[], object], sync: Callable[[], object], repeats: int = REPEATS) -> float:
    run()  # warm up (allocations, kernels, connections)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _slowdown(environ) -> float:
    raw = environ.get(SLOWDOWN_ENV, "")
    try:
        factor = float(raw) if raw else 1.0
    except ValueError:
        raise ValueError(f"{SLOWDOWN_ENV} must be a number, got {raw!r}") from None
    return max(factor, 1.0)


class Check:
    """The check's process group and its store (kept, to finish together: see :meth:`finish`)."""

    def __init__(self, environ) -> None:
        self.environ = environ
        self.timeout = datetime.timedelta(seconds=float(environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S))
        self.rank = int(environ.get("RANK", "0"))
        self.world = int(environ.get("WORLD_SIZE", "1"))
        self.store: dist.TCPStore | None = None

    def run(self) -> dict:
        """Run every stage; return the result fields (``ok`` False with ``stage``/``error`` on failure)."""
        result: dict = {"ok": False, "stage": "setup"}
        try:
            self._stages(result)
            result["stage"] = ""
            result["ok"] = True
        except Exception as exc:  # every failure is a figure of the check: recorded, never raised
            result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return result

    def finish(self, ok: bool) -> None:
        """Say this node is done; node 0, which hosts the store, waits (bounded) until every node is, so
        that no node loses the store while it still needs it. A failed node leaves at once."""
        if self.store is None:
            return
        try:
            self.store.set(f"node_check/done/{self.rank}", "ok" if ok else "failed")
            if ok and self.rank == 0:
                self.store.wait([f"node_check/done/{r}" for r in range(self.world)], self.timeout)
        except Exception:  # noqa: S110 - best effort: the figures are already written
            pass

    def _stages(self, result: dict) -> None:
        import torch
        import torch.distributed as dist

        from elastic import collectives
        from elastic.distributed import backend_for_device

        environ, timeout, rank, world = self.environ, self.timeout, self.rank, self.world
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        result["device"] = (
            str(device) if not cuda else f"{device} ({torch.cuda.get_device_name(device)})"[:64]
        )
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        result["stage"] = "init"
        if cuda:
            torch.cuda.set_device(device)
        self.store = dist.TCPStore(
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
            world,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        dist.init_process_group(
            backend_for_device(cuda), store=self.store, rank=rank, world_size=world, timeout=timeout
        )

        result["stage"] = "pairing"
        groups = {g: dist.new_group(list(g), timeout=timeout) for g in pairs(world)}

        result["stage"] = "matmul"
        if environ.get(FAIL_ENV, "") not in ("", "0"):
            raise RuntimeError(f"injected node-check failure ({FAIL_ENV})")
        n = GPU_MATMUL_N if cuda else CPU_MATMUL_N
        dtype = torch.bfloat16 if cuda else torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        matmul_s = _best_time(lambda: torch.mm(a, b), sync)
        factor = _slowdown(environ)
        if factor > 1:
            time.sleep((factor - 1) * matmul_s * (REPEATS + 1))  # as if every run had been that slow
            matmul_s *= factor
        result["matmul_s"] = matmul_s

        result["stage"] = "allreduce"
        partner = partner_of(rank, world)
        for group_ranks, group in groups.items():  # every pair in the same order on all its members
            if rank not in group_ranks:
                continue
            buf = torch.ones(GPU_ALLREDUCE_ELEMENTS if cuda else CPU_ALLREDUCE_ELEMENTS, device=device)
            collectives.lend(buf)
            seconds = _best_time(functools.partial(dist.all_reduce, buf, group=group), sync)
            if partner in group_ranks:
                result["allreduce_s"], result["partner"] = seconds, partner


def write_result(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)  # the agent never reads a half-written result


def main() -> int:
    path = os.environ.get(RESULT_ENV)
    if not path:
        print(
            f"elastic.node_check: {RESULT_ENV} is not set; it is run by elastic-run --node-check",
            file=sys.stderr,
        )
        return 2
    check = Check(os.environ)
    result = check.run()
    write_result(path, result)
    print(f"node check: {json.dumps(result, sort_keys=True)}", flush=True)
    check.finish(result["ok"])
    # No destroy_process_group(): its collective teardown could wait on a failed peer; exiting is enough.
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
