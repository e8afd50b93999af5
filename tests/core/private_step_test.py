"""Per-example norms and clipped sums of the private step vs a loop over single examples."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import _reference as ref  # noqa: E402
from tf_dp.core import build_per_example_loss, clipped_sum, ghost  # noqa: E402

L = keras.layers


def _brute_force(model, loss_fn, x, y, variables):
    """Per-example gradients (the shared reference), as a list over examples."""
    per = ref.per_example_gradients(model, loss_fn, x, y, variables=variables)
    return [[p[i] for p in per] for i in range(len(per[0]))] if per else []


def _norms(grads):
    return np.array([np.sqrt(sum(np.sum(np.square(t.astype(np.float64))) for t in g))
                     for g in grads])


def _check(model, x, y, loss, strategy, clip=1e9, rtol=1e-5, expect_covered=None):
    loss_fn = build_per_example_loss(loss)
    variables = model.trainable_variables
    bf = _brute_force(model, loss_fn, x, y, variables)
    res = clipped_sum(model, x, y, None, loss_fn, clip, variables=variables,
                      norm_strategy=strategy)
    np.testing.assert_allclose(res.norms.numpy(), _norms(bf), rtol=rtol, atol=1e-6)
    # The clipped sum equals the sum of the individually clipped gradients.
    norms = _norms(bf)
    w = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    for j, v in enumerate(variables):
        want = sum(w[i] * bf[i][j] for i in range(len(bf)))
        np.testing.assert_allclose(res.grads[j].numpy(), want, rtol=1e-4, atol=1e-6,
                                   err_msg=v.path)
    if expect_covered is not None:
        layers = ghost.capturable_layers(model)
        assert {layer.name for layer in layers} >= set(expect_covered)
    return res


def _seq(*layers, inp):
    return keras.Sequential([keras.Input(inp[0], dtype=inp[1] if len(inp) > 1 else "float32"),
                             *layers])


RNG = np.random.default_rng(0)
X4 = RNG.normal(size=(5, 7, 6)).astype("float32")


CASES = {
    "dense_2d": (lambda: _seq(L.Dense(4, activation="tanh"), L.Dense(3), inp=((6,),)),
                 RNG.normal(size=(5, 6)).astype("float32")),
    # sequence axis: T*T = 49 > d*p (6*4 = 24) -> materialised; second dense: ghost choice
    "dense_seq": (lambda: _seq(L.Dense(4, activation="relu"), L.Dense(40), L.Flatten(), L.Dense(3),
                               inp=((7, 6),)), X4),
    "conv2d_same_strided": (lambda: _seq(L.Conv2D(3, 3, strides=2, padding="same",
                                                  activation="tanh"), L.Flatten(), L.Dense(3),
                                         inp=((9, 9, 2),)),
                            RNG.normal(size=(4, 9, 9, 2)).astype("float32")),
    "conv2d_valid_dilated": (lambda: _seq(L.Conv2D(2, 3, dilation_rate=2), L.Flatten(),
                                          L.Dense(3), inp=((10, 10, 1),)),
                             RNG.normal(size=(4, 10, 10, 1)).astype("float32")),
    "conv2d_channels_first": (lambda: _seq(L.Conv2D(2, 2, data_format="channels_first"),
                                           L.Flatten(), L.Dense(3), inp=((2, 6, 6),)),
                              RNG.normal(size=(4, 2, 6, 6)).astype("float32")),
    "conv1d_causal": (lambda: _seq(L.Conv1D(3, 3, padding="causal", dilation_rate=2),
                                   L.Conv1D(2, 2, strides=2), L.Flatten(), L.Dense(3),
                                   inp=((11, 4),)),
                      RNG.normal(size=(4, 11, 4)).astype("float32")),
    "layer_norm": (lambda: _seq(L.Dense(8), L.LayerNormalization(), L.Flatten(), L.Dense(3),
                                inp=((7, 6),)),
                   X4),
    "group_norm": (lambda: _seq(L.Conv2D(4, 3), L.GroupNormalization(groups=2), L.Flatten(),
                                L.Dense(3), inp=((6, 6, 2),)),
                   RNG.normal(size=(4, 6, 6, 2)).astype("float32")),
    "einsum_matmul_form": (lambda: _seq(L.EinsumDense("abc,cde->abde", (7, 2, 3), bias_axes="de"),
                                        L.Flatten(), L.Dense(3), inp=((7, 6),)), X4),
    "einsum_shared_axis": (lambda: _seq(L.Reshape((7, 2, 3)),
                                        L.EinsumDense("abhd,hde->abhe", (7, 2, 4), bias_axes="e"),
                                        L.Flatten(), L.Dense(3), inp=((7, 6),)), X4),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("strategy", ["ghost", "vmap"])
def test_norms_and_clipped_sum_match_brute_force(name, strategy):
    if "channels_first" in name and not ref.cpu_runs_nchw_conv():
        pytest.skip("this TensorFlow build runs no channels_first Conv2D on this CPU")
    keras.utils.set_random_seed(1)
    build, x = CASES[name]
    model = build()
    y = RNG.integers(0, 3, size=len(x))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    res = _check(model, x, y, loss, strategy)
    # A clip below every norm makes every factor < 1: the sum must still match.
    _check(model, x, y, loss, strategy, clip=float(np.min(res.norms.numpy())) * 0.5)


def test_embedding_with_repeated_tokens():
    keras.utils.set_random_seed(2)
    model = _seq(L.Embedding(10, 4), L.Dense(5, activation="tanh"), L.GlobalAveragePooling1D(),
                 L.Dense(1), inp=((6,), "int32"))
    # Repeated token ids inside an example make the cross terms of the ghost norm matter.
    x = np.array([[1, 1, 2, 3, 1, 0], [4, 5, 6, 7, 8, 9], [2, 2, 2, 2, 2, 2]], dtype="int32")
    y = np.array([[0.5], [1.0], [-1.0]], dtype="float32")
    for strategy in ("ghost", "vmap"):
        _check(model, x, y, "mse", strategy)


def test_shared_layer_called_twice():
    keras.utils.set_random_seed(3)
    inp = keras.Input((6,))
    shared = L.Dense(6, activation="tanh")
    out = L.Dense(2)(shared(shared(inp)))
    model = keras.Model(inp, out)
    x = RNG.normal(size=(4, 6)).astype("float32")
    y = RNG.normal(size=(4, 2)).astype("float32")
    _check(model, x, y, "mse", "ghost")


def test_bidirectional_lstm_is_covered_by_its_ghost_rule():
    keras.utils.set_random_seed(4)
    # Named: Keras's automatic names depend on how many layers the process made before.
    model = _seq(L.Embedding(20, 8), L.Bidirectional(L.LSTM(5, name="rnn")),
                 L.Dense(4, activation="tanh"), L.Dense(1), inp=((9,), "int32"))
    x = RNG.integers(0, 20, size=(4, 9)).astype("int32")
    y = RNG.normal(size=(4, 1)).astype("float32")
    _check(model, x, y, "mse", "ghost", expect_covered=["forward_rnn", "backward_rnn"])
    _check(model, x, y, "mse", "vmap")


_RNN_VARIANTS = {
    # Keras's masking semantics: masked steps keep the state; their output is the previous
    # one, or zeros with zero_output_for_mask (which Bidirectional sets with sequences).
    "sequences_masked": lambda: _seq(L.Embedding(20, 8, mask_zero=True),
                                     L.Bidirectional(L.LSTM(5, return_sequences=True)),
                                     L.GlobalAveragePooling1D(), L.Dense(1), inp=((9,), "int32")),
    "last_masked": lambda: _seq(L.Embedding(20, 8, mask_zero=True), L.LSTM(5), L.Dense(1),
                                inp=((9,), "int32")),
    "backwards_no_bias_stacked": lambda: _seq(
        L.Embedding(20, 8), L.LSTM(5, go_backwards=True, use_bias=False, return_sequences=True),
        L.LSTM(3, activation="relu"), L.Dense(1), inp=((9,), "int32")),
    "gru_sequences_masked": lambda: _seq(L.Embedding(20, 8, mask_zero=True),
                                         L.Bidirectional(L.GRU(5, return_sequences=True)),
                                         L.GlobalAveragePooling1D(), L.Dense(1),
                                         inp=((9,), "int32")),
    "gru_reset_before_backwards": lambda: _seq(
        L.Embedding(20, 8, mask_zero=True), L.GRU(5, reset_after=False, go_backwards=True),
        L.Dense(1), inp=((9,), "int32")),
    "gru_no_bias_stacked": lambda: _seq(
        L.Embedding(20, 8), L.GRU(5, use_bias=False, return_sequences=True),
        L.GRU(3, reset_after=False), L.Dense(1), inp=((9,), "int32")),
}


@pytest.mark.parametrize("name", sorted(_RNN_VARIANTS))
def test_recurrent_variants_match_brute_force(name):
    keras.utils.set_random_seed(7)
    model = _RNN_VARIANTS[name]()
    x = RNG.integers(1, 20, size=(4, 9)).astype("int32")
    x[1:, -3:] = 0  # trailing padding on all but the first example
    x[2, 2] = 0  # and a hole inside one sequence
    y = RNG.normal(size=(4, 1)).astype("float32")
    _check(model, x, y, "mse", "ghost", clip=0.1)


def test_lstm_with_dropout_falls_back_to_vmap():
    keras.utils.set_random_seed(8)
    model = _seq(L.Embedding(20, 8), L.LSTM(5, dropout=0.3), L.Dense(1), inp=((9,), "int32"))
    x = RNG.integers(0, 20, size=(4, 9)).astype("int32")
    y = RNG.normal(size=(4, 1)).astype("float32")
    loss_fn = build_per_example_loss("mse")
    with pytest.raises(ValueError, match="no ghost-norm rule"):
        clipped_sum(model, x, y, None, loss_fn, 1.0, norm_strategy="ghost")
    # "auto" computes its weights' per-example gradients by the vectorized fallback.
    res = clipped_sum(model, x, y, None, loss_fn, 1.0, norm_strategy="auto")
    assert all(np.all(np.isfinite(g.numpy())) for g in res.grads)


class _TiedOutput(L.Layer):
    """Logits from the embedding table itself (tied input/output embeddings)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True)


def test_tied_weights_read_outside_their_layer_take_the_exact_fallback():
    # The table gets gradient from the lookup (a ghost term) and from the output projection
    # (no term): ghost factors alone would miss the second part. It must match brute force.
    keras.utils.set_random_seed(9)
    inp = keras.Input((5,), dtype="int32")
    emb = L.Embedding(12, 4)
    h = L.GlobalAveragePooling1D()(L.Dense(4, activation="tanh")(emb(inp)))
    model = keras.Model(inp, _TiedOutput(emb)(h))
    x = RNG.integers(0, 12, size=(4, 5)).astype("int32")
    y = RNG.integers(0, 12, size=4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    _check(model, x, y, loss, "auto", clip=0.5)
    with pytest.raises(ValueError, match="no ghost-norm rule"):
        _check(model, x, y, loss, "ghost")


def test_unknown_batch_keeps_the_static_factor_shapes():
    # Poisson-sampled batches have an unknown size when traced. The factors must keep their
    # static (T, d) so the ghost/materialised choice is the same as for a fixed batch (it
    # was not: an unknown T picked the B*T^2 ghost form, 4x slower on the tutorial CNN).
    seen = []

    @tf.function(input_signature=[tf.TensorSpec([None, 6, 6, 3])])
    def shapes(x):
        seen.append(ghost.rows(x).shape.as_list())
        seen.append(ghost.conv_patches(x, (2, 2), (1, 1), (1, 1), "valid").shape.as_list())
        return x

    shapes(tf.zeros([2, 6, 6, 3]))
    assert seen == [[None, 36, 3], [None, 25, 12]]


def test_clipped_sum_traced_with_unknown_batch_matches_brute_force():
    keras.utils.set_random_seed(10)
    model = _seq(L.Conv2D(3, 3, activation="tanh"), L.Flatten(), L.Dense(2), inp=((6, 6, 2),))
    x = RNG.normal(size=(5, 6, 6, 2)).astype("float32")
    y = RNG.normal(size=(5, 2)).astype("float32")
    loss_fn = build_per_example_loss("mse")
    bf = _brute_force(model, loss_fn, x, y, model.trainable_variables)
    fn = tf.function(lambda a, b: clipped_sum(model, a, b, None, loss_fn, 0.3).norms,
                     input_signature=[tf.TensorSpec([None, 6, 6, 2]), tf.TensorSpec([None, 2])])
    np.testing.assert_allclose(fn(x, y).numpy(), _norms(bf), rtol=1e-5)


def test_custom_layer_fallback_next_to_a_gru():
    keras.utils.set_random_seed(5)

    class Scale(L.Layer):
        def build(self, shape):
            self.s = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.s

    model = _seq(L.GRU(4, return_sequences=True), Scale(), L.GlobalMaxPooling1D(), L.Dense(1),
                 inp=((5, 3),))
    x = RNG.normal(size=(3, 5, 3)).astype("float32")
    y = RNG.normal(size=(3, 1)).astype("float32")
    _check(model, x, y, "mse", "auto")


def test_dropout_consistent_between_norm_and_sum():
    # With dropout the norm and the summed gradient must come from one forward pass:
    # every example's clipped contribution stays <= C (checked on batches of one).
    keras.utils.set_random_seed(6)
    model = _seq(L.Dense(16, activation="relu"), L.Dropout(0.5), L.Dense(3), inp=((6,),))
    x = RNG.normal(size=(8, 6)).astype("float32") * 5
    y = RNG.integers(0, 3, size=8)
    loss_fn = build_per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for i in range(8):
        res = clipped_sum(model, x[i:i + 1], y[i:i + 1], None, loss_fn, 0.01)
        total = np.sqrt(sum(np.sum(np.square(g.numpy())) for g in res.grads))
        assert total <= 0.01 * (1 + 1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
