"""docs/protocol.md says what the contract modules define: the worker environment, the progress datagram,
the warm-start zygote's operations and the error table. Each check reads a table of the doc and compares
it with the code, so a name added, renamed or removed on one side only fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from agent.warm.zygote_ops import MESSAGES, ZygoteOp
from elastic import contract
from elastic.contract import WIRE_KEYS, ProgressKind
from elastic.control.error_table import ERROR_TABLE, ErrorCode

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _table(section: str) -> list[list[str]]:
    """The rows of the first table under ``## section``, each a list of its cells (header excluded)."""
    text = DOC.read_text()
    match = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/protocol.md has no section {section!r}"
    lines = match.group(1).splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) > 2, f"no table under {section!r}"
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows[2:]]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_worker_environment_table_lists_every_variable_the_contract_names() -> None:
    documented = [_names(row[0])[0] for row in _table("Worker environment")]
    assert documented == list(contract.WORKER_ENVIRONMENT)


def test_the_variables_a_user_sets_are_listed_too() -> None:
    text = DOC.read_text()
    start = text.index("| variable | read by | meaning |")
    rows = text[start:].split("\n\n")[0].splitlines()[2:]
    assert [_names(row)[0] for row in rows] == list(contract.USER_VARIABLES)


def test_the_progress_datagram_table_matches_the_typed_report() -> None:
    rows = _table("Progress datagram")
    documented = {_names(row[0])[0]: _names(row[1])[0] for row in rows}
    assert documented == {key: name for name, key in WIRE_KEYS.items()}
    fields = {f.name for f in dataclasses.fields(contract.Progress)}
    assert set(WIRE_KEYS) == fields, "every field of Progress has a wire key"
    kinds = next(_names(row[3]) for row in rows if _names(row[0]) == ["k"])
    assert kinds == [kind.value for kind in ProgressKind]


def test_the_zygote_table_lists_every_operation_with_its_fields() -> None:
    documented = {_names(row[0])[0]: _names(row[2]) for row in _table("Warm-start zygote")}
    assert list(documented) == [op.value for op in ZygoteOp]
    for op, cls in MESSAGES.items():
        assert documented[op.value] == [f.name for f in dataclasses.fields(cls)], op.value


def test_the_error_table_of_the_doc_is_the_one_agents_use() -> None:
    documented = {}
    for row in _error_rows():
        status, code, agent = row[0], _names(row[1]), row[3]
        if code:
            documented[(int(status), code[0])] = agent.split(",")[0].strip()
    assert documented == {(status, code.value): d.value for (status, code), d in ERROR_TABLE.items()}
    assert {code for _, code in documented} <= {code.value for code in ErrorCode}


def _error_rows() -> list[list[str]]:
    """The rows of the error table (the second table under "Every request")."""
    text = DOC.read_text()
    start = text.index("| status | code | when | agent |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows
