"""Rows of sample weight 0 (Poisson padding) are inert, even where the model maps them to NaN.

PoissonSampler(pad_to=...) pads every batch with rows of zeros and weight 0. A model that
maps a zero row to NaN or inf (x / ||x||, log x) gave that row a NaN loss gradient (0 * NaN),
so the "error" policy stopped every step that had padding. Now such rows get clip factor 0,
are zeroed in the sums when these are not finite, are never an error, and stay out of the
logged loss. (Since session 16 the private step drops non-finite real examples too.)
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.core import build_per_example_loss, clipped_sum  # noqa: E402
from tf_dp.core.clipping import ClipSpec  # noqa: E402


class _Unit(keras.layers.Layer):
    """x / ||x||: NaN for a zero row (no epsilon, on purpose)."""

    def call(self, x):
        return x / tf.norm(x, axis=-1, keepdims=True)


class _Scale(keras.layers.Layer):
    """A weight without a ghost rule (the vectorized fallback)."""

    def build(self, shape):
        self.s = self.add_weight(shape=(shape[-1],), initializer="ones", name="s")

    def call(self, x):
        return x * self.s


def _model():
    model = keras.Sequential([keras.Input((4,)), _Unit(), keras.layers.Dense(5, "tanh"),
                              _Scale(), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0, 1, w.shape).astype("float32") for w in model.weights])
    return model


def _batch(n=6, pad=4):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n)
    xp = np.concatenate([x, np.zeros((pad, 4), "float32")])
    yp = np.concatenate([y, np.zeros(pad, y.dtype)])
    sw = np.concatenate([np.ones(n, "float32"), np.zeros(pad, "float32")])
    return (x, y), (xp, yp, sw)


_LOSS = build_per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _clip(model, strategy):
    if strategy == "per_layer":
        groups = {}
        for i, v in enumerate(model.trainable_variables):
            groups.setdefault(v.path.rsplit("/", 1)[0], []).append(i)
        n = len(groups)
        return ClipSpec(clip=0.7, groups=tuple(tuple(g) for g in groups.values()),
                        shares=tuple([1.0 / n] * n)), "auto"
    return 0.7, strategy


@pytest.mark.parametrize("non_finite", ["error", "zero"])
@pytest.mark.parametrize("strategy", ["auto", "vectorized", "jl", "per_layer"])
def test_nan_padding_rows_add_nothing_and_are_not_an_error(strategy, non_finite, monkeypatch):
    from tf_dp.core import private_step

    monkeypatch.setattr(private_step, "non_finite_policy", lambda model: non_finite)
    model = _model()
    (x, y), (xp, yp, sw) = _batch()
    # The premise: the padding rows' per-example loss is NaN.
    assert np.isnan(_LOSS(yp, model(xp), sw).numpy()[-4:]).all()
    clip, name = _clip(model, strategy)
    kwargs = dict(norm_strategy=name)
    if name == "jl":
        kwargs.update(num_projections=3, seed=tf.constant([7, 11], tf.int64))
    want = clipped_sum(model, x, y, np.ones(len(x), "float32"), _LOSS, clip, **kwargs)
    got = clipped_sum(model, xp, yp, sw, _LOSS, clip, **kwargs)
    for a, b in zip(got.grads, want.grads):
        assert np.isfinite(a.numpy()).all()
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)


def test_a_real_example_that_is_nan_adds_nothing():
    # Since session 16 a non-finite real example is dropped too (clip factor 0), never a
    # stop, whose timing would tell whether it was sampled.
    model = _model()
    (x, y), (xp, yp, sw) = _batch()
    sw[-1] = 1.0  # a zero row that is an example
    got = clipped_sum(model, xp, yp, sw, _LOSS, 0.7)
    want = clipped_sum(model, x, y, np.ones(len(x), "float32"), _LOSS, 0.7)
    assert np.isnan(got.losses.numpy()[-1])
    for a, b in zip(got.grads, want.grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)


def _sequence_model():
    # An embedding table (EmbeddingFactors), a Dense and a Conv1D over 6 positions (outer
    # factors with T > 1: Gram norms), a LayerNormalization and a custom weight (materialised).
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(12, 4),
        keras.layers.Dense(5, "tanh"), keras.layers.Conv1D(3, 2),
        keras.layers.LayerNormalization(), _Scale(), keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2)])
    rng = np.random.default_rng(5)
    model.set_weights([rng.normal(0, 1, w.shape).astype("float32") for w in model.weights])
    return model


def _log_loss(y_true, y_pred, sample_weight):
    # -log(y) * sum(outputs): infinite, with an infinite gradient, for a target of 0.
    per = -tf.math.log(tf.cast(y_true, tf.float32)) * tf.reduce_sum(y_pred, axis=-1)
    return per if sample_weight is None else per * tf.cast(sample_weight, tf.float32)


@pytest.mark.parametrize("chunk_bytes", [None, 1])
@pytest.mark.parametrize("strategy", ["auto", "vectorized", "jl", "per_layer"])
def test_an_infinite_example_adds_nothing_whatever_its_factors(strategy, chunk_bytes,
                                                              monkeypatch):
    # Its output gradient is infinite, so every factor kind holds inf for it: its clip bound
    # is then not finite (what lets the sums zero it only when a bound is not finite), and
    # the sums are those of the batch without it. chunk_bytes = 1: the sums run over chunks
    # of one example (the loop's grouped conds), else at once.
    from tf_dp.core.ghost import factors as factors_lib

    if chunk_bytes is not None:
        monkeypatch.setattr(factors_lib, "_SUM_CHUNK_BYTES", chunk_bytes)
    model = _sequence_model()
    rng = np.random.default_rng(6)
    x = rng.integers(0, 12, (5, 6)).astype("int32")
    y = rng.uniform(0.5, 2.0, 5).astype("float32")
    y_bad = y.copy()
    y_bad[3] = 0.0
    clip, name = _clip(model, strategy)
    kwargs = dict(norm_strategy=name)
    if name == "jl":
        kwargs.update(num_projections=3, seed=tf.constant([5, 9], tf.int64))
    keep = np.array([1, 1, 1, 0, 1], "float32")
    got = clipped_sum(model, x, y_bad, None, _log_loss, clip, **kwargs)
    want = clipped_sum(model, x, y, keep, _log_loss, clip, **kwargs)
    assert not np.isfinite(got.losses.numpy()[3])
    moved = 0.0
    for a, b in zip(got.grads, want.grads):
        assert np.isfinite(a.numpy()).all()
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)
        moved += float(np.abs(b.numpy()).sum())
    assert moved > 0


def test_per_timestep_weights_whose_first_entries_are_zero_are_examples():
    # real_rows: any non-zero entry (left-padded sequences); the metrics use the same rows.
    from tf_dp.core.private_step import real_rows

    sw = np.array([[0, 0, 1], [0, 0, 0], [1, 1, 1], [0, -1, 0]], "float32")
    np.testing.assert_array_equal(real_rows(sw).numpy(), [True, False, True, True])
    assert real_rows(None) is None


def test_fit_with_pad_to_trains_a_model_that_is_nan_on_zeros():
    model = tf_dp.keras.DPSequential([keras.Input((4,)), _Unit(), keras.layers.Dense(3)])
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, 64)
    sampler = tf_dp.data.PoissonSampler(x, y, expected_batch_size=4, pad_to=16)
    history = model.fit(sampler, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert model.accountant.steps == 16


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
