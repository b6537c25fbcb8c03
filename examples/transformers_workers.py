"""Hugging Face transformers on shmkv: one prefill process, two decode workers.

A tiny random-weight Llama (built from a config: nothing is downloaded) serves
six requests that share a system prompt:

* the prefill process computes the system prompt once, then for each request
  forks that sequence (the shared prefix is copied, not recomputed), runs the
  request's own tokens through the model into it, and hands the sequence id to
  the decode workers;
* two decode worker processes each continue sequences with
  ``ShmkvCache(store, [seq_id])`` and ``model.generate(...)``; the cache holds
  every token but the prompt's last, so generate computes only that one and the
  new tokens;
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
SYSTEM = [1, 17, 42, 7, 99, 23, 5, 64, 31, 8, 77, 12]  # the shared system prompt's token ids
USERS = [[50, 51, 52], [60, 61], [70, 71, 72, 73], [80], [90, 91], [100, 101, 102]]


def _model(model_dir):
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(1)  # three processes share the machine
    return LlamaForCausalLM.from_pretrained(model_dir).eval()


def prefill(store_name, model_dir, jobs, n_workers):
    """Compute the system prompt once; per request: fork it, add the user tokens but the last."""
    import torch

    import shmkv
    from shmkv.transformers import ShmkvCache

    model = _model(model_dir)
    store = shmkv.attach(store_name)
    with torch.no_grad():
        system = ShmkvCache(store)
        model(torch.tensor([SYSTEM]), past_key_values=system)  # the shared prefix, computed once
        for rid, user in enumerate(USERS):
            prompt = SYSTEM + user
            seq = store.sequence(system.sequence_ids[0]).fork()  # a copy of the prefix's cells
            seq.release()
            cache = ShmkvCache(store, [seq.id])
            if len(prompt) - 1 > len(SYSTEM):  # the request's tokens but its last
                model(torch.tensor([prompt[len(SYSTEM) : -1]]), past_key_values=cache)
            cache.release()
            jobs.put((rid, seq.id, prompt))
    system.free()
    for _ in range(n_workers):
        jobs.put(None)
    store.close()


def decode_worker(store_name, model_dir, jobs, results):
    import torch

    import shmkv
    from shmkv.transformers import ShmkvCache

    model = _model(model_dir)
    store = shmkv.attach(store_name)
    while (job := jobs.get(timeout=120)) is not None:
        rid, seq_id, prompt = job
        cache = ShmkvCache(store, [seq_id])  # takes the lease the prefill process gave up
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        results.put((rid, os.getpid(), out[0, len(prompt):].tolist()))
        cache.free()
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
    try:
        import torch
        from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging
    except ImportError:
        print("transformers_workers.py needs torch and transformers: pip install 'shmkv[transformers]'")
        return 0
    from shmkv.transformers import ShmkvCache

    logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM._from_config(config, dtype=torch.float32).eval()
    ctx = mp.get_context("spawn")  # torch's thread pools do not survive fork
    with tempfile.TemporaryDirectory() as model_dir, ShmkvCache.from_config(config, dtype="float32") as owner:
        model.save_pretrained(model_dir)  # the workers load the same weights
        name = owner.store.name  # this process owns the store: closing removes it
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
        for rid, pid, tokens in sorted(answers):
            with torch.no_grad():
                ref = model.generate(torch.tensor([SYSTEM + USERS[rid]]), past_key_values=DynamicCache(),
                                     max_new_tokens=NEW_TOKENS, do_sample=False)[0, -NEW_TOKENS:].tolist()
            same = tokens == ref
            ok &= same
            print(f"request {rid} (worker {pid}): {tokens[:8]}...  same as DynamicCache: {same}")
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        left = [s.id for s in owner.store.sequences()]
        print(f"sequences left in the store: {left}")
    if not ok:
        print("MISMATCH against DynamicCache")
        return 1
    print("every request matches a single-process DynamicCache run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
