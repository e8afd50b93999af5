"""The Gaussian noise and JL directions are Gaussian in their tails (session 17).

TensorFlow's normal ops clamp their Box-Muller uniform at 1e-7: no draw exceeds 5.678, and
a pair lies on that circle with probability 1e-7. A neighbouring data set then moves the
release outside the support of the other one with probability ~3.6e-6 per step at sigma = 1
(docs/privacy.md). ``tf_dp.core.gaussian`` draws Box-Muller pairs from 64-bit words with
``u1`` down to 2^-128. These tests pin the transform against the math on adversarial words
(the deep tail), the law on ordinary draws, and that no capped TensorFlow normal op is left
in a private step.
"""

import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tests import _reference as ref
from tf_dp.core import gaussian

_TWO64 = 2 ** 64
_CAPPED_OPS = {"RandomStandardNormal", "StatelessRandomNormal", "StatelessRandomNormalV2",
               "TruncatedNormal", "StatelessTruncatedNormal", "StatelessTruncatedNormalV2",
               "ParameterizedTruncatedNormal", "StatelessParameterizedTruncatedNormal",
               "StatefulStandardNormal", "StatefulStandardNormalV2", "StatefulTruncatedNormal"}


def _words(values):
    return tf.constant(np.array(values, dtype=np.uint64))


def _radius(hi, lo):
    first, second = gaussian.box_muller(_words(hi), _words(lo), _words([0] * len(hi)))
    return np.hypot(first.numpy(), second.numpy())


def test_the_radius_follows_u1_into_the_deep_tail():
    # u1 = p for p from 1/2 down to 2^-128: r = sqrt(-2 ln p), far beyond TensorFlow's 5.678.
    ps = [0.5, 1e-3, 1e-7, 1e-8, 1e-12, 1e-19, 2.0 ** -64, 2.0 ** -100, 2.0 ** -127]
    hi, lo = [], []
    for p in ps:
        scaled = int(p * _TWO64 * _TWO64)  # p 2^128 = hi 2^64 + lo + 1
        hi.append((scaled - 1) // _TWO64)
        lo.append((scaled - 1) % _TWO64)
    got = _radius(hi, lo)
    want = [math.sqrt(-2.0 * math.log(p)) for p in ps]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[3] > gaussian.TF_CLAMPED_RADIUS + 0.3  # u1 = 1e-8: 6.07, not 5.678
    # The floor: u1 = 2^-128, radius 13.32; u1 = 1 (hi = 2^64 - 1 rounds to 2^64): 0.
    np.testing.assert_allclose(_radius([0, _TWO64 - 1], [0, 0]), [gaussian.MAX_RADIUS, 0.0],
                               rtol=1e-12, atol=1e-300)


def _radius32(hi, low):
    first, second = gaussian.box_muller_float32(_words(hi), _words(low))
    return np.hypot(first.numpy().astype(np.float64), second.numpy().astype(np.float64))


def test_the_float32_route_follows_u1_to_2_to_the_minus_104():
    # The JL directions' route: u1 = hi 2^-64 + (l + 1) 2^-104, l the low 40 bits.
    ps = [0.5, 1e-3, 1e-7, 1e-8, 1e-12, 1e-19, 2.0 ** -64, 2.0 ** -90, 2.0 ** -103]
    hi, low = [], []
    for p in ps:
        scaled = int(p * 2.0 ** 104)  # = hi 2^40 + l + 1
        hi.append((scaled - 1) >> 40)
        low.append((scaled - 1) & (2 ** 40 - 1))
    got = _radius32(hi, low)
    np.testing.assert_allclose(got, [math.sqrt(-2.0 * math.log(p)) for p in ps], rtol=2e-6)
    assert got[3] > gaussian.TF_CLAMPED_RADIUS + 0.3
    # The floor (u1 = 2^-104, radius 12.0; 2^-104 is a normal float32, so no flush to
    # zero turns it into ln 0), and u1 = 1: radius 0, not NaN.
    np.testing.assert_allclose(_radius32([0, _TWO64 - 1], [0, 0]),
                               [gaussian.MAX_RADIUS_FLOAT32, 0.0], rtol=2e-6, atol=0)
    # The angle: the top 24 bits of the second word, which leave l alone.
    ones = [2 ** 62] * 3
    first, second = gaussian.box_muller_float32(_words(ones), _words([0, 2 ** 63, 2 ** 62]))
    theta = np.arctan2(second.numpy(), first.numpy()) % (2 * np.pi)
    np.testing.assert_allclose(theta, [0, np.pi, np.pi / 2], atol=1e-6)


def test_the_float32_routes_conditional_tail_is_the_gaussians():
    """As below, on the float32 route: hi < 2^40 (u1 < 2^-24) and hi = 0 (u1 < 2^-64,
    radius above 9.4, driven by the low 40 bits)."""
    rng = np.random.default_rng(7)
    n = 200_000
    for hi, x0 in [(rng.integers(0, 2 ** 40, n, dtype=np.uint64), 2 * 24 * math.log(2)),
                   (np.zeros(n, np.uint64), 2 * 64 * math.log(2))]:
        low = rng.integers(0, 2 ** 40, n, dtype=np.uint64)
        r2 = _radius32(hi, low) ** 2
        assert r2.min() > x0 * (1 - 1e-6) and r2.max() > x0 + 10
        assert stats.kstest(r2 - x0, "expon", args=(0, 2)).pvalue > 1e-4


def test_the_angle_is_53_bits_of_the_circle():
    angle = _words([0, 2 ** 63, 2 ** 62, _TWO64 - 1])
    ones = _words([2 ** 62] * 4)  # u1 = 1/4: radius sqrt(2 ln 4)
    first, second = gaussian.box_muller(ones, ones, angle)
    theta = np.arctan2(second.numpy(), first.numpy()) % (2 * np.pi)
    np.testing.assert_allclose(theta, [0, np.pi, np.pi / 2, 2 * np.pi * (1 - 2.0 ** -53)],
                               atol=1e-12)


@pytest.mark.parametrize("hi_bits,lo_bits", [(40, 64), (0, 40)])
def test_the_conditional_tail_is_the_gaussians_beyond_tensorflows_cap(hi_bits, lo_bits):
    """Draws conditioned on a small u1: uniform words with hi < 2^hi_bits and lo <
    2^lo_bits, i.e. u1 below 2^-24 (radius above 5.77, all beyond TensorFlow's cap, which
    maps them to 5.678) or below 2^-88 (radius above 11.05). For the Gaussian, given
    u1 < e^(-x0 / 2), r^2 - x0 is exponential with mean 2."""
    rng = np.random.default_rng(hi_bits)
    n = 200_000

    def uniform(bits):
        if bits == 0:
            return np.zeros(n, np.uint64)
        top = rng.integers(0, 2 ** (bits - 1), n, dtype=np.uint64) * np.uint64(2)
        return top + rng.integers(0, 2, n, dtype=np.uint64)

    r2 = _radius(uniform(hi_bits), uniform(lo_bits)) ** 2
    x0 = 2 * (64 - hi_bits) * math.log(2) if hi_bits else 2 * (128 - lo_bits) * math.log(2)
    assert r2.min() > x0 - 1e-9 and r2.max() > x0 + 15
    assert stats.kstest(r2 - x0, "expon", args=(0, 2)).pvalue > 1e-4


@pytest.mark.parametrize("dtype", [tf.float64, tf.float32])
def test_draws_are_standard_normal_and_independent(dtype):
    z = gaussian.normal([1_000_001], tf.constant([5, 6], tf.int64), dtype).numpy().astype(
        np.float64)
    n = z.size
    assert abs(z.mean()) < 6 / math.sqrt(n)
    assert abs(z.var() - 1) < 6 * math.sqrt(2 / n)
    assert stats.kstest(z, "norm").pvalue > 1e-4
    half = n // 2  # cosines, then sines of the same pairs: independent
    assert abs(np.corrcoef(z[:half], z[half + 1:])[0, 1]) < 6 / math.sqrt(half)
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 6 / math.sqrt(n)


@pytest.mark.parametrize("shape", [[], [0], [1], [7], [3, 5], [2, 3, 4]])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32, tf.float16])
def test_shapes_dtypes_seeds_and_the_reference(shape, dtype):
    seed = tf.constant([2 ** 40 + 1, -3], tf.int64)
    z = gaussian.normal(shape, seed, dtype)
    assert z.shape == tuple(shape) and z.dtype == dtype
    np.testing.assert_array_equal(z.numpy(), gaussian.normal(shape, seed, dtype).numpy())
    dynamic = tf.function(lambda s: gaussian.normal(s, seed, dtype))(tf.constant(shape,
                                                                                 tf.int32))
    np.testing.assert_array_equal(dynamic.numpy(), z.numpy())
    np.testing.assert_allclose(z.numpy().astype(np.float64),
                               ref.normal(shape, seed, dtype).astype(np.float64),
                               rtol=4 * float(np.finfo(dtype.as_numpy_dtype).eps),
                               atol=8 * float(np.finfo(dtype.as_numpy_dtype).eps))
    if int(np.prod(shape)) > 1:
        other = gaussian.normal(shape, seed + [0, 1], dtype).numpy()
        assert not np.array_equal(other, z.numpy())


def test_joint_draws_are_the_single_draws():
    seeds = [tf.constant([1, k], tf.int64) for k in range(4)]
    shapes = [[3, 3], [5], [1], [2, 7]]
    singles = [gaussian.normal(s, k).numpy() for s, k in zip(shapes, seeds)]
    for got, want in zip(gaussian.normals(shapes, seeds), singles):
        np.testing.assert_allclose(got.numpy(), want, rtol=4e-16, atol=1e-300)
    stacked = gaussian.stacked_normals([3, 3], seeds).numpy()
    for got, seed in zip(stacked, seeds):
        np.testing.assert_allclose(got, gaussian.normal([3, 3], seed).numpy(), rtol=4e-16,
                                   atol=1e-300)


def _graph_ops(graph):
    g = graph.as_graph_def()
    return {n.op for n in g.node} | {n.op for f in g.library.function for n in f.node_def}


def _step_ops(model, optimizer, x, y):
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.check_before_training(x, y)
    spec = [tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)),
            tf.TensorSpec([None], tf.as_dtype(y.dtype))]
    graph = tf.function(lambda a, b: model.train_step((a, b))).get_concrete_function(
        *spec).graph
    return _graph_ops(graph)


def test_no_private_step_draws_from_a_capped_tensorflow_normal():
    """The gradient noise, the adaptive clip's count noise and the JL directions (whole and
    on looked-up rows) all come from ``tf_dp.core.gaussian``; drawing any of them with
    ``tf.random.stateless_normal`` again fails this."""
    x = np.random.default_rng(0).random((8, 4), np.float32)
    y = np.arange(8) % 3
    exact = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)),
                                                       keras.layers.Dense(3)]))
    ops = _step_ops(exact, tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        adaptive_clipping=tf_dp.AdaptiveClipping()), x, y)
    assert "StatelessRandomUniformFullIntV2" in ops and not ops & _CAPPED_OPS, ops & _CAPPED_OPS
    ids = np.random.default_rng(1).integers(0, 20, (8, 5))
    text = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]))
    ops = _step_ops(text, tf_dp.DPAdamJL(l2_norm_clip=1.0, noise_multiplier=1.0,
                                         num_projections=2), ids.astype(np.int32), y)
    assert not ops & _CAPPED_OPS, ops & _CAPPED_OPS


@pytest.mark.slow
def test_tensorflows_own_normal_is_capped():
    """Why tf_dp does not use it (TF 2.21): 4e8 float64 draws never exceed 5.678, and pairs
    sit on that circle at the clamp's rate 1e-7 (expected 20). If TensorFlow drops the clamp,
    this fails: then its op could serve again."""
    radius2 = gaussian.TF_CLAMPED_RADIUS ** 2

    @tf.function
    def chunk(seed):
        z = tf.random.stateless_normal([50_000_000], seed=seed, dtype=tf.float64)
        r2 = tf.reduce_sum(tf.reshape(z, [-1, 2]) ** 2, 1)
        return tf.reduce_max(tf.abs(z)), tf.reduce_sum(tf.cast(tf.abs(r2 - radius2) < 1e-9,
                                                               tf.int64))

    largest, ring = 0.0, 0
    for k in range(8):
        m, c = chunk(tf.constant([k, 99], tf.int64))
        largest, ring = max(largest, float(m)), ring + int(c)
    assert largest <= gaussian.TF_CLAMPED_RADIUS + 1e-9
    assert ring >= 5  # Poisson(20): P(< 5) ~ 2e-5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
