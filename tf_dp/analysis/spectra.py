"""Streaming principal components of a stream of vectors (gradients) in O(ℓ·d) memory.

The eigenvalue spectrum of the gradients along a training trajectory, and their top-k
principal subspace, without storing the trajectory (Li et al., "When Does Differentially
Private Learning Not Suffer in High Dimensions?", NeurIPS 2022, §4.2, keep every gradient on
disk). NumPy only: importing this module does not load TensorFlow.
"""

from __future__ import annotations

import numbers

import numpy as np


class StreamingPCA:
    """Top eigenvalues and eigenvectors of the second moment of a stream, by Frequent Directions.

    For vectors ``g_1, ..., g_T`` in R^d (one per ``update`` row) it estimates the
    eigen-decomposition of their **uncentred** second moment (no mean is subtracted, as in
    Li et al.'s eigen-decomposition of the gradients)::

        M = (1/T) Σ_t g_t g_tᵀ

    from a sketch ``B`` of at most ``2ℓ`` rows (Liberty, "Simple and Deterministic Matrix
    Sketching", KDD 2013; the fast variant of Ghashami, Liberty, Phillips, Woodruff,
    "Frequent Directions: Simple and Deterministic Matrix Sketching", SICOMP 2016)::

        append g_t as a row of B
        when B has 2ℓ rows:  U Σ Vᵀ = svd(B);  δ = σ_ℓ²;  B ← sqrt(max(Σ² − δ, 0)) Vᵀ
        Δ = Σ δ  (over all shrinks)

    Deterministic guarantee, for any stream (Ghashami et al. 2016, Thm 1.1 and its proof):
    with ``G`` the T×d matrix of the stream,

        0 ⪯ GᵀG − BᵀB ⪯ Δ·I   and   Δ ≤ ‖G − G_k‖_F² / (ℓ − k)   for every k < ℓ,

    so every eigenvalue ``λ_i`` of ``M`` lies in ``[μ_i, μ_i + Δ/T]`` (``μ_i`` the estimate,
    ``eigenvalues()``; ``eigenvalue_error_bound`` is ``Δ/T``), and the top-k estimated
    eigenvectors ``V_k`` (``components(k)``) capture nearly the best k-dimensional energy:
    ``‖G − G V_k V_kᵀ‖_F² ≤ ℓ/(ℓ − k) · ‖G − G_k‖_F²``. A stream of rank below ``ℓ`` never
    shrinks (``δ = 0``): the result is then exact up to rounding.

    Memory: the ``2ℓ × d`` sketch (float64) and three scalars; no T×d array is ever held.
    Time: one eigen-decomposition of the ``2ℓ × 2ℓ`` Gram matrix of the sketch every ``ℓ + 1``
    rows, O(ℓ·d) per row amortised.

    Args:
        dim: d, the length of each vector.
        sketch_size: ℓ ≥ 1, the number of eigen-pairs the sketch keeps. For the top k with a
            small error take ℓ ≥ 2k (then Δ ≤ ‖G − G_k‖_F² / k).

    Reference: Ghashami, Liberty, Phillips, Woodruff, "Frequent Directions: Simple and
    Deterministic Matrix Sketching", SIAM J. Comput. 45(5), 2016.
    """

    def __init__(self, dim: int, sketch_size: int):
        self.dim = _positive_int(dim, "dim")
        self.sketch_size = _positive_int(sketch_size, "sketch_size")
        self._buffer = np.zeros((2 * self.sketch_size, self.dim))
        self._rows = 0  # rows of the buffer in use (the rest are zero)
        self._count = 0  # T
        self._shrinkage = 0.0  # Δ
        self._energy = 0.0  # ‖G‖_F², exact

    # ------------------------------------------------------------------ the stream
    def update(self, vectors) -> "StreamingPCA":
        """Adds one vector (shape ``[d]``) or a batch of vectors (``[n, d]``) to the stream."""
        vectors = np.asarray(vectors, dtype=np.float64)
        if vectors.ndim not in (1, 2) or vectors.shape[-1] != self.dim:
            raise ValueError(f"`vectors` must have shape [{self.dim}] or [n, {self.dim}], got "
                             f"{list(vectors.shape)}.")
        if vectors.ndim == 1:
            vectors = vectors[None, :]
        if not np.all(np.isfinite(vectors)):
            raise ValueError("`vectors` must be finite, got NaN or infinity.")
        self._count += vectors.shape[0]
        self._energy += float(np.sum(vectors * vectors))
        start = 0
        while start < vectors.shape[0]:
            if self._rows == self._buffer.shape[0]:
                self._shrink()
            n = min(vectors.shape[0] - start, self._buffer.shape[0] - self._rows)
            self._buffer[self._rows:self._rows + n] = vectors[start:start + n]
            self._rows += n
            start += n
        return self

    def _shrink(self):
        squares, rows = self._gram_eigh()
        ell = self.sketch_size
        delta = float(squares[ell - 1]) if squares.shape[0] >= ell else 0.0
        keep = squares[:ell - 1] > delta
        # Row i of the new sketch is sqrt(σ_i² − δ) v_iᵀ = sqrt(1 − δ/σ_i²) u_iᵀB.
        scale = np.sqrt(1.0 - delta / squares[:ell - 1][keep])
        kept = scale[:, None] * rows[:ell - 1][keep]
        self._buffer[:] = 0.0
        self._buffer[:kept.shape[0]] = kept
        self._rows = kept.shape[0]
        self._shrinkage += delta

    def _gram_eigh(self):
        """σ_i² and the rows ``u_iᵀB`` (= σ_i v_iᵀ) of the sketch, largest first.

        From the eigen-decomposition of the small Gram matrix B Bᵀ (2ℓ × 2ℓ): an SVD of the
        2ℓ × d sketch costs many times more for d ≫ ℓ; the squared condition number only
        blurs eigenvalues below about 1e-16 of the largest.
        """
        b = self._buffer[:max(self._rows, 1)]
        squares, u = np.linalg.eigh(b @ b.T)
        squares, u = np.maximum(squares[::-1], 0.0), u[:, ::-1]
        return squares, u.T @ b

    # ------------------------------------------------------------------ results
    @property
    def num_vectors(self) -> int:
        """T, the number of vectors streamed so far."""
        return self._count

    @property
    def trace(self) -> float:
        """``tr M = (1/T) Σ_t ‖g_t‖²``, exact (the total of all d eigenvalues)."""
        return self._energy / self._count if self._count else 0.0

    @property
    def eigenvalue_error_bound(self) -> float:
        """``Δ/T``: each true eigenvalue ``λ_i`` of ``M`` is in ``[μ_i, μ_i + Δ/T]``."""
        return self._shrinkage / self._count if self._count else 0.0

    def eigenvalues(self, k: int | None = None) -> np.ndarray:
        """The top ``min(k, ℓ, d)`` eigenvalue estimates ``μ_i`` of ``M``, in decreasing order.

        Lower bounds: ``μ_i ≤ λ_i ≤ μ_i + eigenvalue_error_bound``. k=None: all ℓ.
        """
        s, _ = self._decomposition(k)
        return s ** 2 / max(self._count, 1)

    def components(self, k: int | None = None) -> np.ndarray:
        """The top ``min(k, ℓ, d)`` estimated eigenvectors of ``M``, as orthonormal columns.

        Shape ``[d, k]``; column i belongs to ``eigenvalues()[i]`` (sign arbitrary).
        """
        _, vt = self._decomposition(k)
        return vt.T.copy()

    def explained_variance_ratio(self, k: int | None = None) -> np.ndarray:
        """``μ_i / tr M`` for the top k: the share of the stream's energy in each direction."""
        trace = self.trace
        values = self.eigenvalues(k)
        return values / trace if trace > 0 else np.zeros_like(values)

    def _decomposition(self, k):
        if self._count == 0:
            raise ValueError("StreamingPCA has seen no vectors yet: call `update` first.")
        limit = min(self.sketch_size, self.dim)
        if k is not None:
            limit = min(_positive_int(k, "k"), limit)
        # All rows in use: BᵀB then still satisfies 0 ⪯ GᵀG − BᵀB ⪯ ΔI.
        squares, rows = self._gram_eigh()
        # Directions whose σ² is at rounding level of the Gram matrix are not resolved.
        resolved = int(np.sum(squares > squares[0] * 1e-13)) if squares[0] > 0 else 0
        count = min(limit, resolved)
        s = np.sqrt(squares[:count])
        vt = np.zeros((0, self.dim))
        if count:
            vectors, r = np.linalg.qr(rows[:count].T / s)  # orthonormal to working precision
            vt = (vectors * np.sign(np.diag(r))).T
        if count < limit:  # the rest are zero (or unresolved) eigenvalues
            pad = limit - count
            s = np.concatenate([s, np.sqrt(squares[count:limit]),
                                np.zeros(max(0, limit - squares.shape[0]))])
            vt = np.concatenate([vt, _complement(vt, pad)])
        return s, vt


def _complement(vt, count):
    """``count`` orthonormal rows orthogonal to the orthonormal rows of ``vt``."""
    d = vt.shape[1]
    # np.eye(d, m), not np.eye(d)[:, :m]: d x d is 41 GB at d = 73,890. Householder QR gives
    # orthonormal columns, those after vt's rows orthogonal to them, even if some e_i lie in
    # vt's span.
    q, _ = np.linalg.qr(np.concatenate([vt.T, np.eye(d, min(d, vt.shape[0] + count))], axis=1))
    return q[:, vt.shape[0]:vt.shape[0] + count].T


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)
