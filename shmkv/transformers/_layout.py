"""Hugging Face model config -> shmkv store layout (the part of :mod:`shmkv.transformers`
that reads configs): layer kinds and windows, head shapes, the storage dtype.

Imports torch and transformers; ``import shmkv`` never imports this module.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from shmkv._engine.table.header import Layout
from shmkv.errors import InvalidArgumentError, NotSupportedError

# HF layer type -> shmkv layer kind. transformers 5.x cache_utils.py
# DYNAMIC_LAYER_TYPE_MAPPING: "sliding_attention" and "chunked_attention" both
# become DynamicSlidingWindowLayer (window = sliding_window or
# attention_chunk_size); only the mask differs.
KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}

TORCH_TO_STORE = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}


def layout_from_config(config: Any) -> dict[str, Any]:
    """``shmkv.create`` layout arguments for the model of ``config`` (its decoder text config).

    Raises NotSupportedError naming the field shmkv cannot serve.
    """
    from transformers.configuration_utils import get_head_shapes

    text = config.get_text_config(decoder=True)
    for field in ("kv_sharing_modes",):
        if getattr(text, field, None) is not None:
            raise NotSupportedError(f"config.{field}={getattr(text, field)!r}: layers sharing another layer's "
                                    "keys and values are not supported by ShmkvCache")
    # the same derivation DynamicCache(config=...) uses (cache_utils.py get_layer_types_and_kwargs)
    hf_types, kwargs = get_layer_types_and_kwargs(text)
    kv_heads, head_dim = get_head_shapes(text)
    if not isinstance(kv_heads, int):
        raise NotSupportedError(f"config num_key_value_heads differs between layers ({kv_heads}): shmkv stores "
                                "one kv_heads for every layer")
    if not isinstance(head_dim, int):
        raise NotSupportedError(f"config head_dim differs between layers ({head_dim}): shmkv stores one "
                                "head_dim for every layer")
    kinds: list[str] = []
    windows: dict[str, set[Any]] = {"sliding": set(), "chunked": set()}
    for i, (t, kw) in enumerate(zip(hf_types, kwargs, strict=True)):
        if t not in KINDS:
            raise NotSupportedError(
                f"config layer_types[{i}]={t!r}: ShmkvCache holds {sorted(KINDS)} layers only "
                "(no linear-attention, hybrid or cache-less layers)"
            )
        kind = KINDS[t]
        kinds.append(kind)
        if kind != "full":
            windows[kind].add(kw.get("sliding_window"))
    spec: dict[str, Any] = {"layers": len(kinds), "kv_heads": kv_heads, "head_dim": head_dim, "layer_types": kinds}
    for kind, field, arg in (("sliding", "sliding_window", "window"), ("chunked", "attention_chunk_size", "chunk")):
        ws = windows[kind]
        if len(ws) > 1:
            raise NotSupportedError(f"config {field} differs between {kind} layers ({sorted(map(str, ws))}): "
                                    f"shmkv has one {arg} per store")
        if ws:
            w = ws.pop()
            if not isinstance(w, int) or w < 1:
                raise NotSupportedError(f"config {field}={w!r} on {kind} layers: need a positive int")
            spec[arg] = w
    return spec


def check_layout(store: Any, config: Any) -> None:
    """InvalidArgumentError naming what differs between ``store``'s layout and the one
    ``from_config`` makes for ``config``: the layers, their kinds, the heads' shapes, the window
    or chunk."""
    spec, layout = layout_from_config(config), store.layout
    have = {"layers": layout.layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
            "layer_types": list(layout.layer_types), "window": layout.window or None, "chunk": layout.chunk or None}
    what = ", ".join(f"{key}={have[key]!r} where the model has {spec.get(key)!r}" for key in have
                     if have[key] != spec.get(key))
    if what:
        raise InvalidArgumentError(f"store {store.name!r} is laid out for another model: {what}; use a store "
                                   "made by ShmkvCache.from_config(model.config, ...)")


def storage_dtype(config: Any, dtype: Any) -> str:
    """The store's dtype name for ``from_config(dtype=...)``: ``None`` takes the config's dtype
    (float32 when it has none shmkv stores); a torch dtype maps to its name; a name stays."""
    if dtype is None:
        dtype = getattr(config.get_text_config(decoder=True), "dtype", None) or getattr(config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        dtype = dtype if dtype in TORCH_TO_STORE else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_TO_STORE:
            raise InvalidArgumentError(f"dtype={dtype} has no shmkv storage dtype: use one of "
                                       f"{sorted(TORCH_TO_STORE.values())} or 'int8'")
        return TORCH_TO_STORE[dtype]
    return dtype  # type: ignore[no-any-return]  # a name: shmkv.create checks it


def layer_windows(layout: Layout) -> list[int]:
    """Per layer, the HF ``sliding_window`` of a sliding or chunked layer (its
    DynamicSlidingWindowLayer window), 0 on full layers."""
    return [layout.window if kind == "sliding" else layout.chunk if kind == "chunked" else 0
            for kind in layout.layer_types]
