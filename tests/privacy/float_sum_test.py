"""The sum over examples is formed in float64: one example cannot make the others round away.

A float32 sum is computed in some order, and each addition rounds to its partial sum's
precision. Another example's presence moves the partial sums, and so how the others' terms
round: Casacuberta, Shoemate, Vadhan and Wagaman, "Widespread underestimation of sensitivity
in differentially private libraries and how to fix it" (CCS 2022). Here, in every entry: half
of the batch are "big" examples whose partial sum ends just below a power of two 2^e, then
the target, then "small" examples of -0.49 ulp above 2^e (0.98 ulp below it). The target
is tiny, but it pushes the partial sum over 2^e, where every small term is absorbed. Without
the target each small term rounds to a whole ulp below 2^e. So with B = 2048 a target of
norm 3e-4 C moved the float32 sum by 0.063 C, 200 times its own size (session 15, measured on
this CPU, whose matrix-vector product adds the rows in order). No example is clipped and no
terms cancel. A target of norm exactly C, placed so that it lands the partial sum just above
2^e, moved the float32 sum by 1.062 C. In float64 the sum moves by the target's gradient (to
float64's rounding).

Each test also runs the attack with the sums switched back to float32 (``SUM_DTYPE``
monkeypatched), and checks that it is amplified there: the test would catch a revert.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core import private_step
from tf_dp.core.ghost import precision

_C = 2.0  # above every example's norm: nothing is clipped, the sums add the rows as given
_WIDTH = 64


def _attack_rows(batch):
    """(rows with the target, rows without it, the target's row): (B, width) float32."""
    big_count = batch // 2
    small_count = batch - big_count - 1
    e = np.floor(np.log2(big_count / np.sqrt(_WIDTH)))  # each big row has norm ~1
    big = np.float32(2.0**e * (1 - 8 * 2.0**-24) / big_count)
    partial = np.float32(0.0)
    for _ in range(big_count):  # the float32 partial sum of the big rows, in order
        partial = np.float32(partial + big)
    ulp_above = 2.0**(e - 23)
    target = np.float32(2.0**e - float(partial) + 2 * ulp_above)
    small = np.float32(-0.49 * ulp_above)
    rows = np.concatenate([np.full((big_count, _WIDTH), big, np.float32),
                           np.full((1, _WIDTH), target, np.float32),
                           np.full((small_count, _WIDTH), small, np.float32)])
    return rows, np.delete(rows, big_count, 0), rows[big_count].astype(np.float64)


def _dense_model():
    inp = keras.Input((1,))
    return keras.Model(inp, keras.layers.Dense(_WIDTH, use_bias=False)(inp))


def _linear_loss(y, pred, sample_weight):
    """The output gradient of example i is y_i: its kernel gradient is x_i y_i^T = y_i."""
    loss = tf.reduce_sum(pred * y, axis=-1)
    return loss if sample_weight is None else loss * sample_weight


def _model_sum(model, rows, strategy):
    x = tf.ones([len(rows), 1])
    res = private_step.clipped_sum(model, x, tf.constant(rows), tf.ones([len(rows)]),
                                   _linear_loss, _C, norm_strategy=strategy)
    return res.grads[0].numpy().astype(np.float64).ravel()


def _materialised_sum(rows):
    w = tf.ones([len(rows)], tf.float64)
    return precision.weighted_per_example_sum(w, tf.constant(rows)).numpy().astype(np.float64)


def _moved(sum_of, batch):
    with_target, without, target = _attack_rows(batch)
    return float(np.linalg.norm(sum_of(with_target) - sum_of(without))), target


@pytest.mark.parametrize("batch", [256, 2048])
def test_a_tiny_example_moves_the_materialised_sum_by_itself(batch, monkeypatch):
    moved, target = _moved(_materialised_sum, batch)
    assert moved == pytest.approx(np.linalg.norm(target), rel=1e-9, abs=1e-12 * _C)
    monkeypatch.setattr(precision, "SUM_DTYPE", tf.float32)
    moved32, _ = _moved(_materialised_sum, batch)
    assert moved32 > 10 * np.linalg.norm(target), (moved32, np.linalg.norm(target))


@pytest.mark.parametrize("strategy", ["vectorized"])
def test_a_tiny_example_moves_the_private_steps_sum_by_itself(strategy, monkeypatch):
    # Through the private step: a Dense kernel's per-example gradients (materialised) are the
    # attack's rows. (The ghost rule's float32 product of the same rows did not add them in
    # order on this CPU, so the attack as built does not show there; the ghost path's sum
    # from factors is pinned by jl_rounding_test's block-boundary case, 1.002 C in float32.)
    model = _dense_model()
    moved, target = _moved(lambda r: _model_sum(model, r, strategy), 2048)
    assert moved == pytest.approx(np.linalg.norm(target), rel=1e-9, abs=1e-12 * _C)
    assert moved < 1e-3 * _C
    monkeypatch.setattr(precision, "SUM_DTYPE", tf.float32)
    moved32, _ = _moved(lambda r: _model_sum(model, r, strategy), 2048)
    assert moved32 > 10 * np.linalg.norm(target), (moved32, np.linalg.norm(target))
    assert moved32 > 0.01 * _C  # in float32: 0.063 C from a target of 3e-4 C


def test_sums_reach_the_optimizer_in_float64_and_are_rounded_once_after_the_noise():
    # A float32 model's clipped sums stay float64 until the update: the optimizer adds the
    # (float64) noise and divides by the expected batch size before one cast. With sigma = 0
    # the update is the float64 sum / E rounded once. For this sum and E = 3 that differs
    # from rounding the sum to float32 first (0.33333364 vs 0.33333367).
    from tf_dp.optimizers import DPSGD  # noqa: PLC0415

    total, expected = 1.0000009127555773, 3.0
    once = np.float32(total * (1.0 / expected))
    assert once != np.float32(np.float32(total) * np.float32(1.0 / expected))
    variable = keras.Variable(np.zeros([1], np.float32))
    opt = DPSGD(1.0, 0.0, learning_rate=1.0)
    opt.apply_private([tf.constant([total], tf.float64)], [variable], expected)
    np.testing.assert_array_equal(variable.numpy(), -np.float32([once]))


def _linear_keras_loss(y, pred):
    return tf.reduce_sum(pred * y, axis=-1)


def _accumulated(rows):
    """The float64 sum of one logical batch of ``rows`` split into micro-batches of one
    example (``max_physical_batch_size=1``), as the private train step accumulates it."""
    from tf_dp.keras import make_private  # noqa: PLC0415
    from tf_dp.optimizers import DPSGD  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    model = make_private(_dense_model())
    model.compile(optimizer=DPSGD(_C, 0.0, learning_rate=1.0), loss=_linear_keras_loss)
    model.optimizer.build(model.trainable_variables)
    grads, _ = model._dp_accumulate(tf.ones([len(rows), 1]), tf.constant(rows), None,
                                    model.trainable_variables, 1, max_rows=1, clip=_C)
    return grads[0].numpy().astype(np.float64).ravel()


def test_micro_batches_are_accumulated_in_float64(monkeypatch):
    # The same attack over micro-batches of one example each: their sums are added to the
    # logical batch's in float64, so the target moves it by itself.
    moved, target = _moved(_accumulated, 256)
    assert moved == pytest.approx(np.linalg.norm(target), rel=1e-9, abs=1e-12 * _C)
    from tf_dp.core import ghost  # noqa: PLC0415

    monkeypatch.setattr(precision, "SUM_DTYPE", tf.float32)
    monkeypatch.setattr(ghost, "SUM_DTYPE", tf.float32)
    moved32, _ = _moved(_accumulated, 256)
    assert moved32 > 10 * np.linalg.norm(target), (moved32, np.linalg.norm(target))


def _full_size_attack(batch):
    """The attack with a target of norm exactly C (= 1), all of it in the attacked entries:
    the big rows end 2 ulps above 2^e minus the target, so that the target lands the partial
    sum just above 2^e. The rounding that the target's presence changes then adds to its own
    contribution. Returns (rows with the target, rows without it)."""
    width, big_count = 64, batch // 2
    target = np.float32(1.0 / np.sqrt(width))
    e = np.floor(np.log2(big_count / np.sqrt(width)))
    ulp_above = 2.0**(e - 23)
    goal = 2.0**e + 2 * ulp_above - float(target)
    big = np.float32(goal / big_count)
    partial = np.float32(0.0)
    for _ in range(big_count - 1):
        partial = np.float32(partial + big)
    last = np.float32(np.float32(goal) - partial)  # the big rows' partial sum is goal
    rows = np.concatenate([np.full((big_count - 1, width), big, np.float32),
                           np.full((1, width), last, np.float32),
                           np.full((1, width), target, np.float32),
                           np.full((batch - big_count - 1, width), -0.49 * ulp_above,
                                   np.float32)])
    return rows, np.delete(rows, big_count, 0)


def test_an_example_clipped_to_c_moves_the_sum_by_at_most_c(monkeypatch):
    # No row is above C = 1 (nothing is clipped; every row is a valid clipped gradient). In
    # float32 the target of norm C moved the sum of 2048 by 1.062 C.
    with_target, without = _full_size_attack(2048)
    assert np.linalg.norm(with_target, axis=1).max() <= 1.0

    def moved():
        return float(np.linalg.norm(_materialised_sum(with_target) - _materialised_sum(without)))

    assert moved() <= 1.0 + 1e-9
    monkeypatch.setattr(precision, "SUM_DTYPE", tf.float32)
    assert moved() > 1.05

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
