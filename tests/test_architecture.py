"""The package's architecture, checked from the source with ``ast`` (issues 13 and 27).

Five rules, each with an explicit allow-list of today's violations that may
only shrink: the test fails on a violation that is not listed, and on a listed
one that no longer exists (then delete its line).

1. Imports among ``shmkv`` modules (subpackages included) run one way: no
   circle, counting imports inside functions.
2. Types too: an import under ``if TYPE_CHECKING:`` may not name a module that
   imports the importer (directly or not) at run time. A lower layer that
   annotates a class of a higher one (``_sequence.reader`` naming ``Store``)
   makes a reader of the lower module learn the higher one first.
3. Outside the module that defines a class, no code touches that class's
   underscore attributes (``store._x`` from ``_sequence``): the narrow core
   is the way in.
4. No module over 500 lines, no class over 350.
5. The top of ``shmkv/`` holds at most 12 entries: the public surface and one
   subpackage per concern (see ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent / "shmkv"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 350
MAX_TOP_ENTRIES = 12

# Edges ("importer", "imported") that lie on an import circle. Empty: issue 13
# broke the last ones (_store with _sequence, _snapshot and _batch; remote with
# _remote_cli); keep it so.
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()

# (accessing module, attribute) pairs: code in the accessing module reads or
# writes an underscore attribute that a class of another module defines. Empty:
# _sequence (and its parts) and _snapshot reach the store's engine through its narrow core,
# the _engine.port.Port protocol; keep it so.
KNOWN_PRIVATE_ACCESS: set[tuple[str, str]] = set()


# Type-only imports ("importer", "imported") of a module that imports the importer at run
# time. Empty: issue 27 gave the lower layers Protocols to annotate with instead (the engine's
# narrow core, _engine.port.Port; the public store as the sequence layer uses it,
# _sequence.handle.Owner); keep it so.
KNOWN_UPWARD_TYPE_IMPORTS: set[tuple[str, str]] = set()

# Modules over MAX_MODULE_LINES and classes ("module.Class") over MAX_CLASS_LINES. Empty:
# issue 27 split the last ones (the limits were 700 / 450 until then); keep it so.
KNOWN_LARGE: set[str] = set()


def _name(path: Path) -> str:
    """A module's dotted name below ``shmkv`` (``__init__`` for the package itself,
    ``_engine`` for ``_engine/__init__.py``, ``_engine.header`` for ``_engine/header.py``)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _paths() -> dict[str, Path]:
    return {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _modules() -> dict[str, ast.Module]:
    """Every module of the package, subpackages included, parsed, by dotted name."""
    return {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, path in _paths().items()}


def _type_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``if TYPE_CHECKING:`` (at any depth)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        yield inner


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth, except those under ``if TYPE_CHECKING:``."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _resolve(dotted: str, names: set[str]) -> str | None:
    """The longest known module that ``dotted`` (below shmkv) names or lies in."""
    parts = dotted.split(".") if dotted else []
    while parts:
        if ".".join(parts) in names:
            return ".".join(parts)
        parts.pop()
    return "__init__"


def _package_of(importer: str, is_package: bool) -> list[str]:
    parts = [] if importer == "__init__" else importer.split(".")
    return parts if is_package else parts[:-1]


def _imported(node: ast.Import | ast.ImportFrom, names: set[str], importer: str = "__init__",
              is_package: bool = False) -> set[str]:
    """The ``shmkv`` modules an import statement loads (``__init__`` for the package)."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "shmkv":
                found.add(_resolve(".".join(parts[1:]), names) or "__init__")
        return found
    if node.level == 0:
        if node.module is None or node.module.split(".")[0] != "shmkv":
            return found
        base = node.module.split(".")[1:]
    else:
        package = _package_of(importer, is_package)
        base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    for alias in node.names:  # from x import y: y is a submodule of x, or a name in x
        sub = ".".join([*base, alias.name])
        found.add(sub if sub in names else (_resolve(".".join(base), names) or "__init__"))
    return found


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    names = set(modules)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    packages = {name for name in names if any(other.startswith(name + ".") for other in names)}
    for name, tree in modules.items():
        for node in _imports(tree):
            graph[name] |= _imported(node, names, name, name in packages) - {name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def upward_type_imports(modules: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(importer, imported) for each type-only import of a module that depends on the importer."""
    names = set(modules)
    packages = {name for name in names if any(other.startswith(name + ".") for other in names)}
    runtime = import_graph(modules)
    found: set[tuple[str, str]] = set()
    for name, tree in modules.items():
        for node in _type_imports(tree):
            for target in _imported(node, names, name, name in packages) - {name}:
                if name in _reachable(runtime, target):
                    found.add((name, target))
    return found


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan), iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                result.append(component)
    return result


def circle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Import edges that lie on a circle (both ends in one strongly connected component)."""
    edges: set[tuple[str, str]] = set()
    for component in _components(graph):
        if len(component) > 1:
            edges |= {(a, b) for a in component for b in graph[a] if b in component}
    return edges


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _class_privates(tree: ast.Module) -> set[str]:
    """Underscore attributes the module's classes define: ``self._x = ...``
    (or ``cls._x``), methods ``def _x``, and class-level ``_x = ...``."""
    found: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(stmt.name):
                found.add(stmt.name)
            targets: list[ast.expr] = []
            if isinstance(stmt, ast.Assign):
                targets = stmt.targets
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                targets = [stmt.target]
            found |= {t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id)}
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
                and _is_private(node.attr)
            ):
                found.add(node.attr)
    return found


def private_accesses(modules: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(module, attribute) for each ``obj._attr`` with ``obj`` not ``self``/``cls``,
    where ``_attr`` belongs to a class of another module and to none of this one."""
    privates = {name: _class_privates(tree) for name, tree in modules.items()}
    found: set[tuple[str, str]] = set()
    for name, tree in modules.items():
        others = set().union(*(attrs for other, attrs in privates.items() if other != name))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in others and node.attr not in privates[name]:
                found.add((name, node.attr))
    return found


def large(modules: dict[str, ast.Module]) -> set[str]:
    found: set[str] = set()
    paths = _paths()
    for name in modules:
        lines = len(paths[name].read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found.add(name)
    for name, tree in modules.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            assert cls.end_lineno is not None
            if cls.end_lineno - cls.lineno + 1 > MAX_CLASS_LINES:
                found.add(f"{name}.{cls.name}")
    return found


def _check(kind: str, found: set[Any], known: set[Any]) -> None:
    new = sorted(found - known)
    gone = sorted(known - found)
    assert not new, f"new {kind} (fix it; the allow-list only shrinks): {new}"
    assert not gone, f"{kind} fixed: delete from the allow-list: {gone}"


def test_no_import_circles() -> None:
    _check("import-circle edges", circle_edges(import_graph(_modules())), KNOWN_CIRCLE_EDGES)


def test_no_lower_module_annotates_a_higher_class() -> None:
    _check("upward type-only imports", upward_type_imports(_modules()), KNOWN_UPWARD_TYPE_IMPORTS)


def test_the_top_of_the_package_is_small() -> None:
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_TOP_ENTRIES, f"{len(entries)} entries at the top of shmkv/: {entries}"


def test_no_private_access_across_modules() -> None:
    _check("cross-module private accesses", private_accesses(_modules()), KNOWN_PRIVATE_ACCESS)


def test_sizes() -> None:
    _check("modules/classes over the size limits", large(_modules()), KNOWN_LARGE)


def test_the_checks_catch_what_they_should() -> None:
    """The passes above on small sources whose answer is known."""
    modules = {
        "a": ast.parse(
            "from typing import TYPE_CHECKING\n"
            "from . import b\n"
            "if TYPE_CHECKING:\n    from .c import C\n"
            "class A:\n    def __init__(self):\n        self._x = 1\n"
            "    def _m(self):\n        return self._x\n"
        ),
        "b": ast.parse("def f():\n    from .a import A\n    return A()._x, A()._m\n"),
        "c": ast.parse("from .a import A\nclass C:\n    _y = 0\n"),
        "d": ast.parse("from shmkv import c\nimport shmkv.b\nclass D:\n    def f(self, o):\n        o._x = 2\n"),
    }
    graph = import_graph(modules)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}, "d": {"b", "c"}}
    assert circle_edges(graph) == {("a", "b"), ("b", "a")}
    assert private_accesses(modules) == {("b", "_x"), ("b", "_m"), ("d", "_x")}
    # c imports a at run time; a names c only for types: an upward type import. A type-only
    # import of a module that does not depend on the importer (b's of e) is not.
    modules["b"] = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\n")
    modules["e"] = ast.parse("class E:\n    pass\n")
    assert upward_type_imports(modules) == {("a", "c")}
