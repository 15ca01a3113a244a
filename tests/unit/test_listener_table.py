"""Every listener elastic-run has is in ``elastic.control.listener_rules.LISTENERS`` (and so in
docs/security.md's table): a ``Listener`` defined anywhere in the packages must be one of the table's, and
every
``check_listener`` call names one of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from elastic.control.listener_rules import LISTENERS, Listener

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "master", "elastic")
DOCS = REPO / "docs" / "security.md"


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out.append((name, ast.parse(path.read_text(), filename=str(path))))
    return out


def _name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def defined_listeners() -> list[tuple[str, str | None]]:
    """``(module, name)`` of every ``Listener(...)`` built in the packages (name None: not a module-level
    constant, which the table cannot hold)."""
    found = []
    for module, tree in _modules():
        constants = {
            id(stmt.value): stmt.targets[0].id
            for stmt in tree.body
            if isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        }
        constants.update(
            (id(stmt.value), stmt.target.id)
            for stmt in tree.body
            if isinstance(stmt, ast.AnnAssign)
            and stmt.value is not None
            and isinstance(stmt.target, ast.Name)
        )
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) == "Listener":
                found.append((module, constants.get(id(node))))
    return found


def checked_listeners() -> list[tuple[str, str]]:
    """``(module, expression)`` of the first argument of every ``check_listener(...)`` call."""
    found = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) == "check_listener" and node.args:
                found.append((module, ast.unparse(node.args[0])))
    return found


@pytest.mark.timeout(30)
def test_every_listener_defined_in_the_packages_is_in_the_table() -> None:
    definitions = defined_listeners()
    assert ("elastic.control.listener_rules", "MASTER_API") in definitions, "the scan finds the table's own"
    for module, name in definitions:
        assert name is not None, (
            f"{module} builds a Listener inline: define it in elastic/control/listener_rules.py"
        )
        value = getattr(importlib.import_module(module), name)
        assert isinstance(value, Listener)
        assert value in LISTENERS, (
            f"{module}.{name} ({value.name!r}) is not in elastic.control.listener_rules.LISTENERS: "
            "define the listener there (and add its row to docs/security.md)"
        )


@pytest.mark.timeout(30)
def test_every_checked_listener_is_in_the_table() -> None:
    calls = checked_listeners()
    assert calls, "the scan finds the check_listener calls"
    for module, expression in calls:
        if module == "elastic.control.listener_rules":
            continue  # the definition itself
        value = getattr(importlib.import_module(module), expression.split(".")[-1], None)
        assert value in LISTENERS, f"{module} checks {expression}, which is not in LISTENERS"


@pytest.mark.timeout(30)
def test_the_security_docs_table_has_a_row_for_every_listener() -> None:
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| ")]
    for listener in LISTENERS:
        assert any(listener.name in row for row in rows), (
            f"docs/security.md has no table row for {listener.name!r}"
        )
