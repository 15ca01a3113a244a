"""The reference docs say what the code does: docs/cli.md holds every option, default and help text.

The checks read the click commands themselves, not a rendering of their help: a newer click may lay out
the usage line or wrap text differently (``[OPTIONS] COMMAND`` became ``[OPTIONS] [COMMAND]``), which is
no drift in what the commands do.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from agent.cli.main import cli as run_cli
from master.cli.main import cli as master_cli

REPO = Path(__file__).resolve().parents[2]
CLI_DOC = REPO / "docs" / "cli.md"
HINT = "run `python docs/gen_cli.py` and commit docs/cli.md"

COMMANDS: dict[str, click.Command] = {
    "elastic-run": run_cli,
    "elastic-master": master_cli,
    "elastic-master status": master_cli.commands["status"],  # type: ignore[attr-defined]
    "elastic-master readmit": master_cli.commands["readmit"],  # type: ignore[attr-defined]
}


def _flat(text: str) -> str:
    """Whitespace-insensitive form; click may also wrap a line after a hyphen (``pre-`` / ``started``)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def _section(title: str) -> str:
    """The fenced help block under ``## `title` `` in docs/cli.md."""
    doc = CLI_DOC.read_text()
    match = re.search(rf"^## `{re.escape(title)}`\n\n```text\n(.*?)\n```", doc, re.S | re.M)
    assert match, f"docs/cli.md has no section for {title}: {HINT}"
    return match.group(1)


def _visible_options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


def _default_shown(option: click.Option) -> str | None:
    """The ``[default: ...]`` text click shows for ``option``, or None when it shows none."""
    with click.Context(click.Command("x")) as ctx:
        record = option.get_help_record(ctx)
    if record is None:
        return None
    found = re.search(r"\[(?:[^\]]*; )?(default: [^\]]*?)(?:;[^\]]*)?\]$", record[1])
    return found.group(1) if found else None


@pytest.mark.parametrize("title", sorted(COMMANDS))
def test_every_option_of_the_command_is_documented_with_its_help_and_default(title: str) -> None:
    section = _section(title)
    flat = _flat(section)
    for option in _visible_options(COMMANDS[title]):
        names = option.opts + option.secondary_opts
        for name in names:
            found = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", section)
            assert found, f"{title}: {name} missing: {HINT}"
        if option.help:
            assert _flat(option.help) in flat, f"{title} {names[0]}: help text differs: {HINT}"
        default = _default_shown(option)
        if default is not None:
            assert _flat(default) in flat, f"{title} {names[0]}: {default!r} not documented: {HINT}"


def _option_names(help_line: str) -> list[str]:
    """Option names at the start of a line of click's option list (``  --a, --b TEXT  help``)."""
    stripped = help_line.strip()
    if not help_line.startswith("  ") or not stripped.startswith("-"):
        return []
    names_part = stripped.split("  ")[0]
    return re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", names_part)


@pytest.mark.parametrize("title", sorted(COMMANDS))
def test_the_docs_name_no_option_the_command_lacks(title: str) -> None:
    known = {name for p in COMMANDS[title].params for name in getattr(p, "opts", []) + p.secondary_opts}
    documented = {name for line in _section(title).splitlines() for name in _option_names(line)}
    stale = sorted(documented - known - {"-h", "--help"})
    assert not stale, f"{title}: docs/cli.md documents options that no longer exist: {stale}: {HINT}"


@pytest.mark.parametrize("title", sorted(COMMANDS))
def test_the_command_description_is_documented(title: str) -> None:
    command = COMMANDS[title]
    summary = _flat((command.help or "").split("\n\n")[0])
    assert summary in _flat(_section(title)), f"{title}: description differs: {HINT}"
