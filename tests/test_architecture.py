"""The package's architecture, checked from the source with ``ast``.

Seven rules, most with an explicit allow-list of today's violations that may only shrink: the
test fails on a violation that is not listed, and on a listed one that no longer exists (then
delete its line).

1. Imports among ``shmkv`` modules (subpackages included) run one way: no
   circle, counting imports inside functions.
2. Types too: an import under ``if TYPE_CHECKING:`` may not name a module that
   imports the importer (directly or not) at run time. A lower layer that
   annotates a class of a higher one (``_sequence.reader`` naming ``Store``)
   makes a reader of the lower module learn the higher one first.
3. Between rooms (the top-level entries of ``shmkv/``), only the imports that the table of
   ARCHITECTURE.md ("Who may call whom") allows, every edge of the table used, each running down
   a floor, and the drawing above the table naming each room on its floor.
4. No ``from shmkv.x import _name`` of a private function, class or constant of another module
   (a submodule of an underscore name, ``from shmkv.cli import _demo``, is a module: allowed).
5. Outside the module that defines a class, no code touches that class's
   underscore attributes (``store._x`` from ``_sequence``): the narrow core
   is the way in.
6. No module over 500 lines, no class over 350.
7. The top of ``shmkv/`` holds at most 12 entries: the public surface and one
   subpackage per concern (see ARCHITECTURE.md).
8. The rooms of ``OWN_NO_WORDS`` (every room but ``_engine`` and ``_sequence``, whose hot-path
   slots ARCHITECTURE.md lists) name no row column or header word of ``_engine/table/header.py``
   (``START``, ``W_NEXT_ID``, ``C_KEY``, ``FINISHED`` ...) and touch no raw view of the engine
   (``.hdr``, ``.table_np``, ``.clients_np``): they use the engine's named operations.
   ``_sequence`` names them only in the hot-path slots that ARCHITECTURE.md's table lists
   (``KNOWN_COLD_WORD_USES``, the functions off it that still do, is empty).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent / "shmkv"
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 350
MAX_TOP_ENTRIES = 12

# Edges ("importer", "imported") that lie on an import circle. Empty; keep it so.
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()

# (accessing module, attribute) pairs: code in the accessing module reads or
# writes an underscore attribute that a class of another module defines. Empty:
# _sequence (and its parts) and _snapshot reach the store's engine through its narrow core,
# the _engine.port.Port protocol; keep it so.
KNOWN_PRIVATE_ACCESS: set[tuple[str, str]] = set()

# ("importer", "module._name") for each ``from module import _name`` of a private function,
# class or constant of another module. Empty: what modules share has a public name; keep it so.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()

# Type-only imports ("importer", "imported") of a module that imports the importer at run
# time. Empty: the lower layers annotate with Protocols of their own instead (the engine's
# narrow core, _engine.port.Port; the public store as the sequence layer uses it,
# _sequence.handle.Owner); keep it so.
KNOWN_UPWARD_TYPE_IMPORTS: set[tuple[str, str]] = set()

# Modules over MAX_MODULE_LINES and classes ("module.Class") over MAX_CLASS_LINES. Empty; keep it so.
KNOWN_LARGE: set[str] = set()


def _name(path: Path) -> str:
    """A module's dotted name below ``shmkv`` (``__init__`` for the package itself,
    ``_engine`` for ``_engine/__init__.py``, ``_engine.table.header`` for ``_engine/table/header.py``)."""
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


def _all_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement at any depth, those under ``if TYPE_CHECKING:`` included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _base(node: ast.ImportFrom, importer: str, is_package: bool) -> list[str] | None:
    """The dotted path below ``shmkv`` that ``from <base> import ...`` names (None: not shmkv)."""
    if node.level == 0:
        if node.module is None or node.module.split(".")[0] != "shmkv":
            return None
        return node.module.split(".")[1:]
    package = _package_of(importer, is_package)
    return package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])


def private_imports(modules: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(importer, "module._name") for each ``from module import _name`` where ``_name`` is not a
    submodule: a private function, class or constant of another module. ``from m import x as _x``
    imports a public name (allowed); ``from shmkv.cli import _demo`` imports a module (allowed)."""
    names = set(modules)
    packages = {name for name in names if any(other.startswith(name + ".") for other in names)}
    found: set[tuple[str, str]] = set()
    for name, tree in modules.items():
        for node in _all_imports(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _base(node, name, name in packages)
            if base is None:
                continue
            source = _resolve(".".join(base), names) or "__init__"
            for alias in node.names:
                if _is_private(alias.name) and ".".join([*base, alias.name]) not in names and source != name:
                    found.add((name, f"{source}.{alias.name}"))
    return found


def room_of(module: str) -> str:
    """The room a module belongs to: its top-level entry of ``shmkv/`` (``_engine.table.header`` is in
    ``_engine``; the package's own ``__init__`` is the room ``__init__``)."""
    return module.split(".", maxsplit=1)[0]


def room_edges(modules: dict[str, ast.Module]) -> dict[tuple[str, str], set[str]]:
    """(room, room it imports) -> the module imports that make the edge ("a.b -> c.d"), counting
    every import: at the top, inside functions and under ``if TYPE_CHECKING:``."""
    names = set(modules)
    packages = {name for name in names if any(other.startswith(name + ".") for other in names)}
    edges: dict[tuple[str, str], set[str]] = {}
    for name, tree in modules.items():
        for node in _all_imports(tree):
            for target in _imported(node, names, name, name in packages):
                if room_of(target) != room_of(name):
                    edges.setdefault((room_of(name), room_of(target)), set()).add(f"{name} -> {target}")
    return edges


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def rooms_table(text: str) -> dict[str, tuple[int, set[str]]]:
    """The table of ARCHITECTURE.md's "Who may call whom": room -> (floor, rooms it may import).
    Its rows are ``| `room` | floor | `a`, `b` | why |``."""
    table: dict[str, tuple[int, set[str]]] = {}
    for line in _section(text, "Who may call whom").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue  # not a row, the header or the rule under it
        room = cells[0].strip("`")
        assert room not in table, f"ARCHITECTURE.md's table has two rows for {room!r}"
        table[room] = (int(cells[1]), set(re.findall(r"`([^`]+)`", cells[2])))
    return table


def drawing_floors(text: str) -> dict[int, str]:
    """The drawing of "Who may call whom" (its first ``` block): floor number -> its line."""
    block = _section(text, "Who may call whom").split("```")[1]
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s*(\d+)\s+(.*)$", block, re.M)}


def table_problems(table: dict[str, tuple[int, set[str]]], edges: dict[tuple[str, str], set[str]],
                   rooms: set[str], floors: dict[int, str]) -> list[str]:
    """What the code and the table (and its drawing) disagree on, one sentence each."""
    problems = [f"{room!r} is a room of shmkv/ with no row in the table" for room in sorted(rooms - set(table))]
    problems += [f"the table has a row for {room!r}, which is not in shmkv/" for room in sorted(set(table) - rooms)]
    for (a, b), why in sorted(edges.items()):
        if a in table and b not in table[a][1]:
            problems.append(f"{a} may not import {b} (its row of the table): {sorted(why)}")
    for a, (floor, allowed) in sorted(table.items()):
        for b in sorted(allowed):
            if (a, b) not in edges:
                problems.append(f"the table lets {a} import {b}, and nothing does: delete {b} from its row")
            if b in table and table[b][0] >= floor:
                problems.append(f"{a} (floor {floor}) may import {b} (floor {table[b][0]}): not down a floor")
        if not re.search(rf"(?<![\w.]){re.escape(a)}(?!\w)", floors.get(floor, "")):
            problems.append(f"the drawing's floor {floor} line does not name {a}")
    return problems


def _top_rooms() -> set[str]:
    return {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


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


def test_no_private_names_imported_across_modules() -> None:
    _check("private names imported across modules", private_imports(_modules()), KNOWN_PRIVATE_IMPORTS)


def test_imports_between_rooms_follow_the_table() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    problems = table_problems(rooms_table(text), room_edges(_modules()), _top_rooms(), drawing_floors(text))
    assert not problems, "ARCHITECTURE.md's Who may call whom and the code disagree:\n" + "\n".join(problems)


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


def test_the_table_checks_catch_what_they_should() -> None:
    """The room and private-import passes on small sources whose answer is known."""
    modules = {
        "a": ast.parse(""),
        "a.m": ast.parse(
            "from typing import TYPE_CHECKING\nfrom shmkv.b import n, _f\nfrom shmkv.b.n import g as _g\n"
            "from . import _p\nif TYPE_CHECKING:\n    from shmkv.c import _C\n"
            "def f():\n    from shmkv.a._p import _h\n"
        ),
        "a._p": ast.parse(""),
        "b": ast.parse("_f = 1\n"),
        "b.n": ast.parse("g = 1\n"),
        "c": ast.parse("class _C:\n    pass\n"),
    }
    # The module-alias and submodule forms are allowed; private names of another module are not,
    # in a function and under TYPE_CHECKING too.
    assert private_imports(modules) == {("a.m", "b._f"), ("a.m", "c._C"), ("a.m", "a._p._h")}
    assert room_edges(modules) == {("a", "b"): {"a.m -> b.n", "a.m -> b"}, ("a", "c"): {"a.m -> c"}}

    text = (
        "# t\n\n## Who may call whom\n\n```\n  2   top\n         |\n  1   mid\n  0   low\n```\n\n"
        "| room | floor | may import | why |\n|---|---|---|---|\n"
        "| `top` | 2 | `mid`, `low` | `low`: a note |\n| `mid` | 1 | `low` | |\n| `low` | 0 | | |\n\n## Next\n"
    )
    table, floors = rooms_table(text), drawing_floors(text)
    assert table == {"top": (2, {"mid", "low"}), "mid": (1, {"low"}), "low": (0, set())}
    assert floors == {2: "top", 1: "mid", 0: "low"}
    rooms = {"top", "mid", "low"}
    edges = {("top", "mid"): {"top -> mid"}, ("top", "low"): {"top -> low"}, ("mid", "low"): {"mid.x -> low"}}
    assert table_problems(table, edges, rooms, floors) == []
    # An import the table forbids (upward here), an edge nothing uses, a room with no row.
    assert table_problems(table, {**edges, ("low", "top"): {"low -> top.y"}}, rooms, floors) == [
        "low may not import top (its row of the table): ['low -> top.y']"
    ]
    assert table_problems(table, {k: v for k, v in edges.items() if k != ("top", "low")}, rooms, floors) == [
        "the table lets top import low, and nothing does: delete low from its row"
    ]
    assert table_problems(table, edges, {*rooms, "new"}, floors) == [
        "'new' is a room of shmkv/ with no row in the table"
    ]
    # A table edge that does not run down a floor, and a drawing that shows a room elsewhere.
    flat = {**table, "mid": (2, {"low"})}
    assert table_problems(flat, edges, rooms, floors) == [
        "the drawing's floor 2 line does not name mid",
        "top (floor 2) may import mid (floor 2): not down a floor",
    ]


# Rooms that name no row column or header word and touch no raw view of the engine (rule 8); the
# engine's ``rows`` part and ``_engine/table/unattached.py`` read and write those words for them.
# Every room but the engine and the sequence layer (whose hot-path slots ARCHITECTURE.md lists).
OWN_NO_WORDS = ("__init__", "__main__", "errors", "store", "_snapshot", "cli", "testing", "remote", "transformers")
RAW_VIEWS = {"hdr", "table_np", "clients_np"}


def header_word_names(header: ast.Module) -> set[str]:
    """The names ``header.py`` gives the words of a row, of the header and of a client row, and
    their values: its module-level names assigned several at once from ints
    (``STATE, ID, ... = range(11)``, ``W_MAGIC, W_VERSION, ... = 0, 1, ...``, ``LIVE, ENCODER = 1, 2``)."""
    found: set[str] = set()
    for node in header.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple):
            value = node.value
            ints = (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "range") or (
                isinstance(value, ast.Tuple)
                and all(isinstance(v, ast.Constant) and isinstance(v.value, int) for v in value.elts))
            if ints:
                found |= {t.id for t in node.targets[0].elts if isinstance(t, ast.Name)}
    return found


def raw_word_uses(modules: dict[str, ast.Module], rooms: tuple[str, ...], words: set[str]) -> set[tuple[str, str]]:
    """(module, name) for each import of one of ``words`` from ``_engine.table.header`` and each
    attribute named one of them or a raw view (``.hdr``), in the modules of ``rooms``."""
    found: set[tuple[str, str]] = set()
    for name, tree in modules.items():
        if room_of(name) not in rooms:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_engine.table.header"):
                found |= {(name, alias.name) for alias in node.names if alias.name in words}
            elif isinstance(node, ast.Attribute) and (node.attr in words or node.attr in RAW_VIEWS):
                found.add((name, f".{node.attr}"))
    return found


def test_no_room_but_the_engine_names_a_row_or_header_word() -> None:
    modules = _modules()
    words = header_word_names(modules["_engine.table.header"])
    assert {"START", "LEASE_PID", "GEN", "FLAGS", "W_NEXT_ID", "W_PREFIX_HITS", "C_KEY", "FINISHED"} <= words
    assert set(OWN_NO_WORDS) == {room_of(m) for m in modules} - {"_engine", "_sequence"}  # a new room included
    _check("row and header words named outside the engine", raw_word_uses(modules, OWN_NO_WORDS, words), set())


# Functions of ``_sequence`` that name row or header words though they are off the hot path. Empty:
# off the hot path the sequence layer calls the engine's rows part (Port.rows); keep it so.
KNOWN_COLD_WORD_USES: set[str] = set()


def word_slots(modules: dict[str, ast.Module], room: str, words: set[str]) -> set[str]:
    """``module:Qualified.function`` for each function of ``room`` whose own body (not a nested
    function's) names one of ``words`` or a raw view (``.hdr``); ``module:<module>`` for a use at
    a module's top level outside its imports."""
    def own_uses(node: ast.AST) -> bool:
        stack = list(ast.iter_child_nodes(node))
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                continue
            if (isinstance(n, ast.Name) and n.id in words) or (
                    isinstance(n, ast.Attribute) and (n.attr in words or n.attr in RAW_VIEWS)):
                return True
            stack.extend(ast.iter_child_nodes(n))
        return False

    found: set[str] = set()

    def walk(name: str, node: ast.AST, qual: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if own_uses(child):
                    found.add(f"{name}:{'.'.join([*qual, child.name])}")
                walk(name, child, [*qual, child.name])
            elif isinstance(child, ast.ClassDef):
                if own_uses(child):  # (a class attribute)
                    found.add(f"{name}:{'.'.join([*qual, child.name])}")
                walk(name, child, [*qual, child.name])

    for name, tree in modules.items():
        if room_of(name) != room:
            continue
        top = ast.Module(body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                           ast.ClassDef))], type_ignores=[])
        if own_uses(top):
            found.add(f"{name}:<module>")
        walk(name, tree, [])
    return found


def hot_path_slots() -> set[str]:
    """The functions ARCHITECTURE.md's table of the sequence layer's hot-path slots lists."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("### The sequence layer's hot-path slots", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `(_sequence\.[\w.]+:[\w.<>]+)` \|", section, re.MULTILINE))


def test_the_sequence_layer_names_words_only_in_its_listed_hot_path_slots() -> None:
    """Rule 8 for ``_sequence``: a row or header word is named only in a hot-path slot that
    ARCHITECTURE.md lists (or in a function of ``KNOWN_COLD_WORD_USES``, which is empty)."""
    modules = _modules()
    words = header_word_names(modules["_engine.table.header"])
    hot = hot_path_slots()
    assert len(hot) > 10, "ARCHITECTURE.md's table of hot-path slots was not found"
    assert not hot & KNOWN_COLD_WORD_USES, sorted(hot & KNOWN_COLD_WORD_USES)
    found = word_slots(modules, "_sequence", words)
    wordless = sorted(hot - found)
    assert not wordless, f"ARCHITECTURE.md lists slots that name no word (delete them): {wordless}"
    _check("functions of _sequence naming row or header words off its listed hot path", found - hot,
           KNOWN_COLD_WORD_USES)


def test_the_slot_check_catches_what_it_should() -> None:
    words = {"START", "GEN"}
    modules = {
        "_sequence.m": ast.parse("from shmkv._engine.table.header import START\nX = START + 1\n"
                                 "class C:\n    def f(self, row):\n        def g():\n            return row[GEN]\n"
                                 "        return g\n    def h(self, e):\n        return e.hdr\n"
                                 "def k(row):\n    return row[0]\n"),
        "store.n": ast.parse("def f(row):\n    return row[START]\n"),
    }
    assert word_slots(modules, "_sequence", words) == {"_sequence.m:<module>", "_sequence.m:C.f.g", "_sequence.m:C.h"}


def test_the_word_check_catches_what_it_should() -> None:
    header = ast.parse("A, B = range(2)\nW_X, W_Y = 3, 4\nF = 7\nM, N = 8, 7 << 8\ndef f(): pass\n")
    words = header_word_names(header)
    assert words == {"A", "B", "W_X", "W_Y"}
    modules = {
        "store.m": ast.parse("from shmkv._engine.table.header import A, F, Layout\n"
                             "from shmkv._engine.table import header\n"
                             "def g(e, row):\n    return row[A], e.hdr[header.W_X], e.rows.length(row), e.table_np\n"),
        "_engine.k": ast.parse("from shmkv._engine.table.header import A\nx = e.hdr\n"),
    }
    assert raw_word_uses(modules, ("store",), words) == {
        ("store.m", "A"), ("store.m", ".hdr"), ("store.m", ".W_X"), ("store.m", ".table_np")}
