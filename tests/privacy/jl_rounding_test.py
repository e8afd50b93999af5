"""JL clip bounds cover the rounding of the sums they clip (session 14 audit).

A JL estimate M_i is formed from projections of example i's exact gradient; the clipped sum
adds whatever the sums make of it (float32 sums then, float64 since session 15). When an example's terms cancel (two time steps or
two tokens of one id with gradients +-Y), its exact gradient is 0 but its terms in the batch
sums are huge, and their rounding is all it adds. Before the fix:

* an Embedding (ghost factors, segment sum): the projection was the rounding of one product
  (M ~ 69 for terms of 1e10), so the clip factor let the target's terms through, and the
  segment sum lost the low bits of every other example's contribution to that row: 5 C;
* a Dense over two time steps (factors projected without materialising): 0.02 C;
* a layer without a ghost rule (then projected by forward-mode JVPs, summed by a weighted
  backward pass): the projections were exactly 0, clip factor 1, and the batch's backward
  sums absorbed every other example's gradient: 21 C (r = 1) and 41 C (r = 5).

Now clip bounds are kept at or above E_i / tau (E_i: the rounding bound of the sums,
``Factors.sum_slack``), weights without a ghost rule are projected and summed from the same
materialised gradients, and the accountant composes sqrt(r / X) + tau. Each case below
fails without its part of the fix.

A second round: the float32 product contracts its rows in blocks (512 here), so a target
whose cancelling steps straddle a block boundary absorbed other examples' terms (7 tau C);
ill-conditioned examples were then summed in float64 apart. The same mechanism left the exact
path a small excess (1.002 C). Every weighted sum is now formed in float64 (session 15): the
exact path's case adds at most C here, and tests/privacy/float_sum_test.py has the attack
without any cancellation.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.accounting import mechanisms
from tf_dp.core import norm_strategies, private_step
from tf_dp.core.ghost.factors import (FactorOptions, OuterFactors,
                                      _materialise_for_projection)

L = keras.layers
_C = 1.0
_OTHERS = 31


class _ScaleT(L.Layer):
    """``x * w`` over every time step: a weight no ghost rule covers."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


def _difference_of_steps(z):
    return z[:, 0] - z[:, 1]


def _model(kind):
    keras.utils.set_random_seed(0)
    if kind == "embedding":
        inp = keras.Input((2,), dtype="int32")
        h = L.Embedding(10, 4)(inp)
    else:
        inp = keras.Input((2, 128))
        h = L.Dense(128, use_bias=False)(inp) if kind == "dense" else _ScaleT()(inp)
    return keras.Model(inp, L.Lambda(_difference_of_steps)(h))


def _linear_loss(y, pred, sample_weight):
    loss = tf.reduce_sum(tf.reshape(pred * y, [tf.shape(y)[0], -1]), axis=-1)
    return loss if sample_weight is None else loss * sample_weight


def _batches(kind, big):
    """The others (each clipped to C, all adding to entry 0) and a target whose two steps
    (or two tokens of one id) cancel: its exact gradient is 0, its terms are +-big."""
    width = 4 if kind == "embedding" else 128
    if kind == "embedding":
        x = np.tile(np.array([[5, 0]], np.int32), (_OTHERS, 1))
        xt = np.array([[5, 5]], np.int32)
    else:
        x = np.zeros((_OTHERS, 2, width), np.float32)
        x[:, 0, 0] = 1.0
        xt = np.zeros((1, 2, width), np.float32)
        xt[0, :, 0] = big
    y = np.zeros((_OTHERS, width), np.float32)
    y[:, 0] = 1e3
    yt = np.zeros((1, width), np.float32)
    yt[0, 0] = big
    return (x, y), (np.concatenate([x, xt]), np.concatenate([y, yt]))


def _sum(model, x, y, r, seed):
    res = private_step.clipped_sum(
        model, tf.constant(x), tf.constant(y), tf.ones([len(x)]), _linear_loss, _C,
        norm_strategy="jl", num_projections=r, seed=tf.constant(seed, tf.int64))
    return np.concatenate([g.numpy().ravel() for g in res.grads])


@pytest.mark.parametrize("kind", ["embedding", "dense", "custom"])
@pytest.mark.parametrize("r", [1, 5])
def test_an_example_of_cancelling_terms_adds_at_most_tau_c(kind, r):
    model = _model(kind)
    worst = 0.0
    for big in (1e5, 1e10, 1e15):
        without, with_target = _batches(kind, big)
        for seed in ((123, 456), (7, 8), (2**40, 3)):
            change = _sum(model, *with_target, r, seed) - _sum(model, *without, r, seed)
            worst = max(worst, float(np.linalg.norm(change)))
    # The target's exact gradient is 0: the JL sensitivity C (0 / M + tau) allows tau C (a
    # few float32 roundings of the others' sums on top).
    assert worst <= 2 * mechanisms.JL_ROUNDING_SLACK * _C, worst


@pytest.mark.parametrize("r", [1, 5])
def test_a_target_split_over_two_blocks_of_the_product_absorbs_nothing(r):
    # The float32 product behind the weighted sum contracts the B*T rows in blocks (512
    # here): a target whose cancelling steps straddle a block boundary starts the second
    # block at -w Y^2, and the other examples' terms under half an ulp of that vanish for up
    # to a block. The per-example rounding bound assumes its terms added in a row, so the
    # allowance alone let it move the sum by 7 tau C (session 14 audit, T = 24, target at
    # index 21, steps 7 and 8: rows 511 and 512). Now ill-conditioned examples are summed in
    # float64 apart from the others.
    keras.utils.set_random_seed(0)
    steps, width, at = 24, 128, 21
    inp = keras.Input((steps, width))
    model = keras.Model(inp, L.Dense(width, use_bias=False)(inp))
    x = np.zeros((_OTHERS * 2 + 1, steps, width), np.float32)
    x[:, :, 0] = 1.0
    y = np.zeros((_OTHERS * 2 + 1, steps, width), np.float32)
    y[:, :, 0] = 0.45 * 2.0**-14  # under half an ulp of the target's partial sums
    x_without, y_without = np.delete(x, at, 0), np.delete(y, at, 0)
    worst = 0.0
    for big in (1e5, 1e10):
        x[at], y[at] = 0.0, 0.0
        x[at, 7:9, 0] = big
        y[at, 7, 0], y[at, 8, 0] = big, -big
        for seed in ((123, 456), (7, 8)):
            change = _sum(model, x, y, r, seed) - _sum(model, x_without, y_without, r, seed)
            worst = max(worst, float(np.linalg.norm(change)))
    assert worst <= 2 * mechanisms.JL_ROUNDING_SLACK * _C, worst


def test_exact_norms_across_a_block_boundary_add_at_most_c():
    # Session 14 measured 1.002 C here: exact norms bounded an example's rounding as if its
    # terms were added in a row, and the blocked float32 product let a target just below the
    # float64 threshold absorb other examples' bits across a block boundary. The weighted
    # sums are now formed in float64 (precision.SUM_DTYPE): what the target adds is its
    # clipped gradient, to float64's rounding.
    # Dense over T = 5 steps, d = p = 512 (Gram norms, sum from factors); the target's terms
    # +H and -H + delta (kappa = 270) on rows 511 and 512 of the product; 159 others with
    # negative terms under half a float32 ulp of its partial sum, in the same entry as its
    # gradient: losing them would add to its clipped contribution.
    keras.utils.set_random_seed(0)
    steps, width, n, at, kappa = 5, 512, 160, 102, 270.0
    inp = keras.Input((steps, width))
    model = keras.Model(inp, L.Dense(width, use_bias=False)(inp))
    big = 1000.0 * kappa
    worst = 0.0
    for s_rel in (0.3, 0.45, 0.9):
        small = s_rel * _C * kappa * 2.0**-24
        x = np.zeros((n, steps, width), np.float32)
        x[:, :, 0] = 1.0
        y = np.full((n, steps, width), 0.0, np.float32)
        y[:, :, 0] = -small
        x[at], y[at] = 0.0, 0.0
        x[at, 1:3, 0] = 1.0
        y[at, 1, 0], y[at, 2, 0] = big, -big + 2 * big / kappa
        sums = []
        for xs, ys in ((x, y), (np.delete(x, at, 0), np.delete(y, at, 0))):
            res = private_step.clipped_sum(model, tf.constant(xs), tf.constant(ys),
                                           tf.ones([len(xs)]), _linear_loss, _C,
                                           norm_strategy="auto")
            assert res.grads[0].dtype == tf.float64
            sums.append(res.grads[0].numpy())
        worst = max(worst, float(np.linalg.norm(sums[0] - sums[1])))
    assert worst <= _C * (1 + 1e-9), worst


def test_the_dense_case_takes_the_projected_factors_path():
    # The "dense" case must reach the factors the allowance is for (T = 2, d p = 16384 not
    # materialised), else the test above would not exercise it.
    a = tf.ones([1, 2, 128])
    assert not _materialise_for_projection(a, a, 1)
    f = OuterFactors(tf.Variable(tf.zeros([128, 128])), a, a,
                     FactorOptions(exact_norms=False, num_projections=1))
    assert f.per is None
    # The float64 sum of B T = 2 terms: gamma_5 * sum_t ||a_t|| ||g_t|| = gamma_5 * 2 * 128
    # (u = 2^-53), to the bound's slack
    assert float(f.sum_slack()[0]) == pytest.approx(5 * 2.0**-53 * 256, rel=1e-4)


def test_the_allowance_leaves_ordinary_examples_alone():
    # Ordinary examples: E_i / tau is far below M_i, so the JL step clips by M_i (the
    # estimate the JL accounting describes), whatever the path, raised only by the float64
    # rounding of the sums of gradients formed outright (1 + gamma_{2B+3}, u = 2^-53).
    rng = np.random.default_rng(3)
    for kind in ("embedding", "dense", "custom"):
        model = _model(kind)
        if kind == "embedding":
            x = rng.integers(0, 10, size=(16, 2)).astype(np.int32)
            # two equal ids cancel exactly here (z0 - z1): such an example is the attack
            # above, not an ordinary one
            x[:, 1] = (x[:, 0] + rng.integers(1, 10, size=16)) % 10
            width = 4
        else:
            x = rng.normal(size=(16, 2, 128)).astype(np.float32)
            width = 128
        y = rng.normal(size=(16, width)).astype(np.float32)
        strategy = norm_strategies.get("jl", 3)
        batch = norm_strategies._Batch(model, tf.constant(x), tf.constant(y), None,
                                       _linear_loss, model.trainable_variables, "error")
        _, bounds, norms, _, _ = strategy._factors_and_norms(batch,
                                                             tf.constant([5, 6], tf.int64))
        raised = norms.numpy() * (1.0 + (2 * 16 + 3) * 2.0**-53 / (1 - (2 * 16 + 3) * 2.0**-53))
        np.testing.assert_allclose(bounds.numpy(), raised, rtol=1e-15)
        assert np.all(bounds.numpy() >= norms.numpy())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
