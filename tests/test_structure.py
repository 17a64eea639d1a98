"""The package's import structure: no cycles between modules, and no private name
(``_x``) imported across a module boundary (what crosses one is public and documented).

Every import counts, including those inside functions: a deferred import hides a
cycle from the interpreter, not from the reader.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "kvstore"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str) -> str:
    """The absolute name of ``from <level dots><name> import ...`` in ``module``."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def package_imports() -> Tuple[Dict[str, Set[str]], List[str]]:
    """``(graph, private)``: module -> kvstore modules it imports, and every
    ``from M import _name`` across modules as ``"importer: M._name"``."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kvstore"):
                        graph[module].add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    target = _resolve(module, is_package, node.level, node.module or "")
                elif (node.module or "").startswith("kvstore"):
                    target = node.module
                else:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:  # `from . import x`: x is a module
                        graph[module].add(sub)
                        continue
                    graph[module].add(target)
                    if alias.name.startswith("_") and target != module:
                        private.append(f"{module}: {target}.{alias.name}")
    for module in graph:  # importing a package's __init__ is importing the package
        graph[module] = {m for m in graph[module] if m in modules and m != module}
    return graph, private


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _parent_packages(module: str) -> Set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycles():
    graph, _ = package_imports()
    # A module importing its own package (which Python initialises first anyway) is
    # not a cycle with the package's re-exports of it.
    acyclic = {
        m: {t for t in targets if t not in _parent_packages(m)}
        for m, targets in graph.items()
    }
    assert find_cycles(acyclic) == []


def test_no_private_names_cross_modules():
    _, private = package_imports()
    assert private == []


def test_the_checker_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
