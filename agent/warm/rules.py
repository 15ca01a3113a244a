"""Which worker starts a warm-start zygote can take: the command's form and the environment's difference.

See :mod:`agent.warm.starter` for why only these qualify. Pure functions, no torch.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping, Sequence
from importlib.util import MAGIC_NUMBER
from typing import Literal

from elastic.contract import OMP_NUM_THREADS, TORCHRUN_VARIABLES

#: Variables that may differ between the zygote and a warm worker: the ones the agent sets per worker,
#: none of which is read when torch or torch._dynamo is imported (checked with torch 2.13).
PER_WORKER_VARIABLES = frozenset(TORCHRUN_VARIABLES)
_PER_WORKER_PREFIXES = ("TORCHELASTIC_", "ELASTIC_")


def env_difference(zygote_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """The variables in which ``worker_env`` differs from ``zygote_env`` other than per-worker ones (empty:
    the worker can be forked from that zygote)."""
    differ = []
    for key in sorted(set(zygote_env) | set(worker_env)):
        value = worker_env.get(key)
        if value == zygote_env.get(key):
            continue
        if key == OMP_NUM_THREADS:
            if value is None or not value.isdigit() or int(value) < 1:
                differ.append(key)
        elif key not in PER_WORKER_VARIABLES and not key.startswith(_PER_WORKER_PREFIXES):
            differ.append(key)
    return differ


Mode = Literal["script", "module"]


def parse_command(argv: list[str], python: str) -> tuple[Mode, str, list[str], bool] | str:
    """``(mode, target, args, -u given)`` of a ``python [-u] script|-m module args`` command, else the
    reason it is not one (mode is "script" or "module")."""
    if not argv or argv[0] != python:
        return f"the command does not run this agent's interpreter {python}"
    rest = list(argv[1:])
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    if not rest:
        return "the command names no script"
    if rest[0] == "-m":
        if len(rest) < 2:
            return "the command names no module after -m"
        return "module", rest[1], rest[2:], unbuffered
    if rest[0].startswith("-"):
        return f"interpreter option {rest[0]!r} is not supported by warm starts (only -u and -m are)"
    return "script", rest[0], rest[1:], unbuffered


def start_problem(
    argv: list[str],
    cwd: str | None,
    envs: Sequence[Mapping[str, str]],
    *,
    python: str,
    zygote_env: Mapping[str, str],
) -> str | None:
    """Why workers with command ``argv``, working directory ``cwd`` and environments ``envs`` cannot be
    forked from a zygote running ``python`` in ``zygote_env``; None when they can."""
    parsed = parse_command(argv, python)
    if isinstance(parsed, str):
        return parsed
    mode, target, _, _ = parsed
    if mode == "script":
        problem = script_problem(os.path.join(cwd or os.getcwd(), target))
        if problem is not None:
            return problem
    for env in envs:
        differ = env_difference(zygote_env, env)
        if differ:
            shown = ", ".join(differ[:5]) + (", ..." if len(differ) > 5 else "")
            return (
                f"the worker environment differs from the zygote's in {shown} "
                "(read when the interpreter and torch start)"
            )
    return None


def script_problem(path: str) -> str | None:
    """Why the interpreter would not run ``path`` as plain source, or None."""
    if not os.path.isfile(path):
        return f"script {path!r} not found"
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC_NUMBER))
    except OSError as e:
        return f"cannot read script {path!r}: {e}"
    if head == MAGIC_NUMBER or zipfile.is_zipfile(path):
        return f"script {path!r} is a .pyc or zip file"
    return None


def current_umask() -> int | None:
    """This process's umask, read without changing it (racy os.umask would affect other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None
