"""What a framework loop's flash checkpoint holds beyond the framework's own state, for every integration.

Whether checkpoints are on (:func:`checkpoints_enabled`), the check that a checkpoint was written by the
loop that restores it (:func:`check_written_by`), and every rank's random number generator states
(:func:`gather_rng`, :func:`restore_rng`, :func:`unpack_rng`).

A flash checkpoint of data-parallel training is written once per node (every rank saves the same state),
but the RNG states differ from rank to rank as soon as anything consumes them unevenly (dropout on
different batches, augmentation). So each save gathers all ranks' states into one float64 tensor of
``[world, n]`` rows, and each rank restores its own row: a restart at the same world size replays the run
exactly. A rank beyond the saved world (the world grew) keeps the state it has.

What a row holds, in this order (every value is exact in a float64: bytes, 32-bit words, a float): torch's
CPU generator, Python's ``random`` (Mersenne Twister words, position, cached gauss), numpy's legacy
global generator (the same), and, when CUDA is initialized, every CUDA device's generator. The layout is
saved with the rows, so a restore never guesses it.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic import collectives
from elastic.checkpoint import replicated
from elastic.checkpoint.env import CKPT_DIR_ENV, CheckpointError

log = logging.getLogger(__name__)

#: The key of the gathered RNG states in a checkpoint written by the integrations.
RNG_KEY = "rng"
#: The key naming the loop (framework) that wrote a checkpoint.
FRAMEWORK_KEY = "framework"


def checkpoints_enabled(ckpt_dir: str | None, owner: str) -> bool:
    """True when saves have somewhere to go: under elastic-run (the agent's memory), or a disk folder.

    Without either (the script run by hand, or by torchrun without ``ELASTIC_CKPT_DIR``) ``owner`` warns
    once and saves nothing, rather than failing the run at its first save.
    """
    if replicated.flash_enabled() or ckpt_dir or os.environ.get(CKPT_DIR_ENV):
        return True
    log.warning(
        "%s: checkpoints are off: not under elastic-run, and no ckpt_dir or %s to save to",
        owner,
        CKPT_DIR_ENV,
    )
    return False


def check_written_by(state: dict[str, Any], step: int, framework: str, owner: str) -> None:
    """Refuse a checkpoint another loop wrote (another framework, or a plain ``elastic.save`` script)."""
    if state.get(FRAMEWORK_KEY) != framework:
        raise CheckpointError(
            f"the checkpoint of step {step} was not written by {owner} (framework "
            f"{state.get(FRAMEWORK_KEY)!r}): resume it with the loop that wrote it, or start elastic-run "
            "with --ckpt-reset"
        )


def _python_words() -> list[float]:
    version, words, gauss = random.getstate()
    return [float(version), *map(float, words), 0.0 if gauss is None else 1.0, gauss or 0.0]


def _numpy_words() -> list[float]:
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):  # legacy=True promises the tuple
        raise TypeError(f"numpy's legacy RNG state is a {type(state).__name__}, not a tuple")
    _, key, pos, has_gauss, cached = state
    return [*map(float, key.tolist()), float(pos), float(has_gauss), float(cached)]


def _cuda_states() -> list[torch.Tensor]:
    # Only when this process already uses CUDA: asking for the states would initialise every device.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(torch.cuda.get_rng_state_all())
    return []


def local_row() -> tuple[torch.Tensor, list[list[Any]]]:
    """This process's states as one float64 row, with its layout (``[[name, length], ...]``)."""
    parts: list[tuple[str, torch.Tensor]] = [
        ("torch", torch.get_rng_state().to(torch.float64)),
        ("python", torch.tensor(_python_words(), dtype=torch.float64)),
        ("numpy", torch.tensor(_numpy_words(), dtype=torch.float64)),
    ]
    parts += [(f"cuda:{i}", state.to(torch.float64)) for i, state in enumerate(_cuda_states())]
    layout = [[name, int(part.numel())] for name, part in parts]
    return torch.cat([part for _, part in parts]), layout


def gather_rng() -> dict[str, Any]:
    """Every rank's states (a collective: call it on every rank at the same point of the loop).

    Returns ``{"rows": float64 tensor [world, n], "layout": [[name, length], ...]}``: a value a checkpoint
    holds (``weights_only`` loadable). Without a process group, one row.
    """
    row, layout = local_row()
    world = collectives.world_size()
    if world <= 1:
        return {"rows": row.unsqueeze(0), "layout": layout}
    device = collectives.collective_device(str(dist.get_backend()))
    mine = row.to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    collectives.lend(mine, *rows)
    dist.all_gather(rows, mine)
    return {"rows": torch.stack([r.cpu() for r in rows]), "layout": layout}


def _split(row: torch.Tensor, layout: list[list[Any]]) -> dict[str, torch.Tensor]:
    parts, offset = {}, 0
    for name, length in layout:
        parts[str(name)] = row[offset : offset + int(length)]
        offset += int(length)
    if offset != row.numel():
        raise ValueError(f"the RNG states' layout covers {offset} values, the row holds {row.numel()}")
    return parts


def unpack_rng(gathered: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s states as the libraries take them, or None when the saved world had no such rank.

    ``{"torch": uint8 tensor, "python": random.getstate() tuple, "numpy": np.random.get_state() tuple,
    "cuda": [uint8 tensor per device]}``.
    """
    rows = gathered["rows"]
    if rank >= rows.shape[0]:
        return None
    parts = _split(rows[rank], gathered["layout"])
    py = [int(v) for v in parts["python"][:-2].tolist()]
    has_gauss, gauss = parts["python"][-2:].tolist()
    np_words = parts["numpy"]
    key = np.array([int(v) for v in np_words[:-3].tolist()], dtype=np.uint32)
    pos, np_has_gauss, cached = np_words[-3:].tolist()
    devices = sorted((p for p in parts if p.startswith("cuda:")), key=lambda p: int(p.split(":")[1]))
    cuda = [parts[name].to(torch.uint8) for name in devices]
    return {
        "torch": parts["torch"].to(torch.uint8),
        "python": (py[0], tuple(py[1:]), gauss if has_gauss else None),
        "numpy": ("MT19937", key, int(pos), int(np_has_gauss), float(cached)),
        "cuda": cuda,
    }


def restore_rng(gathered: dict[str, Any], rank: int) -> bool:
    """Set this process's generators to rank ``rank``'s saved states; False when none was saved for it."""
    states = unpack_rng(gathered, rank)
    if states is None:
        return False
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    return True
