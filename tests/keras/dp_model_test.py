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
from tf_dp.core.private_step import MIN_ROWS
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
@pytest.mark.parametrize("k", [1, 2, 3])
def test_fit_with_sample_weights_matches_the_hand_computation(k):
    # The weight multiplies the example's loss before clipping (so it cannot push an example
    # past C); with fixed batches the sum is divided by the realised batch size (weight-0 rows
    # included), as Keras' 'sum_over_batch_size' does. With k micro-batches the sample
    # weights are split with their examples (k = 3 on 4 examples: sizes 1, 1, 2).
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
    model.compile(optimizer=DPSGD(clip, 0.0, learning_rate=lr, gradient_accumulation_steps=k),
                  loss="mse")
    if k == 1:
        model.fit(x, y, sample_weight=sw, batch_size=n, epochs=1, shuffle=False,
                  poisson_sampling=False, verbose=0)
    else:
        model.fit(tf.data.Dataset.from_tensors((x, y, sw)), epochs=1, verbose=0, dataset_size=n)
    assert int(model.optimizer.iterations) == 1
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
@pytest.mark.parametrize("k", [1, 2, 4])
def test_weight_regularizer_matches_keras(k):
    # A weight penalty is data independent: it is added after privatisation, so with C large
    # and sigma = 0 the step equals Keras' step on mean loss + penalty. With k micro-batches
    # (batch_size 4 // k: logical batches of 4) the penalty is still added once per step.
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
    private.compile(optimizer=DPSGD(1e9, 0.0, learning_rate=0.1, gradient_accumulation_steps=k),
                    loss="mse")
    private.fit(x, y, batch_size=4 // k, epochs=1, shuffle=False, poisson_sampling=False,
                verbose=0)
    assert int(private.optimizer.iterations) == int(plain.optimizer.iterations) == 2
    for got, want in zip(private.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ gradient accumulation
#
# With gradient_accumulation_steps = k, every fit step is one logical step: the train step
# splits its (logical) batch of n rows into k contiguous micro-batches [n j // k, n (j+1) // k),
# sums their clipped sums and applies once (noise once). Keras' batch_size is one micro-batch:
# under Poisson sampling the expected logical batch is batch_size * k.


class _Recorder(keras.layers.Layer):
    """Identity layer recording, for every training forward pass, the example ids it saw
    (``x[:, 0]``); the data sets below store each example's id there.

    The record is a Python list filled by ``tf.numpy_function``, not a variable: tf_dp refuses
    a model whose training pass writes a variable from the data, its own or one outside it.
    The checks ``fit`` runs before training also call the model: ``_checked`` runs them first
    and then clears the record."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._passes = []

    def call(self, x, training=False):
        if training:
            def record(ids):
                self._passes.append(np.array(ids))
                return np.int32(0)

            done = tf.numpy_function(record, [x[:, 0]], tf.int32, stateful=True)
            with tf.control_dependencies([done]):
                x = tf.identity(x)
        return x

    def clear(self):
        self._passes.clear()

    def log(self):
        """The ids of every training forward pass, in order (one array per pass), without
        the padding rows a pass of fewer than ``private_step.MIN_ROWS`` rows runs with
        (copies of its first row; the data sets' ids are distinct)."""
        out = []
        for ids in self._passes:
            np.testing.assert_array_equal(ids, np.round(ids))
            repeats = np.nonzero(ids[1:] == ids[0])[0]
            if len(repeats):
                real = repeats[0] + 1
                assert len(ids) == MIN_ROWS and np.all(ids[real:] == ids[0]), ids
                ids = ids[:real]
            out.append(ids.astype(np.int64))
        return out


def _checked(model, rec, x, y):
    """Runs fit's checks before training on ``x``, ``y`` (they are not run again for this
    architecture), then clears what they recorded."""
    model.check_before_training(x, y)
    rec.clear()


def _id_data(n, seed=0):
    """x[i] = (i, features...), so a forward pass tells which examples it holds."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.arange(n, dtype=np.float32)[:, None],
                        rng.normal(size=(n, 3)).astype(np.float32)], axis=1)
    return x, rng.normal(size=(n, 1)).astype(np.float32)


def _recording_model(seed=0):
    rec = _Recorder()
    model = make_private(_set_weights(keras.Sequential([
        keras.Input((4,)), rec, keras.layers.Dense(3, activation="tanh"),
        keras.layers.Dense(1)]), seed, scale=0.1))
    return model, rec


def _micro(ids, k):
    """The k micro-batches of a logical batch, by the documented boundaries."""
    m = len(ids)
    return [ids[(j * m) // k:((j + 1) * m) // k] for j in range(k)]


@pytest.mark.filterwarnings(_FIXED)
@pytest.mark.parametrize("k", [1, 3, 4])
def test_accumulation_splits_each_logical_batch_into_k_contiguous_micro_batches(k):
    x, y = _id_data(10)
    model, rec = _recording_model()
    model.compile(optimizer=DPSGD(1.0, 0.0, learning_rate=0.1, gradient_accumulation_steps=k),
                  loss="mse")
    _checked(model, rec, x, y)
    # Two logical batches, of 7 (k = 3: sizes 2, 2, 3) and 3 (k = 4: sizes 0, 1, 1, 1: an
    # empty micro-batch must be harmless; it does not call the model: empty_batch_test).
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(7), epochs=1, verbose=0,
              dataset_size=len(x))
    assert int(model.optimizer.iterations) == 2
    want = [m for m in _micro(np.arange(7), k) + _micro(np.arange(7, 10), k) if len(m)]
    got = rec.log()
    assert len(got) == 2 * k - (k == 4), [len(g) for g in got]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_poisson_logical_batches_are_split_into_disjoint_micro_batches():
    # fit(arrays, batch_size=B) with k draws Poisson batches of expected size B k (rate
    # q = B k / N, seeded with the optimizer seed), each split into its k micro-batches: every
    # example is seen at most once per logical step, and exactly the sampled ones are.
    n, batch, k, seed, steps = 30, 3, 3, 4, 6
    x, y = _id_data(n, seed=1)
    model, rec = _recording_model(seed=1)
    model.compile(optimizer=DPSGD(1.0, 1.0, learning_rate=0.05, seed=seed,
                                  gradient_accumulation_steps=k), loss="mse")
    _checked(model, rec, x, y)
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, verbose=0)
    assert int(model.optimizer.iterations) == steps

    from tf_dp.data import PoissonSampler

    logical = [e[0].numpy()[:, 0].astype(np.int64) for e in PoissonSampler(
        x, y, expected_batch_size=batch * k, seed=seed).dataset(num_steps=steps)]
    assert len({len(ids) for ids in logical}) > 1  # realised sizes vary
    got = rec.log()
    assert len(got) == steps * k
    for t, ids in enumerate(logical):
        assert len(np.unique(ids)) == len(ids)
        parts = got[t * k:(t + 1) * k]
        for g, w in zip(parts, _micro(ids, k)):
            np.testing.assert_array_equal(g, w)


def _clipped_mean_step(ref, x, y, idx, clip, lr, expected):
    """Weights of ``ref`` after w - lr * sum_{i in idx} clip_C(g_i) / expected (by hand)."""
    mse = lambda yt, yp: tf.reduce_mean(tf.square(yt - yp))
    grads = {int(i): _tape_grad(ref, mse, x[i], y[i]) for i in idx}
    total = [sum(min(1.0, clip / _norm(grads[i])) * grads[i][j] for i in grads)
             for j in range(len(ref.trainable_variables))]
    return [w - lr * t / expected for w, t in zip(ref.get_weights(), total)]


@pytest.mark.parametrize("k", [2, 3])
def test_accumulated_step_is_the_clipped_sum_of_the_logical_batch_over_its_expected_size(k):
    # sigma = 0, clipping active: the update of one logical step is the brute-force sum of
    # the per-example clipped gradients of the whole Poisson batch, divided by the expected
    # logical size B k (not the realised one), and equals a k = 1 step with batch_size B k:
    # the exact clipped sum is additive over disjoint parts.
    n, batch, lr = 40, 5, 0.5
    x, y = _regression(n, seed=13)
    y[::4] += 3.0  # some large gradients, to be clipped
    from tf_dp.data import PoissonSampler

    def first_batch(seed):  # what fit() draws first with an optimizer of this debug seed
        return [e[0].numpy() for e in PoissonSampler(
            np.arange(n), np.arange(n), expected_batch_size=batch * k, seed=seed).dataset(1)][0]

    # A seed whose first batch is neither the expected size nor a multiple of k.
    seed = next(s for s in range(10, 200)
                if len(first_batch(s)) != batch * k and len(first_batch(s)) % k != 0)
    idx = first_batch(seed)
    ref = _sequential(seed=13)
    mse = lambda yt, yp: tf.reduce_mean(tf.square(yt - yp))
    norms = np.array([_norm(_tape_grad(ref, mse, x[i], y[i])) for i in idx])
    clip = float(np.median(norms))
    assert np.sum(norms > clip * 1.01) >= 2 and np.sum(norms < clip * 0.99) >= 2
    want = _clipped_mean_step(ref, x, y, idx, clip, lr, expected=batch * k)

    runs = {}
    for kk, bs in [(k, batch), (1, batch * k)]:
        model = make_private(_sequential(seed=13))
        model.compile(optimizer=DPSGD(clip, 0.0, learning_rate=lr, seed=seed,
                                      gradient_accumulation_steps=kk), loss="mse")
        model.fit(x, y, batch_size=bs, epochs=1, steps_per_epoch=1, verbose=0)
        assert int(model.optimizer.iterations) == 1
        runs[kk] = model.get_weights()
    for got, exp in zip(runs[k], want):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
    for got, exp in zip(runs[k], runs[1]):
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-7)


def test_accumulation_is_only_a_memory_knob():
    # Noise, momentum and a learning-rate schedule that decays every step: k micro-batches of
    # B give the weights of k = 1 with batch_size B k, and so does a user PoissonSampler of
    # expected size B k padded to N (weight-0 rows in the micro-batches), step for step. Noise
    # added k times, a schedule counting micro-steps or a wrong denominator would all differ.
    n, batch, k, seed = 48, 4, 3, 21
    x, y = _regression(n, seed=15)
    from tf_dp.data import PoissonSampler

    def opt(kk):
        lr = keras.optimizers.schedules.InverseTimeDecay(0.1, decay_steps=1, decay_rate=0.5)
        return DPSGD(0.5, 1.1, learning_rate=lr, momentum=0.9, seed=seed,
                     gradient_accumulation_steps=kk)

    def train(kk, fit):
        model = make_private(_sequential(seed=15))
        model.compile(optimizer=opt(kk), loss="mse")
        fit(model)
        assert int(model.optimizer.iterations) == 8  # q = B k / N = 1/4: 4 steps per epoch
        return model.get_weights()

    acc = train(k, lambda m: m.fit(x, y, batch_size=batch, epochs=2, verbose=0))
    one = train(1, lambda m: m.fit(x, y, batch_size=batch * k, epochs=2, verbose=0))
    padded = train(k, lambda m: m.fit(PoissonSampler(
        x, y, expected_batch_size=batch * k, pad_to=n, seed=seed), epochs=2, verbose=0))
    assert _norm([a - b for a, b in zip(acc, _sequential(seed=15).get_weights())]) > 1e-2
    for a, b, c in zip(acc, one, padded):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c, b, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings(_FIXED)
def test_accumulation_splits_nested_inputs_targets_and_sample_weights():
    # Dict inputs, two outputs and sample weights are sliced together: k = 3 on a logical
    # batch of 8 (micro-batches 2, 3, 3) gives the k = 1 step (sigma = 0, clipping active).
    rng = np.random.default_rng(16)
    n = 8
    x = {"a": rng.normal(size=(n, 3)).astype("float32"),
         "b": rng.normal(size=(n, 2)).astype("float32")}
    y = (rng.normal(size=(n, 1)).astype("float32"), rng.normal(size=(n, 2)).astype("float32"))
    sw = np.array([1.0, 0.0, 2.0, 0.5, 1.0, 3.0, 0.0, 1.5], np.float32)

    def build():
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        h = keras.layers.Dense(4, activation="tanh")(keras.layers.Concatenate()([a, b]))
        return _set_weights(keras.Model({"a": a, "b": b},
                                        [keras.layers.Dense(1)(h), keras.layers.Dense(2)(h)]),
                            16)

    runs = []
    for k in (1, 3):
        model = make_private(build())
        model.compile(optimizer=DPSGD(0.2, 0.0, learning_rate=0.5,
                                      gradient_accumulation_steps=k), loss=["mse", "mse"])
        model.fit(tf.data.Dataset.from_tensors((x, y, sw)), epochs=2, verbose=0,
                  dataset_size=len(x))
        runs.append(model.get_weights())
    assert _norm([a - b for a, b in zip(runs[0], build().get_weights())]) > 1e-2
    for got, want in zip(runs[1], runs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings(_FIXED)
@pytest.mark.parametrize("strategy", ["auto", "vmap", "jl"])
def test_accumulation_matches_one_step_for_every_norm_strategy(strategy):
    # The micro-batch loop runs whichever way the norms are computed (layer formulas,
    # vectorized per-example gradients, JL forward-mode projections shared by the step):
    # k = 3 on logical batches of 10 (micro-batches 3, 3, 4) gives the k = 1 weights.
    from tf_dp.optimizers import DPSGDJL

    rng = np.random.default_rng(20)
    x = rng.normal(size=(10, 6, 3)).astype("float32")
    y = rng.normal(size=(10, 1)).astype("float32")

    def build():
        return _set_weights(keras.Sequential([
            keras.Input((6, 3)), keras.layers.Conv1D(4, 3, activation="tanh"),
            keras.layers.LayerNormalization(), keras.layers.Flatten(), keras.layers.Dense(1)]),
            20)

    def opt(k):
        if strategy == "jl":
            return DPSGDJL(0.3, 0.0, num_projections=3, learning_rate=0.5, seed=1,
                           gradient_accumulation_steps=k)
        return DPSGD(0.3, 0.0, learning_rate=0.5, seed=1, norm_strategy=strategy,
                     gradient_accumulation_steps=k)

    runs = []
    for k in (1, 3):
        model = make_private(build())
        model.compile(optimizer=opt(k), loss="mse")
        model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=2, verbose=0,
                  dataset_size=len(x))
        assert int(model.optimizer.iterations) == 2
        runs.append(model.get_weights())
    assert _norm([a - b for a, b in zip(runs[0], build().get_weights())]) > 1e-3
    for got, want in zip(runs[1], runs[0]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings(_FIXED)
def test_accumulation_logs_the_metrics_of_the_whole_logical_batch():
    # One logical batch of 7 in micro-batches of 2, 2 and 3: the logged loss and MAE are
    # those of the 7 examples (a mean of the three micro-batch means would differ).
    n, k = 7, 3
    x, y = _regression(n, seed=17)
    y[6] += 4.0
    pred0 = _sequential(seed=17).predict(x, verbose=0)
    model = make_private(_sequential(seed=17))
    model.compile(optimizer=DPSGD(1.0, 0.5, learning_rate=0.05, seed=2,
                                  gradient_accumulation_steps=k), loss="mse", metrics=["mae"])
    history = model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0,
                        dataset_size=len(x))
    sq = np.mean((pred0 - y) ** 2, axis=1)
    mean_of_means = np.mean([p.mean() for p in _micro(sq, k)])
    assert abs(mean_of_means - sq.mean()) > 0.1
    np.testing.assert_allclose(history.history["loss"][0], sq.mean(), rtol=1e-5)
    np.testing.assert_allclose(history.history["mae"][0], np.mean(np.abs(pred0 - y)),
                               rtol=1e-5)


@pytest.mark.filterwarnings(_FIXED)
def test_every_fit_step_is_a_logical_step():
    # N = 48, B = 4, k = 3: a logical batch is B k = 12 examples, so an epoch is 4 logical
    # steps (q = 1/4) in every input mode, each step k forward passes on micro-batches.
    from tf_dp.accounting import compute_epsilon

    n, batch, k, sigma = 48, 4, 3, 1.0
    x, y = _id_data(n, seed=18)
    fits = {
        "poisson": lambda m: m.fit(x, y, batch_size=batch, epochs=2, verbose=0),
        "fixed": lambda m: m.fit(x, y, batch_size=batch, epochs=2, poisson_sampling=False,
                                 verbose=0),
        "dataset": lambda m: m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(
            batch * k), epochs=2, verbose=0, dataset_size=n),
    }
    for mode, fit in fits.items():
        model, rec = _recording_model(seed=18)
        model.compile(optimizer=DPSGD(1.0, sigma, learning_rate=0.05, seed=3,
                                      gradient_accumulation_steps=k), loss="mse")
        _checked(model, rec, x, y)
        fit(model)
        assert int(model.optimizer.iterations) == 8, mode
        sizes = [len(g) for g in rec.log()]
        assert len(sizes) == 8 * k, mode
        if mode != "poisson":  # fixed logical batches of 12: micro-batches of B = 4
            assert sizes == [batch] * (8 * k), (mode, sizes)
        # The accountant records 8 steps at the logical rate q = 1/4.
        np.testing.assert_allclose(model.epsilon(), compute_epsilon(
            noise_multiplier=sigma, sampling_probability=0.25, steps=8, delta=1e-5),
                                   rtol=1e-6, err_msg=mode)


@pytest.mark.parametrize("k", [1, 3])
def test_padding_rows_are_invisible_to_the_logged_metrics(k):
    # pad_to is a static-shape device, not data: with the same seed the padded sampler must
    # log the loss and MAE of the unpadded one (sigma = 0: same steps, same weights).
    from tf_dp.data import PoissonSampler

    x, y = _regression(20, seed=21)
    logs = []
    for pad_to in (None, 20):
        model = make_private(_sequential(seed=21))
        model.compile(optimizer=DPSGD(1.0, 0.0, learning_rate=0.1, seed=0,
                                      gradient_accumulation_steps=k), loss="mse",
                      metrics=["mae"])
        sampler = PoissonSampler(x, y, expected_batch_size=6, pad_to=pad_to, seed=5)
        logs.append(model.fit(sampler, epochs=1, steps_per_epoch=3, verbose=0).history)
    np.testing.assert_allclose(logs[1]["loss"], logs[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs[1]["mae"], logs[0]["mae"], rtol=1e-5)


@pytest.mark.filterwarnings(_FIXED)
def test_the_default_batch_size_is_one_micro_batch_in_both_sampling_modes():
    # Keras' default batch_size (32) is one micro-batch, as an explicit one is: with k = 2 and
    # N = 128 the logical batch is 64 and an epoch is 2 logical steps with either sampling.
    x, y = _regression(128, seed=19)
    steps = {}
    for poisson in (True, False):
        model = make_private(_sequential(seed=19))
        model.compile(optimizer=DPSGD(1.0, 1.0, learning_rate=0.01, seed=0,
                                      gradient_accumulation_steps=2), loss="mse")
        model.fit(x, y, epochs=1, poisson_sampling=poisson, verbose=0)
        steps[poisson] = int(model.optimizer.iterations)
    assert steps == {True: 2, False: 2}


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
    # steps_per_epoch counts logical steps, whatever the accumulation (k micro-batches each).
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)

    assert type(loaded) is type(model)
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert loaded.optimizer.accumulation_steps == model.optimizer.accumulation_steps
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 2
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # The loaded model is still private and trains.
    loaded.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
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


def test_fixed_batches_warn_once_and_say_so_in_the_privacy_report(capsys):
    x, y = _regression(16, seed=11)
    model = make_private(_sequential(seed=11))
    model.compile(optimizer=DPSGD(1.0, 1.0, learning_rate=0.01), loss="mse")
    import warnings as _w
    with _w.catch_warnings(record=True) as seen:
        _w.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # arrays: Poisson, no note
    assert not [w for w in seen if "fixed (shuffled) batches" in str(w.message)]
    assert model.privacy_caveats == []
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.warns(UserWarning, match="fixed .shuffled. batches") as seen:
        model.fit(ds, epochs=1, verbose=0, dataset_size=16)
    assert len([w for w in seen if "fixed (shuffled) batches" in str(w.message)]) == 1
    # Library code does not print: the note is a warning and a caveat of the report.
    assert "Poisson" not in capsys.readouterr().out
    report = model.privacy_report()
    assert any(c.startswith("FIXED_BATCHES") for c in report["caveats"])
    assert report["guarantee_holds"] is False  # not proven for fixed batches


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


def _fit_with_an_infinite_gradient(k=1, weight_of_example_2=1.0, **opt_kwargs):
    # Example 2 of 4 is in the last micro-batch when k > 1 (k = 2: [0, 1], [2, 3]).
    x, y = _regression(4, seed=12)
    y = np.abs(y) + 1.0
    y[2] = 0.0  # log(0): this example's loss and gradient are infinite

    def log_loss(yt, yp):
        return -tf.math.log(yt[:, 0]) * tf.reduce_sum(yp, axis=-1)

    model = make_private(_sequential(seed=12))
    model.compile(optimizer=DPSGD(1.0, 0.0, learning_rate=0.1, gradient_accumulation_steps=k,
                                  **opt_kwargs), loss=log_loss)
    sw = np.ones(4, np.float32)
    sw[2] = weight_of_example_2
    history = model.fit(x, y, sample_weight=sw, batch_size=4 // k, epochs=1, shuffle=False,
                        poisson_sampling=False, verbose=0)
    return model, history


@pytest.mark.filterwarnings(_FIXED)
@pytest.mark.filterwarnings("ignore:.*noise_multiplier=0")
@pytest.mark.parametrize("k", [1, 2])
def test_a_non_finite_example_adds_nothing_and_the_step_is_taken(k):
    # Session 16: an example whose gradient is NaN or infinite gets clip factor 0 (the
    # "zero" policy, now always). The CheckNumerics stop it replaced was observable: whoever
    # planted such an example learned from the stop whether it was sampled. The update is the
    # batch's without it (sigma = 0 to compare; its sample weight 0 removes it), the step is
    # taken and accounted, and the logged loss (outside the guarantee) shows the infinity.
    model, history = _fit_with_an_infinite_gradient(k, momentum=0.9)
    without, _ = _fit_with_an_infinite_gradient(k, weight_of_example_2=0.0, momentum=0.9)
    assert int(model.optimizer.iterations) == 1 and model.accountant.steps == 1
    for got, want in zip(model.get_weights(), without.get_weights()):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert any(np.any(a != b) for a, b in zip(model.get_weights(),
                                              _sequential(seed=12).get_weights()))
    assert not np.isfinite(history.history["loss"][0])


class _MLP:
    """A two-layer MLP body for a model class, its layers built by the first call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


class _UnbuiltMLP(_MLP, DPModel):
    """A DPModel subclass (issue 11, bug 1)."""


class _PlainMLP(_MLP, keras.Model):
    """A plain subclassed Keras model."""


@pytest.mark.parametrize("kind", ["dpmodel_subclass", "private_subclass", "sequential_no_input"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_models_not_built_yet_train(kind, optimizer):
    # Optimizer slots for variables the first traced forward pass creates must not be created
    # inside the traced step (tf.function singleton-variable error).
    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=32)
    model = {"dpmodel_subclass": _UnbuiltMLP,
             "private_subclass": lambda: make_private(_PlainMLP()),
             "sequential_no_input": lambda: make_private(keras.Sequential(
                 [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]))}[kind]()
    assert not model.built
    opt = (DPSGD(1.0, 1.0, learning_rate=0.1, momentum=0.9) if optimizer == "momentum"
           else DPAdam(1.0, 1.0, learning_rate=1e-2))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert history.history["epsilon"][-1] > 0 and model.accountant.steps > 0
    before = model.accountant.steps
    model.train_on_batch(x[:8], y[:8])
    assert model.accountant.steps == before + 1


def test_a_model_named_with_an_underscore_is_checked_and_leaves_no_name_scope():
    """Keras cannot open a root graph name scope for a model named "_..." (a class
    "_UnbuiltMLP"): plain Keras fails to train it and leaves the scope on its stack, which
    skipped the independence check (a warning) and prefixed every later variable path. The
    private step and the check run under scopes of their own."""
    import warnings

    from keras.src.backend.common import global_state

    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=32)
    for model in (_UnbuiltMLP(), make_private(_PlainMLP())):
        model.compile(optimizer=DPSGD(1.0, 1.0, learning_rate=0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*could not check")
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert not global_state.get_global_attribute("name_scope_stack")
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert layer.kernel.path == f"{layer.name}/kernel"


def test_compile_then_make_private_keeps_the_compile_arguments():
    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    y = np.random.default_rng(1).integers(0, 3, size=32)
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    plain.compile(optimizer=DPAdam(1.0, 1.0, learning_rate=1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    private = make_private(plain)
    assert isinstance(private.optimizer, DPAdam) and private.optimizer.l2_norm_clip == 1.0
    history = private.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert "accuracy" in history.history and private.epsilon() > 0
    # A plain optimizer would train without privacy: refused, with what to do.
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    other.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="`model` is already compiled with Adam"):
        make_private(other)


def test_keras_clipnorm_on_a_dp_optimizer_warns_that_it_is_not_per_example():
    with pytest.warns(UserWarning, match="not per example"):
        DPAdam(1.0, 1.0, clipnorm=1.0)


@pytest.mark.parametrize("snippet", [
    "import keras, tf_dp; m = keras.saving.load_model(PATH)",
    "import tf_dp; m = tf_dp.keras.load_model(PATH)",
])
def test_a_saved_private_model_loads_in_a_fresh_process_after_import_tf_dp(tmp_path, snippet):
    import os
    import subprocess

    path = str(tmp_path / "private.keras")
    model = make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer=DPAdam(1.0, 1.0), loss="mse")
    model.fit(np.zeros((16, 4), "float32"), np.zeros((16, 2), "float32"), batch_size=4,
              verbose=0)
    model.save(path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = snippet.replace("PATH", repr(path)) + (
        "; print(type(m).__name__, type(m.optimizer).__name__, m.accountant.steps)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "3"},
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["DPSequential", "DPAdam", str(model.accountant.steps)]


def test_fixed_batch_note_is_warned_once_at_any_verbosity():
    # verbose=0 silences Keras' progress, not a note that the guarantee does not hold.
    import warnings

    x = np.zeros((16, 4), "float32")
    y = np.zeros((16, 2), "float32")
    for verbose in (0, 2):
        model = make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        model.compile(optimizer=DPSGD(1.0, 1.0), loss="mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, poisson_sampling=False, verbose=verbose)
        notes = [w for w in caught if "fixed (shuffled) batches" in str(w.message)]
        assert len(notes) == 1
        assert any(c.startswith("FIXED_BATCHES") for c in model.privacy_report()["caveats"])


def test_vectorized_fallback_does_not_repeat_tensorflow_pfor_notes():
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
        clipped_sum(model, np.ones((3, 6, 6, 1), "float32"), np.zeros((3, 2), "float32"),
                    None, build_per_example_loss("mse"), 1.0, norm_strategy="vectorized")
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "Fix that" in r.getMessage()]


def test_multi_output_models_report_per_output_losses_like_keras():
    rng = np.random.default_rng(0)
    inp = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inp)
    outputs = [keras.layers.Dense(2, name="a")(hidden), keras.layers.Dense(1, name="b")(hidden)]
    model = make_private(keras.Model(inp, outputs))
    model.compile(optimizer=DPAdam(1.0, 1.0), loss={"a": "mse", "b": "mae"})
    x = rng.normal(size=(32, 4)).astype("float32")
    y = {"a": rng.normal(size=(32, 2)).astype("float32"),
         "b": rng.normal(size=(32, 1)).astype("float32")}
    logs = model.fit(x, y, batch_size=8, epochs=1, verbose=0, poisson_sampling=False).history
    assert {"a_loss", "b_loss", "loss", "epsilon"} <= set(logs)
    # The total per-example loss is the sum of the outputs' losses (equal batches here).
    np.testing.assert_allclose(logs["loss"][-1], logs["a_loss"][-1] + logs["b_loss"][-1],
                               rtol=1e-5)


@pytest.mark.parametrize("loss_weights", [None, {"o2": 3.0, "o1": 0.5}, [0.5, 3.0]])
def test_a_dict_output_model_is_scored_by_key_like_keras(loss_weights):
    """Outputs keyed otherwise than their layers, targets given in another order: the
    per-example loss reads each output by its key (make_private used to flatten the outputs
    to a list, so the loss dict could not even compile; a list loss_weights raised)."""
    rng = np.random.default_rng(0)
    inp = keras.Input((3,))
    model = make_private(keras.Model(inp, {"o1": keras.layers.Dense(1, name="p1")(inp),
                                           "o2": keras.layers.Dense(2, name="p2")(inp)}))
    model.compile(optimizer=DPSGD(1.0, 0.0, learning_rate=0.0),
                  loss={"o1": "mse", "o2": keras.losses.MeanAbsoluteError()},
                  loss_weights=loss_weights)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = {"o2": rng.normal(size=(8, 2)).astype("float32") + 50.0,
         "o1": rng.normal(size=(8, 1)).astype("float32")}
    pred = model(x)
    assert sorted(pred) == ["o1", "o2"]
    w1, w2 = ((1.0, 1.0) if loss_weights is None else (0.5, 3.0))
    want = (w1 * np.mean((pred["o1"].numpy() - y["o1"]) ** 2, axis=1)
            + w2 * np.mean(np.abs(pred["o2"].numpy() - y["o2"]), axis=1))
    np.testing.assert_allclose(model._dp_loss(y, pred, None).numpy(), want, rtol=1e-5)
    logs = model.fit(x, y, batch_size=8, epochs=1, verbose=0, poisson_sampling=False).history
    # Keras' own loss of the same batch, at the same (unchanged: learning rate 0) weights.
    np.testing.assert_allclose(logs["loss"][-1], want.mean(), rtol=1e-4)


_USER_MODULE = """
import keras


@keras.saving.register_keras_serializable("user")
class UserMLP(keras.Model):
    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}
"""


def test_a_private_subclassed_model_reloads_in_a_fresh_process(tmp_path):
    import os
    import subprocess

    (tmp_path / "user_models.py").write_text(_USER_MODULE)
    path = str(tmp_path / "private.keras")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(tmp_path)]),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    save = (
        "import numpy as np, tf_dp, user_models\n"
        "m = tf_dp.keras.make_private(user_models.UserMLP(units=5))\n"
        "m.compile(optimizer=tf_dp.DPAdam(1.0, 1.0), loss='mse')\n"
        "m.fit(np.zeros((16, 3), 'float32'), np.zeros((16, 2), 'float32'), batch_size=4,\n"
        "      verbose=0)\n"
        f"m.save({path!r}); print(m.accountant.steps)\n")
    load = (
        "import numpy as np, tf_dp, user_models\n"
        f"m = tf_dp.keras.load_model({path!r})\n"
        "assert isinstance(m, user_models.UserMLP) and m.units == 5\n"
        "before = m.accountant.steps\n"
        "m.fit(np.zeros((16, 3), 'float32'), np.zeros((16, 2), 'float32'), batch_size=4,\n"
        "      verbose=0)\n"
        "print(type(m).__name__, type(m.optimizer).__name__, before, m.accountant.steps)\n")
    outs = []
    for code in (save, load):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        outs.append(out.stdout.split())
    steps = int(outs[0][-1])
    name, opt, before, after = outs[1][-4:]
    assert (name, opt, int(before)) == ("PrivateUserMLP", "DPAdam", steps)
    assert int(after) > steps  # the budget carried over and kept growing


class _AtMostRows(keras.layers.Layer):
    """Identity that fails when more than ``rows`` examples pass through at once."""

    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, x):
        with tf.control_dependencies([tf.debugging.assert_less_equal(
                tf.shape(x)[0], self.rows, message="physical batch above the limit")]):
            return tf.identity(x)


def test_max_physical_batch_size_bounds_memory_and_keeps_the_step():
    import warnings

    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = rng.normal(size=(96, 1)).astype("float32")
    weights, eps = [], []
    for rows in (None, 16):  # (a multiple of private_step.ROW_MULTIPLE: no padding above)
        keras.utils.set_random_seed(7)
        model = make_private(keras.Sequential([
            keras.Input((4,)), _AtMostRows(rows or 10**6), keras.layers.Dense(3, "tanh"),
            keras.layers.Dense(1)]))
        # Seeded only so that both runs draw the same batches and noise (debugging use).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.compile(optimizer=DPSGD(1.0, 1.0, learning_rate=0.1, seed=3), loss="mse")
            model.fit(x, y, batch_size=32, epochs=2, verbose=0, max_physical_batch_size=rows)
        weights.append([w.numpy() for w in model.trainable_variables])
        eps.append(model.epsilon())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert eps[0] == eps[1]  # one noisy step per logical batch either way
    with pytest.raises(ValueError, match="`max_physical_batch_size`"):
        model.fit(x, y, batch_size=32, max_physical_batch_size=0, verbose=0)

def test_the_private_step_is_traced_once():
    """A built model's DP optimizer is built by compile, outside any trace: the slot
    variables a first trace would create made tf.function trace the private step twice
    (a first step ~1.7x longer)."""
    keras.utils.set_random_seed(0)
    model = DPSequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(2)])
    model.compile(optimizer=DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                   learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert model.optimizer.built
    traces = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int64)])
    def step(x, y):
        traces.append(1)
        return model.train_step((x, y))["loss"]

    x = tf.constant(np.random.default_rng(0).normal(size=(8, 3)).astype("float32"))
    y = tf.constant(np.arange(8) % 2)
    model.check_before_training(x, y)  # before a traced custom loop (fit runs it itself)
    before = [v.numpy().copy() for v in model.trainable_variables]
    for _ in range(2):
        step(x, y)
    assert len(traces) == 1
    assert any(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
