"""Stable rank and projection residuals against NumPy on matrices whose answer is known."""

import sys

import numpy as np
import pytest

from tf_dp import analysis


def _orthonormal(rng, rows, cols):
    return np.linalg.qr(rng.standard_normal((rows, cols)))[0]


def test_stable_rank_of_known_matrices():
    rng = np.random.default_rng(0)
    rank_one = np.outer(rng.standard_normal(7), rng.standard_normal(5))
    assert analysis.stable_rank(rank_one) == pytest.approx(1.0)
    for n in (1, 4, 9):
        assert analysis.stable_rank(np.eye(n)) == pytest.approx(float(n))
    # diag(3, 1): (9 + 1) / 9.
    assert analysis.stable_rank(np.diag([3.0, 1.0])) == pytest.approx(10 / 9)
    a = rng.standard_normal((6, 11))
    expected = np.linalg.norm(a, "fro") ** 2 / np.linalg.norm(a, 2) ** 2
    assert analysis.stable_rank(a) == pytest.approx(expected)
    assert analysis.stable_rank(a) <= np.linalg.matrix_rank(a) + 1e-12
    assert np.isnan(analysis.stable_rank(np.zeros((3, 2))))


def test_kernel_matrix_flattens_all_axes_but_the_outputs():
    conv = np.arange(3 * 3 * 2 * 4, dtype=np.float32).reshape(3, 3, 2, 4)
    matrix = analysis.kernel_matrix(conv)
    assert matrix.shape == (18, 4)
    np.testing.assert_array_equal(matrix[5], conv[0, 2, 1])
    dense = np.ones((5, 3))
    assert analysis.kernel_matrix(dense).shape == (5, 3)


def test_principal_subspaces_match_numpy_svd():
    rng = np.random.default_rng(1)
    h = rng.standard_normal((8, 6))
    left, right = analysis.principal_subspaces(h, 3)
    u, _, vt = np.linalg.svd(h)
    # Same subspaces (singular vectors are defined up to sign): equal projectors.
    np.testing.assert_allclose(left @ left.T, u[:, :3] @ u[:, :3].T, atol=1e-10)
    np.testing.assert_allclose(right.T @ right, vt[:3].T @ vt[:3], atol=1e-10)


def test_residual_is_zero_inside_and_one_outside_the_historical_subspaces():
    rng = np.random.default_rng(2)
    m, n, r = 9, 7, 2
    u, v = _orthonormal(rng, m, m), _orthonormal(rng, n, n)
    history = u[:, :r] @ np.diag([5.0, 2.0]) @ v[:, :r].T  # rank 2: L = u[:, :2], R = v[:, :2]ᵀ
    inside_left = u[:, :r] @ rng.standard_normal((r, n))  # columns in span(L)
    inside_right = rng.standard_normal((m, r)) @ v[:, :r].T  # rows in span(R)
    outside = u[:, r:] @ rng.standard_normal((m - r, n - r)) @ v[:, r:].T
    assert analysis.projection_residual(inside_left, history, r) == pytest.approx(0, abs=1e-12)
    assert analysis.projection_residual(inside_right, history, r) == pytest.approx(0, abs=1e-12)
    assert analysis.projection_residual(outside, history, r) == pytest.approx(1.0)
    # RGP's reconstruction P_L G + G P_R - P_L G P_R keeps exactly the rest.
    g = rng.standard_normal((m, n))
    p_l, p_r = u[:, :r] @ u[:, :r].T, v[:, :r] @ v[:, :r].T
    kept = p_l @ g + g @ p_r - p_l @ g @ p_r
    expected = np.linalg.norm(g - kept) / np.linalg.norm(g)
    assert analysis.projection_residual(g, history, r) == pytest.approx(expected)
    # Full rank: one projector is the identity, nothing is lost.
    assert analysis.projection_residual(g, rng.standard_normal((m, n)), n) == pytest.approx(
        0, abs=1e-12)


def test_random_subspaces_are_orthonormal_and_their_residual_has_the_known_mean():
    left, right = analysis.random_subspaces((12, 10), 3, seed=0)
    np.testing.assert_allclose(left.T @ left, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(right @ right.T, np.eye(3), atol=1e-12)
    g = np.random.default_rng(3).standard_normal((12, 10))
    squares = [analysis.random_projection_residual(g, 3, seed=s) ** 2 for s in range(400)]
    assert np.mean(squares) == pytest.approx((1 - 3 / 12) * (1 - 3 / 10), rel=0.05)


def test_bad_inputs_name_the_argument():
    g = np.ones((4, 3))
    with pytest.raises(ValueError, match="`rank` must be an integer in \\[1, 3\\]"):
        analysis.projection_residual(g, g, 4)
    with pytest.raises(ValueError, match="`rank`"):
        analysis.projection_residual(g, g, 0)
    with pytest.raises(ValueError, match="`history` is zero"):
        analysis.projection_residual(g, np.zeros((4, 3)), 1)
    with pytest.raises(ValueError, match="`history` must have the shape"):
        analysis.projection_residual(g, np.ones((3, 4)), 1)
    with pytest.raises(ValueError, match="`matrix` must be a matrix"):
        analysis.stable_rank(np.ones((2, 2, 2)))
    with pytest.raises(ValueError, match="`gradient` must be finite"):
        analysis.random_projection_residual(np.full((2, 2), np.nan), 1)
    with pytest.raises(ValueError, match="`kernel` must have at least 2 axes"):
        analysis.kernel_matrix(np.ones(3))
    with pytest.raises(ValueError, match="`left` must have 4 rows"):
        analysis.subspace_residual(g, np.ones((3, 1)), np.ones((1, 3)))


def test_the_numpy_tools_import_without_tensorflow():
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, tf_dp\n"
            "assert tf_dp.analysis.stable_rank([[2.0, 0.0], [0.0, 1.0]]) == 1.25\n"
            "assert 'tensorflow' not in sys.modules, 'tf_dp.analysis loaded TensorFlow'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
