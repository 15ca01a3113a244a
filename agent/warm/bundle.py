"""How the warm-start zygote's process is started: its source bundle, bootstrap and argument padding.

The zygote runs with the worker's interpreter, which need not have this package installed, and must
import nothing of ours (a forked worker inherits every module the zygote imported). So its code travels
as source: the files of :data:`BUNDLE`, joined in order into one text that ``python -c`` executes as
``__main__`` (each file imports the others only when it is *not* ``__main__``, i.e. in the agent's tree).
"""

from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).parent
#: The zygote's source files, in execution order: its protocol, the worker half, the zygote proper.
BUNDLE = ("zygote_ops.py", "_zygote_worker.py", "_zygote_proc.py")
# `python -c` puts the current directory first on sys.path: import nothing from there, not even the
# standard library's names. A worker gets its own sys.path[0] (its script's folder, or the cwd).
_PROLOGUE = "import sys\nif sys.path and sys.path[0] == '':\n    del sys.path[0]\n"
#: Kept short: the zygote's argument area must not be longer than a worker's command line (see filler).
BOOTSTRAP = "import os;exec(os.environ.pop('_EZ'))"


def zygote_source() -> str:
    """The zygote's program: the prologue and the files of :data:`BUNDLE`."""
    parts = [_PROLOGUE]
    parts += [(_HERE / name).read_text(encoding="utf-8") for name in BUNDLE]
    return "\n".join(parts)


def filler(python: str, argv_hint: list[str] | tuple[str, ...] | None) -> list[str]:
    """An extra zygote argument that makes its argument area exactly as long as a worker's command line.

    A forked worker rewrites that area to show its own command in /proc/<pid>/cmdline; the area cannot
    change size, so a shorter command is padded with NULs (empty trailing arguments in psutil).
    """
    if not argv_hint:
        return []
    size = sum(len(os.fsencode(a)) + 1 for a in (python, "-c", BOOTSTRAP))
    target = sum(len(os.fsencode(a)) + 1 for a in argv_hint)
    if target <= size:
        return []
    return ["#" * (target - size - 1)]
