"""GradientGeometry on a tiny private model: its logs against NumPy on the same gradients."""

import logging
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp import analysis


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6, 6, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int64")
    return x, y


def _model():
    model = tf_dp.keras.DPSequential([
        keras.Input((6, 6, 1)),
        keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.Flatten(name="flat"),
        keras.layers.Dense(5, activation="tanh", name="hidden"),
        keras.layers.Dense(2, name="logits"),
    ])
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.5,
                                        learning_rate=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_fit_logs_stable_rank_and_residuals_that_match_numpy(caplog):
    x, y = _data()
    model = _model()
    start = {name: model.get_layer(name).kernel.numpy().copy()
             for name in ("conv", "hidden", "logits")}
    callback = analysis.GradientGeometry(x[:32], y[:32], ranks=(1, 2))
    with caplog.at_level(logging.WARNING, logger="tf_dp"):
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    assert sum("NOT covered" in r.getMessage() for r in caplog.records) == 1  # one warning
    # Session 22 audit: the logs are named in the privacy report too (not voiding: the
    # model is unaffected; its analysis batch here is training data, so the logs are not).
    (noted,) = [c for c in model.privacy_caveats if c.startswith("ANALYSIS_LOGS")]
    assert "GradientGeometry" in noted and "outside epsilon" in noted
    assert model.privacy_report()["guarantee_holds"] is True
    logs = history.history
    for name in ("conv", "hidden", "logits"):
        assert len(logs[f"stable_rank/{name}"]) == 2
        assert len(logs[f"residual_history_r2/{name}"]) == 2
        assert len(logs[f"residual_random_r1/{name}"]) == 2
    assert "residual_history_r2/logits" in logs  # r = 2 = min(5, 2) is measured

    # Recompute the last epoch's values by hand from the weights fit left.
    with tf.GradientTape() as tape:
        logits = model(x[:32], training=False)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y[:32], logits, from_logits=True))
    layers = [model.get_layer(n) for n in ("conv", "hidden", "logits")]
    grads = tape.gradient(loss, [layer.kernel for layer in layers])
    for layer, g in zip(layers, grads):
        g = g.numpy().reshape(-1, g.shape[-1]).astype(np.float64)
        s = np.linalg.svd(g, compute_uv=False)
        assert logs[f"stable_rank/{layer.name}"][-1] == pytest.approx(
            np.sum(s**2) / s[0] ** 2, rel=1e-4)
        h = (layer.kernel.numpy() - start[layer.name]).reshape(g.shape)
        u, _, vt = np.linalg.svd(h)
        for r in (1, 2):
            p_l, p_r = u[:, :r] @ u[:, :r].T, vt[:r].T @ vt[:r]
            outside = (np.eye(len(p_l)) - p_l) @ g @ (np.eye(len(p_r)) - p_r)
            assert logs[f"residual_history_r{r}/{layer.name}"][-1] == pytest.approx(
                np.linalg.norm(outside) / np.linalg.norm(g), rel=1e-3, abs=1e-6)
        assert 0 <= logs[f"residual_random_r1/{layer.name}"][-1] <= 1


def test_chosen_layers_and_bad_arguments():
    x, y = _data(16)
    model = _model()
    callback = analysis.GradientGeometry(x, y, layers=["hidden"], ranks=3)
    callback.set_model(model)
    callback.on_train_begin()
    values = callback.measure()
    assert sorted(values) == ["residual_history_r3/hidden", "residual_random_r3/hidden",
                              "stable_rank/hidden"]
    assert np.isnan(values["residual_history_r3/hidden"])  # no update since W0 yet
    with pytest.raises(ValueError, match="`ranks` must be an integer >= 1"):
        analysis.GradientGeometry(x, y, ranks=0)
    with pytest.raises(ValueError, match="`ranks`"):
        analysis.GradientGeometry(x, y, ranks="a")
    with pytest.raises(ValueError, match="`random_draws` must be an integer >= 1, got 0"):
        analysis.GradientGeometry(x, y, random_draws=0)
    with pytest.raises(ValueError, match="`x` and `y`"):
        analysis.GradientGeometry(x, None)
    bad = analysis.GradientGeometry(x, y, layers=["flat"])
    bad.set_model(model)
    with pytest.raises(ValueError, match="`layers` entry 'flat' has no kernel"):
        bad.on_train_begin()
    missing = analysis.GradientGeometry(x, y, layers=["nope"])
    missing.set_model(model)
    with pytest.raises(ValueError, match="`layers` entry 'nope' is not a layer"):
        missing.on_train_begin()


@pytest.mark.parametrize("sparsity", [None, 0.5])
def test_reparametrized_layers_are_measured_at_their_effective_weight(sparsity):
    # RGP/LSG layers' kernels enter the forward pass as stop_gradient(W): the callback must
    # still measure the full dloss/dW, i.e. exactly the plain model's gradient at the same W.
    x, y = _data(32)
    plain = keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.Flatten(), keras.layers.Dense(5, activation="tanh", name="hidden"),
        keras.layers.Dense(2, name="logits")])
    rgp = tf_dp.layers.reparametrize(plain, rank=1, sparsity=sparsity)
    assert {type(rgp.get_layer(n)).__name__ for n in ("conv", "hidden", "logits")} == {
        "ReparamConv2D", "ReparamDense"}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model in (plain, rgp):
        model.compile(optimizer="sgd", loss=loss)
    # Training still sees no kernel gradient (only the carriers get one).
    with tf.GradientTape() as tape:
        out = loss(y, rgp(x))
    assert tape.gradient(out, rgp.get_layer("hidden").kernel) is None

    measured = {}
    for model in (plain, rgp):
        callback = analysis.GradientGeometry(x, y, ranks=(1,))
        callback.set_model(model)
        callback.on_train_begin()
        measured[model] = (callback.measure(), callback._gradients())
    (plain_logs, plain_grads), (rgp_logs, rgp_grads) = measured[plain], measured[rgp]
    assert sorted(plain_logs) == sorted(rgp_logs)
    for g_plain, g_rgp in zip(plain_grads, rgp_grads):
        np.testing.assert_allclose(g_rgp, g_plain, rtol=1e-5, atol=1e-7)
        assert np.any(g_rgp)
    for key in plain_logs:
        if key.startswith("stable_rank"):
            assert rgp_logs[key] == pytest.approx(plain_logs[key], rel=1e-4)
    # The analysis switch is off again, and refused inside a trace.
    with tf.GradientTape() as tape:
        out = loss(y, rgp(x))
    assert tape.gradient(out, rgp.get_layer("hidden").kernel) is None
    from tf_dp.layers._reparam_layer import kernel_gradients

    @tf.function
    def traced():
        with kernel_gradients([rgp.get_layer("hidden")]):
            return rgp(x)
    with pytest.raises(RuntimeError, match="eager analysis code only"):
        traced()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
