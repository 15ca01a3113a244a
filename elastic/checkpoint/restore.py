"""Restore of replicated (data-parallel) state from whichever rank holds it.

Replicated state is the same on every rank, so one copy anywhere in the job is enough: the restore point
is the newest step that *any* rank holds (the agent's shared memory or the disk folder), and the ranks
that lack it receive it from a holder over the process group. A node that joins, or replaces a lost
one, never holds anything; requiring every rank to hold a step threw the whole job's progress away.

Every rank restores the bytes of one holder's file: the lowest-ranked holder whose copy loads sends it
to all ranks, so no two ranks can restore different states under one step number (after a rollback,
memory and disk may both hold a "step N" of different runs). Should no copy of the newest step load,
the ranks agree to try the next newest, together.

The planning (:func:`plan`) is pure; :func:`restore` does the collectives and the file reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic import collectives, errors
from elastic.checkpoint import flash_format, layout

log = logging.getLogger(__name__)


class NothingLoadableError(errors.CheckpointError):
    """Some rank holds checkpoints, but no copy of any held step loads."""


@dataclass(frozen=True)
class Plan:
    """The step to restore and the ranks that hold a copy of it, in the order they are asked."""

    step: int
    holders: tuple[int, ...]


def plan(holdings: Sequence[Sequence[int]], wanted: int | None, excluded: set[int]) -> Plan | None:
    """Choose what to restore from each rank's steps (``holdings[rank]``).

    The newest step held by any rank (``wanted`` when given), not in ``excluded``; ``None`` when there
    is none. Holders are listed lowest rank first: the same answer on every rank from the same input.
    """
    held = {step for steps in holdings for step in steps} - excluded
    if wanted is not None:
        held &= {wanted}
    if not held:
        return None
    step = max(held)
    return Plan(step, tuple(rank for rank, steps in enumerate(holdings) if step in steps))


def read_valid(
    paths: Sequence[Path], parse: Callable[[bytes], Any], errors: list[str]
) -> tuple[bytes, Any] | None:
    """The bytes of the first of ``paths`` that ``parse`` accepts (it raises on a bad file), parsed."""
    for path in paths:
        try:
            # Under a shared lock: the flash writer of a shared-memory folder never recycles it meanwhile.
            data = layout.read_shared(path)
            return data, parse(data)
        except Exception as exc:  # noqa: BLE001 - any failure to read or parse means: try the next copy
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            errors.append(f"{path}: {exc}")
    return None


def restore(
    copies: dict[int, list[Path]],
    world: int,
    rank: int,
    wanted: int | None,
    parse: Callable[[bytes], Any],
) -> tuple[Any, int, str, bytes] | None:
    """Restore the newest step any rank holds; a collective when ``world`` > 1 (call it on every rank).

    Args:
        copies: this rank's readable files by step, preferred copy first (memory, then disk).
        world: ranks in the process group (0 or 1: this rank alone).
        rank: this rank's place in the group.
        wanted: restore exactly this step, or ``None`` for the newest.
        parse: turns a file's bytes into the restored value; raises on a damaged file.

    Returns:
        ``(parsed, step, source, data)`` (``source`` says whose file, ``data`` are its bytes), or
        ``None`` when no rank holds a step (or ``wanted``).

    Raises:
        NothingLoadableError: steps are held, but no copy of any of them loads on its holder.
    """
    errors: list[str] = []
    if world <= 1:
        excluded: set[int] = set()
        while (chosen := plan([sorted(copies)], wanted, excluded)) is not None:
            found = read_valid(copies[chosen.step], parse, errors)
            if found is not None:
                return found[1], chosen.step, "this rank", found[0]
            excluded.add(chosen.step)
        _raise_if_held(excluded, errors)
        return None

    holdings = collectives.all_step_lists(copies, world)
    excluded = set()
    while (chosen := plan(holdings, wanted, excluded)) is not None:
        for holder in chosen.holders:
            found = read_valid(copies[chosen.step], parse, errors) if holder == rank else None
            received = collectives.broadcast_bytes(found[0] if found else None, src=holder)
            if received is not None:
                # The holder parsed its own bytes already; the others parse what they received.
                parsed = found[1] if found is not None else parse(received)
                return parsed, chosen.step, "this rank" if holder == rank else f"rank {holder}", received
        excluded.add(chosen.step)  # no holder could read it: the next newest, together
    _raise_if_held(excluded, errors)
    return None


def _raise_if_held(failed_steps: set[int], errors: list[str]) -> None:
    if failed_steps:
        here = "; ".join(errors) or "the copies are on other ranks"
        raise NothingLoadableError(f"steps {sorted(failed_steps)} are held but none loads; here: {here}")


def parse_checkpoint(data: bytes, map_location: Any) -> tuple[dict[str, Any], int]:
    """``(state, step)`` from the bytes of a file written by ``elastic.save``; raises if it is not one.

    A flash file (:mod:`elastic.checkpoint.flash_format`, recognised by its magic: memory copies, and the disk
    copies the agent persists byte for byte) or a torch.save file (disk saves without an agent, older runs).
    Neither runs code: the flash format is JSON plus raw tensor bytes, and torch.save files load with
    ``weights_only=True``, so a checkpoint folder on a shared file system cannot be used to execute code
    in the job.
    """
    return flash_format.parse(data, map_location)
