"""The layers of DESIGN.md ("Layout"), one row of ``LAYERS`` per rule, checked on the import graph.

Imports are read from the source (``import_graph``): every statement, also those inside functions (a lazy
import runs when its function is called). Imports under ``if TYPE_CHECKING:`` never run: the rules about
what a process loads (torch, the control client, purity, the web framework) skip them, because a type
checker reading a name is no dependency of the running code; the rules about who may depend on whom
(contracts, etcd, ``master``, private names, cycles) count them, because a type named across a boundary
couples the two sides as much as a call does.

A rule marked "reached" follows imports through the project's modules (and the subpackage ``__init__``
files they run), so a layer cannot be skipped by going through a neighbour; the reported line is the first
import that leaves the layer, with the chain that ends at the forbidden module.

Every rule is a function of a tree, so ``test_a_planted_import_is_reported`` can plant one forbidden
import per rule in a small tree under ``tmp_path`` and see the rule report it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from import_graph import Tree, project_edges, reach, scan, within

REPO = Path(__file__).resolve().parents[2]

#: The contracts between the parts (docs/architecture.md, docs/protocol.md): the worker environment and
#: progress datagram, the error categories, the master's error table, the warm-start zygote's operations.
CONTRACTS = ("elastic.contract", "elastic.errors", "elastic.control.error_table", "agent.warm.zygote_ops")

#: Threads, processes, sockets, event loops: what a pure machine leaves to its executor.
IO = (
    "asyncio",
    "threading",
    "_thread",
    "concurrent.futures",
    "multiprocessing",
    "socket",
    "socketserver",
    "selectors",
    "subprocess",
    "http.client",
    "http.server",
    "httpx",
)
WEB_FRAMEWORK = ("fastapi", "starlette", "uvicorn", "h11")
ETCD_CLIENT = ("aetcd", "etcd3", "grpc")
#: The master client and its agent streams (``elastic.control``); httpx is the client's transport.
CONTROL_CLIENT = ("elastic.control.client", "elastic.control.stream*", "httpx")

Modules = Callable[[Tree, str], bool]


def inside(*prefixes: str) -> Modules:
    return lambda tree, module: any(within(module, p) for p in prefixes)


def outside(*prefixes: str) -> Modules:
    return lambda tree, module: not any(within(module, p) for p in prefixes)


def worker_library(tree: Tree, module: str) -> bool:
    """The modules a training worker imports: ``elastic``'s root modules, its checkpoint and in-process
    subpackages."""
    return tree.unit(module) in ("elastic", "elastic.checkpoint", "elastic.inprocess")


def _matches(target: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(target, p) or fnmatchcase(target, p + ".*") for p in patterns)


def _where(tree: Tree, importer: str, target: str) -> str:
    """``path:line`` of the statement in ``importer`` that loads ``target`` (or its submodule)."""
    for imp in tree.imports[importer]:
        if imp.target == target or within(imp.target, target):
            return imp.where(tree)
    return tree.paths[importer].relative_to(tree.root).as_posix()


@dataclass(frozen=True)
class NeverImports:
    """Modules selected by ``modules`` never load one matching ``forbidden`` (fnmatch on dotted names,
    submodules included)."""

    modules: Modules
    forbidden: tuple[str, ...]
    #: Follow imports through other project modules.
    reached: bool = False
    #: Count ``TYPE_CHECKING`` imports.
    type_only: bool = False
    #: ``(importer, imported module) -> why``: the first import of a chain that the rule lets pass.
    allowed: dict[tuple[str, str], str] = field(default_factory=dict)

    def __call__(self, tree: Tree) -> list[str]:
        found: dict[tuple[str, str], str] = {}
        for module in tree.modules():
            if not self.modules(tree, module):
                continue
            if self.reached:
                chains = reach(tree, module, type_only=self.type_only).values()
            else:
                chains = [
                    [module, imp.target]
                    for imp in tree.imports[module]
                    if self.type_only or not imp.type_only
                ]
            for chain in chains:
                if len(chain) < 2 or not _matches(chain[-1], self.forbidden):
                    continue
                # The import that leaves the layer: the first hop to a module the rule does not cover.
                hop = next(
                    (
                        i
                        for i in range(1, len(chain))
                        if not (chain[i] in tree.paths and self.modules(tree, chain[i]))
                    ),
                    len(chain) - 1,
                )
                edge = (chain[hop - 1], chain[hop])
                if edge in self.allowed or edge in found:
                    continue
                via = f" (via {' -> '.join(chain)})" if len(chain) > 2 else ""
                found[edge] = f"{edge[0]} imports {chain[-1]} at {_where(tree, *edge)}{via}"
        return sorted(found.values())


def contracts_are_stdlib_only(tree: Tree) -> list[str]:
    """The contract modules import the standard library and each other, nothing else."""
    wrong = []
    for module in CONTRACTS:
        if module not in tree.paths:
            wrong.append(f"{module} is gone: name the contract modules in CONTRACTS")
            continue
        for imp in tree.imports[module]:
            top = imp.target.split(".")[0]
            if imp.target in tree.paths:
                if imp.target not in CONTRACTS:
                    wrong.append(f"{module} imports {imp.target} at {imp.where(tree)}")
            elif top not in sys.stdlib_module_names and top != "__future__":
                wrong.append(f"{module} imports {imp.target} at {imp.where(tree)}")
    return wrong


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_part(tree: Tree, dotted: str) -> str | None:
    """The first private component of ``dotted`` below its subpackage (``agent.warm._zygote_proc``)."""
    unit = tree.unit(dotted) if tree.project_module(dotted) else dotted
    rest = dotted[len(unit) + 1 :].split(".") if dotted != unit else []
    return next((part for part in rest if _private(part)), None)


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _module_bindings(tree: Tree, module: str) -> dict[str, str]:
    """Local name -> the project module it is bound to by an import statement of ``module``."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree.sources[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in tree.paths:
                    bound[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in tree.paths:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in tree.paths:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def no_private_name_crosses_a_subpackage(tree: Tree) -> list[str]:
    """No ``_name`` of one subpackage is imported, or read off an imported module, in another."""
    wrong = []
    for module in tree.modules():
        home = tree.unit(module)
        for imp in tree.imports[module]:
            if imp.target not in tree.paths or tree.unit(imp.target) == home:
                continue
            private = [n for n in imp.names if _private(n)]
            part = _private_part(tree, imp.target)
            private += [part] if part else []
            if private:
                wrong.append(f"{module} imports {imp.target}: {', '.join(private)} at {imp.where(tree)}")
        bound = _module_bindings(tree, module)
        for node in ast.walk(tree.sources[module]):
            dotted = _dotted(node) if isinstance(node, ast.Attribute) else None
            if not dotted or dotted.split(".")[0] not in bound:
                continue
            dotted = bound[dotted.split(".")[0]] + dotted[len(dotted.split(".")[0]) :]
            target = tree.project_module(dotted)
            if target is None or tree.unit(target) == home or dotted == target:
                continue
            name = dotted[len(target) + 1 :].split(".")[0]
            if _private(name):
                path = tree.paths[module].relative_to(tree.root).as_posix()
                wrong.append(f"{module} reads {target}.{name} at {path}:{node.lineno}")
    return sorted(set(wrong))


def _is_facade(source: ast.Module) -> bool:
    """Only a docstring, ``from`` imports and ``__all__``: a module that exists to re-export."""
    body = source.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    reexports = [n for n in body if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
    rest = [
        n
        for n in body
        if not isinstance(n, (ast.Import, ast.ImportFrom))
        and not (isinstance(n, ast.Assign) and [_dotted(t) for t in n.targets] == ["__all__"])
    ]
    return bool(reexports) and not rest


def no_reexport_facades(tree: Tree) -> list[str]:
    """A module is more than a list of another module's names. A subpackage's ``__init__`` is its contract
    and may export its public names."""
    return [
        f"{module} only re-exports ({tree.paths[module].relative_to(tree.root).as_posix()})"
        for module in tree.modules()
        if not tree.is_package(module) and _is_facade(tree.sources[module])
    ]


def _annotation_names(annotation: ast.expr | None) -> set[str]:
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}


def no_free_function_mutates_another_modules_object(tree: Tree) -> list[str]:
    """No module-level function assigns attributes of a parameter whose type another project module
    defines: that state belongs to the type's own methods."""
    wrong = []
    for module in tree.modules():
        foreign = {
            alias.asname or alias.name
            for node in tree.sources[module].body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if (tree.project_module(node.module or "") or "") not in ("", module)
            and f"{node.module}.{alias.name}" not in tree.paths
        }
        foreign |= {
            alias.asname or alias.name
            for node in ast.walk(tree.sources[module])
            if isinstance(node, ast.If) and any(isinstance(s, ast.ImportFrom) for s in node.body)
            for s in node.body
            if isinstance(s, ast.ImportFrom) and tree.project_module(s.module or "") not in (None, module)
            for alias in s.names
        }
        for fn in tree.sources[module].body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
            params = {a.arg for a in args if _annotation_names(a.annotation) & foreign}
            for node in ast.walk(fn):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                for target in targets:
                    dotted = _dotted(target) if isinstance(target, ast.Attribute) else None
                    if dotted and dotted.split(".")[0] in params:
                        path = tree.paths[module].relative_to(tree.root).as_posix()
                        wrong.append(f"{module}.{fn.name} assigns {dotted} at {path}:{node.lineno}")
                        break
    return wrong


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def no_module_cycles(tree: Tree) -> list[str]:
    """No two modules import each other, directly or around a loop (lazy imports count: a lazy import is
    how a cycle hides)."""
    graph = {module: project_edges(tree, module) for module in tree.paths}
    wrong = []
    for cycle in _cycles(graph):
        inner = [
            f"{imp.importer} -> {imp.target} at {imp.where(tree)}"
            + (" (type-only)" if imp.type_only else " (lazy)" if imp.lazy else "")
            for module in cycle
            for imp in tree.imports[module]
            if imp.target in cycle and imp.target != module
        ]
        wrong.append(" <-> ".join(cycle) + ": " + "; ".join(inner))
    return wrong


def _node(tree: Tree, module: str) -> str:
    """A subpackage, or a module at a root: a root holds modules of every layer (``elastic.errors`` at the
    bottom, the worker API above ``elastic.checkpoint``), so each is a node of its own."""
    unit = tree.unit(module)
    return module if "." not in unit else unit


def no_subpackage_cycles(tree: Tree) -> list[str]:
    """The subpackages (and the roots' own modules) form a DAG: no two depend on each other."""
    graph: dict[str, set[str]] = {}
    edges: dict[tuple[str, str], list[str]] = {}
    for module in tree.modules():
        home = _node(tree, module)
        graph.setdefault(home, set())
        for target in sorted(project_edges(tree, module)):
            there = _node(tree, target)
            if there != home:
                graph[home].add(there)
                edges.setdefault((home, there), []).append(f"{module} -> {target}")
    wrong = []
    for cycle in _cycles(graph):
        inner = [e for (a, b), found in sorted(edges.items()) if a in cycle and b in cycle for e in found]
        wrong.append(" <-> ".join(cycle) + ": " + "; ".join(inner))
    return wrong


@dataclass(frozen=True)
class Layer:
    rule: str
    check: Callable[[Tree], list[str]]


#: DESIGN.md's "Layers" paragraph, line for line, then the package graph its "Packages" section draws.
LAYERS: tuple[Layer, ...] = (
    Layer("stdlib-only contracts at the bottom", contracts_are_stdlib_only),
    Layer(
        "elastic.control never imports torch (reached)",
        NeverImports(inside("elastic.control"), ("torch",), reached=True),
    ),
    Layer(
        "the worker library never imports the control client (reached)",
        NeverImports(worker_library, CONTROL_CLIENT, reached=True),
    ),
    Layer(
        "master.job is pure: no threads, processes, sockets, web framework, etcd client (reached)",
        NeverImports(inside("master.job"), IO + WEB_FRAMEWORK + ETCD_CLIENT, reached=True),
    ),
    Layer(
        "agent.machine is pure: no threads, processes, sockets, web framework, etcd client (reached)",
        NeverImports(inside("agent.machine"), IO + WEB_FRAMEWORK + ETCD_CLIENT, reached=True),
    ),
    # Stricter than DESIGN.md, from the machine's own contract (docs/architecture.md): `now` is passed in,
    # the executor owns the event queue and the environment.
    Layer(
        "agent.machine has no clock, queue or environment of its own",
        NeverImports(inside("agent.machine"), ("time", "queue", "os")),
    ),
    Layer("etcd only under master.store", NeverImports(outside("master.store"), ETCD_CLIENT, type_only=True)),
    Layer(
        "master.service never imports the web framework (reached, type-only imports too)",
        NeverImports(inside("master.service"), WEB_FRAMEWORK, reached=True, type_only=True),
    ),
    Layer(
        "only agent.cli imports master (to embed it) (reached, type-only imports too)",
        NeverImports(
            outside("agent.cli", "master"),
            ("master",),
            reached=True,
            type_only=True,
            allowed={
                # `python -m agent` is `elastic-run`: the entry point runs the command line, which embeds
                # the master for standalone and convenience mode.
                ("agent.__main__", "agent.cli.main"): "the entry point of `python -m agent`",
            },
        ),
    ),
    Layer("no private name crosses a subpackage", no_private_name_crosses_a_subpackage),
    Layer("no re-export facades", no_reexport_facades),
    Layer(
        "no free function that mutates another module's object",
        no_free_function_mutates_another_modules_object,
    ),
    Layer("no import cycles inside a package", no_module_cycles),
    Layer("no import cycles between packages", no_subpackage_cycles),
    # DESIGN.md "Packages and their single jobs": elastic is shared by master and agent, so it imports
    # neither; the master never imports the agent.
    Layer(
        "elastic imports neither master nor agent",
        NeverImports(inside("elastic"), ("master", "agent"), type_only=True),
    ),
    Layer("master never imports agent", NeverImports(inside("master"), ("agent",), type_only=True)),
)


@pytest.fixture(scope="module")
def repo_tree() -> Tree:
    return scan(REPO)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layer", LAYERS, ids=[layer.rule for layer in LAYERS])
def test_the_tree_keeps_the_layer(layer: Layer, repo_tree: Tree) -> None:
    wrong = layer.check(repo_tree)
    assert not wrong, f"{layer.rule}:\n  " + "\n  ".join(wrong)


# --- the rules catch what they name: a small clean tree, then one planted import per rule ---------------

CLEAN_TREE = {
    "elastic/__init__.py": '"""Lazy."""\nfrom elastic.report import report\n',
    "elastic/report.py": "import socket\nimport threading\n\nfrom elastic import contract\n\nreport = 1\n",
    "elastic/contract.py": "import json\n\nfrom elastic import errors\n\nX = 1\n",
    "elastic/errors.py": "class ElasticRunError(Exception):\n    pass\n",
    "elastic/distributed.py": "import torch\n\nfrom elastic.contract import X\n\nY = X\n",
    "elastic/checkpoint/__init__.py": '"""Checkpoints."""\n',
    "elastic/checkpoint/layout.py": "import torch\n\nfrom elastic import errors\n\nZ = 1\n",
    "elastic/control/__init__.py": '"""The control plane."""\n',
    "elastic/control/error_table.py": "from enum import Enum\n\nfrom elastic import errors\n\nE = Enum\n",
    "elastic/control/protocol.py": "import pydantic\n\nfrom elastic.control import error_table\n\nP = 1\n",
    "elastic/control/client.py": "import httpx\n\nfrom elastic.control.protocol import P\n\nC = P\n",
    "elastic/control/streams.py": "from elastic.control.client import C\n\nS = C\n",
    "master/__init__.py": "",
    "master/job/__init__.py": '"""The job."""\n',
    "master/job/job.py": "import time\n\nfrom elastic.control.protocol import P\n\n\nclass Job:\n    v = P\n",
    "master/job/rounds.py": (
        "from master.job.job import Job\n\n\nclass Rounds:\n    def close(self, job: Job) -> None:\n"
        "        job.v = 2\n"
    ),
    "master/store/__init__.py": '"""Stores."""\n',
    "master/store/etcd_store.py": "import aetcd\n\nfrom master.job.job import Job\n\nE = Job\n",
    "master/service/__init__.py": '"""The service."""\n',
    "master/service/service.py": (
        "import asyncio\n\nfrom master.job.job import Job\nfrom master.store.etcd_store import E\n\n"
        "S = (Job, E)\n"
    ),
    "master/http/__init__.py": '"""HTTP."""\n',
    "master/http/app.py": "import fastapi\n\nfrom master.service.service import S\n\nA = S\n",
    "agent/__init__.py": "",
    "agent/__main__.py": "from agent.cli.main import main\n\nmain()\n",
    "agent/machine/__init__.py": '"""The machine."""\n',
    "agent/machine/decisions.py": "import enum\n\nfrom elastic.control.protocol import P\n\nD = P\n",
    "agent/warm/__init__.py": '"""Warm starts."""\n',
    "agent/warm/zygote_ops.py": "import json\n\nOPS = 1\n",
    "agent/warm/_zygote_proc.py": "from agent.warm import zygote_ops\n\nZ = zygote_ops.OPS\n",
    "agent/executor/__init__.py": '"""The executor."""\n',
    "agent/executor/loop.py": (
        "import threading\n\nfrom agent.machine.decisions import D\nfrom elastic.control.streams import S\n\n"
        "L = (D, S)\n"
    ),
    "agent/cli/__init__.py": '"""The command line."""\n',
    "agent/cli/main.py": (
        "def main() -> None:\n    from master.http.app import A\n    from agent.executor.loop import L\n"
        "    print(A, L)\n"
    ),
}

#: Rule -> (file, source) of one import it forbids, planted into the clean tree.
PLANTED = {
    "stdlib-only contracts at the bottom": ("elastic/contract.py", "import pydantic\n"),
    "elastic.control never imports torch (reached)": (
        "elastic/control/protocol.py",
        "from elastic.checkpoint.layout import Z\n",
    ),
    "the worker library never imports the control client (reached)": (
        "elastic/checkpoint/layout.py",
        "def f() -> None:\n    from elastic.control.streams import S\n",
    ),
    "master.job is pure: no threads, processes, sockets, web framework, etcd client (reached)": (
        "master/job/job.py",
        "from master.store.etcd_store import E\n",
    ),
    "agent.machine is pure: no threads, processes, sockets, web framework, etcd client (reached)": (
        "agent/machine/decisions.py",
        "import concurrent.futures\n",
    ),
    "agent.machine has no clock, queue or environment of its own": (
        "agent/machine/decisions.py",
        "import time\n",
    ),
    "etcd only under master.store": (
        "master/service/service.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aetcd import Client\n",
    ),
    "master.service never imports the web framework (reached, type-only imports too)": (
        "master/service/service.py",
        "from fastapi import Request\n",
    ),
    "only agent.cli imports master (to embed it) (reached, type-only imports too)": (
        "agent/executor/loop.py",
        "def f() -> None:\n    from agent.cli.main import main\n",
    ),
    "no private name crosses a subpackage": (
        "agent/executor/loop.py",
        "from agent.warm import _zygote_proc\n",
    ),
    "no re-export facades": (
        "agent/executor/facade.py",
        '"""Names."""\nfrom agent.machine.decisions import D\n',
    ),
    "no free function that mutates another module's object": (
        "master/service/service.py",
        "def bump(job: Job) -> None:\n    job.v += 1\n",
    ),
    "no import cycles inside a package": (
        "master/job/job.py",
        "def f() -> None:\n    from master.job import rounds\n",
    ),
    "no import cycles between packages": (
        "master/job/job.py",
        "def f() -> None:\n    from master.store import etcd_store\n",
    ),
    "elastic imports neither master nor agent": (
        "elastic/distributed.py",
        "from master.job.job import Job\n",
    ),
    "master never imports agent": ("master/http/app.py", "import agent.machine.decisions\n"),
}


def _plant(root: Path, files: dict[str, str]) -> Tree:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan(root)


@pytest.mark.timeout(30)
def test_every_rule_has_a_planted_import() -> None:
    assert set(PLANTED) == {layer.rule for layer in LAYERS}


@pytest.mark.timeout(30)
def test_the_clean_tree_keeps_every_layer(tmp_path: Path) -> None:
    tree = _plant(tmp_path, CLEAN_TREE)
    wrong = {layer.rule: layer.check(tree) for layer in LAYERS}
    assert wrong == {layer.rule: [] for layer in LAYERS}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layer", LAYERS, ids=[layer.rule for layer in LAYERS])
def test_a_planted_import_is_reported(layer: Layer, tmp_path: Path) -> None:
    name, planted = PLANTED[layer.rule]
    files = dict(CLEAN_TREE)
    files[name] = planted + files.get(name, "")
    reported = layer.check(_plant(tmp_path, files))
    module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    assert any(module in line for line in reported), reported
