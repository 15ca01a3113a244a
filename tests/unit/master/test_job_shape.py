"""``Job`` is one class: no free function changes it from outside (read from the source, by ``ast``).

DESIGN.md, "Layers": no free function that mutates another module's object. The job's transitions are
methods of :class:`master.job.job.Job` (or of the parts it owns, on their own state): a free function
anywhere in ``elastic/``, ``master/`` or ``agent/`` (inside ``master/job/`` too) that takes a job and
assigns its attributes is what the job was once spread over. Two of the job's figures have one writer
each: the restart count (:class:`master.job.accounting.RestartBudget`) and the durable version
(``Job.record`` and ``Job.note_durable_change``). Each rule is shown to catch a planted module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("elastic", "master", "agent")
#: Annotations that name the job (``JobState`` was its state's name when the job was split).
JOB_TYPES = {"Job", "JobState"}
#: Attributes of the restart count, and the one module that may assign them.
RESTART_COUNT_ATTRS = {"restart_count", "_spent"}
BUDGET_MODULE = "master/job/accounting.py"
#: Job's methods that may move its durable version.
VERSION_WRITERS = {"__init__", "note_durable_change"}


def _annotation_names(node: ast.expr | None) -> set[str]:
    """Names an annotation mentions: ``Job``, ``master.job.job.Job``, ``"Job"``, ``Job | None``."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
    return names


def _job_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters that hold a job: annotated with the job's class, or named ``job``."""
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return {a.arg for a in args if a.arg == "job" or _annotation_names(a.annotation) & JOB_TYPES}


def _root(node: ast.expr) -> ast.expr:
    """``job`` of ``job.a.b[c].d``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement writes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            out.append(target)
    return out


def _free_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions not defined directly in a class body (module-level or nested in a function)."""
    methods = {
        id(item)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for item in cls.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return [
        fn
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(fn) not in methods
    ]


def job_mutations(source: str, where: str) -> list[str]:
    """Free functions of ``source`` that assign attributes of a job they take (or ``setattr`` them)."""
    found = []
    for fn in _free_functions(ast.parse(source, where)):
        params = _job_params(fn)
        if not params:
            continue
        for node in ast.walk(fn):
            written = [t for t in _targets(node) if isinstance(t, (ast.Attribute, ast.Subscript))]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                written = node.args[:1]
            for target in written:
                root = _root(target)
                if isinstance(root, ast.Name) and root.id in params:
                    found.append(f"{where}:{node.lineno} {fn.name}() assigns {ast.unparse(target)}")
    return found


def single_writers(source: str, where: str) -> list[str]:
    """Writes of the restart count outside the budget, and of the job's version outside its writers."""
    found = []
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            if target.attr in RESTART_COUNT_ATTRS and where != BUDGET_MODULE:
                found.append(f"{where}:{node.lineno} assigns {ast.unparse(target)} (only the budget may)")
            if target.attr in {"version", "_version"} and "job" in ast.unparse(target.value).lower():
                found.append(f"{where}:{node.lineno} assigns {ast.unparse(target)} (only Job may)")
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and cls.name in JOB_TYPES):
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in VERSION_WRITERS:
                continue
            for node in ast.walk(fn):
                for target in _targets(node):
                    if isinstance(target, ast.Attribute) and target.attr in {"version", "_version"}:
                        found.append(
                            f"{where}:{node.lineno} {cls.name}.{fn.name}() moves the version "
                            f"(only {', '.join(sorted(VERSION_WRITERS))} may)"
                        )
    return found


def _product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


@pytest.mark.timeout(60)
def test_no_free_function_assigns_the_attributes_of_a_job() -> None:
    found = []
    for path in _product_files():
        found += job_mutations(path.read_text(), path.relative_to(REPO).as_posix())
    assert not found, "make these methods of Job (or of a part it owns):\n" + "\n".join(found)


@pytest.mark.timeout(60)
def test_the_restart_count_and_the_version_have_one_writer_each() -> None:
    found = []
    for path in _product_files():
        found += single_writers(path.read_text(), path.relative_to(REPO).as_posix())
    assert not found, "\n".join(found)


# -- the rules catch what they name ----------------------------------------------------------------------
PLANTED_MUTATIONS = {
    "typed parameter": "def f(job: Job) -> None:\n    job.restarts = 1\n",
    "augmented": "def f(job: Job) -> None:\n    job.count += 1\n",
    "untyped job": "def f(job, now):\n    job.outcome = None\n",
    "quoted annotation": 'def f(j: "Job") -> None:\n    j.rdzv.round = 2\n',
    "qualified annotation": "def f(j: master.job.job.Job) -> None:\n    j.nodes['a'] = 1\n",
    "the old state class": "def f(state: JobState) -> None:\n    state.pending, x = None, 1\n",
    "setattr": "def f(j: Job) -> None:\n    setattr(j, 'term', 3)\n",
    "nested function": "def f() -> None:\n    def g(job: Job | None) -> None:\n        job.term = 1\n",
}

CLEAN = (
    "class Job:\n"
    "    def m(self, other: Job) -> None:\n"
    "        self.x = 1\n"
    "def reads(job: Job) -> int:\n"
    "    local = job.version\n"
    "    return local\n"
    "def other(settings: JobSettings) -> None:\n"
    "    value = settings\n"
    "    value.x = 1\n"
)


@pytest.mark.parametrize("source", PLANTED_MUTATIONS.values(), ids=PLANTED_MUTATIONS.keys())
def test_a_planted_mutation_of_a_job_is_found(source: str, tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(CLEAN + source)
    found = job_mutations(planted.read_text(), "planted.py")
    assert len(found) == 1 and "planted.py:" in found[0], found


PLANTED_WRITES = {
    "restart count outside the budget": ("master/job/job.py", "def f(b):\n    b._spent = 0\n"),
    "restart count on the job": (
        "master/service/x.py",
        "class S:\n    def m(self):\n        self.job.restart_count = 1\n",
    ),
    "version from the service": (
        "master/service/x.py",
        "class S:\n    def m(self):\n        self.job.version += 1\n",
    ),
    "version in another Job method": (
        "master/job/job.py",
        "class Job:\n    def note_durable_change(self):\n        self._version += 1\n"
        "    def sneaky(self):\n        self._version += 1\n",
    ),
}


@pytest.mark.parametrize("where, source", PLANTED_WRITES.values(), ids=PLANTED_WRITES.keys())
def test_a_planted_second_writer_is_found(where: str, source: str, tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    found = single_writers(planted.read_text(), where)
    assert len(found) == 1, found


def test_the_budget_and_the_version_writers_themselves_pass() -> None:
    ok = "class Job:\n    def note_durable_change(self):\n        self._version += 1\n"
    assert not single_writers(ok, "master/job/job.py")
    assert not single_writers("class B:\n    def m(self):\n        self._spent -= 1\n", BUDGET_MODULE)
    assert not job_mutations(CLEAN, "clean.py")
