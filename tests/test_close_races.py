"""close() racing every read API in other threads (Liveness.alive against a close in another
thread), on attachments that read borrowers of shared prefix pages while another
process keeps changing spans (so reads re-map as they go): each reading thread ends with
StoreClosedError, never another error, and what a read returned before is right."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import shmkv
from shmkv.cli import verify
from shmkv.errors import WaitTimeout
from shmkv.store._store import engine_of
from shmkv.testing import start_in_process

L, H, D = 2, 2, 64
N = 64  # donor tokens
TRIALS = int(os.environ.get("SHMKV_ATTACK_TRIALS", "12"))


def _kv(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    k = r.standard_normal((L, n, H, D)).astype(np.float16)
    return k, -k


def churn(name: str, prompt: list[int], stop: threading.Event) -> int:
    """In a child: borrowers of the donor's prompt come and go (the span epoch keeps moving)."""
    store = shmkv.attach(name)
    n = 0
    try:
        while not stop.is_set() and n < 100_000:
            s = store.create_sequence(capacity=N + 16, prefix=[*prompt, 7 + n % 5])
            s.extend(*_kv(n, 2))
            s.truncate(N - 3)  # into its span: copy-on-write
            s.free()
            n += 1
    finally:
        store.close()
    return n


@pytest.mark.parametrize("readonly", [False, True])
def test_close_racing_reads_of_borrowers_raises_only_store_closed(make_store, tmp_path, readonly):
    import multiprocessing as mp

    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=4096, max_seqs=32)
    prompt = list(range(100, 100 + N))
    d = store.create_sequence(capacity=N, prefix=prompt)
    k, v = _kv(0, N)
    d.extend(k, v, tokens=prompt)
    d.finish()
    b = store.create_sequence(capacity=N + 16, prefix=[*prompt, 1])
    b.finish()
    assert store.stats().shared_tokens > 0
    want_k = [k[i, : len(b)].tobytes() for i in range(L)]
    stop = mp.get_context("fork").Event()
    child = start_in_process(churn, store.name, prompt, stop, start_method="fork", timeout=300)
    raw: list[str] = []
    wrong: list[str] = []
    ends: list[str] = []

    def checked(got: np.ndarray, layer: int, what: str) -> None:
        if np.asarray(got).tobytes() != want_k[layer]:
            wrong.append(what)

    def ops(h: shmkv.Store, i: int) -> None:
        seq = h.sequence(b.id)
        j = i % 9
        if j == 0:
            h.clients()
            h.sequences()
        elif j == 1:
            h.stats()
            h.match_prefix([*prompt, 3])
        elif j == 2:
            checked(seq.keys(i % L), i % L, "keys")
        elif j == 3:
            checked(seq.read(i % L)[0], i % L, "read")
        elif j == 4:
            try:
                seq.wait(len(b) + 1, timeout=0.005)  # nobody commits to B: it sleeps, counted
            except WaitTimeout:
                pass
        elif j == 5:
            h.save(str(tmp_path / f"s{threading.get_ident()}.snap"), seq_ids=[b.id])
        elif j == 6:
            checked(h.batch_kv([seq], i % L)[0][0], i % L, "batch_kv")
        elif j == 7:
            checked(seq.torch_kv(i % L)[0].numpy(), i % L, "torch_kv")
        else:
            checked(next(iter(seq.kv(0)))[: len(b)], 0, "kv")

    def run(h: shmkv.Store, started: threading.Event, offset: int) -> None:
        try:
            started.set()
            for i in range(offset, offset + 1_000_000):
                ops(h, i)
        except shmkv.StoreClosedError:
            ends.append("closed")
        except BaseException as e:  # anything else is the bug
            raw.append(f"{type(e).__name__}: {e}")

    try:
        for trial in range(TRIALS):
            h = shmkv.attach(store.name, readonly=readonly)
            events = [threading.Event() for _ in range(4)]
            threads = [threading.Thread(target=run, args=(h, ev, 2 * n + trial)) for n, ev in enumerate(events)]
            for t in threads:
                t.start()
            for ev in events:
                assert ev.wait(60)
            if trial % 3:
                for _ in range(trial):
                    h.sequences()  # a little later, now and then
            h.close()
            for t in threads:
                t.join(timeout=120)
                assert not t.is_alive()
            assert raw == [], f"trial {trial}: {raw}"
            assert wrong == [], f"trial {trial}: {wrong}"
    finally:
        stop.set()
        n = child.result()
    assert n > 0 and ends == ["closed"] * 4 * TRIALS
    assert verify(store) == []
    eng = engine_of(store)  # every wait's count came off its row, once (no leak, no double drop)
    assert not any(eng.waiters) and not any(eng.ro_waiters.counts), (list(eng.waiters), list(eng.ro_waiters.counts))


def test_a_read_only_wait_counted_as_close_drops_the_counts_leaks_none(make_store, monkeypatch):
    """A read-only wait that counts itself on the row (the liveness file's count) just after a
    close() in another thread took this handle's counts off: the count must not stay raised
    (every later commit of the row would make a wake-up syscall for nobody). The race test above
    meets this interleaving by chance (a count of 1 to 4 left on the borrower's row); here it is
    forced."""
    from shmkv._sequence import waiting

    store = make_store(layers=L, kv_heads=H, head_dim=D, dtype="float16", max_tokens=512, max_seqs=8)
    s = store.create_sequence(capacity=8)
    s.extend(*_kv(1, 2))
    h = shmkv.attach(store.name, readonly=True)
    seq = h.sequence(s.id)
    e = engine_of(h)
    assert e.ro_waiters.writable
    entered, dropped, registered = threading.Event(), threading.Event(), threading.Event()
    real_register, real_drop = waiting._register, e.drop_waiters

    def register(r):  # the waiter, between its first look at the length and its count
        entered.set()
        assert dropped.wait(60)
        try:
            return real_register(r)
        finally:
            registered.set()

    def drop_waiters():  # close(), between taking the counts off and unmapping
        real_drop()
        dropped.set()
        assert registered.wait(60)

    monkeypatch.setattr(waiting, "_register", register)
    monkeypatch.setattr(e, "drop_waiters", drop_waiters)
    got: list[BaseException] = []

    def wait() -> None:
        try:
            seq.wait(len(s) + 1, timeout=30)
        except BaseException as err:
            got.append(err)

    t = threading.Thread(target=wait)
    t.start()
    # the close begins once the wait took its first look (a close before it is another case: that
    # look raises StoreClosedError, nothing registers, and drop_waiters above waited 60 s in vain)
    assert entered.wait(60)
    h.close()
    t.join(60)
    assert not t.is_alive()
    assert len(got) == 1 and isinstance(got[0], shmkv.StoreClosedError), got
    assert not any(engine_of(store).ro_waiters.counts)
