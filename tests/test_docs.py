"""The reference docs say what the code does: docs/cli.md is the commands' own help text."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", REPO / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_matches_the_commands_help() -> None:
    committed = (REPO / "docs" / "cli.md").read_text()
    assert _gen_cli().render() == committed, (
        "docs/cli.md differs from the commands' --help: run `python docs/gen_cli.py` and commit the result"
    )
