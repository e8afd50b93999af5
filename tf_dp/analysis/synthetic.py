"""Synthetic least squares with a chosen feature spectrum (Li et al. 2022, §4.1).

Li, Liu, Hashimoto, Inan, Kulkarni, Lee, Thakurta, "When Does Differentially Private Learning
Not Suffer in High Dimensions?", NeurIPS 2022: DP-SGD's excess empirical loss depends on the
dimension d only through how fast the loss's curvature (here the feature covariance) decays,
not on d itself ("restricted Lipschitz continuity"). These helpers build the convex problem
and measure the excess loss; NumPy only, no TensorFlow.

    features  x ~ N(0, diag(λ)),  λ_k = k^(−decay),  k = 1..d      (decay 0: isotropic)
    labels    y = xᵀw* + ε,        ε ~ N(0, label_noise²),  w* on the top few directions
    loss      L(w) = 1/(2n) Σ_i (x_iᵀw − y_i)²
    excess    L(w) − min_v L(v)      (min by NumPy least squares)
"""

from __future__ import annotations

import numpy as np

from tf_dp import _validation


def power_law_spectrum(dim: int, decay: float) -> np.ndarray:
    """Eigenvalues ``λ_k = k^(−decay)``, ``k = 1..dim`` (``decay = 0``: all ones)."""
    dim = _validation.positive_int(dim, "dim")
    decay = _non_negative_float(decay, "decay")
    return np.arange(1, dim + 1, dtype=np.float64) ** (-decay)


def linear_regression_data(
    num_examples: int,
    dim: int,
    decay: float,
    *,
    num_informative: int = 4,
    label_noise: float = 0.1,
    seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draws a least-squares problem whose feature covariance is ``diag(λ_k = k^−decay)``.

    The true weights ``w*`` are ``1/sqrt(num_informative)`` on the first ``num_informative``
    coordinates (the largest eigenvalues) and 0 elsewhere, so the problem itself (the loss at
    ``w = 0``, the signal the model must learn) is the same for every ``dim ≥
    num_informative``; only the extra directions, and how much curvature they carry, change.

    Args:
        num_examples: n, number of rows.
        dim: d, number of features.
        decay: α ≥ 0 in ``λ_k = k^−α``; 0 is isotropic (no decay).
        num_informative: coordinates of ``w*`` that are non-zero, ``1 ≤ · ≤ dim``.
        label_noise: standard deviation of the label noise (≥ 0).
        seed: seeds this *data* draw (NumPy); it has nothing to do with any DP noise.

    Returns:
        ``(x, y, w_star)``: float32 ``[n, d]``, float32 ``[n]``, float64 ``[d]``.
    """
    num_examples = _validation.positive_int(num_examples, "num_examples")
    dim = _validation.positive_int(dim, "dim")
    num_informative = _validation.positive_int(num_informative, "num_informative")
    if num_informative > dim:
        raise ValueError(f"`num_informative` must be <= `dim` ({dim}), got {num_informative}.")
    label_noise = _non_negative_float(label_noise, "label_noise")
    rng = np.random.default_rng(seed)
    scale = np.sqrt(power_law_spectrum(dim, decay))
    x = rng.standard_normal((num_examples, dim)) * scale
    w_star = np.zeros(dim)
    w_star[:num_informative] = 1.0 / np.sqrt(num_informative)
    y = x @ w_star + label_noise * rng.standard_normal(num_examples)
    return x.astype(np.float32), y.astype(np.float32), w_star


def least_squares_loss(x, y, weights) -> float:
    """``L(w) = 1/(2n) Σ_i (x_iᵀw − y_i)²``, in float64."""
    x, y, w = _as_problem(x, y, weights)
    residual = x @ w - y
    return float(0.5 * np.mean(residual**2))


def least_squares_optimum(x, y) -> np.ndarray:
    """A minimiser of ``L`` (the minimum-norm one when ``x`` is rank deficient)."""
    x, y, _ = _as_problem(x, y, None)
    return np.linalg.lstsq(x, y, rcond=None)[0]


def excess_empirical_loss(x, y, weights) -> float:
    """``L(w) − min_v L(v)`` on the training set ``(x, y)``, ≥ 0 up to rounding."""
    return least_squares_loss(x, y, weights) - least_squares_loss(
        x, y, least_squares_optimum(x, y)
    )


def _as_problem(x, y, weights):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.ndim != 2:
        raise ValueError(f"`x` must be a matrix [n, d], got shape {x.shape}.")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"`y` must have one entry per row of `x` ({x.shape[0]}), "
                         f"got {y.shape[0]}.")
    if weights is None:
        return x, y, None
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"`weights` must have one entry per column of `x` ({x.shape[1]}), "
                         f"got {w.shape[0]}.")
    return x, y, w


def _non_negative_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"`{name}` must be a number >= 0, got {value!r}.")
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    return float(value)
