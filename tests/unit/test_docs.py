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


# -- links stay inside the repository -----------------------------------------------------------------------
#: The Markdown a reader gets with the repository: every page of docs/ and the README.
DOC_PAGES = sorted([*REPO.glob("docs/*.md"), REPO / "README.md"])
#: ``[text](target)`` and ``<img src="target">`` / ``<a href="target">``.
LINK = re.compile(r"\]\((?P<md>[^)\s]+)(?:\s+\"[^\"]*\")?\)|\b(?:src|href)=\"(?P<html>[^\"]+)\"")
#: A web address or another scheme (``https:``, ``mailto:``): not a file of the reader's checkout.
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
#: A Markdown file named in prose or in a docstring (``DESIGN.md``, ``docs/cli.md``), not inside a path
#: that starts at the file system's root (a benchmark's ``--markdown-out /tmp/x.md``).
MD_NAME = re.compile(r"(?<![\w./-])(?:[\w-]+/)*[\w.-]+\.md\b")


def links_leaving_the_repository(page: Path, text: str, repo: Path = REPO) -> list[str]:
    """The link targets of ``text`` (the page ``page``) that a reader's checkout cannot resolve: absolute
    paths, ``file:`` addresses, and relative paths whose ``..`` climb out of ``repo``."""
    outside = []
    for match in LINK.finditer(text):
        target = match.group("md") or match.group("html")
        path = target.split("#", 1)[0]
        if not path or (SCHEME.match(path) and not path.lower().startswith("file:")):
            continue  # an anchor on the same page, or a web address
        resolved = (page.parent / path).resolve()
        if path.startswith("/") or path.lower().startswith("file:") or not resolved.is_relative_to(repo):
            outside.append(target)
    return outside


def markdown_files_named_but_absent(text: str, repo: Path = REPO) -> list[str]:
    """Markdown file names in ``text`` that no file of ``repo`` has: notes kept outside the repository."""
    present = {p.name for p in repo.rglob("*.md") if ".git" not in p.parts}
    return sorted({m.group(0) for m in MD_NAME.finditer(text) if Path(m.group(0)).name not in present})


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_a_doc_links_only_inside_the_repository(page: Path) -> None:
    outside = links_leaving_the_repository(page, page.read_text(encoding="utf-8"))
    assert not outside, f"{page.relative_to(REPO)} links outside the repository: {outside}"


def test_docs_and_docstrings_name_no_markdown_file_the_repository_lacks() -> None:
    sources = [*DOC_PAGES, *sorted((REPO / "elastic").rglob("*.py"))]
    found = {
        path.relative_to(REPO).as_posix(): absent
        for path in sources
        if (absent := markdown_files_named_but_absent(path.read_text(encoding="utf-8")))
    }
    assert not found, f"these name files that are not in the repository (say what they meant): {found}"


@pytest.mark.parametrize(
    ("target", "leaves"),
    [
        ("cli.md", False),
        ("cli.md#elastic-run", False),
        ("#flapping-nodes", False),
        ("../bench/figures.py", False),
        ("https://pdoc.dev", False),
        ("../../shared/DESIGN.md", True),
        ("/work/shared/STYLE.md", True),
        ("file:///etc/hosts", True),
    ],
)
def test_a_link_is_judged_by_where_it_resolves(tmp_path: Path, target: str, leaves: bool) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    page = repo / "docs" / "page.md"
    for text in (f"See [it]({target}).", f'<img src="{target}">'):
        assert links_leaving_the_repository(page, text, repo) == ([target] if leaves else []), text


def test_a_markdown_file_outside_the_repository_is_found_by_name(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cli.md").write_text("# CLI\n")
    text = "As docs/cli.md and DESIGN.md say; `--markdown-out /tmp/run.md`; see cli.md."
    assert markdown_files_named_but_absent(text, tmp_path) == ["DESIGN.md"]
