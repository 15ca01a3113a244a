"""A backstop, not a design rule: no source file in the packages (``elastic/``, ``master/``, ``agent/``) is
over 1,000 lines.

Size is a review question answered by cohesion (one concept, one module): a module is never split to meet
a number. A file that reaches the backstop has usually grown a second concept; move that one out."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("elastic", "master", "agent")
MAX_LINES = 1000
#: Hand-written sources: Python modules and the status page's assets (master/http/ui_assets).
SOURCE_SUFFIXES = {".py", ".js", ".html", ".css"}


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
