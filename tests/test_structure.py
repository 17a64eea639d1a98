"""The package's import structure: no import cycle, folders that import downward only,
no private name across modules (imported, or used on another module's objects).

Every import statement counts, also those inside functions and ``if TYPE_CHECKING``
blocks: an import deferred into a function still ties the two modules together, it
only hides the cycle from the interpreter. A name ``_x`` is private to its module;
what another module needs is public and documented where it is defined.
"""

import ast
import importlib
import pathlib
import re
import subprocess
import sys
from typing import Dict, Iterable, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "kvstore"


def package_modules(root: pathlib.Path = ROOT) -> Dict[str, pathlib.Path]:
    """Dotted name -> source file of every module of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from ... import`` in ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _ancestors(name: str) -> List[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports(
    modules: Dict[str, pathlib.Path],
) -> Tuple[Dict[str, Set[str]], List[Tuple[str, int, str, str]]]:
    """The import graph of ``modules`` and every private name one takes from another.

    An import of ``a.b.c`` from outside package ``a.b`` also runs ``a.b``'s
    ``__init__``: an edge to it too.

    Returns:
        ``edges[m]``: the package modules ``m`` imports; and ``(module, line, source,
        name)`` for each ``_name`` imported from (or read as an attribute of) another
        package module.
    """
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        bound = {}  # local name -> package module it refers to
        for node in ast.walk(tree):
            found = []  # (module imported, name taken from it or None, local name)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        local = a.asname or a.name.split(".")[0]
                        found.append((a.name, None, a.asname and local))
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node)
                if source not in modules:
                    continue
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    if sub in modules:
                        found.append((sub, None, a.asname or a.name))
                    else:
                        found.append((source, a.name, None))
            for target, name, local in found:
                for m in [target] + _ancestors(target):
                    if m in modules and m != module and not module.startswith(m + "."):
                        edges[module].add(m)
                if local:
                    bound[local] = target
                if name and _private(name) and target != module:
                    private.append((module, node.lineno, target, name))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and bound[node.value.id] != module
                and _private(node.attr)
            ):
                private.append((module, node.lineno, bound[node.value.id], node.attr))
    return edges, private


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def cycles(edges: Dict[str, Iterable[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each
    sorted; every import cycle lies inside one."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_cycle_finder_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_scan_sees_deferred_and_private_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text("def f():\n    from .sub.two import _hidden\n")
    (pkg / "sub" / "__init__.py").write_text("from . import two\n")
    (pkg / "sub" / "two.py").write_text(
        "from .. import one\n\ndef g():\n    return one._x\n"
    )
    edges, private = imports(package_modules(tmp_path))
    assert edges["kvstore.one"] == {"kvstore.sub", "kvstore.sub.two"}
    assert edges["kvstore.sub"] == {"kvstore.sub.two"}
    assert cycles(edges) == [["kvstore.one", "kvstore.sub", "kvstore.sub.two"]]
    assert sorted(p[3] for p in private) == ["_hidden", "_x"]


def test_no_import_cycles():
    edges, _ = imports(package_modules())
    found = cycles(edges)
    described = [
        "; ".join(
            f"{m} -> {', '.join(sorted(edges[m] & set(c)))}" for m in c if edges[m]
        )
        for c in found
    ]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_no_private_names_across_modules():
    _, private = imports(package_modules())
    lines = [
        f"{m}:{line} takes {name} from {source}" for m, line, source, name in private
    ]
    assert not lines, "private names used across modules:\n" + "\n".join(lines)


# The package's folders and top-level modules, lowest layer first. A module imports
# only from its own folder or from those listed before it; a new folder or module
# directly in kvstore/ must be given its place here. "" is the package itself
# (``kvstore/__init__.py``), which re-exports the public names.
LAYERS = [
    "platform",  # operating system, devices, mlx-lm: nothing of kvstore's below
    "disk",  # what is on disk: index, node files, chunking, namespaces, salts
    "maintenance",  # stats, verify, gc, pins; the eviction and deletion rules
    "engine",  # the read and write paths, removal, the RAM tier
    "remote",  # the shared S3 tier
    "store",  # KVStore: the façade composing the engine's parts
    "generate",  # kvstore.stream_generate
    "prompts",  # prompt files
    "options",  # options of the commands and serve
    "bench",  # kvstore bench
    "serve",  # what kvstore serve is built from: request salts, metrics
    "server",  # kvstore serve (also python -m kvstore.server)
    "cli",  # the kvstore command
    "__main__",  # python -m kvstore
    "",
]


def unit(module: str) -> str:
    """The folder (or top-level module) of ``module``: ``kvstore.disk.index`` -> disk."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def folder_edges(edges: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The import graph between folders (and top-level modules)."""
    out: Dict[str, Set[str]] = {}
    for m, targets in edges.items():
        out.setdefault(unit(m), set()).update(unit(t) for t in targets)
    for u, targets in out.items():
        targets.discard(u)
    return out


def upward_imports(
    edges: Dict[str, Set[str]], layers: List[str]
) -> List[Tuple[str, str]]:
    """``(module, imported module)`` for each import of a folder listed after the
    importer's own in ``layers``, or of (or by) a folder ``layers`` does not list."""
    rank = {u: i for i, u in enumerate(layers)}
    out = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            a, b = unit(m), unit(t)
            if a != b and not rank.get(b, len(layers)) < rank.get(a, -1):
                out.append((m, t))
    return out


def test_layer_check_finds_upward_imports():
    edges = {
        "kvstore.disk.index": {"kvstore.platform.fsutil"},
        "kvstore.platform.fsutil": {"kvstore.engine.ram"},
        "kvstore.engine.ram": {"kvstore.disk.index", "kvstore.engine.writer"},
        "kvstore.engine.writer": set(),
        "kvstore.stray.x": {"kvstore.disk.index"},
    }
    assert upward_imports(edges, LAYERS) == [
        ("kvstore.platform.fsutil", "kvstore.engine.ram"),
        ("kvstore.stray.x", "kvstore.disk.index"),
    ]
    assert cycles(folder_edges(edges)) == [["disk", "engine", "platform"]]


def test_every_folder_has_a_layer():
    units = {unit(m) for m in package_modules()}
    assert units <= set(LAYERS), f"place {sorted(units - set(LAYERS))} in LAYERS"


def test_folders_import_downward_only():
    edges, _ = imports(package_modules())
    found = upward_imports(edges, LAYERS)
    lines = [f"{m} imports {t} ({unit(t)} is not below {unit(m)})" for m, t in found]
    assert not lines, "imports up the layers:\n" + "\n".join(lines)
    assert cycles(folder_edges(edges)) == []


# Names starting with "_" on other libraries' objects that kvstore uses, and why each
# is safe to use. No kvstore module may define one of them.
FOREIGN_PRIVATE = {
    "_replace": "collections.namedtuple's public API",
    "_exit": "os._exit",
    "_idx": "mlx-lm's RotatingKVCache write position, part of the state it saves",
    "_run_http_server": "mlx_lm.server, checked at start-up (kvstore.platform.compat)",
    "_trie": "mlx-lm's LRUPromptCache trie, searched only where can_prefetch found it",
}


def _defined(tree: ast.AST) -> Set[str]:
    """The names a module defines: functions, classes, assigned names, and attributes
    it assigns on its own objects (``self._x = ...``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _own(node.value)
        ):
            out.add(node.attr)
    return out


def _own(value: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own class hierarchy."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def private_attributes(
    modules: Dict[str, pathlib.Path],
) -> Tuple[List[Tuple[str, int, str]], Dict[str, Set[str]]]:
    """Every ``x._name`` a module uses where ``x`` is not its own object (``self``,
    ``cls``, ``super()``) and ``_name`` is not defined in that module: another
    module's private attribute or method.

    Returns:
        ``(module, line, expression)`` of each use not in :data:`FOREIGN_PRIVATE`,
        and the names each module defines.
    """
    found, defined = [], {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        defined[module] = own = _defined(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and not _own(node.value)
                and node.attr not in own
                and node.attr not in FOREIGN_PRIVATE
            ):
                found.append((module, node.lineno, ast.unparse(node)))
    return found, defined


def test_private_attribute_scan(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text(
        "class A:\n"
        "    def __init__(self):\n        self._mine = 1\n"
        "    def _helper(self, other):\n        return other._mine + self._theirs\n"
    )
    (pkg / "two.py").write_text(
        "def f(a, b):\n"
        "    a._helper(b)\n    b._mine = 2\n    super()._x\n    return a._peek\n"
    )
    found, _ = private_attributes(package_modules(tmp_path))
    # one.py defines _mine and _helper; two.py defines none of them
    assert sorted(found) == [
        ("kvstore.two", 2, "a._helper"),
        ("kvstore.two", 3, "b._mine"),
        ("kvstore.two", 5, "a._peek"),
    ]


def test_no_private_attributes_across_modules():
    """No module reaches into another module's objects: what a part offers the
    others is its public interface."""
    found, defined = private_attributes(package_modules())
    lines = [f"{m}:{line} uses {expr}" for m, line, expr in sorted(found)]
    assert not lines, "private attributes used across modules:\n" + "\n".join(lines)
    ours = {m: set(FOREIGN_PRIVATE) & names for m, names in defined.items()}
    assert not any(ours.values()), f"kvstore defines a FOREIGN_PRIVATE name: {ours}"


_IMPORT_EACH = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "kvstore" or m.startswith("kvstore.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\\n" + traceback.format_exc())
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.stress
def test_every_module_imports_first():
    """Each module imported before any other kvstore module works: an order that
    only works when some other module happens to be loaded first fails here."""
    r = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH]
        + [m for m in sorted(package_modules()) if not m.endswith("__main__")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# Dotted names that are files, not modules (the store's lock file).
NOT_MODULES = {"kvstore.lock"}
_DOTTED = re.compile(r"(?<![\w./-])kvstore(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolves(name: str) -> bool:
    """Whether ``name`` is an importable module, or an attribute path under one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_names_in_code_and_docs_exist():
    """A ``kvstore.x.y`` named in a docstring, comment or doc is a module or an
    attribute that exists: moving a module updates what points at it."""
    files = [
        *(ROOT / PACKAGE).rglob("*.py"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
    ]
    stale = []
    for path in sorted(files):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in _DOTTED.finditer(line):
                name = m.group(0)
                if name not in NOT_MODULES and not _resolves(name):
                    stale.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not stale, "names of no module or attribute:\n" + "\n".join(stale)
