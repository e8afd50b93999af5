"""``factors.joint_weighted_sums`` over chunks of examples against an extended-precision
reference: the float64 weighted sums of materialised gradients and of outer-product factors
(one loop for both), formed one chunk of examples at a time so that their float64 copies
never hold a whole batch (a batch not divisible by the chunk, one example, none, an unknown
batch). Also: the chunk size follows ``_SUM_CHUNK_BYTES``, and the loop is what runs."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core.ghost import factors as factors_lib
from tf_dp.core.ghost.factors import (FactorOptions, MaterialisedFactors, OuterFactors,
                                      joint_weighted_sums)

RNG = np.random.default_rng(7)
EXT = np.longdouble


def _inputs(batch, steps=2, d=256, p=130, n=6):
    a = RNG.normal(size=(batch, steps, d)).astype(np.float32) * 1e3
    g = RNG.normal(size=(batch, steps, p)).astype(np.float32)
    per = RNG.normal(size=(batch, n)).astype(np.float32)
    w1 = RNG.uniform(0.1, 1.0, size=batch)
    w2 = RNG.uniform(0.1, 1.0, size=batch)
    return a, g, per, w1, w2


class _Shaped:
    """A variable's stand-in: the factors read only its shape."""

    def __init__(self, shape):
        self.shape = tf.TensorShape(shape)


def _reference(a, g, per, w1, w2):
    outer = np.einsum("btd,btp->dp", a.astype(EXT) * w1.astype(EXT)[:, None, None],
                      g.astype(EXT))
    return per.astype(EXT).T @ w2.astype(EXT), outer


def _sums(a, g, per, w1, w2):
    opts = FactorOptions()  # exact norms: ghost Gram norms for d p > 32768, not materialised
    outer = OuterFactors(_Shaped([a.shape[2], g.shape[2]]), a, g, opts)
    assert outer.per is None and outer.sum_parts() is not None
    mat = MaterialisedFactors(_Shaped([per.shape[1]]), per, opts)
    return joint_weighted_sums([mat, outer], [w2, w1])


@pytest.mark.parametrize("batch", [0, 1, 3, 7, 9])
@pytest.mark.parametrize("traced", [False, True])
def test_chunked_sums_equal_the_exact_sums(monkeypatch, batch, traced):
    a, g, per, w1, w2 = _inputs(batch)
    # 3 examples per chunk: the outer factors' float64 copies are the larger, 8 T (d + p).
    monkeypatch.setattr(factors_lib, "_SUM_CHUNK_BYTES", 3 * 8 * 2 * (256 + 130))
    loops = []
    real_while = tf.while_loop

    def counting_while(*args, **kwargs):
        loops.append(1)
        return real_while(*args, **kwargs)

    monkeypatch.setattr(tf, "while_loop", counting_while)
    if traced:
        spec = lambda x: tf.TensorSpec([None, *x.shape[1:]], x.dtype)  # noqa: E731
        fn = tf.function(lambda *t: _sums(*t)).get_concrete_function(
            *(spec(tf.constant(x)) for x in (a, g, per, w1, w2)))
        got = fn(*(tf.constant(x) for x in (a, g, per, w1, w2)))
    else:
        got = _sums(*(tf.constant(x) for x in (a, g, per, w1, w2)))
    # Eager with a static batch of at most 3: one chunk, no loop; else the loop ran.
    assert bool(loops) == (traced or batch > 3)
    want = _reference(a, g, per, w1, w2)
    for x, y in zip(got, want):
        assert x.dtype == tf.float64
        np.testing.assert_allclose(x.numpy(), np.asarray(y, np.float64), rtol=1e-12,
                                   atol=1e-9)


def test_the_chunk_follows_the_largest_float64_copy_per_example(monkeypatch):
    a, g, per, w1, w2 = _inputs(10)
    seen = []
    real = factors_lib._chunked_sums

    def spy(looped, chunk, sanitize=None):
        seen.append(chunk)
        return real(looped, chunk, sanitize)

    monkeypatch.setattr(factors_lib, "_chunked_sums", spy)
    monkeypatch.setattr(factors_lib, "_SUM_CHUNK_BYTES", 4 * 8 * 2 * (256 + 130) + 7)
    _sums(*(tf.constant(x) for x in (a, g, per, w1, w2)))
    assert seen == [4]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
