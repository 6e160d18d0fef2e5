"""Structural checks of the source tree (DESIGN.md's layout; issue 13's "done when"): no import
cycle, imports run one way between the rooms, TVM's moving names in one file, no long files,
no write to ``os.environ`` at import. Static (``ast`` and text only): nothing is imported."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("kvtvm", "schedules")
MAX_LINES = 600
MOVING_NAMES = re.compile(r"tirx|s_tir|sblock")
MOVING_NAMES_HOME = ROOT / "kvtvm" / "kernels" / "_tvm.py"

# (folder of the importing files, packages it must not import); lazy imports count too
LAYERS = [
    ("kvtvm/manager", ["kvtvm.ops", "kvtvm.compiler", "kvtvm.plan", "tvm", "tvm_ffi"]),
    ("kvtvm/ops", ["kvtvm.plan", "kvtvm.engine", "kvtvm.integrations", "kvtvm.relax",
                   "kvtvm.bench", "kvtvm.cli"]),
    ("kvtvm/compiler", ["kvtvm.ops", "kvtvm.plan"]),
    ("kvtvm/engine", ["kvtvm.integrations", "kvtvm.bench", "kvtvm.cli"]),
    ("kvtvm/integrations", ["kvtvm.bench", "kvtvm.cli"]),
]


def _py_files(*roots):
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] == "schedules":  # installed as kvtvm.schedules; imported by both names
        parts.insert(0, "kvtvm")
    return ".".join(parts)


def _canonical(name: str) -> str:
    return "kvtvm." + name if name == "schedules" or name.startswith("schedules.") else name


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, absolute, wherever the import statement is
    (module level, functions, ``if TYPE_CHECKING``); ``from a import b`` gives ``a`` and
    ``a.b`` (``b`` may be a submodule); ``importlib.import_module("x")`` with a literal
    name gives ``x``."""
    tree = ast.parse(path.read_text(), str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and not arg.value.startswith("."):
                found.add(arg.value)
    return {_canonical(n) for n in found if n}


def _import_graph():
    modules = {_module_name(p): p for p in _py_files(*SOURCE_ROOTS)}

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {}
    for name, path in modules.items():
        targets = {resolve(t) for t in _imports(path)}
        # importing one's own ancestor package is how Python loads a submodule, not a cycle
        edges[name] = {t for t in targets
                       if t and t != name and not name.startswith(t + ".")}
    return edges


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the checks -------------------------------------------------------------------------------

def test_cycle_finder_finds_a_cycle():
    """The walk itself can fail: a two-module cycle and a three-module one are found, a chain
    is not."""
    edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}, "g": set()}
    assert sorted(_cycles(edges)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    edges = _import_graph()
    assert len(edges) > 20 and any(edges.values())
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.skipif(not (ROOT.parent / "shared" / "tools" / "import-cycles.py").exists(),
                    reason="../shared/tools/import-cycles.py is not beside the repository")
def test_shared_import_cycle_tool_agrees():
    proc = subprocess.run([sys.executable, str(ROOT.parent / "shared" / "tools" /
                                               "import-cycles.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("folder,forbidden", LAYERS, ids=[f for f, _ in LAYERS])
def test_imports_run_one_way(folder, forbidden):
    files = list(_py_files(folder))
    if not files:
        pytest.skip(f"{folder}/ does not exist (yet)")
    bad = []
    for path in files:
        for name in sorted(_imports(path)):
            hit = [f for f in forbidden if name == f or name.startswith(f + ".")]
            if hit:
                bad.append(f"{_rel(path)} imports {name}")
    assert not bad, f"{folder} must not import {forbidden}:\n" + "\n".join(bad)


def test_moving_tvm_names_live_in_one_file():
    """``tirx``, ``s_tir`` and ``sblock`` (names TVM renames between releases) are spelled in
    kvtvm/kernels/_tvm.py only; everything else imports them from there."""
    this = Path(__file__).resolve()
    bad = []
    for folder in ("kvtvm", "schedules", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.resolve() in (
                    this, MOVING_NAMES_HOME.resolve()):
                continue
            if path.suffix in (".so", ".o", ".pyc", ".png", ".gguf", ".bin"):
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            lines = [i + 1 for i, line in enumerate(text.splitlines())
                     if MOVING_NAMES.search(line)]
            if lines:
                bad.append(f"{_rel(path)}: lines {lines[:8]}{' ...' if len(lines) > 8 else ''}")
    assert not bad, "tirx/s_tir/sblock spelled outside kvtvm/kernels/_tvm.py:\n" + "\n".join(bad)


def test_no_long_files():
    long = [f"{_rel(p)}: {n} lines" for p in _py_files(*SOURCE_ROOTS)
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


class _EnvironWrites(ast.NodeVisitor):
    """Writes to ``os.environ`` that run when the module is imported (function bodies are
    skipped; class bodies, ``if``/``try``/``with`` blocks at module level are not)."""

    MUTATORS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__",
                "__delitem__"}

    def __init__(self, tree):
        self.environ = {"os.environ"}  # spellings of os.environ in this module
        self.putenv = {"os.putenv", "os.unsetenv"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "os":
                for alias in node.names:
                    if alias.name == "environ":
                        self.environ.add(alias.asname or "environ")
                    elif alias.name in ("putenv", "unsetenv"):
                        self.putenv.add(alias.asname or alias.name)
        self.found = []

    def visit_FunctionDef(self, node):
        for deco in node.decorator_list:  # decorators run at import
            self.visit(deco)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        pass

    def _is_environ(self, node):
        return ast.unparse(node) in self.environ

    def _note(self, node):
        self.found.append((node.lineno, ast.unparse(node).splitlines()[0][:100]))

    def _check_targets(self, node, targets):
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Subscript) and self._is_environ(sub.value):
                    self._note(node)
                    return

    def visit_Assign(self, node):
        self._check_targets(node, node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_targets(node, [node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._check_targets(node, [node.target])
        self.generic_visit(node)

    def visit_Delete(self, node):
        self._check_targets(node, node.targets)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in self.MUTATORS \
                and self._is_environ(func.value):
            self._note(node)
        elif ast.unparse(func) in self.putenv:
            self._note(node)
        self.generic_visit(node)


def _environ_writes_at_import(source: str):
    tree = ast.parse(source)
    visitor = _EnvironWrites(tree)
    visitor.visit(tree)
    return visitor.found


def test_environ_write_finder_finds_writes():
    """The finder itself can fail: each spelling of a write at import is found; writes inside
    functions and reads are not."""
    source = (
        "import os\nfrom os import environ as env, putenv\n"
        "os.environ['A'] = '1'\n"
        "os.environ.setdefault('B', '1')\n"
        "if True:\n    env.update(C='1')\n"
        "try:\n    putenv('D', '1')\nexcept Exception:\n    pass\n"
        "class K:\n    os.environ['E'] = '1'\n"
        "def f():\n    os.environ['F'] = '1'\n"
        "x = os.environ.get('G')\n"
        "y = os.environ['H'] if 'H' in os.environ else None\n")
    assert [line for line, _ in _environ_writes_at_import(source)] == [3, 4, 6, 8, 12]


def test_no_environ_write_at_import():
    """Configuration is read from the environment, never written into it when kvtvm is
    imported (TVM's thread pool is configured through its runtime at first use)."""
    bad = [f"{_rel(p)}:{line}: {text}" for p in _py_files("kvtvm")
           for line, text in _environ_writes_at_import(p.read_text())]
    assert not bad, "os.environ written at import:\n" + "\n".join(bad)


def test_layout_folders_exist():
    """The rooms of DESIGN.md's layout, and the test folders by area."""
    want = ["kvtvm/manager", "kvtvm/kernels", "kvtvm/compiler", "kvtvm/ops",
            "kvtvm/integrations", "kvtvm/bench", "schedules/append", "schedules/copy",
            "schedules/decode", "schedules/prefill", "tests/manager", "tests/ops",
            "tests/kernels", "tests/compiler", "tests/integrations", "tests/e2e"]
    missing = [d for d in want if not (ROOT / d).is_dir()]
    assert not missing, f"missing folders: {missing}"
    for family in ("append", "copy", "decode", "prefill"):
        for target in ("cpu.py", "cuda.py"):
            assert (ROOT / "schedules" / family / target).is_file() or \
                not (ROOT / "schedules" / family).is_dir(), f"schedules/{family}/{target}"
    stray = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                   if p.name != Path(__file__).name)
    assert not stray, f"tests not yet in an area folder: {stray}"

