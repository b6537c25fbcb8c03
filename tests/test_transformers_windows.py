"""ShmkvCache against DynamicCache where sliding and chunked windows fill.

transformers' own generation testers use ``sliding_window=4096`` with 7-token prompts, so
a window never fills there. Here every model's windows (4-8) are smaller than its prompt:

* generate scenarios (beam search with 2 and 4 beams, beam sample, assisted decoding with a
  first forward longer than the store's ``memory``, prompt lookup decoding, generate
  restarted from a deep copy of a cache) on tiny random full, sliding (Mistral), chunked
  (Llama4 text) and hybrid (sliding and full layers alternating, as Gemma's) models, batch 1 and 2;
* cache-level cases: a row copy on a full window, crop after a long forward, deepcopy;
* random sequences of cache operations compared step by step with DynamicCache
  (``SHMKV_HF_RANDOM=N`` runs N per config instead of the default).

Skipped when torch or transformers is missing, except under CI (CI=true).
"""

from __future__ import annotations

import copy
import os
import pickle

import numpy as np
import pytest
from conftest import importorskip_unless_ci

import shmkv
from shmkv.testing import unique_name

torch = importorskip_unless_ci("torch")
transformers = importorskip_unless_ci("transformers", "5.0")
importorskip_unless_ci("ml_dtypes")

from transformers import (  # noqa: E402
    DynamicCache,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from shmkv.transformers import ShmkvCache, cache_kwargs, layout_from_config  # noqa: E402

VOCAB = 96
PROMPT = 12  # longer than every window below
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
              bos_token_id=1, eos_token_id=None, pad_token_id=0)


def config(kind, layers=3, **kw):
    """A tiny config of ``kind``: full (Llama), sliding (Mistral, window 5), chunked (Llama4 text,
    chunk 6: three chunked layers and a full one) or hybrid (Qwen2 with Gemma's pattern: sliding
    and full layers alternating, window 4; a tiny random Gemma2 repeats one token whatever its
    prompt, which would compare nothing)."""
    if kind == "full":
        return LlamaConfig(**{**COMMON, "num_hidden_layers": layers, **kw})
    if kind == "sliding":
        return MistralConfig(**{**COMMON, "num_hidden_layers": layers, "sliding_window": 5, **kw})
    if kind == "chunked":
        return Llama4TextConfig(**{**COMMON, "num_hidden_layers": 4, "attention_chunk_size": 6,
                                   "intermediate_size_mlp": 128, "num_local_experts": 1, **kw})
    assert kind == "hybrid"
    return Qwen2Config(**{**COMMON, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 4,
                          "layer_types": ["sliding_attention", "full_attention"] * 2, **kw})


CLASSES = {"full": LlamaForCausalLM, "sliding": MistralForCausalLM, "chunked": Llama4ForCausalLM,
           "hybrid": Qwen2ForCausalLM}
KINDS = list(CLASSES)
EXPECTED_TYPES = {"full": {"full"}, "sliding": {"sliding"}, "chunked": {"chunked", "full"},
                  "hybrid": {"sliding", "full"}}


def build(kind, seed=0, **kw):
    torch.manual_seed(seed)
    return CLASSES[kind]._from_config(config(kind, **kw), dtype=torch.float32).eval()


_models: dict = {}


def model_of(kind, **kw):
    key = (kind, tuple(sorted(kw.items())))
    if key not in _models:
        _models[key] = build(kind, **kw)
    return _models[key]


def prompt(batch, n, seed=1):
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def cache_of():
    """cache_of(model, **from_config kw): a ShmkvCache owning a fresh store, closed after the test."""
    made = []

    def make(model, **kw):
        if set(layout_from_config(model.config)["layer_types"]) == {"full"}:
            kw.pop("memory", None)  # memory= sizes sliding/chunked buffers: refused without them
        c = ShmkvCache.from_config(model.config, unique_name("hfw"), dtype="float32", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def generate(model, ids, cache, seed=None, **kw):
    args = {**dict(do_sample=False, max_new_tokens=10, return_dict_in_generate=True, output_logits=True), **kw}
    if cache is not None:
        args.update(cache_kwargs(model, cache))
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, **args)


def same_output(out, ref, atol=1e-5):
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def windows_fill(model):
    """The model's windows are smaller than the prompt (the point of these tests)."""
    spec = layout_from_config(model.config)
    sizes = [spec.get("window", 0), spec.get("chunk", 0)]
    assert set(spec["layer_types"]) == EXPECTED_TYPES[kind_of(model)]
    assert all(s < PROMPT for s in sizes)


def kind_of(model):
    return next(k for k, cls in CLASSES.items() if isinstance(model, cls))


# -- 1. generate scenarios against DynamicCache --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("beams, sample", [(2, False), (4, False), (2, True)], ids=["beam2", "beam4", "beam_sample"])
def test_beam_search(cache_of, kind, batch, beams, sample):
    model = model_of(kind)
    windows_fill(model)
    ids = prompt(batch, PROMPT)
    kw = dict(num_beams=beams, num_return_sequences=min(beams, 2), do_sample=sample, output_scores=True,
              output_logits=False)
    ref = generate(model, ids, DynamicCache(config=model.config), seed=3, **kw)
    cache = cache_of(model)
    out = generate(model, ids, cache, seed=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=0, atol=1e-5)
    # one sequence per beam row, none leaked by the reorders
    assert sorted(i.id for i in cache.store.sequences()) == sorted(cache.sequence_ids)
    assert len(cache.sequence_ids) == batch * beams


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_assisted_decoding_with_a_long_first_forward(cache_of, kind):
    """The first forward (the prompt and the candidates) is longer than the store's memory, so
    it is committed in steps; crop then rolls rejected candidates back into it."""
    model = model_of(kind)
    assistant = build(kind, seed=5, layers=1) if kind in ("full", "sliding") else build(kind, seed=5)
    ids = prompt(1, 40, seed=2)
    greedy = generate(model, ids, None, max_new_tokens=24).sequences
    assert len(set(greedy[0, 40:].tolist())) > 4  # not a one-token loop: the comparison shows something
    kw = dict(assistant_model=assistant, max_new_tokens=24)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    cache = cache_of(model, memory=16)
    assert kind == "full" or cache.store.layout.step == 16 < ids.shape[1]
    crops = []
    real = cache.crop
    cache.crop = lambda n: (crops.append(n), real(n))[1]  # type: ignore[method-assign]
    out = generate(model, ids, cache, **kw)
    same_output(out, ref)
    assert torch.equal(out.sequences, greedy)
    assert any(n < 0 for n in crops)  # candidates were rejected and rolled back


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_lookup_decoding(cache_of, kind):
    model = model_of(kind)
    ids = torch.cat([prompt(1, 6, seed=7)] * 4, 1)  # repetitions to look up
    kw = dict(prompt_lookup_num_tokens=4, max_new_tokens=20)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    out = generate(model, ids, cache_of(model, memory=8), **kw)
    same_output(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 2])
def test_generate_restarted_from_a_copy_and_new_tokens_only(cache_of, kind, batch):
    """transformers' test_generate_can_restart_from_cache_and_new_tokens_only: generate, deep-copy
    the cache, generate again from the copy with the output and a few new tokens (the cache
    makes generate compute only those); both caches go on, and all equal DynamicCache."""
    model = model_of(kind)
    ids = prompt(batch, PROMPT, seed=4)
    ref_cache, cache = DynamicCache(config=model.config), cache_of(model)
    ref1, out1 = generate(model, ids, ref_cache), generate(model, ids, cache)
    same_output(out1, ref1)
    more = torch.cat([out1.sequences, prompt(batch, 3, seed=6)], 1)
    ref_copy, copied = copy.deepcopy(ref_cache), copy.deepcopy(cache)
    assert copied.get_seq_length() == cache.get_seq_length() == ref_cache.get_seq_length()
    assert not set(copied.sequence_ids) & set(cache.sequence_ids)  # forks: other sequences
    ref2, out2 = generate(model, more, ref_copy), generate(model, more, copied)
    same_output(out2, ref2)
    # the original is untouched by the copy's generate and continues too
    ref3, out3 = generate(model, more, ref_cache), generate(model, more, cache)
    same_output(out3, ref3)
    copied.free()


# -- 2. cache level ----------------------------------------------------------------------------------


def _step(model, ids, cache):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache)).logits


def _same_layers(cache, ref):
    for layer in range(len(ref.layers)):
        r = ref.layers[layer]
        n = cache.layers[layer].keys.shape[2]
        assert n <= r.keys.shape[2]
        torch.testing.assert_close(cache.layers[layer].keys, r.keys[:, :, r.keys.shape[2] - n:], rtol=0, atol=0)
        torch.testing.assert_close(cache.layers[layer].values, r.values[:, :, r.keys.shape[2] - n:], rtol=0, atol=0)


@pytest.mark.parametrize("op, arg", [("reorder_cache", [1, 1]), ("batch_repeat_interleave", 2),
                                     ("batch_select_indices", [1])])
def test_row_copies_on_a_full_window(cache_of, op, arg):
    """2 rows, window 5, a 6-token prefill and 3 more, a row operation (reorder_cache([1, 1]),
    batch_repeat_interleave(2), batch_select_indices([1])), then more tokens: every step equals
    DynamicCache's (a copied row holds as many tokens on the sliding layers as its source)."""
    model = model_of("sliding")
    ref, cache = DynamicCache(config=model.config), cache_of(model)
    ids = prompt(2, 6)
    torch.testing.assert_close(_step(model, ids, cache), _step(model, ids, ref), rtol=0, atol=1e-5)
    nxt = prompt(2, 3, seed=2)
    torch.testing.assert_close(_step(model, nxt, cache), _step(model, nxt, ref), rtol=0, atol=1e-5)
    a = torch.tensor(arg) if isinstance(arg, list) else arg
    getattr(ref, op)(a)
    getattr(cache, op)(a)
    _same_layers(cache, ref)
    rows = ref.layers[0].keys.shape[0]
    for s in range(3):
        tok = prompt(rows, 1, seed=10 + s)
        torch.testing.assert_close(_step(model, tok, cache), _step(model, tok, ref), rtol=0, atol=1e-5)
    _same_layers(cache, ref)


@pytest.mark.parametrize("kind", ["sliding", "chunked", "hybrid"])
@pytest.mark.parametrize("first", [129, 30])
def test_crop_after_a_forward_longer_than_memory(cache_of, kind, first):
    """Window 8 (here 4-6), a 124-token prompt and 5 candidates in the first forward (longer than
    memory=64, so committed in steps of 64, 64, 1), 5 candidates rejected: the crop works (no
    NotSupportedError) and matches DynamicCache. Also a decode
    forward longer than memory (30 tokens on memory=16) after a prompt, then a crop."""
    model = model_of(kind)
    ref, cache = DynamicCache(config=model.config), cache_of(model, memory=None if first == 129 else 16)
    ref.activate_past_recording()  # DynamicCache keeps what a crop needs only so (assisted decoding does it)
    cache.activate_past_recording()  # as generate does for both where it crops
    if first == 30:
        ids = prompt(1, 10, seed=3)
        torch.testing.assert_close(_step(model, ids, cache), _step(model, ids, ref), rtol=0, atol=1e-5)
    ids = prompt(1, first)
    assert ids.shape[1] > cache.store.layout.step
    torch.testing.assert_close(_step(model, ids, cache), _step(model, ids, ref), rtol=0, atol=1e-5)
    total = cache.get_seq_length()
    cache.crop(-5)
    cache.crop(-3)  # and again, further into the same forward (DynamicCache crops once only)
    ref.crop(-8)
    assert cache.get_seq_length() == ref.get_seq_length() == total - 8
    _same_layers(cache, ref)
    for s in range(3):
        tok = prompt(1, 2, seed=20 + s)
        torch.testing.assert_close(_step(model, tok, cache), _step(model, tok, ref), rtol=0, atol=1e-5)
    cache.crop(-2)  # into the last (short) forward: the windows hold what it needs
    ref.crop(-2)
    tok = prompt(1, 1, seed=30)
    torch.testing.assert_close(_step(model, tok, cache), _step(model, tok, ref), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["sliding", "chunked", "hybrid"])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_long_forward_that_fails_while_committed_in_steps_leaves_the_cache_as_before(cache_of, monkeypatch,
                                                                                       kind, rows):
    """A forward longer than memory (30 tokens on memory=16) after a 10-token one is committed in
    steps at its end, row by row. A Ctrl-C (or a CacheFullError) at any of those commits raises as
    itself, and every row goes back to 10 tokens, its sliding/chunked windows as they were: the
    cache says 10 tokens, the store too, and the next forward matches DynamicCache's."""
    from shmkv._sequence import writer

    model = model_of(kind)
    first, long = prompt(rows, 10, seed=3), prompt(rows, 30, seed=4)
    ref = DynamicCache(config=model.config)
    _step(model, first, ref)
    after = prompt(rows, 1, seed=5)
    want = _step(model, after, ref)
    commit = writer.SeqWriter.commit
    calls, fail_at = [0], [0]  # commits so far; the one that raises (0: none)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise KeyboardInterrupt
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(writer.SeqWriter, "commit", counted)
    cache = cache_of(model, memory=16)
    _step(model, first, cache)
    calls[0] = 0
    _step(model, long, cache)
    points = calls[0]  # the long forward's commits (a few steps a row)
    assert points >= 2 * rows
    for point in range(1, points + 1):
        cache = cache_of(model, memory=16)
        _step(model, first, cache)
        calls[0], fail_at[0] = 0, point
        with pytest.raises(KeyboardInterrupt):
            _step(model, long, cache)
        fail_at[0] = 0
        assert cache.get_seq_length() == 10, point
        assert [cache.store.sequence(i).length for i in cache.sequence_ids] == [10] * rows, point
        torch.testing.assert_close(_step(model, after, cache), want, rtol=0, atol=1e-5)
        cache.close()


@pytest.mark.parametrize("rows", [1, 2])
def test_a_rollback_cut_short_by_a_second_ctrl_c_is_finished_by_the_next_call(cache_of, monkeypatch, rows):
    """The rollback above interrupted too (a second Ctrl-C in its first rewind): rows are left
    past the cache's length. The next forward finishes the rollback before it runs, and matches
    DynamicCache's."""
    from shmkv._sequence import handle, writer

    model = model_of("sliding")
    first, long, after = prompt(rows, 10, seed=3), prompt(rows, 30, seed=4), prompt(rows, 1, seed=5)
    ref = DynamicCache(config=model.config)
    _step(model, first, ref)
    want = _step(model, after, ref)
    cache = cache_of(model, memory=16)
    _step(model, first, cache)
    commit, rewind, calls = writer.SeqWriter.commit, handle.Sequence.rewind, [0]

    def fails_second(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return commit(self, *args, **kwargs)

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.SeqWriter, "commit", fails_second)
    monkeypatch.setattr(handle.Sequence, "rewind", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _step(model, long, cache)
    monkeypatch.setattr(writer.SeqWriter, "commit", commit)
    monkeypatch.setattr(handle.Sequence, "rewind", rewind)
    assert any(cache.store.sequence(i).length > 10 for i in cache.sequence_ids)  # (cut short)
    torch.testing.assert_close(_step(model, after, cache), want, rtol=0, atol=1e-5)
    assert [cache.store.sequence(i).length for i in cache.sequence_ids] == [11] * rows


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_crop_into_a_long_forward_without_past_recording_says_what_to_do(cache_of, kind):
    """Without activate_past_recording (generate calls it where it crops) a long forward's
    sliding/chunked states are not kept (they would stay in memory until the next forward):
    a crop back into it is refused, as DynamicCache refuses it, with the way out named;
    a crop the windows still hold works."""
    model = model_of(kind)
    cache = cache_of(model)
    ids = prompt(1, 129)  # a 124-token prompt and 5 candidates: steps of 64, 64, 1
    assert cache.store.layout.step == 64
    _step(model, ids, cache)
    with pytest.raises(shmkv.NotSupportedError, match=r"crop\(-5\).*activate_past_recording"):
        cache.crop(-5)
    assert cache.get_seq_length() == 129  # nothing changed
    cache.crop(-1)  # what the windows still hold (the last step's token): fine
    assert cache.get_seq_length() == 128


def test_deepcopy_gives_an_independent_cache_and_pickle_stays_a_read_alias(cache_of):
    model = model_of("sliding")
    cache = cache_of(model)
    ids = prompt(2, PROMPT)
    _step(model, ids, cache)
    twin = copy.deepcopy(cache)
    assert twin.store is cache.store and twin.batch_size == 2 and twin.get_seq_length() == PROMPT
    assert not set(twin.sequence_ids) & set(cache.sequence_ids)
    a, b = prompt(2, 1, seed=8), prompt(2, 1, seed=9)
    la, lb = _step(model, a, cache), _step(model, b, twin)  # both write: each holds its own leases
    ref_a, ref_b = DynamicCache(config=model.config), DynamicCache(config=model.config)
    _step(model, ids, ref_a)
    _step(model, ids, ref_b)
    torch.testing.assert_close(la, _step(model, a, ref_a), rtol=0, atol=1e-5)
    torch.testing.assert_close(lb, _step(model, b, ref_b), rtol=0, atol=1e-5)
    twin.reset()  # the copy owns its forks: freed, the original's sequences stay
    assert sorted(i.id for i in cache.store.sequences()) == sorted(cache.sequence_ids)
    # pickling keeps its meaning: read handles of the same sequences (a lease never travels)
    back = pickle.loads(pickle.dumps(cache))
    assert back.sequence_ids == cache.sequence_ids
    with pytest.raises(shmkv.ReadOnlyError):
        _step(model, prompt(2, 1), back)
    back._store.close()
    empty = copy.deepcopy(cache_of(model))  # before the first forward: an empty cache
    assert empty.batch_size == -1 and empty.sequence_ids == []


def test_deepcopy_during_a_forward_is_refused(cache_of):
    model = model_of("full")
    cache = cache_of(model)
    _step(model, prompt(1, 4), cache)
    k = torch.zeros(1, 2, 1, 16)
    cache.update(k, k, 0)  # layer 0 of a forward, the others not yet
    with pytest.raises(shmkv.InvalidArgumentError, match="deepcopy"):
        copy.deepcopy(cache)


# -- 3. random sequences of cache operations against DynamicCache ---------------------------------------

RANDOM = int(os.environ.get("SHMKV_HF_RANDOM", "25"))  # sequences per config (4 configs: 100 by default)
OPS = ("update", "update", "update", "crop", "reorder_cache", "batch_repeat_interleave", "batch_select_indices")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_random_operation_sequences(kind):
    """RANDOM seeded sequences of 12 operations per config; after each, every layer's keys and
    values (and what update returned) equal DynamicCache's. Seeds are kind * 1000 + i: a
    failure names its seed. SHMKV_HF_RANDOM=N runs N sequences per config."""
    cfg = config(kind)
    spec = layout_from_config(cfg)
    L = spec["layers"]
    H, D = spec["kv_heads"], spec["head_dim"]
    memory = None if kind == "full" else 12  # small: forwards of up to 20 tokens go in steps
    with ShmkvCache.from_config(cfg, unique_name("hfr"), dtype="float32", memory=memory) as owner:
        for i in range(RANDOM):
            seed = KINDS.index(kind) * 1000 + i
            try:
                _random_sequence(owner.store, cfg, (L, H, D), np.random.default_rng(seed))
            except AssertionError as e:
                raise AssertionError(f"{kind} seed {seed}: {e}") from e
            assert owner.store.sequences() == [], f"seed {seed}: sequences leaked"


def _random_sequence(store, cfg, shape, rng):
    L, H, D = shape
    ref = DynamicCache(config=cfg)
    ref.activate_past_recording()  # so DynamicCache can crop once a window filled
    cache = ShmkvCache(store)
    cache.activate_past_recording()  # and ShmkvCache after a forward longer than memory
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    batch = int(rng.integers(1, 4))
    last_q = 0  # tokens of the last update: crop goes back at most that far (as generate does)
    try:
        for _ in range(12):
            op = OPS[int(rng.integers(len(OPS)))] if last_q else "update"
            if op == "update":
                q = int(rng.integers(1, 21))
                for layer in range(L):
                    k = torch.randn(batch, H, q, D, generator=gen)
                    v = torch.randn(batch, H, q, D, generator=gen)
                    got = cache.update(k, v, layer)
                    want = ref.update(k, v, layer)
                    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, msg=f"update keys, layer {layer}")
                    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, msg=f"update values, layer {layer}")
                last_q = q
            elif op == "crop":  # what assisted decoding does after a forward: once
                n = int(rng.integers(0, last_q + 1))
                cache.crop(-n)
                ref.crop(-n)  # (DynamicCache's window is cut back to window - 1 tokens here:
                last_q = 0  # a second crop would take it below what it needs)
            elif op == "batch_repeat_interleave":
                r = int(rng.integers(1, 3)) if batch < 4 else 1
                cache.batch_repeat_interleave(r)
                ref.batch_repeat_interleave(r)
                batch *= r
            else:
                if op == "reorder_cache":
                    idx = torch.from_numpy(rng.integers(0, batch, batch))
                else:
                    idx = torch.from_numpy(np.sort(rng.choice(batch, int(rng.integers(1, batch + 1)), replace=False)))
                getattr(cache, op)(idx)
                getattr(ref, op)(idx)
                batch = len(idx)
            assert cache.get_seq_length() == ref.get_seq_length(), op
            assert cache.batch_size == batch
            _same_layers(cache, ref)
    finally:
        cache.free()
