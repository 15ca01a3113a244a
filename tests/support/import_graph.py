"""The project's import graph, read from source with ``ast``: what each module of ``elastic/``, ``master/``
and ``agent/`` imports, with where and how.

Every ``import`` statement counts, also those inside functions (a lazy import runs when its function is
called) and those under ``if TYPE_CHECKING:`` (flagged ``type_only``: they never run, and the rules that
are about what a process loads skip them). Imports through ``importlib`` or ``python -m`` strings are not
seen. The graph is a function of a root folder, so the checks built on it also run on planted trees.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("elastic", "master", "agent")


@dataclass(frozen=True)
class Import:
    """One imported module (or, for ``from m import a``, the names taken from it) of one statement."""

    importer: str
    #: The module loaded: a project module (``from pkg import mod`` resolves to ``pkg.mod``, ``import
    #: a.b.c`` to the longest project module it names) or an outside one as written (``torch.nn``).
    target: str
    #: The names taken from ``target`` that are not submodules (``from m import a, b``); empty otherwise.
    names: tuple[str, ...]
    line: int
    #: Under ``if TYPE_CHECKING:``: never runs.
    type_only: bool
    #: Inside a function: runs when the function is called.
    lazy: bool

    def where(self, tree: Tree) -> str:
        return f"{tree.paths[self.importer].relative_to(tree.root).as_posix()}:{self.line}"


@dataclass
class Tree:
    """The modules under ``root``'s packages and their imports."""

    root: Path
    #: Module name -> its file.
    paths: dict[str, Path]
    #: Module name -> its imports, in source order.
    imports: dict[str, list[Import]]
    #: Module name -> its parsed source.
    sources: dict[str, ast.Module]

    def is_package(self, module: str) -> bool:
        return self.paths[module].name == "__init__.py"

    def project_module(self, dotted: str) -> str | None:
        """The longest project module that ``dotted`` names (``a.b.Name`` -> ``a.b``), or None."""
        while dotted and dotted not in self.paths:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def unit(self, module: str) -> str:
        """The subpackage a module belongs to (``elastic.control``), or its root package (``elastic``) for
        the modules at a root."""
        parts = module.split(".")
        if (
            len(parts) >= 2
            and f"{parts[0]}.{parts[1]}" in self.paths
            and self.is_package(f"{parts[0]}.{parts[1]}")
        ):
            return f"{parts[0]}.{parts[1]}"
        return parts[0]

    def modules(self) -> list[str]:
        return sorted(self.paths)

    def lines(self, module: str) -> int:
        return len(self.paths[module].read_text(encoding="utf-8").splitlines())


def within(name: str, prefix: str) -> bool:
    """``name`` is ``prefix`` or inside it (``torch.nn`` is within ``torch``; ``torchvision`` is not)."""
    return name == prefix or name.startswith(prefix + ".")


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement with (type_only, lazy)."""

    def walk(
        node: ast.AST, type_only: bool, lazy: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only, lazy
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, True, lazy)
            for child in node.orelse:
                yield from walk(child, type_only, lazy)
            return
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from walk(child, type_only, inner)

    yield from walk(tree, False, False)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, module] if module else base)


def scan(root: Path, packages: Iterable[str] = PACKAGES) -> Tree:
    """Read every ``*.py`` under ``root/<package>`` (``__pycache__`` aside) and resolve its imports."""
    paths: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                paths[module_name(root, path)] = path
    tree = Tree(root=root, paths=paths, imports={}, sources={})
    for name, path in paths.items():
        source = ast.parse(path.read_text(encoding="utf-8"), str(path))
        tree.sources[name] = source
        found: list[Import] = []
        for node, type_only, lazy in _statements(source):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = tree.project_module(alias.name) or alias.name
                    found.append(Import(name, target, (), node.lineno, type_only, lazy))
                continue
            base = node.module or ""
            if node.level:
                base = _resolve_relative(name, tree.is_package(name), node.level, node.module)
            names: list[str] = []
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in paths:
                    found.append(Import(name, submodule, (), node.lineno, type_only, lazy))
                else:
                    names.append(alias.name)
            if names:
                target = tree.project_module(base) or base
                found.append(Import(name, target, tuple(names), node.lineno, type_only, lazy))
        tree.imports[name] = found
    return tree


def project_edges(tree: Tree, module: str, *, type_only: bool = True) -> set[str]:
    """The project modules ``module``'s own statements import (itself aside)."""
    return {
        imp.target
        for imp in tree.imports[module]
        if imp.target in tree.paths and imp.target != module and (type_only or not imp.type_only)
    }


def importers(tree: Tree) -> dict[str, set[str]]:
    """Project module -> the project modules whose statements import it."""
    out: dict[str, set[str]] = {name: set() for name in tree.paths}
    for module in tree.paths:
        for target in project_edges(tree, module):
            out[target].add(module)
    return out


def reach(tree: Tree, start: str, *, type_only: bool) -> dict[str, list[str]]:
    """Every module, project or outside, that importing ``start`` loads, each with one import chain
    (``[start, ..., target]``).

    Importing ``a.b.c`` also runs the subpackage's ``a/b/__init__.py``, so that is followed too; the
    roots' ``__init__`` files are not (``elastic/__init__`` is lazy and imports only the stdlib progress
    reporter, by its own contract, and ``master``'s and ``agent``'s are empty). ``type_only`` says whether
    ``TYPE_CHECKING`` imports are followed.
    """
    chains: dict[str, list[str]] = {start: [start]}
    queue: deque[str] = deque([start])
    while queue:
        module = queue.popleft()
        for imp in tree.imports.get(module, ()):
            if imp.type_only and not type_only:
                continue
            loaded = [imp.target]
            if imp.target in tree.paths:
                parts = imp.target.split(".")
                loaded += [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p in tree.paths]
            for target in loaded:
                if target in chains or (target in tree.paths and "." not in target):
                    continue
                chains[target] = [*chains[module], target]
                if target in tree.paths:
                    queue.append(target)
    return chains
