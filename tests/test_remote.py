"""The remote tier on Redis (docs/design.md §9): stores on several "machines" share prefixes.

Every test starts its own redis-server(s) on free loopback ports (shmkv.testing._redis)
and stops them. Without redis-server (or redis-py) these tests skip locally and
FAIL when CI=true: CI must run them.

The tests that pull go through ``create_with_tier`` below, which is one call:
``store.create_sequence(capacity=..., prefix=tokens, tier=tier)``, the local prefix cache
first and the tier for the rest (the tests named ``test_create_sequence_*`` are the ones
that exercise it).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from procs.remote import push_when_told

import shmkv
from shmkv import cli
from shmkv.testing._redis import RedisCluster, RedisServer
from shmkv.remote import RemoteTier
from shmkv.testing import start_in_process

LAYOUT = dict(layers=3, kv_heads=2, head_dim=8, dtype="float16", max_tokens=4096, max_seqs=16)
C = 32  # chunk_tokens in these tests: small chunks, many of them


def _need_redis() -> None:
    missing = [exe for exe in ("redis-server", "redis-cli") if shutil.which(exe) is None]
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install 'shmkv[redis]')")
    if missing:
        msg = f"the remote tier's tests need {', '.join(missing)} (apt-get install -y redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + ": CI must run them", pytrace=False)
        pytest.skip(msg)


@pytest.fixture
def server():
    _need_redis()
    s = RedisServer()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    import redis

    r = redis.Redis.from_url(server.url)
    yield r
    r.close()


@pytest.fixture
def tiers():
    """RemoteTier factory; every tier is closed at the end (no socket left to a ResourceWarning)."""
    made: list[RemoteTier] = []

    def make(url: str, **kw) -> RemoteTier:
        kw.setdefault("namespace", "t")
        kw.setdefault("chunk_tokens", C)
        t = RemoteTier(url, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def prompt(n: int, seed: int = 0, layers: int = 3, heads: int = 2, dim: int = 8):
    """Token ids and reference K/V [layers, n, heads, dim] (float32) of a prompt."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_000, n)
    k = rng.standard_normal((layers, n, heads, dim)).astype(np.float32)
    v = rng.standard_normal((layers, n, heads, dim)).astype(np.float32)
    return toks, k, v


def prefill(store: shmkv.Store, toks, k, v) -> shmkv.Sequence:
    seq = store.create_sequence(capacity=max(len(toks), 1))
    seq.extend(k, v, tokens=toks)
    return seq


def create_with_tier(store: shmkv.Store, tokens, tier: RemoteTier, capacity: int = 1024) -> shmkv.Sequence:
    """What a serving process calls: local prefix cache first, then the tier continues."""
    return store.create_sequence(capacity=capacity, prefix=np.asarray(tokens), tier=tier)


def assert_same_prefix(a: shmkv.Sequence, b: shmkv.Sequence, n: int, layers: int = 3) -> None:
    """b holds exactly a's first n tokens: raw storage (int8 codes and scales), ids, positions."""
    assert len(b) == n
    for layer in range(layers):
        for ra, rb in ((a.raw_keys(layer), b.raw_keys(layer)), (a.raw_values(layer), b.raw_values(layer))):
            assert np.array_equal(ra[0][:n], rb[0]), f"layer {layer} differs"
            if ra[1] is not None:
                assert np.array_equal(ra[1][:n], rb[1])
    assert np.array_equal(a.tokens[:n], b.tokens)
    assert np.array_equal(b.positions, np.arange(n))


def gets(client) -> int:
    """GET commands the server has run so far."""
    return int(client.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def chunk_keys(client, namespace: str = "t") -> list[bytes]:
    return sorted(client.scan_iter(match=f"{namespace}:shmkv:*", count=1000))


# -- 1. two machines, one Redis ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16", "int8"])
def test_create_sequence_two_stores_share_whole_chunks(make_store, server, tiers, dtype):
    a = make_store(**{**LAYOUT, "dtype": dtype})  # "machine A"
    b = make_store(**{**LAYOUT, "dtype": dtype})  # "machine B": another store, same layout
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier_a, tier_b = tiers(server.url), tiers(server.url)  # one tier object per machine
    assert tier_a.push(a, sa.id) == 6  # 200 tokens: 6 whole chunks of 32, the last 8 stay local
    assert tier_a.push(a, sa.id) == 0  # a second push writes nothing
    assert tier_b.match(b.layout, toks) == 192
    sb = create_with_tier(b, toks, tier_b)
    assert_same_prefix(sa, sb, 192)  # bit-identical
    if dtype == "float32":  # and what attention reads is the reference
        for layer in range(3):
            kb, vb = sb.kv(layer)
            assert np.array_equal(kb, k[layer, :192]) and np.array_equal(vb, v[layer, :192])
    assert tier_b.stats().chunks_pulled == 6 and tier_b.stats().damaged == 0


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_create_sequence_big_chunks_stream_from_shared_memory(make_store, server, tiers, dtype, monkeypatch):
    """Chunks over 256 KiB go out part by part from the store (checksum on the way), not joined."""
    from shmkv import remote

    def joined(parts):  # pragma: no cover - the test fails if a big value is joined
        raise AssertionError("a chunk over 256 KiB was joined into one bytes object")

    monkeypatch.setattr(remote._wire, "joined", joined)
    big = dict(layers=4, kv_heads=4, head_dim=64, dtype=dtype, max_tokens=2048, max_seqs=4)
    a, b = make_store(**big), make_store(**big)
    toks, k, v = prompt(3 * 256 + 10, layers=4, heads=4, dim=64)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url, chunk_tokens=256)
    assert tier.push(a, sa.id) == 3
    assert tier.stats().bytes_pushed > 3 * 256 * 4 * 4 * 64 * 2  # over the 256 KiB a value joined
    assert_same_prefix(sa, create_with_tier(b, toks, tier, capacity=1024), 768, layers=4)


def test_push_and_pull_after_a_server_restart(make_store, tiers):
    _need_redis()
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    s1 = RedisServer()
    try:
        tier = tiers(s1.url)
        assert tier.push(a, sa.id) == 6  # the tier's pooled connections now point at s1
        s1.stop()  # killed (SIGTERM), its directory removed
        s1 = RedisServer(port=s1.port)  # back, empty, on the same address
        assert tier.push(a, sa.id) == 6  # a stale connection is replaced, not an error
        assert_same_prefix(sa, create_with_tier(b, toks, tier), 192)
    finally:
        s1.stop()


def test_create_sequence_caps_at_len_minus_one_and_follows_the_whole_prefix(make_store, server, tiers):
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(192)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 6
    assert tier.match(b.layout, toks) == 192  # match has no cap
    sb = create_with_tier(b, toks, tier)
    assert_same_prefix(sa, sb, 191)  # the caller runs at least one token: the last chunk loads in part
    # A prompt that differs inside chunk 3 finds chunks 0-2 only: a chunk is named by its whole prefix.
    other = toks.copy()
    other[100] += 1
    assert tier.match(b.layout, other) == 96
    assert_same_prefix(sa, create_with_tier(make_store(**LAYOUT), other, tier), 96)
    # another namespace shares nothing
    assert tiers(server.url, namespace="other").match(b.layout, toks) == 0


# -- 2. local first -----------------------------------------------------------------------


def test_create_sequence_local_first_pulls_only_the_rest(make_store, server, client, tiers):
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 6
    prefill(b, toks[:100], k[:, :100], v[:, :100])  # B computed the first 100 tokens itself
    before = gets(client)
    sb = create_with_tier(b, toks, tier)
    # tokens 100..191: the chunk holding token 100 (96..127) and the two after it, nothing before
    assert gets(client) - before == 3
    assert tier.stats().chunks_pulled == 3 and tier.stats().tokens_pulled == 92
    assert_same_prefix(sa, sb, 192)
    # B holding more than the tier has: nothing is fetched
    before = gets(client)
    sc = create_with_tier(b, toks, tier)  # local: sb's 192 tokens... the cap is 199, tier ends at 192
    assert gets(client) == before and len(sc) == 192


# -- 3. another layout ----------------------------------------------------------------------


@pytest.mark.parametrize("change", [{"head_dim": 16}, {"dtype": "float32"}, {"layers": 2}])
def test_create_sequence_other_layout_never_gets_the_chunks(make_store, server, client, tiers, change):
    a = make_store(**LAYOUT)
    b = make_store(**{**LAYOUT, **change})
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 6
    assert tier.match(b.layout, toks) == 0
    sb = create_with_tier(b, toks, tier)
    assert len(sb) == 0
    # Even A's chunk stored under the key B asks for (a fingerprint collision, a bad copy) is refused:
    blob = client.get(tier.key(a.layout, toks[:C]))
    client.set(tier.key(b.layout, toks[:C]), blob)
    sc = create_with_tier(b, toks, tier)
    assert len(sc) == 0
    assert tier.stats().foreign == 1
    assert client.exists(tier.key(b.layout, toks[:C])) == 0  # deleted
    assert client.exists(tier.key(a.layout, toks[:C])) == 1  # A's own chunk untouched


# -- 4. damage ---------------------------------------------------------------------------------


def _damage(blob: bytes, how: str) -> bytes:
    b = bytearray(blob)
    if how == "payload":
        b[-5] ^= 0x40
    elif how == "header":
        b[20] ^= 0x01
    elif how == "magic":
        b[0:4] = b"XXXX"
    elif how == "truncated":
        del b[-100:]
    elif how == "garbage":
        return b"not a chunk"
    return bytes(b)


@pytest.mark.parametrize("how", ["payload", "header", "magic", "truncated", "garbage"])
def test_create_sequence_damaged_chunk_ends_the_match(make_store, server, client, tiers, how):
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 6
    key = tier.key(a.layout, toks[: 4 * C])  # chunk 3 (tokens 96..127)
    client.set(key, _damage(client.get(key), how))
    assert tier.match(b.layout, toks) == 192  # existence only
    sb = create_with_tier(b, toks, tier)
    assert_same_prefix(sa, sb, 96)  # the data before it, and nothing of it or after it
    assert tier.stats().damaged == 1
    assert client.exists(key) == 0  # removed, so that a push can replace it
    assert tier.push(a, sa.id) == 1
    assert_same_prefix(sa, create_with_tier(b, toks, tier), 192)


def _with_valid_checksum(blob: bytes, layout, mutate) -> bytes:
    """``blob`` with its arrays changed by ``mutate(k, v, ks, vs)`` and its checksum made valid again:
    the checksum is integrity, not authentication (a trusted Redis), so such a chunk passes it."""
    import zlib

    from shmkv import remote

    b = bytearray(blob)
    _, _, _, hlen, _ = remote._wire.FIXED.unpack_from(b, 0)
    mutate(*remote._wire.Geometry(layout, C).arrays(b, remote._wire.payload_offset(hlen), C))
    remote._wire.CRC.pack_into(b, len(b) - remote._wire.CRC.size, zlib.crc32(memoryview(b)[: -remote._wire.CRC.size]))
    return bytes(b)


@pytest.mark.parametrize("what", ["inf scales", "nan scales"])
def test_create_sequence_chunk_that_cannot_be_loaded_is_a_miss_and_leaks_nothing(
        make_store, server, client, tiers, what):
    """An int8 chunk with inf or nan scales (valid checksum) is a miss from that chunk on:
    create_sequence(prefix=, tier=) raises no InvalidArgumentError, the chunk is removed, and no
    live unfinished sequence is left per request."""
    lay = {**LAYOUT, "dtype": "int8"}
    a, b = make_store(**lay), make_store(**lay)
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 6
    key = tier.key(a.layout, toks[: 3 * C])  # chunk 2 (tokens 64..95)
    bad = float("inf") if what == "inf scales" else float("nan")
    client.set(key, _with_valid_checksum(client.get(key), a.layout, lambda k, v, ks, vs: ks.fill(bad)))
    for _ in range(3):  # each request: a miss from that chunk on, never an error, never a leak
        sb = create_with_tier(b, toks, tier)
        assert_same_prefix(sa, sb, 64)
        sb.free()
    assert b.sequences() == []
    assert tier.stats().damaged == 1 and client.exists(key) == 0  # removed: a push replaces it
    assert tier.push(a, sa.id) == 1
    assert_same_prefix(sa, create_with_tier(b, toks, tier), 192)


def test_create_sequence_frees_its_sequence_when_the_pull_raises(make_store, tiers, monkeypatch):
    """Whatever escapes the tier (here an interrupt) leaves no live unfinished sequence behind."""
    store = make_store(**LAYOUT)
    tier = tiers("redis://127.0.0.1:1/0")

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tier, "pull", interrupted)
    with pytest.raises(KeyboardInterrupt):
        create_with_tier(store, np.arange(100), tier)
    assert store.sequences() == []


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_create_sequence_in_many_round_trips(make_store, server, client, tiers, monkeypatch, dtype):  # noqa: PLR0917
    """One chunk a round trip, every value streamed part by part, the next batch fetched on a
    helper thread while one is loaded: the same bytes, and a damaged chunk still ends the pull."""
    from shmkv import remote

    monkeypatch.setattr(remote, "_BATCH_BYTES", 1)
    monkeypatch.setattr(remote, "_GROUP_BYTES", 1)
    monkeypatch.setattr(remote._wire, "_JOIN_BYTES", 0)
    a, b = make_store(**{**LAYOUT, "dtype": dtype}), make_store(**{**LAYOUT, "dtype": dtype})
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 6
    assert_same_prefix(sa, create_with_tier(b, toks, tier), 192)
    key = tier.key(a.layout, toks[: 3 * C])  # chunk 2
    client.set(key, _damage(client.get(key), "payload"))
    c = make_store(**{**LAYOUT, "dtype": dtype})
    assert_same_prefix(sa, create_with_tier(c, np.concatenate([toks[:150], [9, 9]]), tier), 64)
    assert tier.stats().damaged == 1


def test_create_sequence_chunk_of_other_tokens_is_refused(make_store, server, client, tiers):
    """A sound chunk stored under another prefix's key (a hash collision) is never loaded."""
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(64, seed=1)
    other, k2, v2 = prompt(64, seed=2)
    tier = tiers(server.url)
    tier.push(a, prefill(a, toks, k, v).id)
    tier.push(a, prefill(a, other, k2, v2).id)
    client.set(tier.key(a.layout, toks[:C]), client.get(tier.key(a.layout, other[:C])))
    assert len(create_with_tier(b, toks, tier)) == 0
    assert tier.stats().damaged == 1


# -- 5. concurrent pushes ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_two_processes_push_the_same_sequence(make_store, server, client, tiers, tmp_path, method):  # noqa: PLR0917
    a = make_store(**LAYOUT)
    toks, k, v = prompt(40 * C + 5)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.match(a.layout, toks) == 0  # connected here: a forked child must not share the socket
    go = tmp_path / "go"
    kids = [start_in_process(push_when_told, a.name, sa.id, tier, str(go), str(tmp_path / f"ready{i}"),
                             start_method=method, timeout=120) for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline, "children did not get ready"
            time.sleep(0.005)
        go.touch()
        written = [kid.result() for kid in kids]  # both succeed
    finally:
        for kid in kids:
            kid.kill()
    assert sum(written) == 40  # every chunk written once, by one of them
    assert len(chunk_keys(client)) == 40  # one copy in Redis
    assert_same_prefix(sa, create_with_tier(make_store(**LAYOUT), toks, tier, capacity=2048), 40 * C)


# -- 6. eviction ---------------------------------------------------------------------------------


def test_a_full_server_that_does_not_evict_is_named_as_such(make_store, tiers):
    """maxmemory with noeviction: the push's SET is refused (OOM). The error says the server is out of
    memory and how to let it evict, not "check that the server is up"; nothing is published and no
    pending value is left."""
    _need_redis()
    with RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as srv:
        import redis

        client = redis.Redis.from_url(srv.url)
        try:
            a = make_store(layers=4, kv_heads=4, head_dim=64, dtype="float16", max_tokens=8192, max_seqs=4)
            s = prefill(a, *prompt(64 * C, layers=4, heads=4, dim=64))
            tier = tiers(srv.url)
            with pytest.raises(shmkv.RemoteError, match=r"out of memory .*maxmemory-policy allkeys-lru"):
                tier.push(a, s.id)
            assert tier.stats().chunks_pushed == 0
            assert chunk_keys(client) == [] and client.keys("*pending*") == []
        finally:
            client.close()


@pytest.mark.parametrize("cluster", [False, True])
def test_a_refused_publish_is_an_error_not_an_eviction(server, client, cluster):
    """Publishing a pending value takes RENAMENX; a user whose ACL forbids it gets the refusal,
    on either client's path (a cluster client's takes each command alone), not the "evicted"
    answer that ends a push quietly."""
    import redis

    from shmkv.remote import _wire

    client.execute_command("ACL", "SETUSER", "pusher", "on", ">pw", "~*", "+@all", "-renamenx")
    user = redis.Redis.from_url(server.url, username="pusher", password="pw")
    try:
        user.set("{k}:pending:x", b"v", px=60_000)
        with pytest.raises(redis.exceptions.NoPermissionError):
            _wire.publish(user, [("{k}:pending:x", "k")], cluster)
        assert not client.exists("k")
        client.delete("{k}:pending:x")  # (evicted meanwhile: not published, no error)
        assert _wire.publish(client, [("{k}:pending:x", "k")], cluster) == [False]
    finally:
        user.close()


def test_create_sequence_under_eviction_is_shorter_never_wrong(make_store, tiers):
    _need_redis()
    big = dict(layers=4, kv_heads=4, head_dim=64, dtype="float16", max_tokens=8192, max_seqs=32)
    # A chunk is 4 layers x 32 tokens x 4 heads x 64 x 2 bytes x (K, V) = 128 KiB; 12 prompts of 8 chunks = 12 MiB
    # into 8 MB. Redis's LRU clock ticks once a second, so within this test eviction is close to random:
    # about half the chunks survive, and P(every prompt's first chunk evicted) is about (40/96)^12 < 1e-4.
    with RedisServer("--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru") as srv:
        import redis

        client = redis.Redis.from_url(srv.url)
        try:
            a, b = make_store(**big), make_store(**big)
            tier = tiers(srv.url)
            prompts = [prompt(8 * C + 1, seed=s, layers=4, heads=4, dim=64) for s in range(12)]
            src = []
            for toks, k, v in prompts:
                s = prefill(a, toks, k, v)
                tier.push(a, s.id)  # later pushes evict earlier chunks
                src.append(s)
            assert int(client.info("stats")["evicted_keys"]) > 0
            matched = pulled = 0
            for (toks, _, _), s in zip(prompts, src, strict=True):
                m = tier.match(b.layout, toks)
                sb = create_with_tier(b, toks, tier, capacity=len(toks))
                assert len(sb) <= m <= 8 * C and len(sb) % C == 0
                assert_same_prefix(s, sb, len(sb), layers=4)  # whatever is loaded is right
                matched += m
                pulled += len(sb)
            assert 0 < pulled < 12 * 8 * C  # shorter, not gone
            assert tier.stats().damaged == 0
        finally:
            client.close()


# -- 7. the server dies -----------------------------------------------------------------------------


def test_create_sequence_when_server_killed_serves_locally_and_push_raises(make_store, server, tiers):
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url, timeout=1.0)
    assert tier.push(a, sa.id) == 6
    prefill(b, toks[:100], k[:, :100], v[:, :100])
    assert tier.match(b.layout, toks) == 192  # the client is connected now
    server.kill()
    with pytest.warns(RuntimeWarning, match=str(server.port)):
        sb = create_with_tier(b, toks, tier)
    assert_same_prefix(sa, sb, 100)  # the local match, served
    with pytest.raises(shmkv.RemoteError, match=str(server.port)) as ei:
        tier.push(a, sa.id)
    assert isinstance(ei.value, ConnectionError) and isinstance(ei.value, shmkv.ShmkvError)
    with pytest.raises(shmkv.RemoteError):
        tier.match(b.layout, toks)
    assert tier.stats().errors >= 3


def test_create_sequence_when_server_hangs_times_out(make_store, server, tiers):
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(200)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url, timeout=0.3)
    assert tier.push(a, sa.id) == 6
    os.kill(server.pid, signal.SIGSTOP)  # alive, accepting nothing: a slow tier
    try:
        with pytest.warns(RuntimeWarning, match="Timeout"):
            sb = create_with_tier(b, toks, tier)
        assert len(sb) == 0
        other, k2, v2 = prompt(64, seed=5)
        with pytest.raises(shmkv.RemoteError, match="timeout="):
            tier.push(a, prefill(a, other, k2, v2).id)
    finally:
        os.kill(server.pid, signal.SIGCONT)


def test_nothing_listening(make_store, tiers):
    _need_redis()
    from shmkv.testing._redis import free_port

    a = make_store(**LAYOUT)
    toks, k, v = prompt(64)
    sa = prefill(a, toks, k, v)
    tier = tiers(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    with pytest.raises(shmkv.RemoteError, match=re.escape("127.0.0.1")):
        tier.push(a, sa.id)
    with pytest.warns(RuntimeWarning):
        assert tier.pull(a.create_sequence(capacity=64), toks) == 0


# -- 8. a Redis Cluster --------------------------------------------------------------------------------


@pytest.mark.slow
def test_create_sequence_through_a_three_node_cluster(make_store, tiers, capsys):
    _need_redis()
    with RedisCluster(3) as cl:
        a, b = make_store(**LAYOUT), make_store(**LAYOUT)
        toks, k, v = prompt(24 * C + 3)
        sa = prefill(a, toks, k, v)
        tier_a = tiers(cl.url, cluster=True)
        tier_b = tiers(cl.nodes[2].url, cluster=True)  # any node reaches the whole cluster
        assert tier_a.push(a, sa.id) == 24
        assert tier_a.push(a, sa.id) == 0
        assert tier_b.match(b.layout, toks) == 24 * C
        assert_same_prefix(sa, create_with_tier(b, toks, tier_b), 24 * C)
        import redis

        per_node = []
        for node in cl.nodes:
            r = redis.Redis.from_url(node.url)
            per_node.append(r.dbsize())
            r.close()
        assert sum(per_node) == 24 and sum(1 for n in per_node if n) >= 2  # spread by hash slot
        assert cli.main(["tier", cl.url, "--cluster", "--json"]) == 0
        out = __import__("json").loads(capsys.readouterr().out)
        assert out["chunks"] == 24 and out["namespaces"]["t"]["chunks"] == 24


# -- CLI, settings, hygiene -------------------------------------------------------------------------------


def test_cli_push_and_tier(make_store, server, capsys):
    import json

    a = make_store(**LAYOUT)
    toks, k, v = prompt(100)
    s1 = prefill(a, toks, k, v)
    toks2, k2, v2 = prompt(70, seed=3)
    prefill(a, toks2, k2, v2)
    argv = ["push", a.name, server.url, "--namespace", "cli", "--chunk-tokens", "32", "--json"]
    assert cli.main([*argv, "--seq", str(s1.id)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunks_written"] == {str(s1.id): 3}
    assert cli.main(argv) == 0  # every sequence: the first one's chunks are there already
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["chunks_written"].values()) == [0, 2]
    assert cli.main(["tier", server.url, "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["chunks"] == 5 and t["namespaces"]["cli"]["chunks"] == 5 and t["bytes"] > 5 * 3 * 32 * 2 * 8 * 2 * 2
    (lay,) = t["namespaces"]["cli"]["layouts"].values()
    assert lay["chunks"] == 5 and lay["layout"]["head_dim"] == 8 and lay["layout"]["dtype"] == "float16"
    assert lay["layout"]["chunk_tokens"] == 32
    assert cli.main(["tier", server.url, "--namespace", "nothing", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] == 0
    assert cli.main(["tier", server.url]) == 0
    text = capsys.readouterr().out
    assert "cli: 5 chunks" in text and "3 layers x 2 x 8 float16, 32 tokens a chunk" in text
    server.kill()
    assert cli.main(["push", a.name, server.url, "--timeout", "0.5", "--chunk-tokens", "32"]) == 1
    assert server.url in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--seq", "1,a"), ("--chunk-tokens", "0"), ("--timeout", "soon")])
def test_cli_push_arguments_are_checked(capsys, flag, value):
    """A bad value is argparse's usage error naming it (exit 2), before any store or server is touched."""
    with pytest.raises(SystemExit) as ei:
        cli.main(["push", "no-such-store", "redis://127.0.0.1:1/0", flag, value])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert value in err and flag in err


def test_settings_are_checked():
    with pytest.raises(shmkv.InvalidArgumentError, match="chunk_tokens=100"):
        RemoteTier("redis://127.0.0.1:1/0", chunk_tokens=100)
    with pytest.raises(shmkv.InvalidArgumentError, match="chunk_tokens"):
        RemoteTier("redis://127.0.0.1:1/0", chunk_tokens=0)
    with pytest.raises(shmkv.InvalidArgumentError, match="namespace"):
        RemoteTier("redis://127.0.0.1:1/0", namespace="a:b")
    with pytest.raises(shmkv.InvalidArgumentError, match="url"):
        RemoteTier("http://127.0.0.1:1/0")
    with pytest.raises(shmkv.InvalidArgumentError, match="timeout"):
        RemoteTier("redis://127.0.0.1:1/0", timeout=0)


@pytest.mark.parametrize(("url", "kw", "named"), [
    ("redis://localhost:99999/0", {}, "Port out of range"),
    ("redis://localhost:abc/0", {}, "Port could not be cast"),
    ("redis://localhost:0/0", {}, "port 0"),
    ("redis://localhost:6379/0?db=zz", {}, "names db 'zz'"),
    ("redis://localhost:6379/x", {}, "names db 'x'"),
    ("redis://[::1/0", {}, "Invalid IPv6 URL"),
    ("redis://localhost:6379/0", {"timeout": float("inf")}, "timeout=inf"),
    ("redis://localhost:6379/0", {"timeout": 1e20}, "at most 86400"),
])
def test_settings_redis_py_cannot_use_are_refused_at_once(url, kw, named):
    """Settings the tier cannot connect with are refused by the constructor, naming the value
    (they were taken, and every later pull or match raised a raw ValueError or OverflowError)."""
    with pytest.raises(shmkv.InvalidArgumentError, match=re.escape(named)):
        RemoteTier(url, **kw)


def test_a_good_url_with_a_db_and_options_is_taken():
    for url in ("redis://u:p@host:6379/3", "redis://host/0?db=2&socket_keepalive=true", "unix:///tmp/r.sock?db=1",
                "rediss://[::1]:6380/0", "redis://host"):
        RemoteTier(url).close()


def test_password_never_printed_and_tier_pickles():
    t = RemoteTier("redis://user:s3cret@127.0.0.1:1/0", namespace="n", chunk_tokens=64, timeout=0.2)
    assert "s3cret" not in repr(t)
    t2 = pickle.loads(pickle.dumps(t))
    assert (t2.url, t2.namespace, t2.chunk_tokens, t2.timeout) == (t.url, "n", 64, 0.2)
    _need_redis()
    with pytest.raises(shmkv.RemoteError) as ei:
        t.match(shmkv.Layout(2, 2, 4, "float32", 16, 2, ("full", "full")), np.arange(64))
    assert "s3cret" not in str(ei.value) and "127.0.0.1:1" in str(ei.value)
    e = pickle.loads(pickle.dumps(ei.value))  # crosses process boundaries as itself
    assert type(e) is shmkv.RemoteError and str(e) == str(ei.value)
    t.close()


def test_only_a_real_prefix_is_pushed(make_store, server, client, tiers):
    a = make_store(**LAYOUT)
    toks, k, v = prompt(4 * C)
    toks[2 * C + 3] = -1  # no id for one token: chunks from there on are not a prefix
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 2
    s2 = a.create_sequence(capacity=4 * C)
    s2.extend(k, v, tokens=np.arange(4 * C) + 7, positions=np.arange(4 * C) + 5)  # not at 0..n-1
    assert tier.push(a, s2.id) == 0
    assert len(chunk_keys(client)) == 2


def test_tokens_a_remove_moved_are_not_pushed(make_store, server, client, tiers):
    """After remove(C, 2C, shift=...), the tokens from C on were computed with the removed ones in
    context: no prefix, though their positions are 0..n-1 again. Only the first chunk is pushed,
    and another store reuses only it for the prompt the sequence now reads as."""
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(4 * C)
    sa = prefill(a, toks, k, v)
    sa.remove(C, 2 * C, shift=lambda layer, keys, delta: keys)
    assert np.array_equal(sa.positions, np.arange(3 * C))
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 1
    assert len(chunk_keys(client)) == 1
    sb = create_with_tier(b, np.r_[toks[:C], toks[2 * C :], 5], tier)
    assert_same_prefix(sa, sb, C)


@pytest.mark.parametrize("change", ["grows and moves", "is freed"])
def test_a_push_overlapping_a_move_of_its_sequence_publishes_nothing(make_store, server, client, tiers,  # noqa: PLR0917
                                                                     monkeypatch, change):
    """A structural change of the sequence while its chunks go out (here: just before the bytes
    are sent, from the views push took) gives its cells to another sequence, whose K/V the
    views then show. Nothing of that group is published (no chunk key, no pending key left), and
    another store pulls nothing; the next push, undisturbed, publishes the sequence's own."""
    from shmkv import remote

    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(4 * C)
    sa = prefill(a, toks, k, v)
    keep = (np.array(sa.raw_keys(0)[0]), toks.copy())
    other: list[shmkv.Sequence] = []
    send = remote.send_pending

    def change_then_send(r, items, cluster):
        if not other:
            if change == "grows and moves":
                one = prompt(1, seed=9)
                sa.extend(one[1], one[2], tokens=one[0])  # past its capacity: it moves
            else:
                sa.free()
            o = a.create_sequence(capacity=4 * C)  # takes the cells sa left
            o.extend(*prompt(4 * C, seed=5)[1:], tokens=np.arange(4 * C) + 100)
            other.append(o)
        return send(r, items, cluster)

    monkeypatch.setattr(remote, "send_pending", change_then_send)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 0
    assert chunk_keys(client) == [] and client.keys("*pending*") == []
    assert len(create_with_tier(b, np.r_[toks, 1], tier)) == 0
    if change == "grows and moves":
        assert tier.push(a, sa.id) == 4
        sb = create_with_tier(b, np.r_[toks, 1], tier)
        assert_same_prefix(sa, sb, 4 * C)
        assert np.array_equal(sb.raw_keys(0)[0], keep[0])


def test_a_key_of_another_type_under_a_chunks_name_is_a_foreign_miss(make_store, server, client, tiers):
    """A list where chunk 1's value should be (GET answers WRONGTYPE): that chunk is a miss counted
    as foreign and deleted, not a failure of the whole batch (chunk 0 is still loaded, no
    warning); the next push puts the chunk back and a pull then takes all four."""
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    toks, k, v = prompt(4 * C)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    assert tier.push(a, sa.id) == 4
    key = tier.key(a.layout, toks[: 2 * C])
    client.delete(key)
    client.rpush(key, b"not a chunk")
    sb = create_with_tier(b, np.r_[toks, 1], tier)
    assert_same_prefix(sa, sb, C)
    assert tier.stats().foreign == 1 and not client.exists(key)
    assert tier.push(a, sa.id) == 1
    assert_same_prefix(sa, create_with_tier(b, np.r_[toks, 1], tier), 4 * C)


def test_a_value_copied_under_another_prompts_key_is_refused(make_store, server, client, tiers):
    """Two prompts whose second chunks hold the same 32 ids after different first chunks: the
    value of one copied under the other's key (a key migration, a COPY by hand) passes every
    check of its own ids and checksum, but names another prefix: a miss, counted damaged and
    deleted; only the first chunk is loaded."""
    a, b = make_store(**LAYOUT), make_store(**LAYOUT)
    tail = np.arange(1000, 1000 + C)
    p1, p2 = np.r_[np.arange(C), tail], np.r_[np.arange(500, 500 + C), tail]
    s1 = prefill(a, p1, *prompt(2 * C, seed=1)[1:])
    s2 = prefill(a, p2, *prompt(2 * C, seed=2)[1:])
    tier = tiers(server.url)
    assert tier.push(a, s1.id) == 2 and tier.push(a, s2.id) == 2
    moved = tier.key(a.layout, p2)
    client.copy(tier.key(a.layout, p1), moved, replace=True)
    sb = create_with_tier(b, np.r_[p2, 5], tier)
    assert_same_prefix(s2, sb, C)
    assert tier.stats().damaged == 1 and not client.exists(moved)


def test_pull_arguments_are_checked_before_any_fetch(make_store, server, client, tiers):
    a = make_store(**LAYOUT)
    toks, k, v = prompt(2 * C)
    sa = prefill(a, toks, k, v)
    tier = tiers(server.url)
    tier.push(a, sa.id)
    before = gets(client)
    with pytest.raises(shmkv.ReadOnlyError, match="read-only; pull into a write handle"):
        tier.pull(a.sequence(sa.id), toks)
    with pytest.raises(shmkv.InvalidArgumentError, match=r"have=1\.5 must be an int"):
        tier.pull(a.create_sequence(capacity=2 * C), toks, have=1.5)
    assert gets(client) == before


def test_sliding_layers_are_refused(make_store, server, tiers):
    a = make_store(**{**LAYOUT, "layer_types": ["full", "sliding", "full"], "window": 16})
    toks, k, v = prompt(64)
    seq = a.create_sequence(capacity=64)
    for i in range(0, 64, 16):
        seq.extend(k[:, i : i + 16], v[:, i : i + 16], tokens=toks[i : i + 16])
    tier = tiers(server.url)
    with pytest.raises(shmkv.NotSupportedError, match="sliding"):
        tier.push(a, seq.id)
    assert tier.match(a.layout, toks) == 0
    assert tier.pull(a.create_sequence(capacity=64), toks) == 0


def test_import_shmkv_remote_does_not_import_redis():
    code = "import sys, shmkv, shmkv.remote, shmkv.cli; assert 'redis' not in sys.modules, 'redis imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
