"""Every program in examples/ runs as is, says what it showed, and leaves nothing behind."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import importorskip_unless_ci, save_word_level_checkpoint

from shmkv.testing import shm_entries

DIR = pathlib.Path(__file__).parent.parent / "examples"
PROGRAMS = sorted(p for p in DIR.glob("*.py") if p.name != "toymodel.py" and not p.name.startswith("_"))

# What each program must print (each string at least `count` times): the behaviour it claims.
EXPECT: dict[str, list[tuple[str, int]]] = {
    "prefill_handoff.py": [("prefill process exited (code 0)", 1), ("matches a single-process run", 4),
                           ("request 0b (seq", 1), ("done: every request matches", 1)],
    "worker_takeover.py": [("LeaseError: sequence", 1), ("killed by SIGKILL (-9) after 8 tokens", 1),
                           ("alive: False", 1), ("took the lease over at token 8 and decoded 12 more", 1),
                           ("all 20 tokens match a single process that never crashed", 1)],
    "batch_forward.py": [("of requests [0, 1, 2]", 1), ("matches decoding it alone without shmkv", 3)],
    "monitor.py": [("lost its worker (pid", 1), ("is complete", 3), ("(the crashed worker: 1)", 1),
                   ("every sequence matches a single-process run, the crashed one included", 1)],
    "speculative_rollback.py": [("accepted", 2), ("tokens equal plain greedy decoding", 1)],
    "snapshot_restore.py": [("int8 codes identical", 1), ("loaded into a new store: [(1, 40)]", 1)],
    "inspect_live.py": [("(alive: True)", 5), ("first tokens: [0, 1, 2, 3, 4, 5, 6, 7] last key: 199.0", 1)],
    "multi_worker.py": [("32 tokens, last key", 3)],
    "transformers_workers.py": [("reused 40 of", 6), ("same as DynamicCache: True", 6),
                                ("every request matches a single-process DynamicCache run", 1)],
}
NEEDS = {"transformers_workers.py": ("torch", "transformers")}  # optional extras (shmkv[transformers])


def test_every_example_is_checked():
    assert {p.name for p in PROGRAMS} == set(EXPECT)
    assert {"prefill_handoff.py", "worker_takeover.py", "batch_forward.py", "monitor.py"} <= set(EXPECT)


@pytest.mark.parametrize("path", sorted(DIR.glob("*.py")), ids=lambda p: p.name)
def test_examples_use_only_the_public_api(path):
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            if n.split(".")[0] == "shmkv":
                assert not any(part.startswith("_") for part in n.split(".")), f"{path.name} imports {n}"
    assert not re.search(r"\bshmkv\._", path.read_text()), f"{path.name} reaches into shmkv._..."


# Runs an example as `python X.py --help` would, recording (audit hooks) every file it opens under
# /dev/shm and every process it starts; prints them last, on stderr.
HELP_PROBE = """
import os, runpy, sys
made = []
def hook(event, args):
    if event == "open" and str(args[0]).startswith("/dev/shm"):
        made.append(str(args[0]))
    elif event in ("os.fork", "os.posix_spawn", "os.exec", "subprocess.Popen"):
        made.append(event)
sys.addaudithook(hook)
path = sys.argv[1]
sys.argv = [path, "--help"]
sys.path.insert(0, os.path.dirname(path))
try:
    runpy.run_path(path, run_name="__main__")
finally:
    sys.stderr.write(f"made: {made}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", [*PROGRAMS, DIR / "toymodel.py"], ids=lambda p: p.name)
def test_example_answers_help_without_making_anything(path, tmp_path):
    """`python examples/X.py --help`: its usage, exit 0, before any store or process is made (the
    transformers one too, before importing torch)."""
    r = subprocess.run([sys.executable, "-c", HELP_PROBE, str(path)], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"usage: {path.name}"), r.stdout
    assert r.stderr == "made: []", r.stderr  # nothing opened in /dev/shm, no process started
    assert "torch" not in r.stdout or path.name == "transformers_workers.py"
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(900)  # three processes import torch: minutes on a loaded machine
@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    for module in NEEDS.get(path.name, ()):
        importorskip_unless_ci(module)
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    p = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out + err
    assert err == "", err  # no warning, no traceback from a child
    for text, count in EXPECT[path.name]:
        assert out.count(text) >= count, f"{text!r} printed {out.count(text)} times, not {count}:\n{out}"
    # nothing left behind: its stores (named after its pid) and its temporary files
    assert [f for f in shm_entries() if re.fullmatch(rf"skv_[a-z]+{p.pid}\.\w+", f)] == []
    assert list(tmp.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_transformers_workers_on_a_local_checkpoint(tmp_path):
    """``transformers_workers.py --model PATH`` on a checkpoint with its tokenizer: text
    prompts in, text out, every answer checked against DynamicCache. The checkpoint is written
    here (random weights, save_pretrained) with a word-level tokenizer built here: no download."""
    importorskip_unless_ci("torch")
    importorskip_unless_ci("transformers")
    words = ["you", "are", "a", "helpful", "assistant", "answer", "in", "one", "short", "sentence", "and", "be",
             "precise", "about", "numbers", "what", "is", "shared", "memory", "name", "prime", "number", "say",
             "hello", ".", "?"]
    model_dir = tmp_path / "checkpoint"
    fast = save_word_level_checkpoint(model_dir, words)
    system = "You are a helpful assistant. Answer in one short sentence, and be precise about numbers."
    n_system = len(fast(system)["input_ids"])
    assert n_system > 16  # a whole 16-token block: the prefix index finds it (docs/design.md §8)

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    args = [sys.executable, str(DIR / "transformers_workers.py"), "--model", str(model_dir), "--new-tokens", "8",
            "--system", system, "--prompt", "What is shared memory?",
            "--prompt", "Name a prime number.", "--prompt", "Say hello."]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         env={**os.environ, "TMPDIR": str(tmp)})
    try:
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out + err
    assert err == "", err
    assert out.count(f"reused {n_system} of") == 3, out  # the system prompt, computed once
    assert out.count("same as DynamicCache: True") == 3, out
    assert "every request matches a single-process DynamicCache run" in out
    said = re.findall(r"request \d: prompt '[^']*' -> '([^']*)'", out)  # the prompt echoed, then the answer
    assert len(said) == 3 and all(said), out  # text, decoded by the checkpoint's tokenizer
    assert all(w in fast.get_vocab() for s in said for w in s.split()), said
    assert [f for f in shm_entries() if re.fullmatch(rf"skv_[a-z]+{p.pid}\.\w+", f)] == []
    assert list(tmp.iterdir()) == []


# Runs `with temporary_directory(...)` once uninterrupted (the directory gone at the block's end),
# then once for every call event (any Python code: tempfile, shutil, atexit's callers) with a
# KeyboardInterrupt raised there, as a Ctrl-C is at a function's entry; prints the point count.
TEMPDIR_TRIALS = """
import os, sys
sys.path.insert(0, sys.argv[1])
from _cli import temporary_directory

def body():
    with temporary_directory("shmkv-example-") as path:
        assert os.path.isdir(path)
    return path

assert not os.path.exists(body())  # removed at the block's end, not only at exit
count = 0
def counting(frame, event, arg):
    global count
    count += event == "call"
sys.settrace(counting)
body()
sys.settrace(None)
n, fired = count, 0
for point in range(1, n + 1):
    seen = 0
    def tracer(frame, event, arg):
        global seen
        if event == "call":
            seen += 1
            if seen == point:
                raise KeyboardInterrupt
    sys.settrace(tracer)
    try:
        body()
    except KeyboardInterrupt:
        fired += 1
    finally:
        sys.settrace(None)
print(n, fired)
"""


def test_the_examples_temporary_directory_is_removed_whatever_a_ctrl_c_cuts_short(tmp_path):
    """The directory an example writes its snapshot or model to is gone when the process ends,
    whichever function entry of its making or removal a Ctrl-C lands on."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-c", TEMPDIR_TRIALS, str(DIR)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr
    n, fired = map(int, r.stdout.split())
    assert n > 5 and fired == n, (n, fired)  # every point raised inside the block's making or removal
    assert os.listdir(tmp) == []


# A SIGINT sent to itself inside `with uninterrupted_imports():` (an import of a module that sends
# it, half way through its code) does not cut the import short: the module is whole, and the
# KeyboardInterrupt comes once the block is done.
UNINTERRUPTED = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from _cli import uninterrupted_imports

signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    with uninterrupted_imports():
        import halfway
        print("imported", halfway.DONE, flush=True)
except KeyboardInterrupt:
    print("interrupted after", "halfway" in sys.modules and sys.modules["halfway"].DONE)
"""


def test_a_ctrl_c_during_an_examples_heavy_imports_comes_after_them(tmp_path):
    (tmp_path / "halfway.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
                                         "for _ in range(1000):\n    pass\nDONE = True\n")
    r = subprocess.run([sys.executable, "-c", UNINTERRUPTED, str(DIR), str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["imported True", "interrupted after True"], r.stdout
