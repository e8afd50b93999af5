"""Low-rank structure of weight gradients: stable rank and alignment with the historical update.

The two measurements behind RGP's design (Yu, Zhang, Chen, Yin, Liu, "Large Scale Private
Learning via Low-rank Reparametrization", ICML 2021, §3–4):

* the gradient ``G`` of a weight matrix has a low **stable rank** ``‖G‖_F² / ‖G‖_2²``
  (at most its rank, and robust to small singular values), so a rank-r carrier can hold
  most of it;
* the top-r singular subspaces of the **historical update** ``W − W0`` align with the current
  gradient, so carriers built from it (RGP's ``L``, ``R``, ``tf_dp/layers/carriers.py``)
  lose little of ``G``: the **projection residual** is small, much smaller than for random
  subspaces of the same rank.

The residual is what RGP's reconstruction discards. With ``P_L = L·Lᵀ`` and ``P_R = Rᵀ·R``
the reconstructed gradient (Corollary 2.1.1) is ``P_L·G + G·P_R − P_L·G·P_R``, so::

    residual(G; L, R) = ‖(I − P_L)·G·(I − P_R)‖_F / ‖G‖_F   ∈ [0, 1]

0 when every column of ``G`` lies in span(L) or every row in span(R); 1 when ``G`` is
orthogonal to both. For independent uniformly random subspaces its expected square is
``(1 − r/m)(1 − r/n)``.

Matrices follow the Keras kernel layout ``y = x·W``, ``W ∈ R^{m×n}``; a convolution kernel
``[kh, kw, c_in, c_out]`` is the matrix ``[kh·kw·c_in, c_out]`` (``kernel_matrix``), as
``tf_dp.layers.ReparamConv2D`` views it. NumPy only (float64), no TensorFlow; pass tensors
as they are (``np.asarray`` reads them).

These are analysis statistics. Computed on gradients of private training data they are
not differentially private: see ``GradientGeometry``.
"""

from __future__ import annotations

import numbers

import numpy as np


def kernel_matrix(kernel) -> np.ndarray:
    """A kernel as a ``[m, n]`` float64 matrix: all axes but the last (the output units) are
    flattened into rows. Dense ``[m, n]`` is unchanged; Conv2D ``[kh, kw, c_in, c_out]``
    becomes ``[kh·kw·c_in, c_out]``."""
    kernel = np.asarray(kernel, dtype=np.float64)
    if kernel.ndim < 2:
        raise ValueError(f"`kernel` must have at least 2 axes, got shape {kernel.shape}.")
    return kernel.reshape(-1, kernel.shape[-1])


def stable_rank(matrix) -> float:
    """``‖A‖_F² / ‖A‖_2²``: 1 for a rank-1 matrix, ``n`` for the ``n×n`` identity, never more
    than ``rank(A)``. NaN for the zero matrix (no direction at all).

    Args:
        matrix: a ``[m, n]`` array (a kernel with more axes: use ``kernel_matrix`` first).
    """
    a = _matrix(matrix, "matrix")
    singular = np.linalg.svd(a, compute_uv=False)
    if singular[0] == 0:
        return float("nan")
    return float(np.sum(singular**2) / singular[0] ** 2)


def principal_subspaces(matrix, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-``rank`` left and right singular vectors of ``matrix`` (exact SVD).

    RGP's carriers approximate these by one power iteration on ``W − W0``
    (``tf_dp.layers.carriers.power_method``); this is the exact subspace they aim at.

    Returns:
        ``(left, right)``: ``left`` ``[m, r]`` with orthonormal columns, ``right`` ``[r, n]``
        with orthonormal rows.

    Raises:
        ValueError: ``matrix`` is not 2-D or is zero (it has no principal subspace), or
            ``rank`` is not in ``[1, min(m, n)]``.
    """
    a = _matrix(matrix, "matrix")
    rank = _rank(rank, a.shape)
    u, singular, vt = np.linalg.svd(a, full_matrices=False)
    if singular[0] == 0:
        raise ValueError("`matrix` is zero: it has no principal subspace (has the layer been "
                         "updated since W0?).")
    return u[:, :rank], vt[:rank, :]


def random_subspaces(shape, rank: int, seed=None) -> tuple[np.ndarray, np.ndarray]:
    """Uniformly random ``left`` ``[m, r]`` (orthonormal columns) and ``right`` ``[r, n]``
    (orthonormal rows) for a ``[m, n]`` matrix: the data-independent contrast.

    Args:
        shape: ``(m, n)``.
        rank: ``r``, ``1 ≤ r ≤ min(m, n)``.
        seed: seeds the draw (NumPy); None draws from fresh entropy. Unrelated to any DP noise.
    """
    if len(tuple(shape)) != 2:
        raise ValueError(f"`shape` must be (m, n), got {shape!r}.")
    m, n = (int(s) for s in shape)
    rank = _rank(rank, (m, n))
    rng = np.random.default_rng(seed)
    left = _haar_columns(rng.standard_normal((m, rank)))
    right = _haar_columns(rng.standard_normal((n, rank))).T
    return left, right


def subspace_residual(gradient, left, right) -> float:
    """``‖(I − L·Lᵀ)·G·(I − Rᵀ·R)‖_F / ‖G‖_F``: the relative part of ``gradient`` that RGP's
    reconstruction from carriers ``left``, ``right`` discards. NaN for a zero gradient.

    Args:
        gradient: ``[m, n]`` matrix ``G``.
        left: ``[m, r]`` with orthonormal columns.
        right: ``[r', n]`` with orthonormal rows.
    """
    g = _matrix(gradient, "gradient")
    left = _matrix(left, "left")
    right = _matrix(right, "right")
    if left.shape[0] != g.shape[0]:
        raise ValueError(f"`left` must have {g.shape[0]} rows (those of `gradient`), "
                         f"got shape {left.shape}.")
    if right.shape[1] != g.shape[1]:
        raise ValueError(f"`right` must have {g.shape[1]} columns (those of `gradient`), "
                         f"got shape {right.shape}.")
    total = np.linalg.norm(g)
    if total == 0:
        return float("nan")
    outside = g - left @ (left.T @ g)
    outside = outside - (outside @ right.T) @ right
    return float(np.linalg.norm(outside) / total)


def projection_residual(gradient, history, rank: int) -> float:
    """Residual of ``gradient`` outside the rank-``rank`` principal subspaces of ``history``.

    ``history`` is the historical update ``W − W0`` of the same weight; RGP builds its
    carriers from its top singular subspaces, so a small value means those carriers keep most
    of the current gradient.

    Args:
        gradient: ``[m, n]`` current gradient ``G``.
        history: ``[m, n]`` historical update ``W − W0`` (non-zero).
        rank: ``r``, ``1 ≤ r ≤ min(m, n)``.
    """
    g = _matrix(gradient, "gradient")
    h = _matrix(history, "history")
    if h.shape != g.shape:
        raise ValueError(f"`history` must have the shape of `gradient` {g.shape}, "
                         f"got {h.shape}.")
    try:
        left, right = principal_subspaces(h, rank)
    except ValueError as error:
        raise ValueError(str(error).replace("`matrix`", "`history`")) from None
    return subspace_residual(g, left, right)


def random_projection_residual(gradient, rank: int, seed=None) -> float:
    """``subspace_residual`` for uniformly random subspaces of rank ``rank`` (the contrast to
    ``projection_residual``); its expected square is ``(1 − r/m)(1 − r/n)``."""
    g = _matrix(gradient, "gradient")
    return subspace_residual(g, *random_subspaces(g.shape, rank, seed=seed))


def _haar_columns(gaussian):
    q, r = np.linalg.qr(gaussian)
    # Signs fixed by R's diagonal so that Q is Haar-distributed, not biased by the QR routine.
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def _matrix(value, name: str) -> np.ndarray:
    a = np.asarray(value, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"`{name}` must be a matrix [m, n], got shape {a.shape} (reshape a "
                         f"kernel with `kernel_matrix`).")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"`{name}` must be finite, got non-finite entries.")
    return a


def _rank(rank, shape) -> int:
    limit = min(shape)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 1 <= rank <= limit:
        raise ValueError(f"`rank` must be an integer in [1, {limit}] for a {shape[0]}x{shape[1]} "
                         f"matrix, got {rank!r}.")
    return int(rank)
