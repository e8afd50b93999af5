"""``precision.gram_norms`` over chunks of examples against brute force in extended precision:
the float64 Gram matrices of one chunk at a time (a batch not divisible by the chunk, one
example, none, an unknown batch), and ``l1 = sum_t ||a_t|| ||g_t||`` from float32 row norms,
whose bound must stay above the exact value (factors from 1e-40 to 1e30, squares that round
down, near-cancelling sums over positions). Every returned bound must be at least the exact
norm of ``sum_t a_t g_t^T``."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tests import _reference as ref
from tf_dp.core.ghost import precision
from tf_dp.core.ghost.factors import FactorOptions, OuterFactors, _use_ghost

RNG = np.random.default_rng(41)
EXT = np.longdouble  # 64-bit significand on x86: the references' own rounding is ~1e-19


def _exact(a, g):
    """(||sum_t a_t g_t^T||^2, sum_t ||a_t|| ||g_t||) per example, in extended precision."""
    a, g = a.astype(EXT), g.astype(EXT)
    per = np.einsum("btd,btp->bdp", a, g)
    l1 = np.sum(np.sqrt(np.sum(a * a, -1)) * np.sqrt(np.sum(g * g, -1)), axis=1)
    return np.sum(per * per, axis=(1, 2)), l1


def _chunk_of(examples, steps, d, p):
    """A ``_GRAM_CHUNK_BYTES`` that makes chunks of ``examples`` examples."""
    return examples * (8 * steps * (d + p) + 24 * steps * steps)


def _check_bounds(a, g, out):
    sq, upper, l1 = (o.numpy() for o in out)
    true_sq, true_l1 = _exact(a, g)
    assert np.all(l1 >= true_l1), (l1 - true_l1)[l1 < true_l1]
    assert np.all(upper >= true_sq), (upper - true_sq)[upper < true_sq]
    assert np.all(np.sqrt(upper) >= np.sqrt(true_sq))
    assert np.all((sq >= 0) & (sq <= upper))
    return sq, upper, l1, true_sq, true_l1


def _factors(batch, steps, d, p):
    return (RNG.normal(size=(batch, steps, d)).astype(np.float32),
            RNG.normal(size=(batch, steps, p)).astype(np.float32))


@pytest.mark.parametrize("batch", [0, 1, 3, 7, 9])
@pytest.mark.parametrize("signature", ["static", "unknown_batch", "unknown_steps"])
def test_chunked_equals_unchunked_and_brute_force(monkeypatch, batch, signature):
    steps, d, p = 5, 12, 7
    a, g = _factors(batch, steps, d, p)
    whole = precision.gram_norms(tf.constant(a), tf.constant(g))  # one chunk: the default
    monkeypatch.setattr(precision, "_GRAM_CHUNK_BYTES", _chunk_of(3, steps, d, p))
    assert precision._gram_chunk_examples(steps, d, p) == 3
    fn = precision.gram_norms
    if signature != "static":
        t = None if signature == "unknown_steps" else steps
        fn = tf.function(fn, input_signature=[tf.TensorSpec([None, t, d], tf.float32),
                                              tf.TensorSpec([None, t, p], tf.float32)])
    chunked = fn(tf.constant(a), tf.constant(g))
    for x, y in zip(whole, chunked):
        assert y.shape == (batch,)
        np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-14, atol=0)
    sq, upper, l1, true_sq, true_l1 = _check_bounds(a, g, chunked)
    # The estimate is the float64 Gram form's, off by at most gamma l1^2; l1 by float32's
    # widening, ~gamma_d(float32) / 2.
    np.testing.assert_allclose(sq, true_sq, rtol=0, atol=1e-12 * float(np.max(l1, initial=0)) ** 2)
    np.testing.assert_allclose(l1, true_l1, rtol=2 * precision.gamma(d, tf.float32))


def test_only_one_chunk_is_formed_at_a_time_in_the_loop(monkeypatch):
    # A batch of 200 in chunks of 16 (12 in the loop, 8 after it), traced with an unknown
    # batch: the same numbers as one chunk.
    steps, d, p = 4, 16, 8
    a, g = _factors(200, steps, d, p)
    whole = precision.gram_norms(tf.constant(a), tf.constant(g))
    monkeypatch.setattr(precision, "_GRAM_CHUNK_BYTES", _chunk_of(16, steps, d, p))
    fn = tf.function(precision.gram_norms,
                     input_signature=[tf.TensorSpec([None, steps, d], tf.float32),
                                      tf.TensorSpec([None, steps, p], tf.float32)])
    graph = fn.get_concrete_function().graph.as_graph_def()
    body = [f for f in graph.library.function if "body" in f.signature.name]
    assert body, "no loop over chunks"
    chunked = fn(tf.constant(a), tf.constant(g))
    for x, y in zip(whole, chunked):
        np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-14, atol=0)
    _check_bounds(a, g, chunked)


def test_adversarial_magnitudes_and_cancellation(monkeypatch):
    steps, d, p = 6, 40, 24
    a, g = _factors(11, steps, d, p)
    # Rows from 1e-40 (subnormal in float32) to 1e30 (squares overflow float32) and examples
    # whose terms are far larger than their sum.
    a *= (10.0 ** RNG.uniform(-30, 30, size=(11, steps, 1))).astype(np.float32)
    g *= (10.0 ** RNG.uniform(-30, 30, size=(11, steps, 1))).astype(np.float32)
    a[0, 2] = 1e-40 * np.sign(a[0, 2])
    a[1] = 1e-30 * RNG.normal(size=(steps, d))
    g[1] = 1e30 * RNG.normal(size=(steps, p))
    a[2] = 3e38 * np.sign(RNG.normal(size=(steps, d)))
    a[3, 1] = 0.0  # a zero row
    g[3, 4] = 0.0
    for i in (4, 5):  # a_0 g_0^T + a_1 g_1^T nearly cancel: a_1 = a_0, g_1 = -g_0 (1 + eps)
        a[i] = RNG.normal(size=(steps, d))
        g[i] = RNG.normal(size=(steps, p))
        a[i, 1::2] = a[i, 0::2]
        g[i, 1::2] = -g[i, 0::2] * np.float32(1 + 2**-20 * (i - 3))
    a[6] = a[4] * np.float32(1e25)
    g[6] = g[4] * np.float32(1e-25)
    monkeypatch.setattr(precision, "_GRAM_CHUNK_BYTES", _chunk_of(4, steps, d, p))
    out = precision.gram_norms(tf.constant(a), tf.constant(g))
    sq, upper, l1, true_sq, true_l1 = _check_bounds(a, g, out)
    assert np.all(np.isfinite(upper[:2])) and np.all(np.isfinite(upper[3:]))
    # Tight where the squares are float32 numbers; within sqrt(d) where they overflow or
    # flush (there the largest entry bounds the row).
    def representable(x):
        top = np.max(np.abs(x), axis=-1)
        return np.all((top == 0) | ((top > 2.0**-40) & (top < 2.0**40)), axis=1)

    normal = representable(a) & representable(g)
    assert 2 <= np.sum(normal) <= 9
    np.testing.assert_allclose(l1[normal], true_l1[normal], rtol=1e-4)
    # Everywhere, l1 is no looser than its documented form: per row the smaller of
    # sqrt((||x||^2 + 5 n lam)(1 + gamma)) (not when the sum of squares overflows) and
    # sqrt(n) max(max |x_i|, lam), lam = 2^-126 (rows below float32's normals are floored
    # there; `true_l1 * sqrt(max(d, p))` failed for some draws of the data through it).
    assert np.all(l1 <= np.sum(_row_cap(a) * _row_cap(g), axis=1) * (1 + 1e-5))
    # The cancelling examples: the bound is still above the (tiny) exact norm.
    assert np.all(true_sq[4:6] < 1e-6 * true_l1[4:6].astype(np.float64) ** 2)


def _row_cap(x):
    """The largest row bound ``precision._row_norm_bounds`` may return (up to 1e-5), (B, T)."""
    x = x.astype(EXT)
    n, lam = x.shape[-1], EXT(2.0**-126)
    top = np.max(np.abs(x), axis=-1)
    by_max = np.sqrt(EXT(n)) * np.maximum(top, lam)
    by_sum = np.sqrt((np.sum(x * x, axis=-1) + 5 * n * lam) * (1 + EXT(1e-5)))
    # the float32 sum of squares overflows (or may: a margin below float32's largest number)
    overflow = np.sum(x * x, axis=-1) > EXT(3.0e38)
    return np.where(overflow, by_max, np.minimum(by_sum, by_max))


def test_l1_bound_covers_squares_that_round_down():
    # (1 + 2^-12)^2 and (1/2 + 2^-13)^2 round down in float32 (ties to even): the float32
    # sums of squares are below the exact ones, so l1 must be widened to stay above it.
    steps, d = 8, 512
    row = np.where(np.arange(d) % 2 == 0, 1 + 2.0**-12, 0.5 + 2.0**-13).astype(np.float32)
    a = np.broadcast_to(row, (3, steps, d)).copy()
    g = np.broadcast_to(row[:256], (3, steps, 256)).copy()
    _check_bounds(a, g, precision.gram_norms(tf.constant(a), tf.constant(g)))


def test_l1_bound_covers_the_float64_rounding_of_row_norms():
    # Rows of +-1: ||a_t|| = sqrt(3) exactly, its float64 value is below it (and so is
    # fl(sqrt 3)^2 < 3): l1 = 3T exactly, and the computed bound must not fall below it.
    steps = 7
    a = np.sign(RNG.normal(size=(4, steps, 3))).astype(np.float32)
    g = np.sign(RNG.normal(size=(4, steps, 3))).astype(np.float32)
    _, _, l1 = precision.gram_norms(tf.constant(a), tf.constant(g))
    assert np.all(l1.numpy() >= 3 * steps)


def test_l1_bound_over_many_random_examples(monkeypatch):
    # Float32 rounding of the row norms goes either way: over 256 examples some fall below
    # the exact value unless the bound is widened.
    steps, d, p = 8, 700, 300
    a, g = _factors(256, steps, d, p)
    monkeypatch.setattr(precision, "_GRAM_CHUNK_BYTES", _chunk_of(48, steps, d, p))
    _check_bounds(a, g, precision.gram_norms(tf.constant(a), tf.constant(g)))


def test_float64_factors():
    # (Magnitudes whose squared norms float64 can hold: beyond, the Gram form overflows.)
    steps, d, p = 5, 30, 20
    a = RNG.normal(size=(9, steps, d)) * 10.0 ** RNG.uniform(-60, 60, size=(9, steps, 1))
    g = RNG.normal(size=(9, steps, p)) * 10.0 ** RNG.uniform(-60, 60, size=(9, steps, 1))
    _check_bounds(a, g, precision.gram_norms(tf.constant(a), tf.constant(g)))


def test_non_finite_factors_give_non_finite_bounds():
    a, g = _factors(3, 4, 6, 5)
    a[0, 1, 2], g[2, 3, 1] = np.inf, np.nan
    _, upper, l1 = precision.gram_norms(tf.constant(a), tf.constant(g))
    assert not np.isfinite(upper.numpy()[0]) and not np.isfinite(upper.numpy()[2])
    assert not np.isfinite(l1.numpy()[0]) and np.isnan(l1.numpy()[2])
    assert np.isfinite(upper.numpy()[1])


def test_outer_factors_bound_with_chunked_gram_norms(monkeypatch):
    # The exact-norm path of a Gram-norm layer (ill-conditioned examples included) through
    # the chunked norms: every example's bound is above its exact per-example gradient norm.
    steps, d, p = 4, 64, 64
    a, g = _factors(10, steps, d, p)
    a[3, 1], g[3, 1] = a[3, 0], -g[3, 0] * np.float32(1 + 2**-18)  # near-cancelling
    a[3, 2:], g[3, 2:] = 0.0, 0.0
    a[5] *= np.float32(1e20)
    assert _use_ghost(tf.constant(a), tf.constant(g))
    monkeypatch.setattr(precision, "_GRAM_CHUNK_BYTES", _chunk_of(3, steps, d, p))

    class V:
        shape = (d, p)

    f = OuterFactors(V(), tf.constant(a), tf.constant(g), FactorOptions())
    true_sq, _ = _exact(a, g)
    assert np.all(f.bound.numpy() >= np.sqrt(true_sq))
    np.testing.assert_allclose(f.sq.numpy(), true_sq.astype(np.float64), rtol=1e-6,
                               atol=1e-30)


def test_ill_conditioned_examples_get_their_own_exact_norms_traced():
    # Several near-cancelling examples at scattered positions (batch unknown, traced): each
    # gets the norm of its own float64 matrix (precision.exact_outer_norms, on the gathered
    # examples), the others the Gram form's; every bound above the exact norm.
    steps, d, p = 4, 64, 64
    a, g = _factors(9, steps, d, p)
    for i, eps in ((1, 2**-18), (4, 2**-16), (8, 2**-20)):
        a[i, 1], g[i, 1] = a[i, 0], -g[i, 0] * np.float32(1 + eps)
        a[i, 2:], g[i, 2:] = 0.0, 0.0
    assert _use_ghost(tf.constant(a), tf.constant(g))

    class V:
        shape = (d, p)

    @tf.function(input_signature=[tf.TensorSpec([None, steps, d]),
                                  tf.TensorSpec([None, steps, p])])
    def norms(x, y):
        f = OuterFactors(V(), x, y, FactorOptions())
        return f.sq, f.bound, f.wide

    sq, bound, wide = (t.numpy() for t in norms(tf.constant(a), tf.constant(g)))
    assert sorted(np.flatnonzero(wide)) == [1, 4, 8]
    true_sq, _ = _exact(a, g)
    assert np.all(bound >= np.sqrt(true_sq))
    np.testing.assert_allclose(sq, true_sq.astype(np.float64), rtol=1e-6, atol=1e-30)
    # the exact norms are what make the cancelling ones accurate to 1e-6: the Gram form
    # is off by more (6e-6 and 2e-4 of them here)
    gram_sq, _, _ = precision.gram_norms(tf.constant(a), tf.constant(g))
    assert np.all(np.abs(gram_sq.numpy()[[1, 8]] - true_sq[[1, 8]]) > 2e-6 * true_sq[[1, 8]])


class _Var:
    def __init__(self, d, p):
        self.shape = (d, p)


# (steps, d, p) of three weights of one step: different chunk sizes
_JOINT_SHAPES = [(4, 64, 48), (4, 96, 64), (3, 80, 64)]


@pytest.mark.parametrize("batch", [0, 1, 7, 10])
def test_joint_gram_norms_are_each_weights_own(monkeypatch, batch):
    # One loop for every weight (chunks of the smallest chunk size, here 2 of 3 and 5
    # examples), batch unknown: per weight, the numbers of gram_norms alone (one chunk).
    pairs = [_factors(batch, t, d, p) for t, d, p in _JOINT_SHAPES]
    alone = [precision.gram_norms(tf.constant(a), tf.constant(g)) for a, g in pairs]
    sizes = {(t, d, p): c for (t, d, p), c in zip(_JOINT_SHAPES, (3, 2, 5))}
    monkeypatch.setattr(precision, "_gram_chunk_examples", lambda t, d, p: sizes[(t, d, p)])
    spec = [tf.TensorSpec([None, t, d]) for t, d, _ in _JOINT_SHAPES] + [
        tf.TensorSpec([None, t, p]) for t, _, p in _JOINT_SHAPES]

    @tf.function(input_signature=spec)
    def joint(*args):
        k = len(_JOINT_SHAPES)
        return precision.joint_gram_norms(list(zip(args[:k], args[k:])))

    got = joint(*[tf.constant(a) for a, _ in pairs], *[tf.constant(g) for _, g in pairs])
    graph = joint.get_concrete_function().graph
    assert [op.type for op in graph.get_operations()].count("StatelessWhile") == 1
    for (a, g), want, out in zip(pairs, alone, got):
        for x, y in zip(want, out):
            assert y.shape == (batch,)
            np.testing.assert_allclose(y.numpy(), x.numpy(), rtol=1e-14, atol=0)
        _check_bounds(a, g, out)


def test_joint_gram_sums_form_one_weight_after_the_other():
    # Inside the loop, each weight's float64 copies are made after the previous weight's
    # sums exist (one weight's copies of one chunk at a time).
    out = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3, 4])] * 3)
    def run(x, y, z):
        out.extend(precision._in_order([lambda v=v: precision._gram_sums(v, v)
                                        for v in (x, y, z)]))
        return out[-1]

    graph = run.get_concrete_function().graph
    ops = [graph.get_operation_by_name(t.op.name) for t in out]
    casts = [[o for o in graph.get_operations() if o.type == "Cast"
              and o.inputs[0].op.type == "Placeholder" and o.inputs[0].op.name == n]
             for n in ("x", "y", "z")]
    for k in (1, 2):
        assert all(ops[k - 1] in ref.ancestor_ops(c) for c in casts[k]), k
    assert not any(ops[1] in ref.ancestor_ops(c) for c in casts[0])


def test_joint_exact_norms_of_ill_conditioned_examples_across_weights():
    # Three weights read together (combined_norms: one Gram loop and one loop over the
    # ill-conditioned examples for all), with 0, 1 and 3 near-cancelling examples: each
    # example's norm is its own float64 matrix's, every bound above the exact norm, each
    # weight's numbers those of the weight read alone.
    from tf_dp.core.ghost.factors import combined_norms

    batch = 8
    pairs = [_factors(batch, t, d, p) for t, d, p in _JOINT_SHAPES]
    for k, bad in ((1, [5]), (2, [0, 3, 7])):
        a, g = pairs[k]
        for i in bad:
            a[i, 1], g[i, 1] = a[i, 0], -g[i, 0] * np.float32(1 + 2**-18)
            a[i, 2:], g[i, 2:] = 0.0, 0.0
    for a, g in pairs:
        assert _use_ghost(tf.constant(a), tf.constant(g))
    spec = [tf.TensorSpec([None, t, d]) for t, d, _ in _JOINT_SHAPES] + [
        tf.TensorSpec([None, t, p]) for t, _, p in _JOINT_SHAPES]
    k = len(_JOINT_SHAPES)

    def factors(args):
        return [OuterFactors(_Var(d, p), x, y, FactorOptions())
                for (_, d, p), x, y in zip(_JOINT_SHAPES, args[:k], args[k:])]

    @tf.function(input_signature=spec)
    def together(*args):
        fs = factors(args)
        combined_norms(fs, args[0][:, 0, 0])
        return [(f.sq, f.bound, f.wide) for f in fs]

    @tf.function(input_signature=spec)
    def alone(*args):
        return [(f.sq, f.bound, f.wide) for f in factors(args)]  # each formed on its own

    inputs = [tf.constant(a) for a, _ in pairs] + [tf.constant(g) for _, g in pairs]
    got, want = together(*inputs), alone(*inputs)
    loops = [op.type for op in together.get_concrete_function().graph.get_operations()]
    assert loops.count("StatelessWhile") == 2, loops.count("StatelessWhile")
    for (a, g), (sq, bound, wide), (sq1, bound1, wide1), bad in zip(pairs, got, want,
                                                                     ([], [5], [0, 3, 7])):
        assert sorted(np.flatnonzero(wide.numpy())) == bad
        true_sq, _ = _exact(a, g)
        assert np.all(bound.numpy() >= np.sqrt(true_sq))
        np.testing.assert_allclose(sq.numpy(), true_sq.astype(np.float64), rtol=1e-6,
                                   atol=1e-30)
        np.testing.assert_array_equal(sq.numpy(), sq1.numpy())
        np.testing.assert_array_equal(bound.numpy(), bound1.numpy())
        np.testing.assert_array_equal(wide.numpy(), wide1.numpy())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
