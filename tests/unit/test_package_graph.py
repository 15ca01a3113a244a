"""The package graph: ``elastic`` (shared protocol, settings, client) <- ``master``, ``agent``; no cycles.

Imports are read from the source (every ``import`` statement, also those inside functions), so a lazy
import counts as much as a top-level one.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("elastic", "master", "agent")
#: The one place the agent may import the master: to embed it (standalone and convenience mode).
AGENT_EMBEDS_MASTER_IN = {"agent.cli.bootstrap"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from pkg import mod`` resolved to ``pkg.mod``)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import mod`` imports pkg.mod; ``from pkg import name`` imports pkg itself.
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _package(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.timeout(60)
def test_packages_form_a_dag_elastic_at_the_bottom() -> None:
    wrong = []
    for module, targets in _imports().items():
        for target in targets:
            src, dst = _package(module), _package(target)
            if src == dst:
                continue
            embeds = src == "agent" and dst == "master" and module in AGENT_EMBEDS_MASTER_IN
            allowed = dst == "elastic" or embeds
            if not allowed:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the package DAG:\n" + "\n".join(sorted(wrong))


@pytest.mark.timeout(60)
def test_no_module_import_cycles() -> None:
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


#: The agent's decisions are a pure state machine (agent.machine.decisions): the standard library, minus
#: anything that waits, spawns or talks, and the wire models; the executor (agent.executor.loop) does all I/O.
PURE_AGENT_MODULES = {
    "agent.machine.decisions": {"agent.machine.events", "elastic.control.protocol"},
    "agent.machine.events": {"elastic.control.protocol"},
}
IO_MODULES = {"asyncio", "os", "queue", "selectors", "socket", "subprocess", "threading", "time"}


@pytest.mark.timeout(60)
def test_the_agent_machine_does_no_io() -> None:
    import sys

    wrong = []
    for module, allowed in PURE_AGENT_MODULES.items():
        path = REPO / (module.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                stdlib = top in sys.stdlib_module_names and top not in IO_MODULES
                if not (stdlib or name in allowed or top == "__future__"):
                    wrong.append(f"{module} imports {name}")
    assert not wrong, "the agent machine must stay pure:\n" + "\n".join(wrong)
