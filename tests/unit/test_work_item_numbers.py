"""Internal work-item numbers stay out of what users and readers of the code see.

An issue or task number means something only to whoever filed it; a reader needs the sentence to say
what it meant. Checked: docs/*.md and README.md (all text), the docstrings and comments of every Python
file of the packages, tests/ and scripts/, and every string and comment of bench/*.py (the labels and
target lines the benchmarks write into docs/benchmarks.md).

``python tests/unit/test_work_item_numbers.py`` prints every hit as ``path:line: text``.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: A numbered reference to a work item: a tracker word followed by a number ("issue", "issues", "work
#: item", "task", "ticket", "pull request", "PR"; then an optional ``#`` or hyphen), or a bare ``#`` and a
#: number standing alone (not a colour such as ``#333333``, not ``a#1``); also when a line break falls
#: between word and number. A tracker word followed by anything but a number ("the trust issue", "tasks
#: of 2 nodes") is prose.
WORK_ITEM = re.compile(
    r"\b(?:issues?|work[ -]?items?|tasks?|tickets?|pull[ -]requests?|PRs?)(?:\s+|-)?#?\d+\b"
    r"|(?<![^\s(\[])#\d{1,5}(?![\w-])",
    re.I,
)
#: The text of these files is checked whole.
DOC_GLOBS = ("docs/*.md", "README.md")
#: The docstrings and comments of every Python file under these folders are checked.
CODE_FOLDERS = ("elastic", "master", "agent", "tests", "scripts")
#: Every string and comment of these files is checked: benchmarks write their strings into the docs.
BENCH_GLOB = "bench/*.py"


def _docstring_lines(source: str) -> set[int]:
    """The line numbers that the module's, classes' and functions' docstrings span."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def _tokens(source: str, *, strings: bool) -> Iterator[tuple[int, str]]:
    """(first line, text) of each comment, and of each string token when ``strings`` (else of the
    docstrings only)."""
    docstrings = set() if strings else _docstring_lines(source)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        is_string = token.type == tokenize.STRING or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1)
        if token.type == tokenize.COMMENT or (is_string and (strings or token.start[0] in docstrings)):
            yield token.start[0], token.string


def hits_in_text(text: str, first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(line, that line) of each work-item number in ``text``, whose first line is ``first_line``."""
    lines = text.splitlines()
    for match in WORK_ITEM.finditer(text):
        offset = text.count("\n", 0, match.start())
        yield first_line + offset, lines[offset].strip()


def hits_in_python(source: str, *, strings: bool) -> Iterator[tuple[int, str]]:
    for line, text in _tokens(source, strings=strings):
        yield from hits_in_text(text, line)


def hits(root: Path) -> list[str]:
    """``path:line: text`` of every work-item number under ``root``, in path order."""
    found: list[str] = []

    def add(path: Path, lines: Iterator[tuple[int, str]]) -> None:
        found.extend(f"{path.relative_to(root).as_posix()}:{n}: {text}" for n, text in lines)

    for pattern in DOC_GLOBS:
        for path in sorted(root.glob(pattern)):
            add(path, hits_in_text(path.read_text(encoding="utf-8")))
    for folder in CODE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                add(path, hits_in_python(path.read_text(encoding="utf-8"), strings=False))
    for path in sorted(root.glob(BENCH_GLOB)):
        add(path, hits_in_python(path.read_text(encoding="utf-8"), strings=True))
    return found


@pytest.mark.timeout(60)
def test_no_work_item_number_in_docs_docstrings_comments_or_benchmark_labels() -> None:
    found = hits(REPO)
    assert not found, "say what the work item meant instead of its number:\n  " + "\n  ".join(found)


# Built from pieces so that this file's own text holds no hit.
N = "1" + "7"


@pytest.mark.parametrize(
    "text",
    [
        f"issue {N}",
        f"Issue #{N}",
        f"(issue {N})",
        f"issue {N}'s check",
        f"issues {N} and 18",
        f"work item {N}",
        f"work-item {N}",
        f"task {N}",
        f"ticket {N}",
        f"PR #{N}",
        f"pull request {N}",
        f"see #{N}",
        f"(#{N})",
        f"issue-{N}",
        f"the in-process issue\n{N} rows",
    ],
)
def test_a_numbered_work_item_is_a_hit(text: str) -> None:
    assert WORK_ITEM.search(text), text


@pytest.mark.parametrize(
    "text",
    [
        "the trust issue",
        "an issue with 2 nodes",
        "tasks of the agent",
        "color: #333333",
        "'#1f77b4'",
        "rank#1",
        "# 1 s of slack",
        "step 17",
        "tissue 17",
        "multitask 3",
        "issue N",
        "the ticket is set",
    ],
)
def test_ordinary_words_are_not_hits(text: str) -> None:
    assert not WORK_ITEM.search(text), text


@pytest.mark.timeout(30)
def test_each_place_is_read_as_its_rule_says(tmp_path: Path) -> None:
    ref = f"issue {N}"
    files = {
        "docs/guide.md": f"# Guide\n\nAs {ref} asked.\n",
        "agent/loop.py": f'"""The loop ({ref})."""\n\n# {ref}: why\nX = "{ref}"  # a plain string is code\n',
        "tests/test_x.py": f'def test_x():\n    """Checks {ref}."""\n',
        "bench/recovery.py": f'LABEL = f"Target ({ref}): met"\n',
        "bench/data/notes.md": f"{ref}\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert [hit.split(": ")[0] for hit in hits(tmp_path)] == [
        "docs/guide.md:3",
        "agent/loop.py:1",
        "agent/loop.py:3",
        "tests/test_x.py:2",
        "bench/recovery.py:1",
    ]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{hit}\n" for hit in hits(REPO)))
