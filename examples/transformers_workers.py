"""Hugging Face transformers on shmkv: one prefill process, two decode workers.

Six requests share a system prompt:

* the prefill process computes the system prompt once, ``finish``es it (a
  cached prefix now, for every process), and queues the requests;
* two decode worker processes take requests: ``ShmkvCache.for_prompt(store,
  prompt)`` starts each one from the longest cached prefix (the system prompt,
  copied from the prefill process's cells, not recomputed), ``model.generate``
  computes only the rest, and ``cache.finish(output)`` caches the whole request
  for a later turn;
* the main process checks every answer against ``generate`` with transformers'
  own ``DynamicCache`` in one process.

By default the model is a tiny random-weight Llama built from a config (nothing
is downloaded) and the prompts are token ids. With ``--model PATH`` it is a local
checkpoint with its tokenizer (any causal LM ``AutoModelForCausalLM`` and
``AutoTokenizer`` load from that directory): text prompts in, text out.

Run: ``python examples/transformers_workers.py [--model PATH] [--system TEXT]
[--prompt TEXT ...] [--new-tokens N]`` (needs ``pip install 'shmkv[transformers]'``).
"""

from __future__ import annotations

from _cli import parser, run, temporary_directory, uninterrupted_imports  # first: --help, Ctrl-C (not about shmkv)

import argparse
import multiprocessing as mp
import os
import time


NEW_TOKENS = 16
SYSTEM = [1] + [(7 * i) % 120 + 3 for i in range(39)]  # the random model's shared system prompt: 40 token ids
USERS = [[50, 51, 52], [60, 61], [70, 71, 72, 73], [80], [90, 91], [100, 101, 102]]
SYSTEM_TEXT = "You are a helpful assistant. Answer in one short sentence, and be precise about numbers."
USER_TEXTS = ["What is shared memory?", "Name a prime number.", "Why cache keys and values?",
              "What does a decode worker do?", "Say hello.", "How many cores does this machine have?"]


def _model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.set_num_threads(1)  # three processes share the machine
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def prefill(store_name, model_dir, work, queues, n_workers):
    """Compute the shared system prompt once and cache it; then queue the requests."""
    system, requests = work
    jobs, results = queues
    import torch

    import shmkv
    from shmkv.transformers import ShmkvCache, cache_kwargs

    model = _model(model_dir)
    store = shmkv.attach(store_name)
    with torch.no_grad():
        cache = ShmkvCache.for_prompt(store, [system])
        model(torch.tensor([system]), **cache_kwargs(model, cache))  # cache= (or past_key_values=)
        cache.finish([system])  # a cached prefix for every process from now on
    results.put(("prefilled", len(system)))
    for rid, prompt in enumerate(requests):
        jobs.put((rid, prompt))
    for _ in range(n_workers):
        jobs.put(None)
    store.close()


def decode_worker(store_name, model_dir, new_tokens, jobs, results):
    import torch

    import shmkv
    from shmkv.transformers import ShmkvCache, cache_kwargs

    model = _model(model_dir)
    store = shmkv.attach(store_name)
    while (job := jobs.get(timeout=120)) is not None:
        rid, prompt = job
        cache = ShmkvCache.for_prompt(store, [prompt])  # starts from the cached system prompt
        reused = cache.get_seq_length()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), **cache_kwargs(model, cache),
                                 max_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - t0
        cache.finish(out)  # the whole request: a prefix for its next turn
        results.put((rid, os.getpid(), reused, out[0, len(prompt):].tolist(), seconds))
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


def options() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--model", metavar="PATH", help="a local checkpoint directory with its tokenizer "
                   "(default: a tiny random Llama, token-id prompts)")
    p.add_argument("--system", default=SYSTEM_TEXT, help="the shared system prompt (with --model)")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a user prompt (repeatable; with --model)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    return p


def main(a: argparse.Namespace) -> None:
    with temporary_directory("shmkv-example-") as tmp:
        # torch writes its compile cache under $TMPDIR unless told where: here, removed at the end
        # (the spawned processes inherit it)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "torchinductor"))
        code = demo(a.model or os.path.join(tmp, "model"), a.model is not None, a.system,
                    a.prompt or USER_TEXTS, a.new_tokens)
    if code:
        raise SystemExit(code)


def demo(model_dir: str, checkpoint: bool, system_text: str, user_texts: list[str], new_tokens: int) -> int:
    t_start = time.perf_counter()
    print("loading torch and transformers (10 s or more on a busy machine) ...", flush=True)
    try:
        with uninterrupted_imports():  # (a Ctrl-C meanwhile comes out once they are done)
            import torch
            from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM
            from transformers.utils import logging

            from shmkv.transformers import ShmkvCache, cache_kwargs
    except ImportError:
        print("transformers_workers.py needs torch and transformers: pip install 'shmkv[transformers]'")
        return 0

    logging.disable_progress_bar()
    torch.set_num_threads(1)  # as each worker (_model): the speeds below compare like with like
    print(f"loaded in {time.perf_counter() - t_start:.1f} s", flush=True)
    tokenizer = None
    if checkpoint:  # a local checkpoint: its weights, its config, its tokenizer
        model = _model(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # the system prompt's ids, then each user prompt's: every request starts with the same ids
        system = tokenizer(system_text)["input_ids"]
        requests = [system + tokenizer(t, add_special_tokens=False)["input_ids"] for t in user_texts]
        dtype = None  # the store keeps the checkpoint's dtype
    else:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                             eos_token_id=None, pad_token_id=0)
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32).eval()
        model.save_pretrained(model_dir)  # the workers load the same weights
        system, requests, dtype = SYSTEM, [SYSTEM + u for u in USERS], "float32"
    what = model_dir if checkpoint else "a tiny random-weight Llama (2 layers, token-id prompts)"
    print(f"model: {what}; system prompt {len(system)} tokens, {len(requests)} requests of {new_tokens} new "
          "tokens each", flush=True)
    ctx = mp.get_context("spawn")  # torch's thread pools do not survive fork
    name = f"hfworkers{os.getpid()}"
    # this process owns the store: closing removes it
    with ShmkvCache.from_config(model.config, name, dtype=dtype) as owner:
        jobs, results = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=prefill, args=(name, model_dir, (system, requests), (jobs, results), 2))]
        procs += [ctx.Process(target=decode_worker, args=(name, model_dir, new_tokens, jobs, results))
                  for _ in range(2)]
        print("starting a prefill process and 2 decode workers (each loads torch and the model) ...", flush=True)
        for p in procs:
            p.start()
        try:
            answers = []
            while len(answers) < len(requests):
                got = _result(results, procs)
                if got[0] == "prefilled":
                    print(f"prefill: the {got[1]}-token system prompt is computed once and cached", flush=True)
                    continue
                answers.append(got)
                print(f"  request {got[0]} answered by worker {got[1]} ({len(answers)}/{len(requests)})", flush=True)
            print("waiting for the processes to exit ...", flush=True)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        print("each answer against generate() with transformers' DynamicCache in this process:", flush=True)
        ok = True
        shmkv_s = dyn_s = 0.0
        for rid, pid, reused, tokens, seconds in sorted(answers):
            t0 = time.perf_counter()
            with torch.no_grad():
                ref_cache = DynamicCache(config=model.config)  # sliding layers too, if the model has them
                ref = model.generate(torch.tensor([requests[rid]]), **cache_kwargs(model, ref_cache),
                                     max_new_tokens=new_tokens, do_sample=False)[0, len(requests[rid]):].tolist()
            dyn = time.perf_counter() - t0
            shmkv_s, dyn_s = shmkv_s + seconds, dyn_s + dyn
            same = tokens == ref
            ok &= same
            if tokenizer:
                asked = repr(tokenizer.decode(requests[rid][len(system):], skip_special_tokens=True))
                said = repr(tokenizer.decode(tokens, skip_special_tokens=True))
            else:
                asked, said = f"{requests[rid][len(system):]} (token ids)", f"{tokens[:8]}..."
            print(f"request {rid}: prompt {asked} -> {said}")
            print(f"  worker {pid}: reused {reused} of {len(requests[rid])} prompt tokens; "
                  f"{len(tokens) / seconds:.0f} tokens/s with shmkv, {len(ref) / dyn:.0f} with DynamicCache "
                  f"(prompt computed whole); same as DynamicCache: {same}")
        n = len(answers) * new_tokens
        print(f"speed, every request: {n / shmkv_s:.0f} tokens/s with shmkv (in a worker, prompt from the "
              f"prefix cache), {n / dyn_s:.0f} with DynamicCache (this process); both one request at a time")
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
    run(main, options())
