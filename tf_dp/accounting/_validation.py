"""Argument checks shared by the accounting API (ValueError naming the argument and its value)."""

from __future__ import annotations

import math
import numbers
from typing import Optional


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


def num_projections(value: Optional[int]) -> Optional[int]:
    """None means exact clipping; otherwise an integer r >= 1."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"`num_projections` must be None or an integer >= 1, got {value!r}.")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        if not float(value).is_integer():
            raise ValueError(f"`num_projections` must be an integer >= 1, got {value!r}.")
        value = int(value)
    if not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`num_projections` must be None or an integer >= 1, got {value!r}.")
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
