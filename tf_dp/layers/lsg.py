"""LSG sparsification of the gradient carriers: unit importances and keep-masks.

An input unit ``i`` of a weight matrix ``W ∈ R^{m×n}`` (``y = x·W``) has importance
``Σⱼ |Wᵢⱼ|``, an output unit ``j`` has ``Σᵢ |Wᵢⱼ|``. The top ``(1 − p)`` fraction of units by
importance keeps its carrier gradients; the others are frozen (their rows of ``∂L`` and
columns of ``∂R`` are zero and receive no noise), so the noised dimension drops to about
``(1 − p)·r·(m + n)``. For convolutions a unit is a channel and ``W`` is replaced by the
matrix of kernel-level sums ``Σ_{h,w} |W[h, w, i, j]|``.

Reference: Ito, Liew, Takahashi, Sasaki, Onizuka, "Scaling Private Deep Learning with
Low-Rank and Sparse Gradients" (LSG), arXiv:2207.02699.
"""

from __future__ import annotations

import math

import tensorflow as tf


def unit_importances(weight_matrix: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(Σⱼ |Wᵢⱼ|)_i`` of shape ``[m]`` and ``(Σᵢ |Wᵢⱼ|)_j`` of shape ``[n]``."""
    magnitude = tf.abs(tf.convert_to_tensor(weight_matrix))
    return tf.reduce_sum(magnitude, axis=1), tf.reduce_sum(magnitude, axis=0)


def num_kept_units(num_units: int, sparsity: float | None) -> int:
    """``⌈(1 − p)·units⌉``, at least 1; a ``1e-9`` slack absorbs float error in ``(1 − p)·units``.

    E.g. 10 units at ``p = 0.3`` keep 7 (not 8, as a bare ``ceil(0.7 * 10)`` would give).
    """
    if sparsity is not None and not 0.0 <= sparsity < 1.0:
        raise ValueError(f"`sparsity` must be in [0, 1), got {sparsity}")
    if not sparsity:
        return num_units
    kept = math.ceil((1.0 - sparsity) * num_units - 1e-9)
    return min(num_units, max(1, kept))


def top_units_mask(importance: tf.Tensor, num_kept: int) -> tf.Tensor:
    """A 0/1 mask of ``importance``'s shape ``[units]`` with ones on its ``num_kept`` largest.

    Ties go to the lower index (`tf.math.top_k`), so exactly ``num_kept`` ones are set.
    """
    importance = tf.convert_to_tensor(importance)
    units = importance.shape[0]
    if num_kept >= units:
        return tf.ones_like(importance)
    _, kept = tf.math.top_k(importance, k=num_kept, sorted=False)
    return tf.scatter_nd(kept[:, tf.newaxis], tf.ones([num_kept], importance.dtype), shape=[units])


def lsg_masks(
    importances: tuple[tf.Tensor, tf.Tensor], sparsity: float | None
) -> tuple[tf.Tensor, tf.Tensor]:
    """Keep-masks ``(input_mask [m], output_mask [n])`` from ``(input_imp, output_imp)``.

    Args:
        importances: the pair returned by `unit_importances` (or kernel-level sums for a
            convolution): importance of each input unit and of each output unit.
        sparsity: fraction ``p ∈ [0, 1)`` of units to freeze; ``None`` or 0 keeps all.

    Returns:
        Two float 0/1 vectors; each keeps exactly `num_kept_units(units, sparsity)` units.
    """
    return tuple(
        top_units_mask(importance, num_kept_units(importance.shape[0], sparsity))
        for importance in (tf.convert_to_tensor(i) for i in importances)
    )
