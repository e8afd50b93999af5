"""The vectorized fallback keeps row-lookup gradients (embeddings) in lookup form.

``tf_dp.core.vmap.per_example_gradients(..., rows=True)`` returns a table's per-example
gradient as ``RowGradients`` (ids, values) when TensorFlow gives it as row slices, and the
vectorized strategy forms its norms and clipped sum with the embedding ghost rule's code
instead of a dense (B, rows, width) tensor. These tests pin that path against the
one-example-at-a-time reference (float64 models: exact to rounding), including repeated ids
within an example, masking, a table also read densely (tied weights: no row form), several
tables, the loop fallback, and that nothing is lost when rows repeat across examples.
That every example adds at most C in float32 on this path, for adversarial (cancelling)
repeated tokens, is tests/privacy/clip_bound_test.py's embedding case (strategy "vmap").
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import _reference as ref
from tf_dp.core import build_per_example_loss, clipped_sum, vmap

L = keras.layers
_LOSS = build_per_example_loss("mse")


def _set_weights(model, seed):
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, 0.7, size=w.shape).astype(w.dtype)
                       for w in model.get_weights()])
    return model


def _text_model(dtype, mask_zero=False, rows=11, width=4, steps=6):
    with ref.Precision(dtype):
        model = keras.Sequential([keras.Input((steps,), dtype="int32"),
                                  L.Embedding(rows, width, mask_zero=mask_zero),
                                  L.Dense(5, activation="tanh"),
                                  L.GlobalAveragePooling1D(),
                                  L.Dense(2)])
    return _set_weights(model, 3)


def _two_tables(dtype):
    with ref.Precision(dtype):
        tokens = keras.Input((6,), dtype="int32")
        pos = keras.Input((6,), dtype="int32")
        h = L.Add()([L.Embedding(9, 4)(tokens), L.Embedding(6, 4)(pos)])
        out = L.Dense(2)(L.Flatten()(h))
        model = keras.Model([tokens, pos], out)
    return _set_weights(model, 4)


def _ids(batch=7, steps=6, rows=11, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, rows, size=(batch, steps)).astype("int32")
    x[0] = 3                    # one id repeated over the whole example
    x[1, :3] = x[2, :3]         # rows shared with another example
    return x


def _check(model, x, y, strategy, dtype, sample_weight=None):
    variables = model.trainable_variables
    per = ref.per_example_gradients(model, _LOSS, x, y, sample_weight, variables)
    norms = ref.per_example_norms(per)
    clip = float(np.float32(np.median(norms)))
    w = ref.clip_weights(norms, clip)
    sums = [np.tensordot(w, g, axes=1) for g in per]
    res = clipped_sum(model, x, y, sample_weight, _LOSS, clip, norm_strategy=strategy)
    ref.assert_clipped_sum_matches(res, norms, sums, variables, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mask_zero", [False, True])
def test_vectorized_embedding_matches_brute_force(dtype, mask_zero):
    model = _text_model(dtype, mask_zero)
    x = _ids()
    x[4, 2:] = 0  # padding under mask_zero
    y = np.random.default_rng(1).normal(size=(len(x), 2)).astype(dtype)
    _check(model, x, y, "vectorized", dtype)


def test_two_tables_with_sample_weights_match_brute_force():
    model = _two_tables("float64")
    x = [_ids(rows=9), np.tile(np.arange(6, dtype="int32"), (7, 1))]
    y = np.random.default_rng(2).normal(size=(7, 2))
    _check(model, x, y, "vectorized", "float64",
           sample_weight=np.array([1.0, 0.0, 2.0, 1.0, 0.5, 1.0, 3.0]))


def test_rows_form_only_for_row_lookups():
    model = _text_model("float64")
    x, y = _ids(), np.zeros((7, 2))
    with_rows, losses, _ = vmap.per_example_gradients(model, _LOSS, x, y, None,
                                                      model.trainable_variables, rows=True)
    dense, losses2, _ = vmap.per_example_gradients(model, _LOSS, x, y, None,
                                                   model.trainable_variables)
    kinds = [type(g).__name__ for g in with_rows]
    assert kinds[0] == "RowGradients" and all(k != "RowGradients" for k in kinds[1:]), kinds
    assert all(not isinstance(g, vmap.RowGradients) for g in dense)
    np.testing.assert_array_equal(losses.numpy(), losses2.numpy())
    # Densified, the row form is the dense per-example gradient (repeated ids add up).
    table = with_rows[0]
    assert table.ids.shape == (7, 6) and table.values.shape == (7, 6, 4)
    rebuilt = np.zeros(dense[0].shape)
    for i in range(7):
        np.add.at(rebuilt[i], table.ids.numpy()[i], table.values.numpy()[i])
    np.testing.assert_allclose(rebuilt, dense[0].numpy(), rtol=1e-12, atol=1e-15)
    for g, h in zip(with_rows[1:], dense[1:]):
        np.testing.assert_array_equal(g.numpy(), h.numpy())


def test_loop_fallback_gives_the_same_rows():
    model = _text_model("float64")
    x, y = _ids(), np.random.default_rng(3).normal(size=(7, 2))
    vec, _, _ = vmap.per_example_gradients(model, _LOSS, x, y, None,
                                           model.trainable_variables, rows=True)
    loop, _, _ = vmap.per_example_gradients(model, _LOSS, x, y, None,
                                            model.trainable_variables, mode="loop", rows=True)
    assert isinstance(loop[0], vmap.RowGradients)
    np.testing.assert_array_equal(vec[0].ids.numpy(), loop[0].ids.numpy())
    np.testing.assert_allclose(vec[0].values.numpy(), loop[0].values.numpy(), rtol=1e-12)


def test_a_table_also_read_densely_stays_dense_and_exact():
    # Tied weights: the table is gathered and multiplied (ReversibleEmbedding's reverse
    # projection); its gradient is no longer row slices alone.
    with ref.Precision("float64"):
        table = L.ReversibleEmbedding(7, 4)
        ids = keras.Input((5,), dtype="int32")
        out = L.GlobalAveragePooling1D()(table(table(ids), reverse=True))
        model = _set_weights(keras.Model(ids, out), 5)
    x = _ids(rows=7, steps=5)
    y = np.random.default_rng(4).normal(size=(7, 7))
    per, _, _ = vmap.per_example_gradients(model, _LOSS, x, y, None,
                                           model.trainable_variables, rows=True)
    assert not any(isinstance(g, vmap.RowGradients) for g in per)
    _check(model, x, y, "vectorized", "float64")


def test_unknown_batch_in_a_traced_step():
    model = _text_model("float64")
    x, y = _ids(), np.random.default_rng(6).normal(size=(7, 2))
    norms = ref.per_example_norms(ref.per_example_gradients(model, _LOSS, x, y))
    fn = tf.function(lambda a, b: clipped_sum(model, a, b, None, _LOSS, 1e9,
                                              norm_strategy="vectorized").norms,
                     input_signature=[tf.TensorSpec([None, 6], tf.int32),
                                      tf.TensorSpec([None, 2], tf.float64)])
    np.testing.assert_allclose(fn(x, y).numpy(), norms, rtol=1e-9)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
