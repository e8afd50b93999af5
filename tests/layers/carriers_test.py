"""Carrier math: Gram–Schmidt, the power method, the low-rank update (RGP Alg. 2, Cor. 2.1.1)."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.layers.carriers import gram_schmidt, power_method, random_carriers, reconstruct_update


def _orthonormality_error(q):
    q = np.asarray(q)
    return np.abs(q.T @ q - np.eye(q.shape[1])).max()


def _max_principal_angle_sine(a, b):
    """sin of the largest principal angle between span(a) and span(b), both orthonormal."""
    a, b = np.asarray(a), np.asarray(b)
    return np.linalg.norm(b - a @ (a.T @ b), 2)


def _classical_gram_schmidt(a):
    q = np.zeros_like(a)
    for j in range(a.shape[1]):
        v = a[:, j] - q[:, :j] @ (q[:, :j].T @ a[:, j])
        q[:, j] = v / np.linalg.norm(v)
    return q


def test_gram_schmidt_matches_classical_on_full_rank_input():
    a = np.random.default_rng(0).normal(size=(7, 4))
    q = gram_schmidt(tf.constant(a)).numpy()
    np.testing.assert_allclose(q, _classical_gram_schmidt(a), atol=1e-10)
    assert _orthonormality_error(q) < 1e-12


@pytest.mark.parametrize(
    "matrix",
    [np.zeros((5, 2)), np.outer(np.arange(1.0, 6.0), np.ones(3))],
    ids=["zero", "rank_one"],
)
def test_gram_schmidt_rank_deficient_input_still_orthonormal(matrix):
    assert _orthonormality_error(gram_schmidt(tf.constant(matrix))) < 1e-12


def test_power_method_recovers_top_subspace_of_noisy_low_rank_matrix():
    rng = np.random.default_rng(1)
    m, n, r = 30, 20, 3
    u, _ = np.linalg.qr(rng.normal(size=(m, r)))
    v, _ = np.linalg.qr(rng.normal(size=(n, r)))
    matrix = u @ np.diag([5.0, 3.0, 2.0]) @ v.T + 1e-4 * rng.normal(size=(m, n))
    left, right = power_method(tf.constant(matrix), rank=r, iterations=1, seed=3)
    assert left.shape == (m, r) and right.shape == (r, n)
    assert _orthonormality_error(left) < 1e-10
    assert _orthonormality_error(tf.transpose(right)) < 1e-10
    # K = 1 (RGP's choice) finds the planted subspaces up to the noise level
    # (||noise|| / sigma_r ~ 1e-3) ...
    assert _max_principal_angle_sine(u, left) < 1e-2
    assert _max_principal_angle_sine(v, tf.transpose(right)) < 1e-2
    # ... and more iterations converge to the noisy matrix's own top-r singular subspaces.
    left, right = power_method(tf.constant(matrix), rank=r, iterations=3, seed=3)
    svd_u, _, svd_vt = np.linalg.svd(matrix)
    assert _max_principal_angle_sine(svd_u[:, :r], left) < 1e-8
    assert _max_principal_angle_sine(svd_vt[:r].T, tf.transpose(right)) < 1e-8


def test_power_method_is_exact_on_an_exactly_low_rank_matrix():
    rng = np.random.default_rng(4)
    matrix = rng.normal(size=(12, 2)) @ rng.normal(size=(2, 9))
    left, right = power_method(tf.constant(matrix), rank=2, iterations=1, seed=0)
    svd_u, _, svd_vt = np.linalg.svd(matrix)
    assert _max_principal_angle_sine(svd_u[:, :2], left) < 1e-10
    assert _max_principal_angle_sine(svd_vt[:2].T, tf.transpose(right)) < 1e-10
    np.testing.assert_allclose(left @ (tf.transpose(left) @ matrix), matrix, atol=1e-10)


def test_power_method_is_deterministic_in_its_seed_inside_tf_function():
    matrix = tf.random.stateless_normal([6, 5], seed=[0, 1])
    eager = power_method(matrix, rank=2, iterations=2, seed=7)
    traced = tf.function(lambda w: power_method(w, rank=2, iterations=2, seed=[7, 0]))(matrix)
    for a, b in zip(eager, traced):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_random_carriers_are_orthonormal():
    left, right = random_carriers(9, 4, 3, seed=[1, 2])
    assert left.shape == (9, 3) and right.shape == (3, 4)
    assert _orthonormality_error(left) < 1e-5
    assert _orthonormality_error(tf.transpose(right)) < 1e-5


@pytest.mark.parametrize("m, n", [(4, 7), (7, 4), (5, 5)])
def test_reconstruct_update_at_full_rank_is_the_plain_gradient(m, n):
    # RGP Corollary 2.1.1 with r = min(m, n): one projector is the identity.
    rng = np.random.default_rng(m * 10 + n)
    grad_w = tf.constant(rng.normal(size=(m, n)))
    left, right = power_method(tf.constant(rng.normal(size=(m, n))), rank=min(m, n), seed=0)
    grad_left = grad_w @ tf.transpose(right)  # Theorem 2.1
    grad_right = tf.transpose(left) @ grad_w
    update = reconstruct_update(grad_left, grad_right, left, right)
    np.testing.assert_allclose(update, grad_w, atol=1e-10)


def test_reconstruct_update_is_the_projection_onto_the_carrier_spaces():
    rng = np.random.default_rng(2)
    m, n, r = 8, 6, 2
    grad_w = rng.normal(size=(m, n))
    left, right = (t.numpy() for t in power_method(tf.constant(rng.normal(size=(m, n))), r))
    update = reconstruct_update(grad_w @ right.T, left.T @ grad_w, left, right).numpy()
    p_left, p_right = left @ left.T, right.T @ right
    expected = p_left @ grad_w + grad_w @ p_right - p_left @ grad_w @ p_right
    np.testing.assert_allclose(update, expected, atol=1e-10)
    # A projection: applying it again changes nothing.
    again = reconstruct_update(update @ right.T, left.T @ update, left, right).numpy()
    np.testing.assert_allclose(again, update, atol=1e-10)


def test_least_squares_gradients_stay_in_the_data_span():
    # RGP §4.2, Proposition 4.1: for least squares y = x·W trained by gradient descent, every
    # gradient Xᵀ(XW − Y)/N has its columns in span(Xᵀ), so the historical update has rank
    # <= rank(X), and carriers from it reproduce every later gradient exactly.
    rng = np.random.default_rng(3)
    num, d, p, k = 40, 10, 6, 3
    x = rng.normal(size=(num, k)) @ rng.normal(size=(k, d))  # data of rank k < d
    y = rng.normal(size=(num, p))
    w0 = rng.normal(size=(d, p))
    w = w0.copy()
    data_basis, _ = np.linalg.qr(x.T)
    data_basis = data_basis[:, :k]
    for _ in range(25):
        grad = x.T @ (x @ w - y) / num
        assert np.linalg.norm(grad - data_basis @ (data_basis.T @ grad)) < 1e-10
        w -= 0.01 * grad
    history = w - w0
    singular_values = np.linalg.svd(history, compute_uv=False)
    assert singular_values[k - 1] > 1e-6 and singular_values[k] < 1e-10 * singular_values[0]

    left, right = power_method(tf.constant(history), rank=k, seed=0)
    assert _max_principal_angle_sine(data_basis, left) < 1e-8
    grad = x.T @ (x @ w - y) / num
    update = reconstruct_update(grad @ tf.transpose(right), tf.transpose(left) @ grad, left, right)
    np.testing.assert_allclose(update, grad, atol=1e-10)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
