"""Our suite uses the shipped pytest plugin (shmkv.testing.pytest_plugin): its leak check
(opt-in for other projects) is on for every test here, and ``shmkv_store`` /
``shmkv_store_factory`` make stores."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

import shmkv
from shmkv.testing import assert_store_state

pytest_plugins = ["pytester"]

# CI runs the same hypothesis examples every time (a failure there reproduces);
# locally they vary, and SHMKV_HYPOTHESIS_EXAMPLES asks for more of them.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

START_METHODS = ["fork", "spawn", "forkserver"]


FRESH_INTERPRETERS = set(START_METHODS) - {"fork"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.shmkv_leak_check)  # the plugin's leak check, on for our own suite
        # The fast tier (-m "not slow") keeps a test's fork variant; its spawn and forkserver
        # variants start fresh interpreters (a second each) and run with the whole suite.
        params = getattr(item, "callspec", None)
        if params is not None and any(isinstance(v, str) and v in FRESH_INTERPRETERS
                                      for v in params.params.values()):
            item.add_marker(pytest.mark.slow)


def _checked_at_rest(stores: list[shmkv.Store]) -> None:
    """After the test: every store it made that is still open (read-write) keeps its invariants."""
    for s in stores:
        if not s.closed and not s.readonly:
            assert_store_state(s)


@pytest.fixture
def make_store(shmkv_store_factory):
    made: list[shmkv.Store] = []

    def factory(**kw):
        s = shmkv_store_factory(**kw)
        made.append(s)
        return s

    yield factory
    _checked_at_rest(made)


@pytest.fixture
def store(shmkv_store: shmkv.Store) -> Iterator[shmkv.Store]:
    yield shmkv_store
    _checked_at_rest([shmkv_store])


def importorskip_unless_ci(modname: str, minversion: str | None = None):
    """``pytest.importorskip`` locally; under CI (``CI=true``, set by .ci/run) a missing
    optional dependency is a failure, not a skip: CI installs every extra."""
    if os.environ.get("CI", "").lower() == "true":
        import importlib

        module = importlib.import_module(modname)  # ImportError fails the run
        if minversion is not None:
            from packaging.version import Version

            if Version(getattr(module, "__version__", "0")) < Version(minversion):
                raise ImportError(f"{modname} {module.__version__} < {minversion} under CI")
        return module
    return pytest.importorskip(modname, minversion)


def save_word_level_checkpoint(model_dir, words: list[str]):
    """A random-weight Llama (2 layers, hidden 64, seed 0) and a word-level tokenizer over ``words``
    (lower-cased, split on whitespace and punctuation, ``<s>`` first), saved together in
    ``model_dir`` as a local checkpoint: no download. Returns the tokenizer."""
    tokenizers = importorskip_unless_ci("tokenizers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "[UNK]", *dict.fromkeys(words)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="[UNK]")
    fast.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    LlamaForCausalLM._from_config(config, dtype=torch.float32).eval().save_pretrained(model_dir)
    return fast
