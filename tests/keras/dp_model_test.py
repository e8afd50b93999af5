"""Private Keras models: make_private on every model kind, losses, sample weights, metrics,
saving, validation, the Poisson note, and loud failures (invariant 4: never silent).

Expected updates are computed by hand from per-example gradients of a plain twin model
(one GradientTape per example), never from tf_dp's own output.
"""

import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core import build_per_example_loss, clipped_sum
from tf_dp.keras import DPModel, DPSequential, make_private
from tf_dp.optimizers import DPSGD, DPAdam, DPAdamW

_FIXED = "ignore:tf_dp. training on a dataset of fixed"


def _set_weights(model, seed, scale=0.5):
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, scale, size=w.shape).astype("float32")
                       for w in model.weights])
    return model


def _sequential(seed=0, in_dim=4):
    return _set_weights(keras.Sequential([
        keras.Input((in_dim,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ]), seed)


def _functional(seed=0, in_dim=4):
    inputs = keras.Input((in_dim,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return _set_weights(keras.Model(inputs, keras.layers.Dense(1)(hidden)), seed)


class SubclassedRegressor(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.hidden(x))


def _subclassed(seed=0, in_dim=4):
    model = SubclassedRegressor()
    model(np.zeros((1, in_dim), np.float32))
    return _set_weights(model, seed)


def _regression(n=64, in_dim=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype("float32")
    y = (x @ rng.normal(size=(in_dim, 1)) * 0.5).astype("float32")
    return x, y


def _norm(arrays):
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays))


def _tape_grad(model, loss_fn, xi, yi):
    with tf.GradientTape() as tape:
        loss = loss_fn(yi[None], model(xi[None], training=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


# ------------------------------------------------------------------ every kind of model trains


@pytest.mark.parametrize("build", [_sequential, _functional, _subclassed],
                         ids=["sequential", "functional", "subclassed"])
def test_make_private_trains_every_model_kind(build):
    x, y = _regression()
    model = make_private(build())
    assert hasattr(model, "train_step")
    model.compile(optimizer=DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1,
                                  seed=1), loss="mse")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=16, epochs=4, verbose=0)  # Poisson sampling, 4 steps / epoch
    after = model.evaluate(x, y, verbose=0)
    assert after < 0.5 * before, (before, after)


def test_make_private_shares_the_weights_of_sequential_and_functional_models():
    for build, cls in [(_sequential, DPSequential), (_functional, DPModel)]:
        plain = build()
        private = make_private(plain)
        assert isinstance(private, cls)
        assert [id(v) for v in private.trainable_variables] == [
            id(v) for v in plain.trainable_variables]


# ------------------------------------------------------------------ losses


def _seq_mse(y_true, y_pred):  # plain function: (B, T) values, mean over features
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


_LOSSES = {
    # name: (compiled loss, reduction of the (B, T) values inside one example)
    "string": ("mse", np.mean),
    "loss_object": (keras.losses.MeanSquaredError(), np.mean),
    "loss_object_sum": (keras.losses.MeanSquaredError(reduction="sum"), np.sum),
    "function": (_seq_mse, np.mean),
}


@pytest.mark.filterwarnings(_FIXED)
@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_loss_kinds_give_the_hand_computed_update(name):
    # Sequence outputs (B, T=3, 2): a per-example loss must reduce over T as documented
    # (mean, or sum for a Loss whose reduction is "sum"); the step is the mean over the batch
    # of the clipped per-example gradients (C large: no clipping, sigma = 0).
    compiled, within = _LOSSES[name]
    n, lr = 5, 0.3
    rng = np.random.default_rng(4)
    x = rng.normal(size=(n, 3, 4)).astype("float32")
    y = rng.normal(size=(n, 3, 2)).astype("float32")

    def build():
        return _set_weights(keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(2)]), 2)

    model = make_private(build())
    model.compile(optimizer=DPSGD(1e9, 0.0, learning_rate=lr), loss=compiled)
    model.fit(x, y, batch_size=n, epochs=1, shuffle=False, poisson_sampling=False, verbose=0)

    ref = build()

    def per_example(yt, yp):
        values = tf.reduce_mean(tf.square(yt - yp), axis=-1)  # (1, T)
        return tf.reduce_sum(values) if within is np.sum else tf.reduce_mean(values)

    grads = [_tape_grad(ref, per_example, x[i], y[i]) for i in range(n)]
    want = [w - lr * sum(g[j] for g in grads) / n for j, w in enumerate(ref.get_weights())]
    for got, exp in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings(_FIXED)
def test_a_scalar_loss_is_refused():
    x, y = _regression(8)
    model = make_private(_sequential())
    model.compile(optimizer=DPSGD(1.0, 1.0, seed=0), loss=lambda yt, yp: tf.reduce_mean(yp))
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"per[- ]example"):
        model.fit(x, y, batch_size=4, epochs=1, poisson_sampling=False, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ sample weights


def test_an_example_with_weight_zero_contributes_nothing():
    model = _sequential(seed=3)
    x, y = _regression(6, seed=3)
    y[2] += 50.0  # the dropped example would dominate (and be clipped) if it counted
    loss = build_per_example_loss("mse")
    weights = np.array([1, 1, 0, 1, 1, 1], np.float32)
    keep = weights > 0
    clip = 0.1
    with_zero = clipped_sum(model, x, y, weights, loss, clip)
    without = clipped_sum(model, x[keep], y[keep], None, loss, clip)
    for a, b in zip(with_zero.grads, without.grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    assert float(with_zero.norms[2]) == 0.0


@pytest.mark.filterwarnings(_FIXED)
def test_fit_with_sample_weights_matches_the_hand_computation():
    # The weight multiplies the example's loss before clipping (so it cannot push an example
    # past C); with fixed batches the sum is divided by the realised batch size (weight-0 rows
    # included), as Keras' 'sum_over_batch_size' does.
    n, lr = 4, 0.5
    x, y = _regression(n, seed=5)
    sw = np.array([1.0, 0.0, 3.0, 0.5], np.float32)
    ref = _sequential(seed=6)
    mse = lambda yt, yp: tf.reduce_mean(tf.square(yt - yp))
    grads = [[sw[i] * g for g in _tape_grad(ref, mse, x[i], y[i])] for i in range(n)]
    norms = [_norm(g) for g in grads]
    clip = float(np.median([nm for nm in norms if nm > 0]))
    total = [sum(min(1.0, clip / norms[i]) * g[j] for i, g in enumerate(grads) if norms[i] > 0)
             for j in range(len(ref.get_weights()))]
    want = [w - lr * t / n for w, t in zip(ref.get_weights(), total)]

    model = make_private(_sequential(seed=6))
    model.compile(optimizer=DPSGD(clip, 0.0, learning_rate=lr), loss="mse")
    model.fit(x, y, sample_weight=sw, batch_size=n, epochs=1, shuffle=False,
              poisson_sampling=False, verbose=0)
    for got, exp in zip(model.get_weights(), want):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ metrics, evaluate, predict


@pytest.mark.filterwarnings(_FIXED)
def test_metrics_evaluate_and_predict():
    n = 8
    x, y = _regression(n, seed=7)
    model = make_private(_sequential(seed=7))
    pred0 = _sequential(seed=7).predict(x, verbose=0)
    model.compile(optimizer=DPSGD(1.0, 0.5, learning_rate=0.05, seed=2), loss="mse",
                  metrics=["mae"])
    history = model.fit(x, y, batch_size=n, epochs=1, shuffle=False, poisson_sampling=False,
                        verbose=0)
    assert {"loss", "mae"} <= set(history.history)
    # One step on one batch: the logged values are those of the forward pass before it.
    np.testing.assert_allclose(history.history["loss"][0], np.mean((pred0 - y) ** 2), rtol=1e-5)
    np.testing.assert_allclose(history.history["mae"][0], np.mean(np.abs(pred0 - y)), rtol=1e-5)

    pred = model.predict(x, verbose=0)
    assert pred.shape == (n, 1)
    loss, mae = model.evaluate(x, y, verbose=0)
    np.testing.assert_allclose(loss, np.mean((pred - y) ** 2), rtol=1e-5)
    np.testing.assert_allclose(mae, np.mean(np.abs(pred - y)), rtol=1e-5)


@pytest.mark.filterwarnings(_FIXED)
def test_weight_regularizer_matches_keras():
    # A weight penalty is data independent: it is added after privatisation, so with C large
    # and sigma = 0 the step equals Keras' step on mean loss + penalty.
    def build():
        return _set_weights(keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.Dense(1),
        ]), 8)

    x, y = _regression(8, seed=8)
    plain = build()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    private = make_private(build())
    private.compile(optimizer=DPSGD(1e9, 0.0, learning_rate=0.1), loss="mse")
    private.fit(x, y, batch_size=4, epochs=1, shuffle=False, poisson_sampling=False, verbose=0)
    for got, want in zip(private.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ saving


@pytest.mark.parametrize("kind, opt", [
    ("sequential", lambda: DPAdam(1.5, 0.5, learning_rate=0.01, seed=3)),
    ("functional", lambda: DPSGD(0.8, 1.1, learning_rate=0.05, momentum=0.5, seed=4,
                                 gradient_accumulation_steps=2)),
    ("functional", lambda: DPAdamW(1.0, 0.7, learning_rate=0.01, weight_decay=0.01, seed=5,
                                   norm_strategy="vmap")),
])
def test_save_and_load_round_trip(tmp_path, kind, opt):
    x, y = _regression(32, seed=9)
    model = make_private(_sequential(seed=9) if kind == "sequential" else _functional(seed=9))
    model.compile(optimizer=opt(), loss="mse", metrics=["mae"])
    k = model.optimizer.accumulation_steps
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2 * k, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)

    assert type(loaded) is type(model)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 2
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # The loaded model is still private and trains.
    loaded.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=k, verbose=0)
    assert int(loaded.optimizer.iterations) == 3


# ------------------------------------------------------------------ validation and sampling notes


def test_validation_split_with_poisson_sampling_holds_out_the_tail():
    # As in Keras, validation_split holds out the *last* fraction. Those rows are NaN here:
    # if Poisson sampling drew from them, the private step would stop on a NaN gradient.
    x, y = _regression(40, seed=10)
    x[30:] = np.nan
    model = make_private(_sequential(seed=10))
    model.compile(optimizer=DPSGD(1.0, 0.0, learning_rate=0.05, seed=6), loss="mse")
    history = model.fit(x, y, batch_size=10, epochs=3, validation_split=0.25, verbose=0)
    assert len(history.history["val_loss"]) == 3
    assert np.isnan(history.history["val_loss"][0])  # evaluated on the held-out NaN rows
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_fixed_batches_print_the_poisson_note(capsys):
    x, y = _regression(16, seed=11)
    model = make_private(_sequential(seed=11))
    model.compile(optimizer=DPSGD(1.0, 1.0, learning_rate=0.01, seed=7), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # arrays: Poisson, no note
    assert "assumes Poisson sampling" not in capsys.readouterr().out
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.warns(UserWarning, match="assumes Poisson sampling"):
        model.fit(ds, epochs=1, verbose=0)
    assert "assumes Poisson sampling" in capsys.readouterr().out


# ------------------------------------------------------------------ loud failures


def test_a_plain_optimizer_is_refused_by_a_private_model():
    model = make_private(_sequential())
    for opt in [keras.optimizers.SGD(0.1), "adam"]:
        with pytest.raises(TypeError, match="tf_dp"):
            model.compile(optimizer=opt, loss="mse")


def test_a_dp_optimizer_in_a_plain_model_refuses_to_train():
    x, y = _regression(8)
    model = _sequential()
    before = model.get_weights()
    model.compile(optimizer=DPSGD(1.0, 1.0, seed=0), loss="mse")
    with pytest.raises(RuntimeError, match="make_private"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_batch_normalization_is_refused():
    x, y = _regression(8)
    model = make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
        keras.layers.Dense(1)]))
    model.compile(optimizer=DPSGD(1.0, 1.0, seed=0), loss="mse")
    with pytest.raises(ValueError, match="BatchNormalization"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_a_frozen_batch_normalization_is_allowed():
    x, y = _regression(8)
    bn = keras.layers.BatchNormalization()
    model = make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(3), bn, keras.layers.Dense(1)]))
    bn.trainable = False
    model.compile(optimizer=DPSGD(1.0, 0.0, learning_rate=0.1, seed=0), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_an_activity_regularizer_is_refused():
    # Its loss mixes the batch's activations and is not per example: it cannot be clipped.
    x, y = _regression(8)
    model = make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(3, activity_regularizer="l2"),
        keras.layers.Dense(1)]))
    model.compile(optimizer=DPSGD(1.0, 1.0, seed=0), loss="mse")
    with pytest.raises(ValueError, match="loss"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)


def _fit_with_an_infinite_gradient(**opt_kwargs):
    x, y = _regression(4, seed=12)
    y = np.abs(y) + 1.0
    y[2] = 0.0  # log(0): this example's loss and gradient are infinite

    def log_loss(yt, yp):
        return -tf.math.log(yt[:, 0]) * tf.reduce_sum(yp, axis=-1)

    model = make_private(_sequential(seed=12))
    model.compile(optimizer=DPSGD(1.0, 1.0, seed=0, **opt_kwargs), loss=log_loss)
    before = model.get_weights()
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN or infinite"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, poisson_sampling=False,
                  verbose=0)
    return model, before


@pytest.mark.filterwarnings(_FIXED)
def test_a_non_finite_gradient_stops_training_and_leaves_the_weights():
    model, before = _fit_with_an_infinite_gradient(momentum=0.9)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert model.optimizer.momentums
    for v in model.optimizer.momentums:  # momentum buffers untouched too
        np.testing.assert_array_equal(np.asarray(v), 0.0)


@pytest.mark.filterwarnings(_FIXED)
def test_a_refused_step_does_not_advance_the_step_counter():
    # The error says "the step was not applied"; the optimizer's step counter must agree,
    # since it seeds the noise ([seed, step]) and sets the gradient-accumulation phase.
    model, _ = _fit_with_an_infinite_gradient()
    assert int(model.optimizer.iterations) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
