"""Two backstops, not design rules, on the packages (``elastic/``, ``master/``, ``agent/``): no source file
is over 1,000 lines, and no module under 120 lines has a single importer unless it is listed with its
reason.

Size is a review question answered by cohesion (one concept, one module): a module is never split to meet
a number. A file that reaches the upper backstop has usually grown a second concept; move that one out. A
small module that one other module imports is usually part of that module's concept cut off (a split made
for a line count); merge it back, unless it is a contract, a stdlib-only wire module or an entry point.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import importers, scan

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("elastic", "master", "agent")
MAX_LINES = 1000
#: Hand-written sources: Python modules and the status page's assets (master/http/ui_assets).
SOURCE_SUFFIXES = {".py", ".js", ".html", ".css"}
#: A module under this many lines with one importer is part of its importer's concept, unless exempt.
SMALL_LINES = 120
#: Small modules with a single importer that stay on their own: module -> why. Only contracts (a
#: subpackage's ``__init__`` always is one), stdlib-only wire modules and entry points belong here.
SMALL_MODULE_EXEMPT = {
    "agent.__main__": "entry point: `python -m agent` is `elastic-run`",
    "master.__main__": "entry point: `python -m master` is `elastic-master`",
    "agent.workers._reaper_proc": "entry point: the reaper sentinel process, stdlib only, its own session",
    "agent.warm._zygote_proc": "entry point: the warm-start zygote process",
    # elastic/__init__ resolves it lazily; it cannot join a neighbour that uses `from __future__ import
    # annotations`, because DDP reads the communication hook's annotations at run time.
    "elastic.ddp_timing": "worker API entry: `elastic.track_ddp`",
}


def oversized(root: Path, packages: tuple[str, ...] = PACKAGES, limit: int = MAX_LINES) -> dict[str, int]:
    """``{path relative to root: line count}`` of every source file in ``packages`` over ``limit`` lines."""
    out: dict[str, int] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                out[path.relative_to(root).as_posix()] = lines
    return out


@pytest.mark.timeout(30)
def test_no_package_file_is_over_the_backstop():
    offenders = oversized(REPO)
    listing = ", ".join(f"{path} ({lines} lines)" for path, lines in offenders.items())
    assert not offenders, f"over {MAX_LINES} lines, move its second concept out: {listing}"


@pytest.mark.timeout(30)
def test_a_file_over_the_limit_is_named_with_its_count(tmp_path: Path):
    (tmp_path / "agent" / "ui").mkdir(parents=True)
    (tmp_path / "agent" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "agent" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "agent" / "ui" / "page.js").write_text("let x;\n" * (MAX_LINES + 5))
    (tmp_path / "agent" / "notes.txt").write_text("x\n" * (MAX_LINES + 1))

    expected = {"agent/big.py": MAX_LINES + 1, "agent/ui/page.js": MAX_LINES + 5}
    assert oversized(tmp_path, ("agent",)) == expected


def small_single_importer_modules(root: Path, exempt: dict[str, str]) -> dict[str, tuple[int, str]]:
    """``{module: (lines, its one importer)}`` for each module under ``root``'s packages with fewer than
    ``SMALL_LINES`` lines that exactly one other module imports, subpackage ``__init__`` files and
    ``exempt`` aside. Importers are the packages' own modules (any import statement, also lazy and
    ``TYPE_CHECKING`` ones); tests and benchmarks do not count."""
    tree = scan(root)
    out: dict[str, tuple[int, str]] = {}
    for module, by in sorted(importers(tree).items()):
        if tree.is_package(module) or module in exempt or len(by) != 1:
            continue
        lines = tree.lines(module)
        if lines < SMALL_LINES:
            out[module] = (lines, next(iter(by)))
    return out


@pytest.mark.timeout(30)
def test_no_small_module_has_a_single_importer():
    offenders = small_single_importer_modules(REPO, SMALL_MODULE_EXEMPT)
    listing = "\n  ".join(
        f"{m} ({lines} lines), imported by {by} only" for m, (lines, by) in offenders.items()
    )
    assert not offenders, (
        f"under {SMALL_LINES} lines with one importer: merge each into its importer's concept, or list it in "
        f"SMALL_MODULE_EXEMPT with why (a contract, a stdlib-only wire module, an entry point):\n  {listing}"
    )


@pytest.mark.timeout(30)
def test_the_exempt_modules_exist():
    tree = scan(REPO)
    assert not set(SMALL_MODULE_EXEMPT) - set(tree.paths), "an exempt module is gone: drop it from the list"


@pytest.mark.timeout(30)
def test_a_small_module_with_one_importer_is_named_with_its_importer(tmp_path: Path):
    files = {
        "agent/__init__.py": "",
        "agent/cli/__init__.py": '"""The contract."""\n',
        "agent/cli/main.py": "from agent.cli import small, shared, big, allowed\n",
        "agent/cli/other.py": "def f() -> None:\n    from agent.cli.shared import X\n",
        "agent/cli/small.py": "X = 1\n",
        "agent/cli/shared.py": "X = 1\n",
        "agent/cli/big.py": "X = 1\n" * SMALL_LINES,
        "agent/cli/allowed.py": "X = 1\n",
        "agent/cli/unused.py": "X = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    exempt = {"agent.cli.allowed": "an entry point"}
    assert small_single_importer_modules(tmp_path, exempt) == {"agent.cli.small": (1, "agent.cli.main")}
