"""The engine is composed of parts it holds (ARCHITECTURE.md, "Store holds its engine"), checked
from the source with ``ast``: no class of ``shmkv/_engine`` inherits from a class of the project
that itself inherits from one (a part is held, not a link of a class chain), and no method
there is a ``NotImplementedError`` stub for a method that lives further down a chain. The
engine's parts are wired in one place (checked on a live store below)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

import shmkv

ENGINE = Path(shmkv.__file__).parent / "_engine"


def _trees(root: Path) -> dict[str, ast.Module]:
    return {str(p.relative_to(root)): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(root.rglob("*.py"))}


def _base(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def chained(project: dict[str, ast.Module], checked: dict[str, ast.Module]) -> list[str]:
    """``module: Class(Base)`` for each class of ``checked`` whose base is a class of ``project``
    that has a base of the project itself."""
    bases: dict[str, set[str]] = {}
    for tree in project.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(_base(b) for b in node.bases)
    found = []
    for name, tree in checked.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found += [f"{name}: {node.name}({b})" for b in map(_base, node.bases)
                          if bases.get(b, set()) & set(bases)]
    return found


def stubs(checked: dict[str, ast.Module]) -> list[str]:
    """``module: function`` for each function whose body (a docstring aside) only raises
    NotImplementedError."""
    found = []
    for name, tree in checked.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                if len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None \
                        and _base(body[0].exc if not isinstance(body[0].exc, ast.Call) else body[0].exc.func) \
                        == "NotImplementedError":
                    found.append(f"{name}: {node.name}")
    return found


@pytest.mark.slow
def test_no_engine_class_is_a_link_of_a_chain() -> None:
    project = _trees(ENGINE.parent)
    assert chained(project, _trees(ENGINE)) == []


def test_no_engine_method_is_a_stub_for_one_further_down() -> None:
    assert stubs(_trees(ENGINE)) == []


def test_the_checks_catch_what_they_should() -> None:
    src = {
        "m.py": ast.parse(
            "class A:\n    def f(self):\n        raise NotImplementedError\n"
            "class B(A):\n    def g(self):\n        '''doc'''\n        raise NotImplementedError()\n"
            "class C(B): pass\nclass D(A): pass\nclass E(Exception): pass\nclass F(E): pass\n"
        )
    }
    assert chained(src, src) == ["m.py: C(B)"]  # (F(E): E inherits from no class of the project)
    assert stubs(src) == ["m.py: f", "m.py: g"]


def test_the_parts_are_held_and_their_operations_bound_once(make_store) -> None:
    """The engine's operations that the sequence layer calls are its parts' own bound methods
    (no call layer between), and closing releases the parts' views too, again if run again."""
    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=256, max_seqs=4)
    e = store._engine
    assert e.changing.__self__ is e.journal and e.locked.__self__ is e.journal
    assert e.alloc.__self__ is e.arena and e.new_row.__self__ is e.arena
    assert e.room.__self__ is e.pages and e.borrow.__self__ is e.spans and e.touch.__self__ is e.rows
    assert e.spans.alloc.__self__ is e.arena and e.arena.journal is e.journal is e.spans.journal
    assert e.relocate.__self__ is e.growth and e.growth.alloc.__self__ is e.arena and e.growth.pages is e.pages
    parts = (e.journal, e.pages, e.arena, e.growth, e.spans, e.rows, e.snapshot_rows)
    assert all(isinstance(v, (memoryview, np.ndarray)) for v in (e.journal.hdr, e.arena.table_np, e.snapshot_rows.hdr))
    seq = store.create_sequence(capacity=16)
    seq.release()
    store.close()
    for part in parts:  # (tests/test_lifecycle.py checks that the mappings are gone)
        assert not any(isinstance(v, (memoryview, np.ndarray)) for v in vars(part).values()), part
    e.release()  # a release cut short runs again (Store.close's steps): nothing left to do, no error


def test_a_listing_reads_the_same_records_whichever_way_it_reads_the_rows(make_store) -> None:
    """``store.sequences()`` reads the live rows at once through numpy, or, while a transaction
    of another holder is in the undo log, each row as its rollback leaves it: with nothing to
    roll back, both ways give the same records, field by field."""
    from shmkv._engine.table.header import W_UNDO_COUNT

    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=512, max_seqs=8)
    made = [store.create_sequence(capacity=16 + 8 * i) for i in range(5)]
    for i, seq in enumerate(made):
        seq.extend(np.ones((1, i + 1, 1, 8), np.float32), np.ones((1, i + 1, 1, 8), np.float32),
                   tokens=np.arange(i + 1))
    made[1].finish()
    made[3].free()
    made[4].release()  # one row without a lease
    rows = store._engine.rows
    direct = rows.listed_sequences()
    shared_hdr = rows.hdr
    rows.hdr = hdr = np.array(shared_hdr)  # a private copy: the undo log looks busy to this listing only
    hdr[W_UNDO_COUNT] = 1
    try:
        settled = rows.listed_sequences()
    finally:
        rows.hdr = shared_hdr
    assert [r.id for r in direct] == [s.id for s in made if s is not made[3]]
    assert settled == direct and [type(r) for r in settled] == [type(r) for r in direct]
    assert [r.finished for r in direct] == [False, True, False, False]


def test_the_records_a_listing_makes_are_sequence_infos_like_any_other(make_store) -> None:
    """``store.sequences()`` makes its records without the frozen class's ``__init__``: each is a
    ``SequenceInfo`` equal, field by field, to one the constructor makes, with the same hash and
    repr, and as frozen."""
    import dataclasses

    from shmkv.store._records import SequenceInfo

    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=256, max_seqs=8)
    a, b = store.create_sequence(capacity=16), store.create_sequence(capacity=32)
    a.extend(np.ones((1, 3, 1, 8), np.float32), np.ones((1, 3, 1, 8), np.float32), tokens=[5, 6, 7])
    b.finish()
    listed = store.sequences()
    assert len(listed) == 2
    for info in listed:
        made = SequenceInfo(*(getattr(info, f.name) for f in dataclasses.fields(SequenceInfo)))
        assert type(info) is SequenceInfo and info == made and hash(info) == hash(made) and repr(info) == repr(made)
        assert dataclasses.astuple(info) == dataclasses.astuple(made)
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.length = 0  # type: ignore[misc]
    assert [(i.id, i.length, i.capacity, i.finished, i.lease_alive) for i in listed] == [
        (a.id, 3, 16, False, True), (b.id, 0, 32, True, False)]  # (finish gives the lease up)
    rows = store._engine.rows.listed_sequences()
    assert [(i.id, i.length, i.capacity, i.start, i.lease_pid, i.generation, i.finished) for i in listed] == [
        (r.id, r.length, r.capacity, r.start, r.lease_pid, r.generation, r.finished) for r in rows]
    assert listed[0].lease_pid == os.getpid() and listed[1].lease_pid == 0 and listed[0].start != listed[1].start
