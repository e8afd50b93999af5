"""Every argument check of tf_dp, in one message style and without TensorFlow.

Each check raises ``ValueError`` naming the argument in backticks and the value it got
(``ValueError: `l2_norm_clip` must be > 0, got -1.0``) and returns the value normalised.
``tf_dp.accounting`` uses it too, so it must not import TensorFlow.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Callable, Optional


def noise_multiplier(value: float, name: str = "noise_multiplier") -> float:
    """σ must be a finite number ≥ 0 (σ = 0 means no noise: ε = ∞)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"`{name}` must be a number >= 0, got {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
    if math.isinf(value):
        raise ValueError(f"`{name}` must be finite, got {value!r}.")
    return float(value)


def sampling_probability(value: float, name: str = "sampling_probability") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")
    return float(value)


def steps(value: int, name: str = "steps") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer() and value >= 0:
            return int(value)
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return int(value)


def count(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`count` must be an integer >= 1, got {value!r}.")
    return int(value)


def num_projections(value: Optional[int], allow_none: bool = True) -> Optional[int]:
    """r, the number of JL projections: an integer >= 1 (None means exact clipping when
    ``allow_none``)."""
    if value is None and allow_none:
        return None
    what = "None or an integer >= 1" if allow_none else "an integer >= 1"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`num_projections` must be {what}, got {value!r}.")
    return int(value)


def delta(value: float, name: str = "delta") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
        raise ValueError(f"`{name}` must be in (0, 1), got {value!r}.")
    return float(value)


def epsilon(value: float, name: str = "epsilon") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or math.isnan(value)
        or value < 0
        or math.isinf(value)
    ):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    return float(value)


def positive_epsilon(value: float, name: str = "target_epsilon") -> float:
    value = epsilon(value, name)
    if value <= 0:
        raise ValueError(f"`{name}` must be > 0, got {value!r}.")
    return value


def positive_int(value: int, name: str) -> int:
    """An integer >= 1 (``gradient_accumulation_steps``, ``dataset_size``, ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)


def l2_norm_clip(value: float, noise: float = None) -> float:
    """C > 0; C = inf (no clipping) only with no noise (a non-private reference run: noise
    scaled by an infinite clip would be infinite)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"`l2_norm_clip` must be a number > 0, got {value!r}.")
    if not value > 0:
        raise ValueError(f"`l2_norm_clip` must be > 0, got {value!r}.")
    if math.isinf(value) and noise:
        raise ValueError(f"`l2_norm_clip` is inf (no clipping) but `noise_multiplier` is "
                         f"{noise!r}: the noise std sigma*C would be infinite.")
    return float(value)


def seed(value) -> Optional[int]:
    """None (fresh OS entropy, the default) or an int (debugging only)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(f"`seed` must be an int or None, got {value!r}.")
    return None if value is None else int(value)


def non_negative_int(value: int, name: str) -> int:
    """An integer >= 0 (``warmup_steps``, ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"`{name}` must be an integer >= 0, got {value!r}.")
    return int(value)


def fraction(value: float, name: str) -> float:
    """A number in [0, 1) (LSG ``sparsity``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"`{name}` must be a number in [0, 1), got {value!r}.")
    return float(value)


def one_of(value, name: str, choices) -> object:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}.")
    return value


def keyword_only(namespace: str) -> Callable:
    """Decorator for a function (or method) whose parameters after ``self`` are keyword-only.

    Several privacy quantities are floats of similar size (σ, q, δ, ε): passed by position in
    the wrong order they give a wrong ε without any error. The decorated function refuses a
    positional call with a ``TypeError`` that names it (``namespace.qualname``) and shows the
    keyword call, instead of Python's bare "takes 0 positional arguments".
    """

    def decorate(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters.values()
        n_positional = sum(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
        )  # `self` for a method, else 0
        shown = ", ".join(
            f"{p.name}=..." if p.default is p.empty else f"{p.name}={p.default!r}"
            for p in params
            if p.kind == p.KEYWORD_ONLY
        )
        message = (
            f"{namespace}.{fn.__qualname__} takes keyword arguments only (numbers passed in the "
            f"wrong order would silently give a wrong privacy guarantee): "
            f"{fn.__name__}({shown})"
        )

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if len(args) > n_positional:
                raise TypeError(message)
            return fn(*args, **kwargs)

        return wrapper

    return decorate
