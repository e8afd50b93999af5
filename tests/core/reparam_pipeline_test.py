"""RGP / LSG layers through the private step: carriers clipped and noised, W rebuilt."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.core import build_per_example_loss, carrier_for, clipped_sum  # noqa: E402
from tf_dp.layers import reparametrize  # noqa: E402


def _plain(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(4)])


def _data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 4)).astype("float32")


def test_full_rank_rgp_step_equals_plain_sgd():
    # rank = min(m, n) with orthonormal carriers: the rebuilt gradient is dW itself
    # (Corollary 2.1.1), so with no clipping and no noise RGP is plain SGD.
    x, y = _data()

    def square():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                                 keras.layers.Dense(4)])

    plain = square()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model = square()
    rgp = reparametrize(model, rank=4, layers=[layer.name for layer in model.layers])
    assert len(tf_dp.layers.reparam_layers(rgp)) == 2
    np.testing.assert_allclose(rgp.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    private = tf_dp.keras.make_private(rgp)
    private.compile(optimizer=tf_dp.DPSGD(float("inf"), 0.0, learning_rate=0.1), loss="mse")
    for _ in range(3):
        plain.train_on_batch(x, y)
        private.fit(x, y, batch_size=len(x), epochs=1, verbose=0, poisson_sampling=False)
    np.testing.assert_allclose(private.predict(x, verbose=0), plain.predict(x, verbose=0),
                               rtol=1e-4, atol=1e-5)


def test_low_rank_update_lies_in_the_carrier_spaces():
    x, y = _data()
    model = tf_dp.keras.make_private(reparametrize(_plain(), rank=2))
    layer = tf_dp.layers.reparam_layers(model)[0]
    model.compile(optimizer=tf_dp.DPSGD(float("inf"), 0.0, learning_rate=0.1), loss="mse")
    before = layer.kernel.numpy().copy()
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0, poisson_sampling=False)
    left, right = [c.numpy() for c in layer.carrier_variables()]
    delta = layer.kernel.numpy() - before
    # delta = dL R + L dR - L L^T dL R: zero after projecting out both carrier spaces.
    p_left = np.eye(left.shape[0]) - left @ left.T
    p_right = np.eye(right.shape[1]) - right.T @ np.linalg.pinv(right.T)
    assert np.abs(delta).max() > 1e-4
    np.testing.assert_allclose(p_left @ delta @ p_right, 0.0, atol=1e-6)


def test_each_example_contribution_is_clipped_jointly_over_carriers_and_biases():
    x, y = _data(8)
    model = reparametrize(_plain(), rank=2)
    plan = carrier_for(model)
    kernels = {id(layer.kernel) for layer in plan.layers}
    assert not any(id(v) in kernels for v in plan.privatized)
    loss_fn = build_per_example_loss("mse")
    for i in range(8):
        res = clipped_sum(model, x[i:i + 1], y[i:i + 1], None, loss_fn, 0.01,
                          variables=plan.privatized)
        total = np.sqrt(sum(np.sum(np.square(g.numpy())) for g in res.grads))
        assert total <= 0.01 * (1 + 1e-5)
        assert total > 0.0099  # these examples all have norm above 0.01


class _MasksOnly(tf_dp.core.GradientCarrier):
    """A carrier over ``variables`` with given noise masks and no reconstruction."""

    def __init__(self, variables, masks):
        super().__init__(variables)
        self._masks = masks

    @property
    def noise_masks(self):
        return self._masks


def test_lsg_noise_only_on_unfrozen_carrier_entries():
    model = reparametrize(_plain(), rank=2, sparsity=0.5)
    plan = carrier_for(model)
    masks = [m for m in plan.noise_masks if m is not None]
    assert masks and any(float(tf.reduce_min(m)) == 0.0 for m in masks)
    opt = tf_dp.DPSGD(1.0, 1.0, learning_rate=1.0, seed=3)
    shadows = [tf.Variable(tf.zeros(v.shape)) for v in plan.privatized]
    opt.build(shadows)
    zeros = [tf.zeros(v.shape) for v in plan.privatized]
    opt.apply_private(zeros, shadows, 1.0, carrier=_MasksOnly(shadows, plan.noise_masks))
    for v, m in zip(shadows, plan.noise_masks):
        moved = np.abs(v.numpy()) > 0
        if m is None:
            assert moved.all()
        else:
            mask = np.broadcast_to(m.numpy(), v.shape) > 0
            np.testing.assert_array_equal(moved, mask)


def test_rgp_trains_privately_end_to_end():
    x, y = _data(256, seed=1)
    model = tf_dp.keras.make_private(reparametrize(_plain(), rank=2, sparsity=0.2))
    model.compile(optimizer=tf_dp.DPAdam(1.0, 0.5, learning_rate=0.02, seed=0), loss="mse")
    hist = model.fit(x, y, batch_size=64, epochs=6, verbose=0)
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert np.isfinite(hist.history["epsilon"][-1])


def _brute_norms_and_sums(model, loss_fn, x, y, variables, clip):
    per = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            tape.watch([v.value for v in variables])
            loss = tf.reduce_sum(loss_fn(y[i:i + 1], model(x[i:i + 1], training=True)))
        per.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(
            loss, [v.value for v in variables],
            unconnected_gradients=tf.UnconnectedGradients.ZERO)])
    norms = np.array([np.sqrt(sum(np.sum(np.square(g)) for g in p)) for p in per])
    w = np.minimum(1.0, clip / norms)
    sums = [sum(w[i] * per[i][j] for i in range(len(x))) for j in range(len(variables))]
    return norms, sums


@pytest.mark.parametrize("kind", ["dense_seq", "conv", "conv_then_dense"])
@pytest.mark.parametrize("sparsity", [None, 0.5])
@pytest.mark.parametrize("strategy", ["ghost", "vmap"])
def test_carrier_norms_and_sums_match_brute_force(kind, sparsity, strategy):
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(7)
    if kind == "dense_seq":
        plain = keras.Sequential([keras.Input((5, 6)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
        x = rng.normal(size=(4, 5, 6)).astype("float32")
    elif kind == "conv_then_dense":
        # Both layers reparametrized: the conv's carriers get their gradient through the
        # Dense rule's input gradient (x·sg(W) only, not the carrier path).
        plain = keras.Sequential([keras.Input((7, 7, 3)),
                                  keras.layers.Conv2D(6, 3, strides=2, padding="same",
                                                      activation="tanh"),
                                  keras.layers.Flatten(), keras.layers.Dense(5, activation="tanh"),
                                  keras.layers.Dense(3)])
        x = rng.normal(size=(4, 7, 7, 3)).astype("float32")
    else:
        plain = keras.Sequential([keras.Input((7, 7, 3)),
                                  keras.layers.Conv2D(6, 3, strides=2, padding="same",
                                                      activation="tanh"),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
        x = rng.normal(size=(4, 7, 7, 3)).astype("float32")
    chosen = [plain.layers[0].name] + ([plain.layers[2].name] if kind == "conv_then_dense" else [])
    model = reparametrize(plain, rank=2, sparsity=sparsity, layers=chosen)
    plan = carrier_for(model)
    y = rng.integers(0, 3, size=4)
    loss_fn = build_per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    want_norms, want_sums = _brute_norms_and_sums(model, loss_fn, x, y, plan.privatized, 0.3)
    res = clipped_sum(model, x, y, None, loss_fn, 0.3, variables=plan.privatized,
                      norm_strategy=strategy)
    np.testing.assert_allclose(res.norms.numpy(), want_norms, rtol=1e-5)
    for got, want in zip(res.grads, want_sums):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
