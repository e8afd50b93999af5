"""The cheaper exact-norm paths of issue 14 part 2 against float64 brute force: squared norms
of rows that overflow float32 (rescaled per row, no tf.cond), rank-one (Dense on (B, d))
norms, segment-sum embedding norms with repeated ids, and the traced step with an unknown
batch. Every bound must be at least the exact norm."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core.ghost import precision
from tf_dp.core.ghost.factors import FactorOptions, OuterFactors, _use_ghost

RNG = np.random.default_rng(14)


@pytest.mark.parametrize("traced", [False, True])
def test_squared_norms_rescale_only_the_rows_that_overflow(traced):
    x = RNG.normal(size=(5, 96)).astype(np.float32)
    x[1] *= 1e20  # squares overflow float32
    x[3, 7] = 3e38
    x[4] *= 1e-30  # tiny
    fn = precision.squared_norms
    if traced:
        fn = tf.function(fn, input_signature=[tf.TensorSpec([None, 96], tf.float32)])
    sq, upper = fn(tf.constant(x))
    exact = np.sum(np.square(x.astype(np.float64)), axis=1)
    # Squares below float32's smallest normal are flushed (the bound's absolute term).
    np.testing.assert_allclose(sq.numpy(), exact, rtol=1e-5, atol=96 * 2.0**-126)
    assert np.all(upper.numpy() >= exact)
    # Absolute term: n flushed products and two per block (a root's square flushed).
    assert np.all(upper.numpy() <= exact * (1 + 1e-5) + (96 + 2 * 3) * 2.0**-126)


def test_squared_norms_bound_rows_of_every_scale_and_near_the_flush_threshold():
    """Rows scaled over float32's whole range, rows whose block sums sit at its smallest
    normal (where a root's square can flush) and near its largest (where the square of a
    root can overflow): the bound holds against float64 sums; rows are summed in one pass
    per block (a EuclideanNorm reduction, no tensor of squares), whose two extra roundings
    the bound covers."""
    n, k = 4096, 32
    rows = [RNG.normal(size=n) * 10.0 ** e for e in range(-45, 19, 3)]
    for target in (2.0**-126, 2.0**-125, 3 * 2.0**-127):  # block sums at the flush edge
        block = np.abs(RNG.normal(size=k))
        block *= np.sqrt(target / np.sum(block ** 2))
        rows.append(np.tile(block, n // k))
    big = np.full(n, np.sqrt(np.float32(3.4e38) / k) * 0.99999)  # block sums near max
    rows.append(big)
    x = np.stack(rows).astype(np.float32)
    sq, upper = precision.squared_norms(tf.constant(x))
    exact = np.sum(np.square(x.astype(np.float64)), axis=1)
    assert np.all(upper.numpy() >= exact), np.flatnonzero(upper.numpy() < exact)
    assert np.all(np.isfinite(upper.numpy()))
    # The one-pass block sums: no Square op on a (B, n) tensor in the graph.
    graph = tf.function(precision.squared_norms).get_concrete_function(
        tf.TensorSpec([None, n], tf.float32)).graph
    ops = {op.type for op in graph.get_operations()}
    assert "EuclideanNorm" in ops
    squares = [op for op in graph.get_operations() if op.type == "Square"
               and op.outputs[0].shape.rank is not None and op.outputs[0].shape.rank >= 2
               and op.outputs[0].shape[-1] in (k, n)]
    assert not squares, [op.name for op in squares]



def test_squared_norms_compile_with_xla_and_keep_the_bound():
    """Under jit_compile (no EuclideanNorm kernel in XLA) the plain sum of squares is used;
    the bound still holds (fails if the one-pass reduction is used there: XLA refuses it)."""
    x = RNG.normal(size=(4, 256)).astype(np.float32)
    x[1] *= 1e-21
    x[2] *= 1e18
    sq, upper = tf.function(precision.squared_norms, jit_compile=True)(tf.constant(x))
    exact = np.sum(np.square(x.astype(np.float64)), axis=1)
    assert np.all(upper.numpy() >= exact)
    np.testing.assert_allclose(sq.numpy(), exact, rtol=1e-5, atol=256 * 2.0**-126)

def test_squared_norms_of_non_finite_rows_are_not_finite():
    x = RNG.normal(size=(3, 64)).astype(np.float32)
    x[0, 1], x[2, 5] = np.inf, np.nan
    sq, upper = precision.squared_norms(tf.constant(x))
    assert np.isinf(upper.numpy()[0]) and np.isnan(upper.numpy()[2])
    assert np.isfinite(upper.numpy()[1])


def test_rank_one_norms_are_exact_and_bound_the_product():
    a = RNG.normal(size=(7, 1, 9)).astype(np.float32)
    g = RNG.normal(size=(7, 1, 4)).astype(np.float32)
    a[2] *= 1e15
    g[2] *= 1e-12

    class V:
        shape = (9, 4)

    f = OuterFactors(V(), tf.constant(a), tf.constant(g), FactorOptions())
    per = np.einsum("btd,btp->bdp", a.astype(np.float64), g.astype(np.float64))
    exact = np.sqrt(np.sum(per ** 2, axis=(1, 2)))
    np.testing.assert_allclose(np.sqrt(f.sq.numpy()), exact, rtol=1e-12)
    assert np.all(f.bound.numpy() >= exact)
    w = RNG.uniform(size=7).astype(np.float32)
    np.testing.assert_allclose(f.weighted_sum(tf.constant(w)).numpy(),
                               np.einsum("b,bdp->dp", w, per), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [1, 6, 40])
def test_embedding_norms_by_segments_match_brute_force(steps):
    vocab, width, batch = 12, 5, 6
    ids = RNG.integers(0, vocab, size=(batch, steps)).astype(np.int32)
    ids[0] = 3  # one id repeated over the whole example
    g = RNG.normal(size=(batch, steps, width)).astype(np.float32)
    g[1] *= 1e20  # overflowing squares
    fn = tf.function(precision.embedding_norms,
                     input_signature=[tf.TensorSpec([None, steps], tf.int32),
                                      tf.TensorSpec([None, steps, width], tf.float32)])
    sq, bound, _ = fn(tf.constant(ids), tf.constant(g))
    dense = np.zeros((batch, vocab, width))
    for i in range(batch):
        np.add.at(dense[i], ids[i], g[i].astype(np.float64))
    exact = np.sum(dense ** 2, axis=(1, 2))
    np.testing.assert_allclose(sq.numpy(), exact, rtol=1e-5)
    assert np.all(bound.numpy() >= np.sqrt(exact))


def test_embedding_norms_of_an_empty_batch():
    sq, bound, _ = precision.embedding_norms(tf.zeros([0, 4], tf.int32),
                                             tf.zeros([0, 4, 3], tf.float32))
    assert sq.shape == (0,) and bound.shape == (0,)


def test_materialised_when_cheaper_and_small():
    def shapes(t, d, p):
        return tf.zeros([2, t, d]), tf.zeros([2, t, p])

    assert not _use_ghost(*shapes(25, 256, 32))  # the tutorial CNN's second convolution
    assert not _use_ghost(*shapes(64, 64, 128))  # a Transformer feed-forward layer
    assert _use_ghost(*shapes(16, 768, 768))  # few positions, a wide layer
    assert not _use_ghost(*shapes(196, 64, 16))  # T^2 > d*p, as before


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
