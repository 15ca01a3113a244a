"""The API reference of ``import elastic`` builds from its docstrings, and documents every public name.

The build is the command docs/testing.md gives (pdoc, warnings as errors), run into a temp folder. For
each name of ``elastic.__all__`` the page must show it with its signature (every parameter, in order)
and the first line of its docstring; a public name without a docstring of its own fails. So do the
public methods and properties of the public classes.
"""

from __future__ import annotations

import ast
import html
import inspect
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import elastic

REPO = Path(__file__).resolve().parents[2]
TESTING_DOC = REPO / "docs" / "testing.md"
#: The documented command: ``python -W error -m pdoc ... -o build/api`` on one line of docs/testing.md.
COMMAND = re.compile(r"^python (?P<args>-W error -m pdoc .*) -o (?P<out>\S+)$", re.M)

pytestmark = pytest.mark.timeout(180)


def _documented_command() -> tuple[list[str], str]:
    """The pdoc arguments after ``python`` and the output folder of the command in docs/testing.md."""
    found = COMMAND.search(TESTING_DOC.read_text())
    assert found, "docs/testing.md gives no `python -W error -m pdoc ... -o DIR` command line"
    return shlex.split(found.group("args")), found.group("out")


def _build(args: list[str], out: Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args, "-o", str(out)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference built by the documented command, in a temp folder (pytest removes it)."""
    args, _ = _documented_command()
    out = tmp_path_factory.mktemp("api")
    done = _build(args, out)
    assert done.returncode == 0, f"the API reference does not build cleanly:\n{done.stderr[-4000:]}"
    return out


def _text(fragment: str) -> str:
    """Visible text of an HTML fragment without whitespace (markup splits words unpredictably)."""
    return "".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _plain(docstring_line: str) -> str:
    """A docstring line as the page shows it, as :func:`_text` reads it: no reST roles, no backticks or
    emphasis marks, no whitespace."""
    # pdoc shows :func:`f` and :meth:`m` as ``f()``, and ``~a.b`` as ``b``.
    line = re.sub(r":(?:func|meth):`([^`]*)`", r"\1()", docstring_line)
    line = re.sub(r":[a-z]+:`([^`]*)`", r"\1", line)
    line = re.sub(r"~(?:\w+\.)*(\w+)", r"\1", line)
    return "".join(line.replace("`", "").replace("*", "").split())


def _parts(page: str, anchor: str) -> tuple[str, str]:
    """(signature text, docstring text) of the member whose anchor is ``anchor``; source views left out."""
    start = re.search(rf'<(?:section|div) id="{re.escape(anchor)}"[^>]*>', page)
    assert start, f"{anchor}: not in the reference"
    rest = page[start.end() :]
    end = re.search(r'<(?:section|div) id="[^"]+"', rest)
    block = re.sub(
        r'<div class="pdoc-code codehilite">.*?</pre></div>',
        "",
        rest[: end.start() if end else None],
        flags=re.S,
    )
    docstring = re.search(r'<div class="docstring">(.*)', block, re.S)
    signature = block[: docstring.start()] if docstring else block
    return _text(signature), _text(docstring.group(1)) if docstring else ""


def _first_line(obj: Any) -> str:
    """The first line of ``obj``'s own docstring (a class's is not inherited), or ''."""
    own = obj.__doc__ if isinstance(obj, (type, types.ModuleType)) else inspect.getdoc(obj)
    return inspect.cleandoc(own).splitlines()[0] if own else ""


def _variable_docstring(module: types.ModuleType, name: str) -> str:
    """The string literal that follows ``name = ...`` at the top of ``module`` (its docstring), or ''."""
    body = ast.parse(Path(module.__file__ or "").read_text()).body
    for node, after in zip(body, body[1:], strict=False):
        targets = node.targets if isinstance(node, ast.Assign) else []
        assigned = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if assigned and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            return str(after.value.value)
    return ""


def _check_callable(page: str, anchor: str, obj: Any) -> None:
    signature, docstring = _parts(page, anchor)
    first = _first_line(obj)
    assert first, f"{anchor} has no docstring of its own"
    assert _plain(first) in docstring, f"{anchor}: the first docstring line {first!r} is not shown"
    if isinstance(obj, type):
        if "__init__" not in vars(obj):
            return  # an exception class: constructed like its base, no signature of its own
        signature, _ = _parts(page, f"{anchor}.__init__")  # pdoc shows the constructor there
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    if params[:1] == ["self"]:
        params = params[1:]
    positions = [signature.find(p) for p in params]
    assert -1 not in positions, f"{anchor}: the signature {signature!r} lacks a parameter of {params}"
    assert positions == sorted(positions), f"{anchor}: parameters out of order in {signature!r}"


@pytest.mark.parametrize("name", sorted(elastic.__all__))
def test_every_public_name_is_in_the_reference_with_signature_and_summary(reference: Path, name: str) -> None:
    page = (reference / "elastic.html").read_text()
    obj = getattr(elastic, name)
    if isinstance(obj, types.ModuleType):
        # A submodule gets a page of its own, listed on the package's page.
        subpage = reference / "elastic" / f"{name}.html"
        assert subpage.exists(), f"elastic.{name}: no page in the reference"
        assert f'href="elastic/{name}.html"' in page, f"elastic.{name}: not listed on the package page"
        first = _first_line(obj)
        assert first, f"elastic.{name} has no module docstring"
        assert _plain(first) in _text(subpage.read_text()), f"elastic.{name}: its summary is not shown"
    elif callable(obj):
        _check_callable(page, name, obj)
    else:
        doc = _variable_docstring(elastic, name)
        assert doc, f"elastic.{name} has no docstring (a string literal after its assignment)"
        signature, docstring = _parts(page, name)
        assert repr(obj) in signature, f"elastic.{name}: its value {obj!r} is not shown"
        assert _plain(doc.splitlines()[0]) in docstring, f"elastic.{name}: its docstring is not shown"


PUBLIC_CLASSES = sorted(n for n in elastic.__all__ if isinstance(getattr(elastic, n), type))


@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_every_public_method_of_a_public_class_is_documented(reference: Path, name: str) -> None:
    page = (reference / "elastic.html").read_text()
    cls = getattr(elastic, name)
    for member, value in vars(cls).items():
        if member.startswith("_"):
            continue
        if isinstance(value, property):
            _, docstring = _parts(page, f"{name}.{member}")
            first = _first_line(value)
            assert first, f"{name}.{member} has no docstring"
            assert _plain(first) in docstring, f"{name}.{member}: its summary is not shown"
        elif inspect.isfunction(value):
            _check_callable(page, f"{name}.{member}", value)


def test_a_warning_fails_the_documented_build(tmp_path: Path) -> None:
    """Warnings are errors: a module whose ``__all__`` names something missing does not build."""
    args, _ = _documented_command()
    (tmp_path / "broken_api.py").write_text('"""A module."""\n\n__all__ = ["missing"]\n')
    args = [a if a != "elastic" else "broken_api" for a in args]
    done = _build(args, tmp_path / "out", cwd=tmp_path)
    assert done.returncode != 0, "pdoc warned about a name that does not resolve, and still succeeded"
    assert "missing" in done.stderr


def test_the_build_command_writes_where_git_ignores_it() -> None:
    """The documented output folder is ignored by git, so that a local build is never committed."""
    _, out = _documented_command()
    if not (REPO / ".git").exists():  # CI tests a copy of the tree without its git folder: read the file
        top = out.strip("/").split("/")[0]
        lines = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
        assert {f"/{top}/", f"{top}/", f"/{top}", top} & lines, f"{out} is not ignored by .gitignore"
        return
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", f"{out.rstrip('/')}/elastic.html"], cwd=REPO, check=False, timeout=30
    )
    assert ignored.returncode == 0, f"{out} is not ignored by .gitignore"
