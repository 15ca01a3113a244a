"""docs/architecture.md draws the package tree as it is, and the docs name only files and modules that exist.

The tree under "## The package tree" lists every ``*.py`` of ``elastic/``, ``master/`` and ``agent/`` (as
``find elastic master agent -name '*.py'`` does), one per line, drawn like ``tree``; text after a name is
a comment. ``python tests/unit/test_architecture_doc.py`` prints the tree of the current checkout, each
line with the first clause of its module's docstring, to paste into the doc.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
PACKAGES = ("elastic", "master", "agent")
SECTION = "The package tree"
HINT = "run `python tests/unit/test_architecture_doc.py` and paste its tree into docs/architecture.md"
#: Where a comment starts on a line of the drawing.
COMMENT_COLUMN = 36
#: The widest comment that stays on one line of a 110-column page.
COMMENT_WIDTH = 110 - COMMENT_COLUMN


def python_files(root: Path) -> set[str]:
    """``find elastic master agent -name '*.py'`` under ``root``, ``__pycache__`` aside, as posix paths."""
    return {
        path.relative_to(root).as_posix()
        for package in PACKAGES
        for path in (root / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring; when too long, its first clause, or a cut."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    text = re.split(r"(?<=[a-z)`])\.(?:\s|$)", text)[0]
    if len(text) > COMMENT_WIDTH:
        clause = re.split(r"(?<=[a-z)`])[;:](?:\s|$)", text)[0]
        text = clause if len(clause) >= 16 else text
    if len(text) > COMMENT_WIDTH:
        text = text[: COMMENT_WIDTH - 1].rsplit(" ", 1)[0].rstrip(",(:;") + "…"
    return text


def draw(root: Path) -> str:
    """The tree of the packages' Python files under ``root``, as docs/architecture.md draws it."""
    files = python_files(root)
    lines: list[str] = []

    def line(prefix: str, name: str, about: Path | None) -> None:
        summary = _summary(about) if about is not None and about.exists() else ""
        text = prefix + name
        lines.append(f"{text.ljust(COMMENT_COLUMN - 1)} {summary}".rstrip() if summary else text)

    def walk(folder: str, indent: str) -> None:
        children = sorted(
            {
                f[len(folder) + 1 :].split("/")[0] + ("/" if "/" in f[len(folder) + 1 :] else "")
                for f in files
                if f.startswith(folder + "/")
            },
            key=lambda name: (name != "__init__.py", name.endswith("/"), name),
        )
        for i, child in enumerate(children):
            last = i == len(children) - 1
            connector = "└── " if last else "├── "
            if child.endswith("/"):
                line(indent + connector, child, root / folder / child / "__init__.py")
                walk(f"{folder}/{child[:-1]}", indent + ("    " if last else "│   "))
            elif child != "__init__.py":
                line(indent + connector, child, root / folder / child)
            else:
                line(indent + connector, child, None)

    for package in PACKAGES:
        line("", package + "/", root / package / "__init__.py")
        walk(package, "")
    return "\n".join(lines)


def listed(doc: str) -> set[str]:
    """The files the tree under ``## The package tree`` lists."""
    match = re.search(rf"^## {re.escape(SECTION)}\n.*?^```[a-z]*\n(.*?)^```", doc, re.S | re.M)
    assert match, f"docs/architecture.md has no fenced tree under '## {SECTION}': {HINT}"
    out: set[str] = set()
    stack: list[str] = []
    for row in match.group(1).splitlines():
        found = re.match(r"^((?:[│ ]   )*)(?:[├└]── )?(\S+)", row)
        if not found or not row.strip():
            continue
        depth = len(found.group(1)) // 4 + (1 if re.match(r"^(?:[│ ]   )*[├└]── ", row) else 0)
        name = found.group(2)
        stack = [*stack[:depth], name.rstrip("/")]
        if name.endswith(".py"):
            out.add("/".join(stack))
    return out


@pytest.mark.timeout(30)
def test_the_tree_in_the_doc_is_the_tree_of_the_packages() -> None:
    documented = listed(DOC.read_text(encoding="utf-8"))
    actual = python_files(REPO)
    missing, gone = sorted(actual - documented), sorted(documented - actual)
    assert not missing and not gone, f"not drawn: {missing}; drawn but gone: {gone}: {HINT}"


@pytest.mark.timeout(30)
def test_the_drawing_lists_what_it_reads(tmp_path: Path) -> None:
    for name in ("agent/__init__.py", "agent/cli/__init__.py", "agent/cli/main.py", "agent/errors.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('"""The command line: flags. More."""\n')
    for package in ("elastic", "master"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    tree = draw(tmp_path)
    assert "│   ├── main.py" not in tree and "    └── main.py" in tree
    assert "The command line" in tree and "More" not in tree
    assert listed(f"## {SECTION}\n\n```text\n{tree}\n```\n") == python_files(tmp_path)


def _names_in(module: Path) -> set[str]:
    """What a module defines, imports or names in a string (``__all__``, a lazy attribute table)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def stale_mentions(root: Path) -> list[str]:
    """``doc:line: name`` for each package file path (``agent/cli/main.py``) or whole code span naming a
    module (`` `agent.executor.loop` ``, `` `agent.executor.loop.ElasticAgent` ``) in docs/*.md that the
    tree lacks."""
    files = python_files(root)
    modules = {f.removesuffix(".py").removesuffix("/__init__").replace("/", "."): root / f for f in files}
    wrong = []
    for doc in sorted((root / "docs").glob("*.md")):
        for number, text in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{doc.relative_to(root).as_posix()}:{number}"
            for path in re.findall(r"(?<![\w/.-])((?:elastic|master|agent)/[\w/]*\w\.py)\b", text):
                if path not in files:
                    wrong.append(f"{where}: {path}")
            for dotted in re.findall(r"`((?:elastic|master|agent)(?:\.\w+)+)(?:\(\))?`", text):
                if dotted.endswith(".py"):  # a file name (`agent.py`), not a module
                    continue
                module = dotted
                while module and module not in modules:
                    module = module.rpartition(".")[0]
                rest = dotted[len(module) + 1 :].split(".")[0] if module and module != dotted else ""
                if not module or (rest and rest not in _names_in(modules[module])):
                    wrong.append(f"{where}: {dotted}")
    return wrong


@pytest.mark.timeout(30)
def test_the_docs_name_only_files_and_modules_that_exist() -> None:
    wrong = stale_mentions(REPO)
    assert not wrong, "docs name files or modules the packages lack:\n  " + "\n  ".join(wrong)


if __name__ == "__main__":
    sys.stdout.write(draw(REPO) + "\n")
