"""Views that outlive close() are valid to read, never a segfault (DESIGN section 4; issue 22
part B, lifecycle). The K/V arrays a handle reads through were ``np.ndarray(buffer=mmap)``, which
numpy 2 builds without holding an export of the mapping: close() then unmapped the pages under
a view the caller still held, and reading it killed the process with SIGSEGV. Each case runs in
a child process (a segfault there is a ChildFailed here, not the end of the test run)."""

from __future__ import annotations

import numpy as np
import pytest

import shmkv
from shmkv.testing import run_in_process, unique_name

LAYOUT = dict(layers=2, kv_heads=2, head_dim=4, max_tokens=64, max_seqs=4)


def _views_after_close(how: str, dtype: str) -> list[float]:
    """Take views, drop every handle, close (the creator: the store is removed too), read them."""
    made = shmkv.create(unique_name("cv"), dtype=dtype, **LAYOUT)
    seq = made.create_sequence(capacity=8)
    k = np.arange(2 * 5 * 2 * 4, dtype=np.float32).reshape(2, 5, 2, 4) % 7
    seq.extend(k, -k, tokens=range(5))
    seq_id = seq.id
    del seq
    store = made if how == "created" else shmkv.attach(made.name, readonly=how == "readonly")
    reader = store.sequence(seq_id)
    kept = [reader.keys(1), reader.values(0), *reader.kv(1)]
    if how != "readonly" and dtype != "int8":
        kept.append(store.batch_kv([store.sequence(seq_id)], 0)[0][0])  # a zero-copy batch view
    del reader
    store.close()
    if made is not store:
        made.close()
    # only the views are left holding the pages; reading them must not fault
    return [float(v.astype(np.float64).sum()) for v in kept]


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("how", ["created", "attached", "readonly"])
def test_views_that_outlive_close_stay_readable(how, dtype):
    sums = run_in_process(_views_after_close, how, dtype, start_method="fork", timeout=60)
    k = np.arange(2 * 5 * 2 * 4, dtype=np.float32).reshape(2, 5, 2, 4) % 7
    expected = [k[1].sum(), -k[0].sum(), k[1].sum(), -k[1].sum()]
    if how != "readonly" and dtype != "int8":
        expected.append(k[0].sum())
    assert sums == pytest.approx(expected, rel=0.02, abs=0.2)  # (int8 dequantizes: near, not equal)
