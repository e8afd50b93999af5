"""The ghost rules on inputs whose non-batch dimensions are unknown while tracing.

A ``tf.data`` input of variable-length sequences (``padded_batch``, or an ``element_spec``
that leaves the time dimension None) traces the private step with the sequence length
unknown. The rules used to stop there with a ``TypeError`` (a byte count of None), so such a
model trained only on the vectorized strategy. Each case here runs ``clipped_sum`` in a
function traced with every non-batch dimension but the features unknown, and compares its
norms and clipped sums with a loop over single examples (float64 models: exact to float64
rounding); JL with unknown dimensions gives the norms it gives with them known (the same
directions); and ``fit`` trains on a ``padded_batch`` dataset.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # run as a script: `tests` importable like under pytest / Bazel
    sys.path.insert(0, _ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tests import _reference as ref  # noqa: E402
from tf_dp.core import build_per_example_loss, clipped_sum  # noqa: E402

L = keras.layers


def _seq(*layers, d=3, ids=False, pool=L.GlobalAveragePooling1D, spatial=1):
    inp = (keras.Input((None,), dtype="int32") if ids
           else keras.Input((None,) * spatial + (d,)))
    h = inp
    for layer in layers:
        h = layer(h)
    if pool is not None:
        h = pool()(h)
    return keras.Model(inp, L.Dense(2)(h))


def _mha():
    inp = keras.Input((None, 4))
    h = L.MultiHeadAttention(2, 3)(inp, inp)
    return keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling1D()(h)))


def _image():
    inp = keras.Input((None, None, 2))
    h = L.Conv2D(3, 3, padding="same")(inp)
    h = L.GroupNormalization(groups=1)(h)
    h = L.Conv2D(2, 2, strides=2)(h)
    return keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling2D()(h)))


def _image_other():
    inp = keras.Input((None, None, 2))
    h = L.DepthwiseConv2D(2, strides=2, padding="same", depth_multiplier=2)(inp)
    h = L.SeparableConv2D(3, (2, 3))(h)
    h = L.Conv2DTranspose(2, 3, strides=2, padding="same")(h)
    h = L.Conv2DTranspose(2, (2, 1), strides=(1, 2))(h)
    return keras.Model(inp, L.Dense(2)(L.GlobalAveragePooling2D()(h)))


# name -> (model builder, x shape of one example with its unknown dimensions' sizes)
CASES = {
    "dense_layernorm": (lambda: _seq(L.Dense(4), L.LayerNormalization()), (5, 3)),
    # d * p above factors._MATERIALISE_NORMS_MAX_ENTRIES: Gram norms with T unknown
    "dense_wide_gram": (lambda: _seq(L.Dense(200), d=200), (5, 200)),
    "einsum": (lambda: _seq(L.EinsumDense("btd,de->bte", (None, 4), bias_axes="e")), (5, 3)),
    "conv1d": (lambda: _seq(L.Conv1D(3, 2, padding="same"), L.Conv1D(2, 3, strides=2)),
               (7, 3)),
    "conv1d_depthwise_separable_transpose": (
        lambda: _seq(L.DepthwiseConv1D(2, padding="same", strides=2), L.SeparableConv1D(3, 2),
                     L.Conv1DTranspose(2, 3, strides=2, padding="same"),
                     L.Conv1DTranspose(2, 2)), (7, 3)),
    "conv2d_depthwise_separable_transpose": (_image_other, (5, 7, 2)),
    "conv3d": (lambda: _seq(L.Conv3D(2, 2, padding="same", strides=(1, 2, 1)), d=2,
                            spatial=3, pool=L.GlobalAveragePooling3D), (3, 5, 4, 2)),
    "lstm": (lambda: _seq(L.LSTM(3), pool=None), (5, 3)),
    "gru_sequences": (lambda: _seq(L.GRU(3, return_sequences=True)), (5, 3)),
    "bidirectional_simple_rnn": (lambda: _seq(L.Bidirectional(L.SimpleRNN(2)), pool=None),
                                 (5, 3)),
    "multi_head_attention": (_mha, (5, 4)),
    "embedding": (lambda: _seq(L.Embedding(12, 3), L.Dense(4), ids=True), (6,)),
    "embedding_masked_lstm": (lambda: _seq(L.Embedding(12, 3, mask_zero=True), L.LSTM(3),
                                           ids=True, pool=None), (6,)),
    "conv2d_groupnorm_images": (_image, (5, 4, 2)),
}


def _batch(name, shape, rows=5):
    rng = np.random.default_rng(7)
    if name.startswith("embedding"):
        x = rng.integers(1, 12, size=(rows, *shape)).astype("int32")
        x[1, -2:] = 0  # padded ends (masked where the Embedding masks)
        x[3, -4:] = 0
    else:
        x = rng.normal(size=(rows, *shape))
    y = rng.normal(size=(rows, 2))
    return x, y


def _unknown_spec(x):
    """Batch and every non-batch dimension unknown but the last (the features) for float
    inputs; every dimension unknown for ids."""
    if x.dtype == np.int32:
        return tf.TensorSpec([None] * x.ndim, tf.int32)
    return tf.TensorSpec([None] * (x.ndim - 1) + [x.shape[-1]], tf.float64)


def _traced_clipped_sum(model, x, y, clip, **kwargs):
    loss_fn = build_per_example_loss("mse")

    @tf.function(input_signature=[_unknown_spec(x), tf.TensorSpec([None, 2], tf.float64)],
                 autograph=False)
    def step(a, b):
        out = clipped_sum(model, a, b, None, loss_fn, clip, **kwargs)
        return out.norms, out.grads

    assert None in step.get_concrete_function().structured_input_signature[0][0].shape[1:]
    return step(tf.constant(x), tf.constant(y))


@pytest.mark.parametrize("name", sorted(CASES))
def test_ghost_rules_with_unknown_dimensions_match_brute_force(name):
    build, shape = CASES[name]
    keras.utils.set_random_seed(0)
    with ref.Precision("float64"):
        model = build()
    x, y = _batch(name, shape)
    loss_fn = build_per_example_loss("mse")
    per = ref.per_example_gradients(model, loss_fn, x, y)
    norms = ref.per_example_norms(per)
    clip = float(np.float32(np.median(norms)))  # some examples clipped, others not
    w = ref.clip_weights(norms, clip)
    sums = [np.tensordot(w, g, axes=1) for g in per]
    got_norms, got_sums = _traced_clipped_sum(model, x, y, clip, norm_strategy="ghost")
    np.testing.assert_allclose(got_norms.numpy(), norms, rtol=1e-9)
    scale = max(float(np.max(np.abs(s))) for s in sums)
    for got, want, v in zip(got_sums, sums, model.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-9 * scale,
                                   err_msg=v.path)


def test_sums_of_unknown_sizes_run_in_chunks_of_the_same_rule(monkeypatch):
    # Gram factors of an unknown length have no static byte count: the chunk of examples
    # is computed in the graph (4 examples of 5 x 400 float64 entries here: the 16 padded
    # rows in 4 chunks, the sums still those of the loop over single examples).
    from tf_dp.core.ghost import factors as factors_lib  # noqa: PLC0415

    monkeypatch.setattr(factors_lib, "_SUM_CHUNK_BYTES", 4 * 8 * 5 * 400 + 7)
    chunks = []
    original = factors_lib._chunked_sums

    def spy(looped, chunk, sanitize=None):
        chunks.append(chunk)
        return original(looped, chunk, sanitize)

    monkeypatch.setattr(factors_lib, "_chunked_sums", spy)
    test_ghost_rules_with_unknown_dimensions_match_brute_force("dense_wide_gram")
    assert chunks and all(isinstance(c, tf.Tensor) for c in chunks)


@pytest.mark.parametrize("name", ["dense_layernorm", "lstm", "embedding", "conv1d"])
def test_jl_with_unknown_dimensions_gives_the_norms_of_known_ones(name):
    # Two copies of one model (a model's first private trace fixes which dimensions are
    # known: static_batch_shape_test), the same seed, so the same directions.
    build, shape = CASES[name]
    x, y = _batch(name, shape)
    seed = tf.constant([3, 4], tf.int64)
    loss_fn = build_per_example_loss("mse")
    jl_args = dict(norm_strategy="jl", num_projections=3, seed=seed)

    from tf_dp.core import jl  # noqa: PLC0415

    for one_part in (False, True):  # whole tables, and the Keras step's rows alone
        models = []
        for _ in range(2):
            keras.utils.set_random_seed(0)
            with ref.Precision("float64"):
                models.append(build())

        @tf.function(autograph=False)
        def known(a, b, model=models[0]):
            return clipped_sum(model, a, b, None, loss_fn, 1.0, **jl_args).norms

        with jl.one_part_step() if one_part else _nothing():
            static = known(tf.constant(x), tf.constant(y))
            dynamic, _ = _traced_clipped_sum(models[1], x, y, 1.0, **jl_args)
        # JL norms are estimates: they differ from the exact ones, not between the traces.
        exact = ref.per_example_norms(ref.per_example_gradients(models[0], loss_fn, x, y))
        assert not np.allclose(static.numpy(), exact, rtol=1e-3)
        np.testing.assert_allclose(dynamic.numpy(), static.numpy(), rtol=1e-9)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fit_trains_on_variable_length_sequences_with_ghost_rules():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 30, size=n).astype("int32") for n in rng.integers(3, 9, size=48)]
    labels = rng.integers(0, 2, size=48).astype("int32")
    ds = tf.data.Dataset.from_generator(
        lambda: zip(seqs, labels),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)))
    ds = ds.padded_batch(16)
    keras.utils.set_random_seed(0)
    inp = keras.Input((None,), dtype="int32")
    h = L.LSTM(4)(L.Embedding(30, 4, mask_zero=True)(inp))
    model = tf_dp.keras.make_private(keras.Model(inp, L.Dense(2)(h)))
    model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                         learning_rate=1e-2, norm_strategy="ghost"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.warns(UserWarning, match=r"fixed \(shuffled\) batches"):
        model.fit(ds, epochs=1, dataset_size=48, verbose=0)
    assert model.optimizer.iterations.numpy() == 3
    assert all(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))
    print(model.privacy_report())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
