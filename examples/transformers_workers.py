"""Hugging Face transformers on shmkv: one prefill process, two decode workers.

A tiny random-weight Llama (built from a config: nothing is downloaded) serves
six requests that share a system prompt:

* the prefill process computes the system prompt once, ``finish``es it (a
  cached prefix now, for every process), and queues the requests;
* two decode worker processes take requests: ``ShmkvCache.for_prompt(store,
  prompt)`` starts each one from the longest cached prefix (the system prompt,
  copied from the prefill process's cells, not recomputed), ``model.generate``
  computes only the rest, and ``cache.finish(output)`` caches the whole request
  for a later turn;
* the main process checks every answer against ``generate`` with transformers'
  own ``DynamicCache`` in one process.

Run: ``python examples/transformers_workers.py`` (needs ``pip install 'shmkv[transformers]'``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile

NEW_TOKENS = 16
SYSTEM = [1] + [(7 * i) % 120 + 3 for i in range(39)]  # the shared system prompt's 40 token ids
USERS = [[50, 51, 52], [60, 61], [70, 71, 72, 73], [80], [90, 91], [100, 101, 102]]


def _model(model_dir):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(1)  # three processes share the machine
    return LlamaForCausalLM.from_pretrained(model_dir).eval()


def prefill(store_name, model_dir, jobs, n_workers):
    """Compute the shared system prompt once and cache it; then queue the requests."""
    import torch

    import shmkv
    from shmkv.transformers import ShmkvCache, cache_kwargs

    model = _model(model_dir)
    store = shmkv.attach(store_name)
    with torch.no_grad():
        cache = ShmkvCache.for_prompt(store, [SYSTEM])
        model(torch.tensor([SYSTEM]), **cache_kwargs(model, cache))  # cache= (or past_key_values=)
        cache.finish([SYSTEM])  # a cached prefix for every process from now on
    for rid, user in enumerate(USERS):
        jobs.put((rid, SYSTEM + user))
    for _ in range(n_workers):
        jobs.put(None)
    store.close()


def decode_worker(store_name, model_dir, jobs, results):
    import torch

    import shmkv
    from shmkv.transformers import ShmkvCache, cache_kwargs

    model = _model(model_dir)
    store = shmkv.attach(store_name)
    while (job := jobs.get(timeout=120)) is not None:
        rid, prompt = job
        cache = ShmkvCache.for_prompt(store, [prompt])  # starts from the cached system prompt
        reused = cache.get_seq_length()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), **cache_kwargs(model, cache),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        cache.finish(out)  # the whole request: a prefix for its next turn
        results.put((rid, os.getpid(), reused, out[0, len(prompt):].tolist()))
    store.close()


def _result(results, procs, timeout=180.0):
    """The next answer; fails at once if a process died instead of waiting out the timeout."""
    import queue
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a worker process failed (exit codes {dead})") from None
    raise TimeoutError(f"no answer within {timeout} s")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        # torch writes its compile cache under $TMPDIR unless told where: here, removed at the end
        # (the spawned processes inherit it)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "torchinductor"))
        return run(os.path.join(tmp, "model"))


def run(model_dir: str) -> int:
    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging
    except ImportError:
        print("transformers_workers.py needs torch and transformers: pip install 'shmkv[transformers]'")
        return 0
    from shmkv.transformers import ShmkvCache, cache_kwargs

    logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM._from_config(config, dtype=torch.float32).eval()
    ctx = mp.get_context("spawn")  # torch's thread pools do not survive fork
    name = f"hfworkers{os.getpid()}"
    with ShmkvCache.from_config(config, name, dtype="float32") as owner:
        model.save_pretrained(model_dir)  # the workers load the same weights
        # this process owns the store: closing removes it
        jobs, results = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=prefill, args=(name, model_dir, jobs, 2))]
        procs += [ctx.Process(target=decode_worker, args=(name, model_dir, jobs, results)) for _ in range(2)]
        for p in procs:
            p.start()
        try:
            answers = [_result(results, procs) for _ in USERS]
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        ok = True
        for rid, pid, reused, tokens in sorted(answers):
            with torch.no_grad():
                ref = model.generate(torch.tensor([SYSTEM + USERS[rid]]), **cache_kwargs(model, DynamicCache()),
                                     max_new_tokens=NEW_TOKENS, do_sample=False)[0, -NEW_TOKENS:].tolist()
            same = tokens == ref
            ok &= same
            print(f"request {rid} (worker {pid}): reused {reused} of {len(SYSTEM + USERS[rid])} prompt tokens, "
                  f"generated {tokens[:6]}...  same as DynamicCache: {same}")
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        st = owner.store.stats()
        print(f"prefix cache: {st.prefix_hits} hits, {st.prefix_misses} misses, "
              f"{st.prefix_tokens_reused} tokens reused; {len(owner.store.sequences())} finished sequences kept")
    if not ok:
        print("MISMATCH against DynamicCache")
        return 1
    print("every request matches a single-process DynamicCache run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
