"""Which keyword a model takes its cache under: ``cache=`` (newer transformers 5.x) or
``past_key_values=`` (older 5.x).

transformers 5.24 renamed the argument of ``model.forward``, ``model.generate`` and the
masking functions from ``past_key_values`` to ``cache`` (``@deprecate_kwarg("past_key_values",
..., new_name="cache")`` in ``models/*/modeling_*.py`` and ``generation/utils.py``); the old
name still works there but warns (``FutureWarning``), and model outputs carry the cache as
``output.cache`` (``output.past_key_values`` is a property that logs a deprecation).
Older 5.x releases know only ``past_key_values`` and refuse ``cache=`` in ``generate``
("model_kwargs are not used"). So the keyword is read from the model's own ``forward``
signature: the one a given installation of transformers accepts without a warning.
``deprecate_kwarg`` wraps with ``functools.wraps``, so ``inspect.signature`` sees the
function's real parameters.
"""

from __future__ import annotations

import inspect
from typing import Any

NEW = "cache"
OLD = "past_key_values"


def cache_keyword(model: Any) -> str:
    """``"cache"`` when ``model.forward`` takes ``cache=`` (transformers >= 5.24), else
    ``"past_key_values"``: the keyword to pass a cache to ``model(...)`` and ``model.generate(...)``.

    Example:
        >>> out = model.generate(ids, **{cache_keyword(model): cache})   # doctest: +SKIP
    """
    forward = getattr(model, "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or an object without a signature
        return OLD
    return NEW if NEW in params else OLD


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(**...)`` or ``model.generate(**...)`` (see :func:`cache_keyword`).
    A ShmkvCache is checked against the model first (``ShmkvCache.check_model``)."""
    check = getattr(cache, "check_model", None)
    if check is not None and getattr(model, "config", None) is not None:
        check(model)
    return {cache_keyword(model): cache}

