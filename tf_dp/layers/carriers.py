"""Gradient carriers for RGP: orthonormalisation, the power method, the low-rank update.

Pure functions on matrices (no variables, no layers), composed by the reparametrized layers.
Shapes follow the Keras kernel layout ``y = x·W`` with ``W ∈ R^{m×n}`` (``m`` inputs, ``n``
outputs): the left carrier ``L ∈ R^{m×r}`` has orthonormal columns, the right carrier
``R ∈ R^{r×n}`` has orthonormal rows, and ``W ≈ L·Lᵀ·W·Rᵀ·R``.

Reference: Yu, Zhang, Chen, Yin, Liu, "Large Scale Private Learning via Low-rank
Reparametrization", ICML 2021 (RGP), Algorithm 2 and Corollary 2.1.1.
"""

from __future__ import annotations

import tensorflow as tf


def _stateless_seed(seed) -> tf.Tensor:
    """A shape-[2] int64 seed for `tf.random.stateless_*` from an int or a [2] tensor."""
    seed = tf.convert_to_tensor(seed)
    if not seed.dtype.is_integer:
        raise ValueError(f"`seed` must be an integer or a pair of integers, got {seed!r}")
    seed = tf.cast(seed, tf.int64)
    if seed.shape.rank == 0:
        return tf.stack([seed, tf.constant(0, tf.int64)])
    return tf.reshape(seed, [2])


def gram_schmidt(matrix: tf.Tensor) -> tf.Tensor:
    """Orthonormalises the columns of ``matrix`` (shape ``[m, k]``, ``m ≥ k``).

    Returns ``Q`` of shape ``[m, k]`` with ``QᵀQ = I`` whose leading ``j`` columns span the
    leading ``j`` columns of ``matrix`` for every ``j`` — the Gram–Schmidt result. It is
    computed by a Householder QR (numerically stabler than classical Gram–Schmidt) whose
    signs are fixed so that ``diag(QᵀA) ≥ 0``: for a full-column-rank input this is exactly
    the matrix Gram–Schmidt returns. For a rank-deficient input (e.g. a zero historical
    update) the columns are still orthonormal, the extra ones completing the basis.
    """
    matrix = tf.convert_to_tensor(matrix)
    q, r = tf.linalg.qr(matrix, full_matrices=False)
    signs = tf.where(tf.linalg.diag_part(r) < 0, -tf.ones_like(q[0]), tf.ones_like(q[0]))
    return q * signs[tf.newaxis, :]


def _orthonormal_rows(matrix: tf.Tensor) -> tf.Tensor:
    return tf.transpose(gram_schmidt(tf.transpose(matrix)))


def power_method(
    matrix: tf.Tensor, rank: int, iterations: int = 1, seed=0
) -> tuple[tf.Tensor, tf.Tensor]:
    """Top-``rank`` left/right singular subspaces of ``matrix`` by the power method.

    RGP Algorithm 2 in the ``y = x·W`` layout::

        R ~ N(0, 1)^{r×n}
        repeat K = iterations times:
            L = orthonormalise_columns(W · Rᵀ)      # Gram–Schmidt
            R = Lᵀ · W
        R = orthonormalise_rows(R)

    One iteration (K = 1) suffices in practice (RGP §3.2): the historical update is close to
    low rank. The result is a valid pair of carriers even when ``matrix`` has rank < ``rank``.

    Args:
        matrix: ``[m, n]`` float tensor (the historical update ``W_t − W_0`` or the weights).
        rank: number of carrier directions ``r``, ``1 ≤ r ≤ min(m, n)``.
        iterations: number of power iterations ``K ≥ 1``.
        seed: int or shape-``[2]`` int tensor for the Gaussian start (stateless, so the same
            seed gives the same carriers inside or outside ``tf.function``).

    Returns:
        ``(left, right)``: ``left`` ``[m, r]`` with orthonormal columns, ``right`` ``[r, n]``
        with orthonormal rows.
    """
    matrix = tf.convert_to_tensor(matrix)
    if iterations < 1:
        raise ValueError(f"`iterations` must be >= 1, got {iterations}")
    n = tf.shape(matrix)[1]
    right = tf.random.stateless_normal(
        tf.stack([rank, n]), seed=_stateless_seed(seed), dtype=matrix.dtype
    )
    for _ in range(iterations):
        left = gram_schmidt(tf.matmul(matrix, right, transpose_b=True))
        right = tf.matmul(left, matrix, transpose_a=True)
    return left, _orthonormal_rows(right)


def random_carriers(
    input_dim: int, output_dim: int, rank: int, seed=0, dtype=tf.float32
) -> tuple[tf.Tensor, tf.Tensor]:
    """Gaussian carriers, orthonormalised: ``left`` ``[m, r]`` and ``right`` ``[r, n]``.

    The data-independent baseline of RGP's ablation (§5, "random" gradient carriers).
    """
    seeds = tf.random.experimental.stateless_split(_stateless_seed(seed), num=2)
    left = tf.random.stateless_normal([input_dim, rank], seed=seeds[0], dtype=dtype)
    right = tf.random.stateless_normal([rank, output_dim], seed=seeds[1], dtype=dtype)
    return gram_schmidt(left), _orthonormal_rows(right)


def reconstruct_update(
    grad_left: tf.Tensor, grad_right: tf.Tensor, left: tf.Tensor, right: tf.Tensor
) -> tf.Tensor:
    """The weight update from carrier gradients (RGP Corollary 2.1.1, ``y = x·W`` layout).

    ::

        ∂W ≈ ∂L·R + L·∂R − L·(Lᵀ·∂L)·R

    With ``∂L = ∂W·Rᵀ`` and ``∂R = Lᵀ·∂W`` (RGP Theorem 2.1) and orthonormal carriers this
    is ``P_L·∂W + ∂W·P_R − P_L·∂W·P_R`` with ``P_L = L·Lᵀ``, ``P_R = Rᵀ·R``: the projection of
    ``∂W`` onto matrices whose columns lie in span(L) or rows in span(R). At full rank
    (``r = min(m, n)``) one projector is the identity and the result is ``∂W`` exactly.

    Args:
        grad_left: ``[m, r]`` gradient (clipped, noised) of the left carrier.
        grad_right: ``[r, n]`` gradient of the right carrier.
        left: ``[m, r]`` left carrier, orthonormal columns.
        right: ``[r, n]`` right carrier, orthonormal rows.

    Returns:
        ``[m, n]`` update for the weight matrix.
    """
    # Grouped as ∂L·R + L·(∂R − (Lᵀ∂L)·R): two m×r×n products and one r×r, never m×m.
    overlap = tf.matmul(left, grad_left, transpose_a=True)
    return tf.matmul(grad_left, right) + tf.matmul(left, grad_right - tf.matmul(overlap, right))
