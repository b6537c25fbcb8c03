"""The command line and the demo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from procs.cli import own_store

import shmkv
from shmkv import cli
from shmkv.cli import _demo as demo
from shmkv.store._store import engine_of
from shmkv.testing import shm_entries, start_in_process, unique_name


SHMKV = os.path.join(os.path.dirname(sys.executable), "shmkv")  # the installed console script a user types


def shmkv_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHMKV, *args], capture_output=True, text=True, timeout=timeout)


def wait_until(cond, what: str, alive=lambda: True, timeout: float = 120.0) -> None:
    """Poll ``cond`` (a file, a line); fail at once if ``alive()`` says the producer died."""
    t_end = time.monotonic() + timeout
    while not cond():
        assert alive() or cond(), f"died before {what}"
        assert time.monotonic() < t_end, f"no {what} within {timeout} s"
        time.sleep(0.01)


@pytest.fixture
def live_owner(tmp_path):
    """(name, child): a store created, owned and written by another process."""
    name = unique_name()
    ready = tmp_path / "ready"
    child = start_in_process(own_store, name, str(ready), 120.0, start_method="spawn", timeout=180)
    wait_until(ready.exists, "the store is ready", child.process.is_alive)
    yield name, child
    child.kill(signal.SIGTERM)
    try:
        shmkv.remove(name)
    except shmkv.StoreNotFound:
        pass


@pytest.fixture
def live_store(live_owner):
    return live_owner[0]


@pytest.mark.slow
def test_demo_equals_single_process_run(tmp_path):
    lines: list[str] = []
    summary = demo.run(workers=2, new_tokens=6, prompts=demo.PROMPTS[:3], snapshot=str(tmp_path / "d.shmkv"),
                       out=lines.append)
    assert summary["ok"] is True
    assert any("equal to a single-process run without shmkv: yes" in x for x in lines)
    assert (tmp_path / "d.shmkv").exists()  # asked for: kept
    head = shmkv.read_header(tmp_path / "d.shmkv")
    assert head.layout.layers == 4
    assert summary["store"] not in shmkv.list_stores()


@pytest.mark.slow
def test_demo_command_says_what_it_does_and_leaves_nothing(tmp_path):
    """Through the console script: what starts comes first, '=' is gone for a word that is
    explained, the timing is labelled, and no snapshot file is left in the temp directory."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    r = subprocess.run([SHMKV, "demo", "--tokens", "4"], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("shmkv demo: a tiny numpy transformer") and "starting store" in lines[1]
    assert any("'matches': the same tokens" in x for x in lines)
    requests = [x for x in lines if x.startswith("  request") and "(seq" in x]
    assert len(requests) == len(demo.PROMPTS) and all(": matches, tokens" in x for x in requests)
    assert "removed at the end" in r.stdout
    shared = [x for x in lines if x.startswith("shared prefix pages:")]  # in tokens and KiB/MiB, not bytes
    assert shared and " tokens (" in shared[0] and "iB) a request" in shared[0] and " bytes" not in shared[0]
    assert lines[-1].startswith("equal to a single-process run without shmkv: yes (wall time ")
    assert list(tmp.iterdir()) == []  # the default snapshot file was removed
    assert not store_entries(lines[1])


def store_entries(starting_line: str | bytes) -> list[str]:
    """What is left in /dev/shm of the store the demo named in its 'starting store ...' line
    (other programs' stores come and go meanwhile on a shared machine)."""
    text = starting_line.decode() if isinstance(starting_line, bytes) else starting_line
    name = re.search(r"starting store '([^']+)'", text).group(1)  # type: ignore[union-attr]
    return [f for f in shm_entries() if f.startswith(f"skv_{name}.")]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_demo_command_and_interrupt(tmp_path, how):
    """A Ctrl-C to the group (130), or a SIGTERM to the demo alone (as kill and timeout send it:
    143), while requests are decoded: one line, and the demo's store is removed."""
    p = subprocess.Popen([SHMKV, "demo", "--tokens", "512", "--snapshot", str(tmp_path / "i.shmkv")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert p.stdout is not None
        seen = []
        for line in p.stdout:  # the demo reports as it goes: wait until requests reach the workers
            seen.append(line)
            if b"requests go to the workers" in line:
                break
        assert seen and b"requests go to the workers" in seen[-1], seen
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        else:
            os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    # it was stopped, not finished (512 tokens each: about 5 s of decoding)
    assert p.returncode == (130 if how == "ctrl-c" else 143), err
    assert err.count(b"\n") == 1 and (b"interrupted" if how == "ctrl-c" else b"terminated") in err, err
    assert not store_entries(seen[1])


@pytest.mark.slow
def test_inspection_commands_on_a_live_store(live_store, tmp_path):
    name = live_store
    store = shmkv.attach(name, readonly=True)
    try:
        gen0 = store.stats().generation
        clients0 = store.clients()
        r = shmkv_cmd("ls", "--json")
        assert r.returncode == 0 and name in [row["name"] for row in json.loads(r.stdout)]
        r = shmkv_cmd("info", name, "--json")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["sequences"][0]["first_tokens"][:5] == [10, 11, 12, 13, 14]
        assert info["sequences"][0]["lease_alive"] is True
        r = shmkv_cmd("info", name)
        assert "first tokens" in r.stdout
        r = shmkv_cmd("watch", name, "--count", "2", "--interval", "0.1", "--json")
        assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
        r = shmkv_cmd("verify", name)
        assert r.returncode == 0 and "ok" in r.stdout
        # inspectors never write: no structural change, no client registered
        assert store.stats().generation == gen0
        assert store.clients() == clients0
        snap = tmp_path / "live.shmkv"
        r = shmkv_cmd("save", name, str(snap))
        assert r.returncode == 0, r.stderr
        other = unique_name()
        r = shmkv_cmd("load", str(snap), "--name", other)
        assert r.returncode == 0, r.stderr
        try:
            loaded = shmkv.attach(other, readonly=True)
            assert loaded.sequences()[0].length >= 5
            loaded.close()
        finally:
            assert shmkv_cmd("rm", other).returncode == 0
        out = tmp_path / "snaps"
        r = shmkv_cmd("snapshot", name, "--dir", str(out), "--every", "0.05", "--keep", "2", "--count", "4")
        assert r.returncode == 0, r.stderr
        assert len(r.stdout.splitlines()) == 4 and len(os.listdir(out)) == 2
    finally:
        store.close()


def _stop_at_line(store_name: str, directory: str, k: int, stop: Any) -> tuple[bool, int]:
    """Run ``snapshot_loop`` (two snapshots) calling ``stop.set()`` at the ``k``-th line event of
    cli's own code (and threading's) from a trace, as Python runs a signal handler between any
    two bytecodes of its thread: whether the loop ended, and how many line events it ran."""
    seen = [0]
    files = {cli.__file__, threading.__file__}

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            return tracer if frame.f_code.co_filename in files else None
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                stop.set()
        return tracer

    def run() -> None:
        sys.settrace(tracer)
        try:
            cli.snapshot_loop(store_name, directory, 0.01, 2, count=2, stop=stop, log=lambda m: None)
        finally:
            sys.settrace(None)

    t = threading.Thread(target=run, daemon=True)  # (a thread: one that waits for itself is left behind)
    t.start()
    t.join(20)
    return not t.is_alive(), seen[0]


def test_the_snapshotters_stop_can_be_set_at_any_line_by_its_signal_handler(live_store, tmp_path):
    """``shmkv snapshot`` stops on SIGTERM or SIGINT through a flag its handler sets. Set at every
    line the loop and the flag run, the loop ends (after at most its two snapshots here) and never
    waits for itself, as a handler calling ``threading.Event.set()`` inside ``Event.wait()`` would."""
    lines = 0
    k = 0
    while k <= lines:  # (k = 0: never set; it counts the lines)
        stop = cli.SignalStop()
        ended, n = _stop_at_line(live_store, str(tmp_path / f"s{k}"), k, stop)
        assert ended, f"the loop waits for itself after a stop set at line event {k}"
        stop.close()
        lines = lines or n
        k += 1
    assert lines > 10


@pytest.mark.slow
def test_snapshotter_stops_on_sigterm(live_store, tmp_path):
    out = tmp_path / "snaps"
    p = subprocess.Popen([sys.executable, "-m", "shmkv", "snapshot", live_store, "--dir", str(out),
                          "--every", "0.2", "--keep", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # a snapshot is written, and the snapshotter is on to the next one
    wait_until(lambda: out.exists() and len(os.listdir(out)) >= 2, "two snapshots", lambda: p.poll() is None)
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=30)
    assert p.returncode == 0, stderr
    assert "stopping" in stderr
    files = sorted(os.listdir(out))
    assert 1 <= len(files) <= 3 and all(f.endswith(".shmkv") for f in files)
    for f in files:  # every file kept is a complete snapshot
        assert shmkv.read_header(out / f).seq_ids


@pytest.mark.slow
def test_errors_and_usage():
    missing = unique_name("nope")
    r = shmkv_cmd("info", missing)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no store named" in r.stderr
    assert shmkv_cmd("info").returncode == 2
    assert shmkv_cmd("frobnicate").returncode == 2
    assert shmkv_cmd("rm", missing).returncode == 1


@pytest.mark.parametrize(("args", "code", "said"), [
    (["demo", "--workers", "0"], 2, "--workers: 0 must be at least 1"),
    (["demo", "--workers", "100000"], 2, "must be at most 32"),
    (["demo", "--tokens", "3000"], 2, "must be at most 512"),
    (["demo", "--tokens", "-1"], 2, "--tokens: -1 must be at least 1"),
    (["demo", "--snapshot", "{tmp}"], 1, "give the path of a file in a directory"),
    (["demo", "--snapshot", "{tmp}/missing/s.shmkv"], 1, "give the path of a file in a directory"),
    (["snapshot", "{store}", "--dir", "{tmp}/a-file", "--every", "1", "--keep", "1"], 1, "is a file, not a directory"),
])
def test_bad_demo_and_snapshotter_arguments_are_one_line_before_any_work(make_store, tmp_path, args, code, said):
    """Refused before anything starts (no process, no store), in one line with the fix: they were a
    traceback, or the whole demo ran and then failed, or --tokens -1 'matched'."""
    store = make_store()
    (tmp_path / "a-file").write_text("x")
    p = subprocess.Popen([SHMKV, *[a.format(tmp=tmp_path, store=store.name) for a in args]], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code and said in err and "Traceback" not in err, err
    assert code == 2 or err.count("\n") == 1, err  # (a usage error: argparse's usage lines, then the error)
    assert f"demo{p.pid}" not in shmkv.list_stores()  # (the demo names its store after its pid)


@pytest.mark.slow
def test_rm_refuses_a_store_with_live_writers_unless_forced(live_owner):
    name, child = live_owner
    r = shmkv_cmd("rm", name)
    assert r.returncode == 1, r.stdout
    assert str(child.pid) in r.stderr and "--force" in r.stderr and "removed" not in r.stdout
    assert name in shmkv.list_stores()
    r = shmkv_cmd("rm", "--force", name)
    assert r.returncode == 0 and f"removed {name}" in r.stdout
    assert name not in shmkv.list_stores()


@pytest.mark.slow
def _ls_line(name: str) -> str:
    """``shmkv ls``'s line for store ``name``; a failure names what of the store is left in /dev/shm."""
    r = shmkv_cmd("ls")
    lines = [x for x in r.stdout.splitlines() if x.startswith(f"{name}:")]
    assert lines, (f"`shmkv ls` has no line for {name}; its files now: "
                   f"{sorted(f for f in shm_entries() if name in f)}; ls said: {r.stdout!r} {r.stderr!r}")
    return lines[0]


def test_ls_says_who_keeps_a_store_alive(live_owner):
    name, child = live_owner
    line = _ls_line(name)
    assert f"creator {child.pid} alive" in line and "would remove" not in line
    row = next(x for x in json.loads(shmkv_cmd("ls", "--json").stdout) if x["name"] == name)
    assert row["creator_alive"] is True and row["live_clients"] == [child.pid] and row["gc_removes"] is False
    child.kill()  # SIGKILL: the creator cannot remove its store; gc would
    line = _ls_line(name)
    assert f"creator {child.pid} dead, no live clients (`shmkv gc` would remove it)" in line
    row = next(x for x in json.loads(shmkv_cmd("ls", "--json").stdout) if x["name"] == name)
    assert row["creator_alive"] is False and row["live_clients"] == [] and row["gc_removes"] is True
    assert shmkv_cmd("rm", name).returncode == 0  # nobody alive writes it: no --force needed


def test_ls_names_a_store_whose_owners_it_cannot_read_and_goes_on(make_store, monkeypatch, capsys):
    """A store that `ls` attached but whose header it could not read again (removed meanwhile, as
    other programs' stores come and go): its line says so, and the listing goes on."""
    import shmkv.cli
    from shmkv.store._lifecycle import Unjudged

    store = make_store(layers=1, kv_heads=1, head_dim=8, max_tokens=16, max_seqs=2)
    real = shmkv.cli.store_owners
    monkeypatch.setattr(shmkv.cli, "store_owners",
                        lambda name: Unjudged.UNREADABLE if name == store.name else real(name))
    assert shmkv.cli.main(["ls"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{store.name}:")]
    assert lines == [f"{store.name}: 0 sequences, 0 tokens, float32, {0:.2f} MiB; owners unknown: "
                     f"{Unjudged.UNREADABLE.value} (being removed?)"], lines
    assert shmkv.cli.main(["ls", "--json"]) == 0
    row = next(x for x in json.loads(capsys.readouterr().out) if x["name"] == store.name)
    assert row["owners_unknown"] == Unjudged.UNREADABLE.value and "creator_pid" not in row


def test_ls_prints_a_line_when_there_are_no_stores(tmp_path):
    # The machine's /dev/shm may hold other programs' stores: run the installed script's own
    # code with an empty directory in its place.
    code = ("import runpy, sys, shmkv._engine.memory.segment as s; s.SHM_DIR = sys.argv[1]; "
            "sys.argv = [sys.argv[2], 'ls']; runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), SHMKV], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"no stores in {tmp_path}\n"


def test_version_and_bare_command_prints_help():
    r = shmkv_cmd("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"shmkv {shmkv.__version__}"
    r = shmkv_cmd()
    assert r.returncode == 2 and "required" not in r.stderr
    assert r.stdout.startswith("usage: shmkv") and "demo" in r.stdout and "COMMAND --help" in r.stdout


def test_help_shows_defaults():
    r = shmkv_cmd("snapshot", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert "seconds between snapshots (default: 60.0)" in text and "(default: 3)" in text
    assert "(default: None)" not in text
    assert "(default: 24)" in " ".join(shmkv_cmd("demo", "--help").stdout.split())


def test_load_onto_an_existing_name_names_the_store(make_store, tmp_path):
    store = make_store()
    store.create_sequence(capacity=4).extend(np.ones((2, 2, 2, 4)), np.ones((2, 2, 2, 4)))
    store.save(tmp_path / "s.shmkv")
    r = shmkv_cmd("load", str(tmp_path / "s.shmkv"), "--name", store.name)
    assert r.returncode == 1
    assert f"a store named {store.name!r} exists already" in r.stderr and "skv_" not in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.slow
def test_info_wording(live_store):
    r = shmkv_cmd("info", live_store)
    assert r.returncode == 0, r.stderr
    assert "1 read-write client\n" in r.stdout or "1 read-write client," in r.stdout
    assert "reserved" not in r.stdout and "MiB used of" not in r.stdout
    store = shmkv.attach(live_store, readonly=True)
    try:
        max_tokens = store.layout.max_tokens
    finally:
        store.close()
    # the capacity is the store's own: its token cells and the shared memory they take
    size = os.stat(f"/dev/shm/skv_{live_store}.d").st_size
    info = json.loads(shmkv_cmd("info", live_store, "--json").stdout)
    assert info["capacity_bytes"] == size
    from shmkv.cli._words import size as in_words

    assert f"capacity {max_tokens:,} tokens ({in_words(size)} of shared memory)" in r.stdout


def test_info_of_a_sequence_without_token_ids_says_so(make_store):
    store = make_store()
    seq = store.create_sequence(capacity=4)
    seq.extend(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))  # no tokens=: no ids
    r = shmkv_cmd("info", store.name)
    assert r.returncode == 0, r.stderr
    assert "no token ids" in r.stdout and "[-1" not in r.stdout
    assert "generation" not in repr(store.sequences()[0])  # a change counter, not a figure to read


def test_cli_errors_speak_the_cli_and_json_stays_json():
    missing = unique_name("nope")
    r = shmkv_cmd("info", missing)
    assert r.returncode == 1 and "`shmkv ls`" in r.stderr and "list_stores" not in r.stderr
    r = shmkv_cmd("info", missing, "--json")
    assert r.returncode == 1 and r.stderr == ""
    err = json.loads(r.stdout)
    assert err["type"] == "StoreNotFound" and missing in err["error"]


def test_create_on_an_existing_name_names_the_store_and_load_wants_a_name(make_store, tmp_path):
    store = make_store()
    with pytest.raises(shmkv.StoreExistsError) as e:
        shmkv.create(store.name, layers=2, kv_heads=2, head_dim=4)
    assert f"a store named {store.name!r} exists already" in str(e.value) and "skv_" not in str(e.value)
    store.save(tmp_path / "s.shmkv")
    with pytest.raises(shmkv.InvalidArgumentError, match="needs the new store's name"):
        shmkv.load(tmp_path / "s.shmkv")


def test_verify_finds_problems(make_store):
    store = make_store()
    a = store.create_sequence(capacity=8)
    b = store.create_sequence(capacity=8)
    assert cli.verify(store) == []
    a._row[shmkv._engine.table.header.CAPACITY] = 20  # damage: a now overlaps b
    problems = cli.verify(store)
    assert any("sequence 1 and sequence 2 overlap" in p for p in problems), problems
    a._row[shmkv._engine.table.header.CAPACITY] = 8
    b._row[shmkv._engine.table.header.LENGTH] = 99
    assert any("outside capacity" in p for p in cli.verify(store))
    b._row[shmkv._engine.table.header.LENGTH] = 0
    # a range that ends past the arena's cells is reported, although its start is >= 0
    cells = engine_of(store).cells  # max_tokens and the alignment slack
    b._row[shmkv._engine.table.header.START] = cells - 4
    assert any(f"outside the arena's {cells} cells" in p for p in cli.verify(store))
    b._row[shmkv._engine.table.header.START] = cells - 8  # (in the slack: no problem)
    assert cli.verify(store) == []
    b._row[shmkv._engine.table.header.START] = 8
    # an encoder cache is a row of its own (state 2) with a range of its own: not a problem
    a.set_encoder(np.ones((2, 3, 2, 4)), np.ones((2, 3, 2, 4)))
    assert cli.verify(store) == []
    r = shmkv_cmd("verify", store.name, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True


@pytest.mark.slow
def test_doctor_says_whose_layout_its_room_is_for():
    r = shmkv_cmd("doctor")
    room = [x for x in r.stdout.splitlines() if x.startswith("room ")]
    assert room and "tokens fit in /dev/shm now" in room[0] and "the default layout" in room[0], r.stdout
    assert "--layers" in room[0] and "beside" not in r.stdout
    r = shmkv_cmd("doctor", "--layers", "4", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float16")
    room = [x for x in r.stdout.splitlines() if x.startswith("room ")]
    assert "4 layers, 2 KV heads of 8 dims, float16 (256 B a token" in room[0] and "default" not in room[0]


def test_the_snapshotter_keeps_only_its_own_files_apart_from_another_stores(make_store, tmp_path):
    """--keep counts this store's snapshots only: another store whose name starts with this
    one's and a dash ("x-b" beside "x") keeps every file, and the newest of this one stays."""
    short = make_store(layers=1, kv_heads=1, head_dim=2, max_tokens=64, max_seqs=2)
    longer = make_store(name=f"{short.name}-b", layers=1, kv_heads=1, head_dim=2, max_tokens=64, max_seqs=2)
    theirs = cli.snapshot_loop(longer.name, str(tmp_path), 0.0, 3, count=3, log=lambda m: None)
    ours = cli.snapshot_loop(short.name, str(tmp_path), 0.0, 1, count=2, log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in [*theirs, ours[-1]])
