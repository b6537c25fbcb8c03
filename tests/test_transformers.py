"""shmkv.transformers.ShmkvCache against transformers' own DynamicCache, on tiny
random-weight models built from configs (no downloads).

Skipped when torch or transformers is missing, except under CI (CI=true), where
that is a failure (conftest.importorskip_unless_ci).
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import importorskip_unless_ci

import shmkv
from shmkv.testing import run_in_process, unique_name

torch = importorskip_unless_ci("torch")
transformers = importorskip_unless_ci("transformers", "5.0")
importorskip_unless_ci("ml_dtypes")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from shmkv.transformers import ShmkvCache, cache_keyword, cache_kwargs, layout_from_config  # noqa: E402

VOCAB = 96
NEW = 12  # new tokens per generate


def llama_config(**kw):
    # initializer_range 0.2 (HF default 0.02) makes the logits of random weights peaky
    # enough that greedy choices are not near-ties
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return LlamaConfig(**{**base, **kw})


def sliding_config(**kw):
    """Qwen2 with layers full, sliding, sliding, full (window 8)."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2, use_sliding_window=True, sliding_window=8,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return Qwen2Config(**{**base, **kw})


def build(config_fn, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    cls = Qwen2ForCausalLM if config_fn is sliding_config else LlamaForCausalLM
    return cls._from_config(config_fn(**kw), dtype=dtype).eval()  # config.dtype = dtype


@pytest.fixture(scope="module")
def llama():
    return build(llama_config)


@pytest.fixture(scope="module")
def qwen_sliding():
    return build(sliding_config)


def prompt(batch, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


def left_padded():
    """Batch 2, row 0 left-padded by 4."""
    ids = prompt(2, 10, seed=3)
    mask = torch.ones_like(ids)
    ids[0, :4] = 0
    mask[0, :4] = 0
    return ids, mask


GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def generate(model, ids, cache=None, mask=None, **kw):
    args = {**GEN, "max_new_tokens": NEW, **kw}
    if mask is not None:
        args["attention_mask"] = mask
    if cache is not None:
        args.update(cache_kwargs(model, cache))  # cache= or past_key_values=, as the model takes it
    with torch.no_grad():
        return model.generate(ids, **args)


def max_logit_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits, strict=True))


@pytest.fixture
def cache_of(request):
    """cache_of(model, **from_config kw): a ShmkvCache owning a fresh store, closed after the test."""
    made = []

    def make(model, **kw):
        c = ShmkvCache.from_config(model.config, unique_name("hf"), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# -- 1. outputs equal DynamicCache's ------------------------------------------------------------------


@pytest.mark.parametrize("case", ["batch1", "batch2", "left_padded2"])
def test_greedy_matches_dynamic_cache(llama, cache_of, case):
    if case == "left_padded2":
        ids, mask = left_padded()
    else:
        ids, mask = prompt(1 if case == "batch1" else 2, 9), None
    ref_cache = DynamicCache()
    ref = generate(llama, ids, ref_cache, mask)
    cache = cache_of(llama, dtype="float32")
    out = generate(llama, ids, cache, mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) <= 1e-5
    # the store holds what DynamicCache holds, row by row, in every layer
    assert cache.get_seq_length() == ref_cache.get_seq_length()
    assert cache.batch_size == ids.shape[0] == len(cache.sequence_ids)
    for layer in range(llama.config.num_hidden_layers):
        for row, seq_id in enumerate(cache.sequence_ids):
            k, v = cache.store.sequence(seq_id).kv(layer)
            np.testing.assert_array_equal(k, ref_cache.layers[layer].keys[row].transpose(0, 1).numpy())
            np.testing.assert_array_equal(v, ref_cache.layers[layer].values[row].transpose(0, 1).numpy())
        torch.testing.assert_close(cache.layers[layer].keys, ref_cache.layers[layer].keys, rtol=0, atol=0)


# Storage error bounds (shmkv._sequence.quant): float16 relative 2^-11, bfloat16 relative 2^-8, int8
# absmax/254 per (token, head). The stated tolerance: no logit moves by more than 16 x that bound
# x the largest |logit| (measured here: 1.6x, 1.5x and 6.4x the bound x max|logit| respectively).
STORAGE_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 1 / 254}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_compact_storage_within_bounds(llama, cache_of, dtype):
    """Teacher-forced along DynamicCache's tokens, so one flipped choice (allowed for int8)
    does not make the rest incomparable."""
    ids, mask = left_padded()
    ref = generate(llama, ids, DynamicCache(), mask)
    cache = cache_of(llama, dtype=dtype)
    seq, m = ids, mask
    worst = 0.0
    with torch.no_grad():
        logits = llama(ids, attention_mask=mask, **cache_kwargs(llama, cache)).logits[:, -1]
        for step in range(NEW):
            worst = max(worst, float((logits - ref.logits[step]).abs().max()))
            tok = ref.sequences[:, ids.shape[1] + step, None]
            seq, m = torch.cat([seq, tok], 1), torch.cat([m, torch.ones_like(tok)], 1)
            logits = llama(tok, attention_mask=m, **cache_kwargs(llama, cache)).logits[:, -1]
    scale = max(float(x.abs().max()) for x in ref.logits)
    assert worst <= 16 * STORAGE_EPS[dtype] * scale, (worst, scale)
    assert worst > 0  # the storage really is lossy: the comparison is not vacuous
    if dtype != "int8":
        out = generate(llama, ids, cache_of(llama, dtype=dtype), mask)
        assert torch.equal(out.sequences, ref.sequences)


def test_bfloat16_model_bfloat16_storage(cache_of):
    model = build(llama_config, dtype=torch.bfloat16)
    ids = prompt(1, 9)
    ref = generate(model, ids, DynamicCache())
    cache = cache_of(model)  # dtype from the config: bfloat16
    assert cache.store.layout.dtype == "bfloat16"
    out = generate(model, ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) <= 1e-2  # bfloat16 arithmetic, same stored values
    k = cache.layers[0].keys
    assert k.dtype == torch.bfloat16


# -- 2. prefill in one process, continue in another ------------------------------------------------


def _child_prefill(model_dir, name, ids):
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with ShmkvCache.attach(name) as cache, torch.no_grad():
        model(torch.tensor(ids), **cache_kwargs(model, cache))
        return cache.sequence_ids  # close(): leases released, the sequences stay


def _child_generate(model_dir, name, seq_ids, ids):
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with ShmkvCache.attach(name, seq_ids) as cache:
        assert cache.get_seq_length() == len(ids[0]) - 1
        out = generate(model, torch.tensor(ids), cache)
        return out.sequences.tolist(), cache.get_seq_length()


@pytest.mark.slow
def test_prefill_in_one_process_continue_in_another(llama, cache_of, tmp_path):
    # spawn only: torch's thread pools do not survive fork, and forkserver imports it the same way
    llama.save_pretrained(tmp_path)
    ids = prompt(2, 9)
    ref = generate(llama, ids, DynamicCache())
    owner = cache_of(llama, dtype="float32")  # this process owns the store
    name = owner.store.name
    seq_ids = run_in_process(_child_prefill, str(tmp_path), name, ids[:, :-1].tolist(), timeout=120)
    assert [len(owner.store.sequence(i)) for i in seq_ids] == [8, 8]
    tokens, length = run_in_process(_child_generate, str(tmp_path), name, seq_ids, ids.tolist(), timeout=120)
    assert tokens == ref.sequences.tolist()
    assert length == ids.shape[1] + NEW - 1


# -- 5. prefix reuse across processes: for_prompt and finish --------------------------------------------

SYSTEM = list(range(3, 23))  # a 20-token system prompt (a whole 16-token block and 4 more)


def _child_for_prompt(model_dir, name, ids):
    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    store = shmkv.attach(name)
    try:
        cache = ShmkvCache.for_prompt(store, ids)
        reused = cache.get_seq_length()
        out = generate(model, torch.tensor(ids), cache)
        cache.finish(out.sequences)
        return reused, out.sequences.tolist()
    finally:
        store.close()


@pytest.mark.slow
def test_for_prompt_reuses_across_processes_and_finish_caches(llama, cache_of, tmp_path):
    llama.save_pretrained(tmp_path)
    store = cache_of(llama, dtype="float32").store
    system = torch.tensor([SYSTEM])
    first = ShmkvCache.for_prompt(store, system)  # nothing cached yet
    assert first.get_seq_length() == 0
    first.finish(generate(llama, system, first, max_new_tokens=1).sequences)  # caches the system prompt
    assert store.match_prefix([*SYSTEM, 99]) == len(SYSTEM)

    prompt = torch.tensor([[*SYSTEM, 40, 41, 42, 43, 44]])
    reused, tokens = run_in_process(_child_for_prompt, str(tmp_path), store.name, prompt.tolist(), timeout=120)
    assert reused == len(SYSTEM)  # the other process computed only the user's 5 tokens
    assert tokens == generate(llama, prompt, DynamicCache()).sequences.tolist()  # as a fresh run

    again = ShmkvCache.for_prompt(store, prompt)  # the child's finish cached its whole request
    assert again.get_seq_length() == prompt.shape[1] - 1
    assert generate(llama, prompt, again).sequences.tolist() == tokens
    again.free()
    stats = store.stats()
    assert stats.prefix_hits >= 2 and stats.prefix_tokens_reused >= len(SYSTEM) + prompt.shape[1] - 1


def test_for_prompt_leaves_room_for_the_new_tokens(llama, cache_of):
    """A row made by for_prompt holds its prompt and what generate adds without moving (a move
    copies the cells it borrowed from the cached prefix); capacity= is honoured when given."""
    store = cache_of(llama, dtype="float32").store
    long_system = [3 + i % (VOCAB - 3) for i in range(300)]  # longer than a default first range (256)
    system = torch.tensor([long_system])
    c = ShmkvCache.for_prompt(store, system)
    c.finish(generate(llama, system, c, max_new_tokens=1))
    prompt = torch.tensor([[*long_system, 40, 41]])
    cache = ShmkvCache.for_prompt(store, prompt)
    assert cache.get_seq_length() == len(long_system)
    (sid,) = cache.sequence_ids
    start = store.sequence(sid).capacity
    assert start >= prompt.shape[1] + NEW
    generate(llama, prompt, cache)
    assert store.sequence(sid).capacity == start  # it did not grow (nor move)
    cache.free()
    given = ShmkvCache.for_prompt(store, prompt, capacity=400)
    assert store.sequence(given.sequence_ids[0]).capacity == 400
    given.free()


def test_for_prompt_batch_reuses_the_shortest_match(llama, cache_of):
    store = cache_of(llama, dtype="float32").store
    system = torch.tensor([SYSTEM])
    c = ShmkvCache.for_prompt(store, system)
    c.finish(generate(llama, system, c, max_new_tokens=1))  # a GenerateOutput works too
    ids = torch.tensor([[*SYSTEM, 50, 51], [*SYSTEM[:17], 60, 61, 62, 63, 64]])
    cache = ShmkvCache.for_prompt(store, ids)
    assert cache.get_seq_length() == 17  # row 1 matches 17 tokens: both rows start there
    out = generate(llama, ids, cache)
    assert torch.equal(out.sequences, generate(llama, ids, DynamicCache()).sequences)
    bad = out.sequences.clone()
    bad[0, 3] += 1  # disagrees with the reused cells' ids: refused, nothing recorded
    with pytest.raises(shmkv.InvalidArgumentError, match="holds token"):
        cache.finish(bad)
    mask = torch.ones_like(out.sequences)
    mask[1, 0] = 0  # as if row 1 were padded: freed, not cached
    ids_before = cache.sequence_ids
    cache.finish(out.sequences, attention_mask=mask)
    live = {i.id for i in store.sequences()}
    assert ids_before[0] in live and ids_before[1] not in live
    assert store.match_prefix(out.sequences[0].tolist()) == out.sequences.shape[1] - 1


def test_for_prompt_caches_the_prompt_from_its_prefill_on(llama, cache_of):
    """generate's first forward commits the prompt with its ids: another request reuses it while
    this one still generates, before finish. Rows that may be padded are not recorded so early."""
    from transformers.generation.streamers import BaseStreamer

    store = cache_of(llama, dtype="float32").store
    ids = torch.tensor([[*SYSTEM, 40, 41, 42]])
    probe = [*ids[0].tolist(), 99]
    seen = []

    class Probe(BaseStreamer):  # generate puts the prompt, then each new token after its forward
        def put(self, value):
            seen.append(store.match_prefix(probe))

        def end(self):
            return None

    cache = ShmkvCache.for_prompt(store, ids)
    out = generate(llama, ids, cache, streamer=Probe())
    assert seen[0] == 0  # before the first forward: nothing cached
    assert seen[1:] == [ids.shape[1]] * NEW  # from the prefill on, before finish: the whole prompt
    assert torch.equal(out.sequences, generate(llama, ids, DynamicCache()).sequences)
    cache.finish(out)  # the prompt's ids again, and the new tokens'
    assert store.match_prefix(out.sequences[0].tolist()) == out.sequences.shape[1] - 1

    padded, mask = left_padded()  # row 0 padded by 4
    rows = [[*r, 99] for r in padded.tolist()]
    before = [store.match_prefix(r) for r in rows]
    unmasked = ShmkvCache.for_prompt(store, padded)  # two rows, no mask: none recorded early
    generate(llama, padded, unmasked, mask=mask, max_new_tokens=1)
    assert [store.match_prefix(r) for r in rows] == before
    unmasked.free()
    masked = ShmkvCache.for_prompt(store, padded, attention_mask=mask)  # the unpadded row only
    generate(llama, padded, masked, mask=mask, max_new_tokens=1)
    assert [store.match_prefix(r) for r in rows] == [before[0], padded.shape[1]]
    masked.free()
    with pytest.raises(shmkv.InvalidArgumentError, match="attention_mask"):
        ShmkvCache.for_prompt(store, padded, attention_mask=mask[:, 1:])


# -- 3. crop (assisted and prompt-lookup decoding), beam search, batch ops ----------------------------


def test_a_prompt_holding_the_pad_id_is_not_cached_when_generate_masks_it(llama, cache_of):
    """Batch 1, no attention_mask, the prompt holds pad_token_id (0): generate infers the mask
    ids != 0 and computes the prompt with that token masked out, so its cells are no prefix a match
    by ids may reuse. The prefill does not record it and finish frees it: a later request with
    the same ids and an all-ones mask reuses nothing and equals DynamicCache's."""
    store = cache_of(llama).store
    ids = prompt(1, 20, seed=5)
    ids[0, 7] = llama.generation_config.pad_token_id
    first = ShmkvCache.for_prompt(store, ids)
    out = generate(llama, ids, first)
    assert out.sequences.tolist() == generate(llama, ids).sequences.tolist()
    assert store.match_prefix(ids[0].tolist()) == 0  # (not recorded by the prefill)
    first.finish(out.sequences)
    assert store.match_prefix(ids[0].tolist()) == 0 and [s.id for s in store.sequences()] == []
    more = torch.cat([ids, torch.tensor([[11, 12, 13]])], 1)
    ones = torch.ones_like(more)
    second = ShmkvCache.for_prompt(store, more, attention_mask=ones)
    assert second.get_seq_length() == 0
    got, want = generate(llama, more, second, mask=ones), generate(llama, more, mask=ones)
    assert got.sequences.tolist() == want.sequences.tolist()
    second.free()


def test_a_prefix_reused_where_generate_masks_the_pad_id_is_cut_before_it(llama, cache_of):
    """The other way round: a prompt holding the pad id cached from a request with an all-ones
    mask (computed with it visible); the same ids without a mask, where generate masks it out,
    reuse only the cells before it, and equal DynamicCache's."""
    store = cache_of(llama).store
    ids = prompt(1, 20, seed=5)
    ids[0, 7] = llama.generation_config.pad_token_id
    ones = torch.ones_like(ids)
    first = ShmkvCache.for_prompt(store, ids, attention_mask=ones)
    first.finish(generate(llama, ids, first, mask=ones).sequences, attention_mask=ones)
    assert store.match_prefix(ids[0].tolist()) == 19
    second = ShmkvCache.for_prompt(store, ids)
    got = generate(llama, ids, second)
    assert got.sequences.tolist() == generate(llama, ids).sequences.tolist()
    second.free()


def _spy(monkeypatch, name):
    calls = []
    real = getattr(ShmkvCache, name)

    def spy(self, *a):
        calls.append(a)
        return real(self, *a)

    monkeypatch.setattr(ShmkvCache, name, spy)
    return calls


def test_assisted_decoding(llama, cache_of, monkeypatch):
    crops = _spy(monkeypatch, "crop")
    assistant = build(llama_config, seed=5, num_hidden_layers=1)
    ids = prompt(1, 9)
    ref = generate(llama, ids, DynamicCache(), assistant_model=assistant, max_new_tokens=20)
    out = generate(llama, ids, cache_of(llama, dtype="float32"), assistant_model=assistant, max_new_tokens=20)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.sequences, generate(llama, ids, max_new_tokens=20).sequences)  # greedy
    assert any(a[0] < 0 for a in crops)  # candidates were rejected and rolled back


def test_prompt_lookup_decoding(llama, cache_of, monkeypatch):
    crops = _spy(monkeypatch, "crop")
    ids = torch.cat([prompt(1, 6, seed=7)] * 4, 1)  # repetitions to look up
    kw = dict(prompt_lookup_num_tokens=4, max_new_tokens=20)
    ref = generate(llama, ids, DynamicCache(), **kw)
    out = generate(llama, ids, cache_of(llama, dtype="float32"), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert any(a[0] < 0 for a in crops)


def test_beam_search(llama, cache_of, monkeypatch):
    reorders = _spy(monkeypatch, "reorder_cache")
    ids, mask = left_padded()
    kw = dict(num_beams=3, num_return_sequences=2, output_scores=True, output_logits=False)
    ref = generate(llama, ids, DynamicCache(), mask, **kw)
    cache = cache_of(llama, dtype="float32")
    out = generate(llama, ids, cache, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=0, atol=1e-5)
    assert len(reorders) >= NEW - 1
    # no sequence leaked by the reorders: one per beam row
    assert sorted(i.id for i in cache.store.sequences()) == sorted(cache.sequence_ids)
    assert len(cache.sequence_ids) == 6


def _step(model, ids, cache):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache)).logits


@pytest.mark.parametrize("op, arg", [
    ("reorder_cache", [2, 0, 0]),
    ("reorder_cache", [1, 2, 0]),
    ("batch_select_indices", [2, 0]),
    ("batch_select_indices", [True, False, True]),
    ("batch_select_indices", "python bools"),
    ("batch_repeat_interleave", 2),
])
def test_batch_ops(llama, cache_of, op, arg):
    ids = prompt(3, 7)
    ref, cache = DynamicCache(), cache_of(llama, dtype="float32")
    torch.testing.assert_close(_step(llama, ids, cache), _step(llama, ids, ref), rtol=0, atol=1e-5)
    before = list(cache.sequence_ids)
    a = torch.tensor(arg) if isinstance(arg, list) else arg
    if arg == "python bools":  # a plain list of bools is a mask too, as for a tensor
        a = torch.tensor([False, True, True])
        getattr(ref, op)(a)
        getattr(cache, op)([False, True, True])
    else:
        getattr(ref, op)(a)
        getattr(cache, op)(a)
    rows = ref.layers[0].keys.shape[0]
    assert cache.batch_size == rows
    for layer in range(2):
        torch.testing.assert_close(cache.layers[layer].keys, ref.layers[layer].keys, rtol=0, atol=0)
        torch.testing.assert_close(cache.layers[layer].values, ref.layers[layer].values, rtol=0, atol=0)
    nxt = prompt(rows, 2, seed=9)
    torch.testing.assert_close(_step(llama, nxt, cache), _step(llama, nxt, ref), rtol=0, atol=1e-5)
    live = sorted(i.id for i in cache.store.sequences())
    assert live == sorted(cache.sequence_ids)  # dropped rows' sequences were freed
    if op == "reorder_cache":
        assert set(cache.sequence_ids) == set(before)  # relabelled and copied, no new sequence


# -- 4. sliding layers -------------------------------------------------------------------------------


@pytest.mark.parametrize("memory, n", [(None, 100), (5, 40), (None, 20)])
def test_sliding_model_long_prompt(qwen_sliding, cache_of, memory, n):
    cache = cache_of(qwen_sliding, dtype="float32", memory=memory)
    lay = cache.store.layout
    assert lay.layer_types == ("full", "sliding", "sliding", "full") and lay.window == 8
    if n != 20:
        assert n > lay.window + lay.step  # longer than the window buffer takes in one commit
    ids = prompt(1, n)
    ref = generate(qwen_sliding, ids, max_new_tokens=30)  # generate's own DynamicCache(config)
    out = generate(qwen_sliding, ids, cache, max_new_tokens=30)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) <= 1e-5
    # a sliding layer keeps a bounded buffer, a full layer everything
    seq = cache.store.sequence(cache.sequence_ids[0])
    assert len(seq.keys(0)) == n + 29
    assert len(seq.keys(1)) <= lay.window_cells
    assert list(seq.held_positions(1)[-7:]) == list(range(n + 22, n + 29))


@pytest.mark.parametrize("memory", [None, 5])
def test_sliding_model_for_prompt_records_the_prompt_at_its_prefill(qwen_sliding, cache_of, memory):
    """A prompt longer than the window buffer takes between commits (memory=5) is committed in steps at
    the end of its forward: the ids go with it, as with a forward committed at once."""
    store = cache_of(qwen_sliding, dtype="float32", memory=memory).store
    ids = prompt(1, 40)
    assert memory is None or ids.shape[1] > store.layout.step  # committed in steps
    cache = ShmkvCache.for_prompt(store, ids)
    out = generate(qwen_sliding, ids, cache, max_new_tokens=1)  # the prefill alone
    assert torch.equal(out.sequences, generate(qwen_sliding, ids, max_new_tokens=1).sequences)
    seq = store.sequence(cache.sequence_ids[0])
    assert seq.tokens.tolist() == ids[0].tolist()  # recorded before finish
    cache.finish(out)


def test_sliding_model_left_padded_batch(qwen_sliding, cache_of):
    ids = prompt(2, 30, seed=4)
    mask = torch.ones_like(ids)
    ids[1, :5] = 0
    mask[1, :5] = 0
    ref = generate(qwen_sliding, ids, mask=mask, max_new_tokens=20)
    out = generate(qwen_sliding, ids, cache_of(qwen_sliding, dtype="float32", memory=6), mask=mask,
                   max_new_tokens=20)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) <= 1e-5


# -- 6. zero-copy at batch 1 ------------------------------------------------------------------------


def _zero_copy_child(name):
    warnings.simplefilter("error")  # torch warns once per process: a fresh process sees it
    cache = ShmkvCache.attach(name)
    lay = cache.store.layout
    g = torch.Generator().manual_seed(0)
    shape = (1, lay.kv_heads, 5, lay.head_dim)
    outs = []
    for layer in range(lay.layers):
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        outs.append((k, v, *cache.update(k, v, layer)))
    seq = cache.store.sequence(cache.sequence_ids[0])
    for layer, (k, v, k_out, v_out) in enumerate(outs):
        kk, vv = seq.kv(layer)
        assert k_out.data_ptr() == kk.__array_interface__["data"][0]
        assert v_out.data_ptr() == vv.__array_interface__["data"][0]
        assert torch.equal(k_out, k) and torch.equal(v_out, v)
    cache.free()
    cache.close()
    return True


@pytest.mark.slow
def test_zero_copy_views_and_no_warning(llama, cache_of):
    cache = cache_of(llama, dtype="float32")
    assert run_in_process(_zero_copy_child, cache.store.name, timeout=120)
    # and in a real forward, here, under filterwarnings=error
    ids = prompt(1, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(llama, ids, cache)
        seq = cache.store.sequence(cache.sequence_ids[0])
        k = cache.layers[1].keys
        assert k.data_ptr() == seq.keys(1).__array_interface__["data"][0]


def _ptr(a):
    return a.__array_interface__["data"][0]


def test_batch_views_zero_copy_until_a_row_moves(llama, cache_of):
    """At batch > 1 the rows are made together (store.create_sequences: equally spaced), so
    update returns one strided view of the shared cells (store.batch_kv); once a row outgrows
    its range and moves, each layer is gathered into a copy, with the same values."""
    store = cache_of(llama, dtype="float32").store
    cache = ShmkvCache(store, capacity=12)
    lay = store.layout
    g = torch.Generator().manual_seed(0)

    def step(q):
        states = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for layer in range(lay.layers):
                shape = (2, lay.kv_heads, q, lay.head_dim)
                k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
                states.append((k, v, *cache.update(k, v, layer)))
        return states

    first = step(5)
    seqs = [store.sequence(i) for i in cache.sequence_ids]
    for layer, (k, v, k_out, v_out) in enumerate(first):
        assert torch.equal(k_out, k) and torch.equal(v_out, v)
        for row, s in enumerate(seqs):  # each row of the returned tensor is that sequence's cells
            assert k_out[row].data_ptr() == _ptr(s.keys(layer))
            assert v_out[row].data_ptr() == _ptr(s.values(layer))
        assert cache.layers[layer].keys[1].data_ptr() == _ptr(seqs[1].keys(layer))  # held(): a view too
    second = step(8)  # 13 tokens > capacity 12: the rows move, one after another
    for layer, ((k0, v0, _, _), (k, v, k_out, v_out)) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(k_out, torch.cat([k0, k], 2)) and torch.equal(v_out, torch.cat([v0, v], 2))
        assert all(k_out[row].data_ptr() != _ptr(s.keys(layer)) for row, s in enumerate(seqs))
        torch.testing.assert_close(cache.layers[layer].keys, k_out, rtol=0, atol=0)
    cache.free()
    # generate across the moves: still DynamicCache's tokens and logits
    ids = prompt(2, 9)
    ref = generate(llama, ids, DynamicCache())
    out = generate(llama, ids, ShmkvCache(store, capacity=12))
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_diff(out, ref) <= 1e-5


# -- the rest of the contract ----------------------------------------------------------------------


@pytest.mark.parametrize(("other", "named"), [
    (dict(num_hidden_layers=3), "layers=3 where the model has 2"),
    (dict(num_hidden_layers=1), "layers=1 where the model has 2"),
    (dict(num_key_value_heads=4), "kv_heads=4 where the model has 2"),
    (dict(layer_types=["sliding_attention"] * 2, sliding_window=3), "window=3 where the model has None"),
])
def test_a_store_laid_out_for_another_model_is_refused(llama, other, named):
    """A store of another model's layout (another deployment's, attached by name) is refused before
    a forward runs, naming what differs: with more layers than the model nothing would ever be
    committed, with a window where the model has none attention would skip tokens, and neither
    raises in a forward. Without cache_kwargs, a store with fewer layers says so at the update."""
    spec = layout_from_config(llama_config(**other))
    with shmkv.create(unique_name("hfm"), **spec, max_tokens=256) as store:
        cache = ShmkvCache(store)
        with pytest.raises(shmkv.InvalidArgumentError, match=re.escape(named)):
            _step(llama, prompt(1, 5), cache)
        assert [s.id for s in store.sequences()] == []  # (refused before anything is made)
        if spec["layers"] < 2:
            with pytest.raises(shmkv.InvalidArgumentError, match="has 1 layers, the model more"), torch.no_grad():
                llama(prompt(1, 5), **{cache_keyword(llama): cache})  # (not cache_kwargs: no check)
        cache.close()


def test_a_small_store_runs_with_the_default_capacity(llama, cache_of):
    """from_config(max_tokens=64) without capacity=: the rows start with what the store holds
    (the default 256 would not fit), and generate equals DynamicCache's."""
    ids = prompt(2, 5)
    got = generate(llama, ids, cache_of(llama, max_tokens=64))
    assert got.sequences.tolist() == generate(llama, ids).sequences.tolist()


def test_a_sliding_model_in_bfloat16_is_told_which_dtype_to_store():
    model = build(sliding_config, dtype=torch.bfloat16)
    with pytest.raises(shmkv.NotSupportedError, match="use dtype='float16', 'float32' or 'float64'"):
        ShmkvCache.from_config(model.config, unique_name("hfd"))


def test_import_shmkv_does_not_import_torch():
    code = "import sys, shmkv; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_cache_keyword_follows_the_models_forward(llama):
    """transformers 5.24 renamed forward's and generate's past_key_values= to cache= (the old name
    warns: FutureWarning, an error under this suite's filterwarnings); older 5.x take only
    past_key_values=. The keyword is read from the model's forward signature."""
    expected = "cache" if "cache" in inspect.signature(llama.forward).parameters else "past_key_values"
    assert cache_keyword(llama) == expected

    class Old:  # an older 5.x model: forward(input_ids, past_key_values=None, ...)
        def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
            return None

    class New:
        def forward(self, input_ids, cache=None, **kwargs):
            return None

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    assert cache_kwargs(Old(), 7) == {"past_key_values": 7}
    # under the installed transformers, a forward with the keyword it names raises no warning
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = llama(prompt(1, 5), **cache_kwargs(llama, cache))
    assert cache.get_seq_length() == 5 and out.logits.shape == (1, 5, VOCAB)


def test_layout_from_config(llama):
    spec = layout_from_config(llama.config)
    assert spec == {"layers": 2, "kv_heads": 2, "head_dim": 16, "layer_types": ["full", "full"]}
    spec = layout_from_config(sliding_config())
    assert spec["layer_types"] == ["full", "sliding", "sliding", "full"] and spec["window"] == 8
    chunked = transformers.PretrainedConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                            num_key_value_heads=2, attention_chunk_size=32,
                                            layer_types=["chunked_attention", "full_attention"])
    assert layout_from_config(chunked) == {"layers": 2, "kv_heads": 2, "head_dim": 16,
                                           "layer_types": ["chunked", "full"], "chunk": 32}


@pytest.mark.parametrize("kw, field", [
    (dict(layer_types=["full_attention", "linear_attention"]), "layer_types[1]"),
    (dict(per_layer_config={0: {"num_key_value_heads": 1}}), "num_key_value_heads"),
    (dict(layer_types=["sliding_attention"] * 2, per_layer_config={0: {"sliding_window": 4}, 1: {"sliding_window": 8}}),
     "sliding_window"),
])
def test_unsupported_configs_name_the_field(kw, field):
    config = transformers.PretrainedConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, **kw)
    with pytest.raises(shmkv.NotSupportedError, match=field.replace("[", r"\[")):
        ShmkvCache.from_config(config, unique_name("hf"))


def test_from_config_owns_the_store(llama):
    name = unique_name("hf")
    with ShmkvCache.from_config(llama.config, name) as cache:
        assert cache.store.name == name and name in shmkv.list_stores()
        assert cache.store.layout.dtype == "float32"  # the config's dtype
        generate(llama, prompt(1, 4), cache)
    assert name not in shmkv.list_stores()  # not persistent: removed on close
    name = unique_name("hf")
    with ShmkvCache.from_config(llama.config, name, persistent=True, dtype=torch.float16):
        pass
    try:
        assert name in shmkv.list_stores()
    finally:
        shmkv.remove(name)


def test_seq_ids_take_every_lease_or_none(llama, cache_of):
    owner = cache_of(llama, dtype="float32")
    _step(llama, prompt(3, 4), owner)
    ids = owner.sequence_ids
    owner.release()
    held = owner.store.sequence(ids[2], write=True)  # another writer on the last one
    with pytest.raises(shmkv.LeaseError):
        ShmkvCache(owner.store, ids)
    # nothing kept: the first two can be taken right away
    both = ShmkvCache(owner.store, ids[:2])
    assert both.sequence_ids == ids[:2] and both.get_seq_length() == 4
    held.release()
    both.release()


def test_continue_after_release_in_process(llama, cache_of):
    ids = prompt(1, 9)
    ref = generate(llama, ids, DynamicCache())
    first = cache_of(llama, dtype="float32")
    _step(llama, ids[:, :-1], first)
    first.release()
    again = ShmkvCache(first.store, first.sequence_ids)
    out = generate(llama, ids, again)
    assert torch.equal(out.sequences, ref.sequences)
    again.release()


def test_failed_forward_leaves_whole_tokens(llama, cache_of):
    cache = cache_of(llama, dtype="float32")
    ids = prompt(1, 9)
    _step(llama, ids[:, :-1], cache)
    seq = cache.store.sequence(cache.sequence_ids[0])
    k = torch.zeros(1, 2, 3, 16)
    cache.update(k, k, 0)  # a forward that dies after its first layer
    assert len(seq) == 8 and cache.get_seq_length() == 8  # nothing published
    out = generate(llama, ids, cache)  # the next forward drops the half-written tokens
    assert torch.equal(out.sequences, generate(llama, ids, DynamicCache()).sequences)


def test_crop_reset_and_errors(llama, cache_of):
    cache = cache_of(llama, dtype="float32")
    ref = DynamicCache()
    ids = prompt(2, 6)
    _step(llama, ids, cache), _step(llama, ids, ref)
    cache.crop(-2), ref.crop(-2)
    assert cache.get_seq_length() == ref.get_seq_length() == 4
    torch.testing.assert_close(cache.layers[0].keys, ref.layers[0].keys, rtol=0, atol=0)
    with pytest.raises(shmkv.InvalidArgumentError, match="positive"):
        cache.crop(3)
    with pytest.raises(shmkv.InvalidArgumentError, match="batch of 1 rows"):
        _step(llama, prompt(1, 2), cache)
    cache.crop(-10)  # more than the length empties the rows, as DynamicCache does
    assert cache.get_seq_length() == 0
    ids_before = cache.sequence_ids
    cache.reset()  # its own sequences: freed, the next batch may differ
    assert cache.batch_size == -1 and not any(i.id in ids_before for i in cache.store.sequences())
    _step(llama, prompt(1, 3), cache)
    assert cache.batch_size == 1 and cache.get_mask_sizes(1, 0) == (4, 0)
    assert cache.get_max_length() == -1


def test_sliding_mask_sizes_and_max_length(qwen_sliding, cache_of):
    cache, ref = cache_of(qwen_sliding, dtype="float32"), DynamicCache(config=qwen_sliding.config)
    for n in (3, 6, 1, 1, 4):
        ids = prompt(1, n, seed=n)
        _step(qwen_sliding, ids, cache), _step(qwen_sliding, ids, ref)
        for q in (1, 5):
            for layer in range(4):
                assert cache.get_mask_sizes(q, layer) == ref.get_mask_sizes(q, layer)
    assert cache.is_sliding == ref.is_sliding == [False, True, True, False]
    assert cache.get_max_length() == ref.get_max_length() == 8



# -- the core primitive under the zero-copy path: seq.torch_kv(layer, pending=True) ---------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_torch_kv_pending_includes_this_handles_pending_tokens(make_store, dtype):
    store = make_store(dtype=dtype)
    g = np.random.default_rng(0)
    k = g.standard_normal((2, 5, 2, 4)).astype(np.float32)
    v = g.standard_normal((2, 5, 2, 4)).astype(np.float32)
    seq = store.create_sequence(capacity=8)
    seq.extend(k[:, :3], v[:, :3])
    keys, _ = seq.append(0, k[0, 3:], v[0, 3:])  # two pending tokens on layer 0 only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about read-only arrays: none are handed to it
        kt, vt = seq.torch_kv(0, pending=True)
        k1, _ = seq.torch_kv(1, pending=True)
    assert kt.shape == (5, 2, 4) and k1.shape == (3, 2, 4)
    rel = {"float32": 0.0, "bfloat16": 2.0**-8, "int8": 1 / 127}[dtype]  # storage error bounds (_quant)
    np.testing.assert_allclose(kt.float().numpy(), k[0], rtol=0, atol=rel * np.abs(k).max())
    np.testing.assert_allclose(vt.float().numpy(), v[0], rtol=0, atol=rel * np.abs(v).max())
    if dtype != "int8":  # the cells themselves: writing the tensor writes the cache
        assert kt.data_ptr() == keys.__array_interface__["data"][0]
        expect = kt[4].clone() + 1
        kt[4] += 1
        assert torch.equal(seq.torch_kv(0, pending=True)[0][4], expect)
    assert len(seq.torch_kv(0)[0]) == 3  # pending=False: committed only
    assert len(store.sequence(seq.id).torch_kv(0, pending=True)[0]) == 3  # a read handle has none
    seq.discard()
    assert len(seq.torch_kv(0, pending=True)[0]) == 3


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16", "int8"])
def test_pending_views_are_the_cells_torch_kv_pending_shows_or_none(make_store, dtype):
    from shmkv._sequence.handle import pending_views

    store = make_store(dtype=dtype)
    g = np.random.default_rng(1)
    k = g.standard_normal((2, 5, 2, 4)).astype(np.float32)
    seq = store.create_sequence(capacity=8)
    seq.extend(k[:, :3], k[:, :3])
    seq.append(0, k[0, 3:], -k[0, 3:])  # two pending tokens on layer 0 only
    views = pending_views(seq, 0)
    if dtype in ("bfloat16", "int8"):  # not the stored values as they are: torch_kv makes the tensors
        assert views is None
        return
    kn, vn = views
    kt, vt = seq.torch_kv(0, pending=True)
    assert kn.shape == vn.shape == (5, 2, 4) and kn.flags.writeable and vn.flags.writeable
    assert (kn.ctypes.data, vn.ctypes.data) == (kt.data_ptr(), vt.data_ptr())  # the same cells
    np.testing.assert_array_equal(kn, kt.numpy())
    np.testing.assert_array_equal(vn[3:], -k[0, 3:].astype(dtype))
    assert pending_views(seq, 1) is None  # nothing pending in layer 1
    seq.append(1, 2 * k[1, 3:4], -2 * k[1, 3:4])  # one on layer 1: its own cells
    kn1, vn1 = pending_views(seq, 1)
    kt1, _ = seq.torch_kv(1, pending=True)
    assert kn1.shape == (4, 2, 4) and kn1.ctypes.data == kt1.data_ptr() and kn1.ctypes.data != kn.ctypes.data
    np.testing.assert_array_equal(vn1[3], -2 * k[1, 3].astype(dtype))
    assert pending_views(store.sequence(seq.id), 0) is None  # a read handle has nothing pending
    seq.discard()
    assert pending_views(seq, 0) is None
    seq.append(0, k[0, 3:], k[0, 3:])
    store.close()
    assert pending_views(seq, 0) is None  # closed: torch_kv says so
    with pytest.raises(shmkv.StoreClosedError):
        seq.torch_kv(0, pending=True)
