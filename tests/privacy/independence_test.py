"""Models that mix the examples of a batch are refused; adapted preprocessing is reported."""

import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_dp.core import build_per_example_loss, carrier_for, clipped_sum  # noqa: E402
from tf_dp.core.independence import (  # noqa: E402
    adapted_layers_warning,
    adapted_preprocessing_layers,
    check_before_private_training,
    check_ghost_rows_are_examples,
    check_per_example_independence,
    warn_adapted_layers,
)
from tf_dp.data import PoissonSampler  # noqa: E402
from tf_dp.layers import reparametrize  # noqa: E402

L = keras.layers
RNG = np.random.default_rng(0)
X = RNG.normal(size=(12, 6)).astype("float32")
Y = RNG.integers(0, 3, size=12)
XENT = build_per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))


# ------------------------------------------------------------------ layers that mix examples


class BatchMean(L.Layer):
    """``x - mean over the batch``: the centring a hand-written batch norm does."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0)


class PerBatchSize(L.Layer):
    """Divides by the batch size: no row sees another, yet removing one rescales all."""

    def call(self, x):
        return x * (8.0 / tf.cast(tf.shape(x)[0], x.dtype))


class RollBatch(L.Layer):
    def call(self, x):
        return x + tf.roll(x, shift=1, axis=0)


class CumulativeBatch(L.Layer):
    """Row i sees rows 0..i: only a comparison that keeps the LATER rows catches it."""

    def call(self, x):
        return tf.cumsum(x, axis=0)


class GradientOnlyMix(L.Layer):
    """Forward is the identity; the backward pass subtracts the batch mean."""

    def call(self, x):
        m = tf.reduce_mean(x, axis=0)
        return x - m + tf.stop_gradient(m)


class MixingDense(L.Layer):
    """A trainable layer that adds the batch mean of its own projection."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 5), initializer="glorot_uniform")

    def call(self, x):
        z = tf.matmul(x, self.kernel)
        return z + 0.5 * tf.reduce_mean(z, axis=0, keepdims=True)


class Block(L.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.Dense(5, activation="tanh", name="inner_dense")
        self.mix = MixingDense(name="deep_mixer")

    def call(self, x):
        return self.mix(self.inner(x))


class Deep(keras.Model):
    def __init__(self):
        super().__init__()
        self.stem = L.Dense(6, activation="relu", name="stem")
        self.block = Block(name="block")
        self.head = L.Dense(3, name="head")

    def call(self, x, training=None):
        return self.head(self.block(self.stem(x)))


class MixesInItsOwnCall(keras.Model):
    def __init__(self):
        super().__init__()
        self.a = L.Dense(5, activation="tanh", name="a")
        self.b = L.Dense(3, name="b")

    def call(self, x):
        h = self.a(x)
        return self.b(h - tf.reduce_mean(h, axis=0))


class TransposedNoise(L.Layer):
    """Per-example noise drawn as (features, batch): its first rows differ between batch sizes,
    so only the fallback without random layers tells it from a batch-size dependence."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gen = keras.random.SeedGenerator(3)

    def call(self, x, training=None):
        if not training:
            return x
        noise = keras.random.normal((x.shape[-1], tf.shape(x)[0]), seed=self.gen)
        return x + 0.3 * tf.transpose(noise)


class StatefulNoise(L.Layer):
    """Noise from TensorFlow's global stateful generator: cannot be replayed."""

    def call(self, x, training=None):
        return x + tf.random.normal(tf.shape(x)) if training else x


def _seq(*layers, inp=(6,), dtype="float32"):
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input(inp, dtype=dtype), *layers])


def _mlp(middle):
    return _seq(L.Dense(8, activation="tanh"), *middle, L.Dense(3))


@pytest.mark.parametrize("layer, cause, found_by", [
    (lambda: BatchMean(name="batch_mean"), "'batch_mean' \\(BatchMean\\)", "were replaced"),
    (lambda: RollBatch(name="roll"), "'roll' \\(RollBatch\\)", "were replaced"),
    (lambda: CumulativeBatch(name="cumsum"), "'cumsum' \\(CumulativeBatch\\)", "were replaced"),
    (lambda: PerBatchSize(name="per_batch"), "'per_batch' \\(PerBatchSize\\)",
     "batch changed from 8 to 4 examples, padded to a larger size"),
])
def test_mixing_layers_are_refused_and_named(layer, cause, found_by):
    model = _mlp([layer()])
    with pytest.raises(ValueError, match=f"{cause} mixes the examples.*{found_by}.*not bounded "
                                         "by the clipping norm.*GroupNormalization"):
        check_per_example_independence(model, X, Y, None, XENT)


def test_mixing_next_to_dropout_is_still_found():
    model = _mlp([L.Dropout(0.3), BatchMean(name="batch_mean"), L.GaussianNoise(0.2)])
    with pytest.raises(ValueError, match="'batch_mean'"):
        check_per_example_independence(model, X, Y, None, XENT)
    model = _mlp([L.Dropout(0.3), PerBatchSize(name="per_batch")])
    with pytest.raises(ValueError, match="'per_batch'.*batch changed"):
        check_per_example_independence(model, X, Y, None, XENT)


def test_trainable_mixing_layer_deep_in_a_subclassed_model():
    model = Deep()  # unbuilt: the check builds it
    with pytest.raises(ValueError, match="'deep_mixer' \\(MixingDense\\)"):
        check_per_example_independence(model, X, Y, None, XENT)


def test_mixing_in_a_models_own_call():
    with pytest.raises(ValueError, match="call of MixesInItsOwnCall .* itself \\(outside its "
                                         "sublayers\\)"):
        check_per_example_independence(MixesInItsOwnCall(), X, Y, None, XENT)


def test_gradient_only_mixing():
    model = _mlp([GradientOnlyMix()])
    with pytest.raises(ValueError, match="gradient of the per-example loss"):
        check_per_example_independence(model, X, Y, None, XENT)


def test_mixing_loss():
    def centred(y_true, y_pred, sample_weight=None):
        losses = XENT(y_true, y_pred, sample_weight)
        return losses - tf.reduce_mean(losses) + 1.0

    with pytest.raises(ValueError, match="The loss function mixes"):
        check_per_example_independence(_mlp([]), X, Y, None, centred)



def test_rows_whose_first_time_step_weighs_zero_are_still_probed():
    """Session 21 audit: the probe took the rows whose FIRST weight entry was positive, so
    per-time-step weights of left-padded sequences (step 0 weighted 0) left no probe rows;
    a layer normalising across the batch (UnitNormalization(axis=0)) trained, 3.23 C. The
    probe now takes every row with a non-zero weight, as the private step counts them."""
    import tf_dp  # noqa: PLC0415

    steps = 4
    rng = np.random.default_rng(51)
    x = rng.normal(size=(8, steps, 3)).astype("float32")
    y = rng.normal(size=(8, steps, 2)).astype("float32")
    weights = np.ones((8, steps), "float32")
    weights[:, 0] = 0.0
    keras.utils.set_random_seed(9)
    i = keras.Input((steps, 3))
    h = keras.layers.UnitNormalization(axis=0)(keras.layers.Dense(3)(i))
    model = tf_dp.keras.make_private(keras.Model(i, keras.layers.Dense(2)(h)))
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=0.05, noise_multiplier=0.0,
                                        learning_rate=1.0), loss="mse")
    with pytest.raises(ValueError, match="UnitNormalization.*mixes the examples"):
        model.train_on_batch(x, y, sample_weight=weights)

def test_batch_norm_keeps_its_specific_message():
    model = _mlp([L.BatchNormalization(name="bn")])
    with pytest.raises(ValueError, match="'bn' is a BatchNormalization layer: its batch "
                                         "statistics mix examples"):
        check_per_example_independence(model, X, Y, None, XENT)


def _text_model(length):
    import tf_dp  # noqa: PLC0415

    strings = keras.Input((), dtype="string")
    tokens = L.TextVectorization(vocabulary=["a", "b", "c"], output_sequence_length=length,
                                 name="vectorize")(strings)
    h = L.GlobalAveragePooling1D()(L.Embedding(6, 3, mask_zero=True)(tokens))
    return tf_dp.keras.make_private(keras.Model(strings, L.Dense(2)(h)))


def test_a_text_vectorization_padding_to_the_batchs_longest_is_refused():
    # Session 25 audit: TextVectorization(output_sequence_length=None) pads each batch to
    # its longest text, so one example set every other's length (2.41 C moved, no caveat);
    # the independence check caught it only when the first batch's rows had mixed lengths.
    # Refused by the layer's configuration, whatever the data.
    import tf_dp  # noqa: PLC0415

    same_length = np.array(["a b"] * 12 + ["a b c a b c a"] * 4)
    y = np.zeros(16, np.int32)
    for texts in (same_length, same_length[::-1]):
        model = _text_model(None)
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss="sparse_categorical_crossentropy")
        with pytest.raises(ValueError, match="'vectorize' is a TextVectorization with "
                                             "output_sequence_length=None"):
            model.train_on_batch(texts, y)
    model = _text_model(8)  # a fixed length: runs
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss="sparse_categorical_crossentropy")
    model.train_on_batch(same_length, y)
    assert model.accountant.steps == 1


def test_frozen_batch_norm_runs_in_inference_mode_and_passes():
    model = _mlp([L.BatchNormalization(name="bn")])
    model.get_layer("bn").trainable = False
    check_per_example_independence(model, X, Y, None, XENT)


def test_padding_rows_are_skipped_and_state_is_restored():
    model = _mlp([L.Dropout(0.5)])
    before = [v.numpy().copy() for v in model.variables]
    weights = np.ones(12, "float32")
    weights[:3] = 0.0
    check_per_example_independence(model, X, Y, weights, XENT)
    for a, v in zip(before, model.variables):
        np.testing.assert_array_equal(a, v.numpy(), err_msg=v.path)


def test_too_few_rows_check_nothing_and_bad_arguments_raise():
    check_per_example_independence(_mlp([BatchMean()]), X[:1], Y[:1], None, XENT)
    with pytest.raises(ValueError, match="`num_rows` must be an integer >= 2, got 1"):
        check_per_example_independence(_mlp([]), X, Y, None, XENT, num_rows=1)
    with pytest.raises(ValueError, match="`rtol` must be > 0, got 0"):
        check_per_example_independence(_mlp([]), X, Y, None, XENT, rtol=0)


def test_unreplayable_randomness_warns_instead_of_refusing():
    with pytest.warns(UserWarning, match="could not check.*cannot be replayed"):
        check_per_example_independence(_mlp([StatefulNoise()]), X, Y, None, XENT)


# ------------------------------------------------------------------ before training


def test_check_before_training_reads_the_first_batch_of_any_input():
    def gen():
        while True:
            yield X[:4], Y[:4]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return X[4 * i:4 * i + 4], Y[4 * i:4 * i + 4]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seeded sampler's warning
        sampler = PoissonSampler(X, Y, expected_batch_size=6, pad_to=12, seed=0)
    inputs = {"arrays": (X, Y, None), "sampler": (sampler, None, None),
              "dataset": (sampler.dataset(), None, None), "pydataset": (Batches(), None, None),
              "dict": ({"features": X}, Y, np.ones(12))}
    for name, (x, y, w) in inputs.items():
        def build(middle):
            inp = keras.Input((6,), name="features")
            out = _mlp(middle)(inp)
            return keras.Model({"features": inp} if name == "dict" else inp, out)

        with pytest.raises(ValueError, match="BatchMean"):
            check_before_private_training(build([BatchMean()]), x, y, w, XENT)
        model = build([])
        assert check_before_private_training(model, x, y, w, XENT), name
        assert not check_before_private_training(model, x, y, w, XENT), name  # done once
    with pytest.warns(UserWarning, match="could not check.*\\(generator\\) cannot be read ahead"):
        assert not check_before_private_training(_mlp([BatchMean()]), gen(), None, None, XENT)


def test_a_small_poisson_batch_never_skips_the_check():
    """At small q the first Poisson batch often holds 0 or 1 rows. The check must then read
    the sampler's data, not the batch (a mixing layer trained silently through
    fit(sampler.dataset()) before), and a batch too small to compare must warn and leave the
    model unchecked, never mark it as checked."""
    import tf_dp

    rng = np.random.default_rng(7)
    x = rng.normal(size=(400, 6)).astype("float32")
    y = rng.integers(0, 3, size=400)

    def centring_model():
        inp = keras.Input((6,))
        h = L.Lambda(lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True))(inp)
        return tf_dp.keras.make_private(keras.Model(inp, L.Dense(3)(h)))

    sampler = PoissonSampler(x, y, sampling_probability=0.002)
    for data in (sampler.dataset(), sampler.dataset().map(lambda a, b: (a * 1.0, b))):
        model = centring_model()
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with pytest.raises(ValueError, match="independ|mix"):
            model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    # A dataset of single-example batches: nothing to compare, so a warning and no mark.
    ones = tf.data.Dataset.from_tensor_slices((X, Y)).batch(1)
    model = _mlp([BatchMean()])
    with pytest.warns(UserWarning, match="could not check.*did not run"):
        assert not check_before_private_training(model, ones, None, None, XENT)
    with pytest.warns(UserWarning, match="did not run"):
        assert not check_before_private_training(model, ones, None, None, XENT)  # not marked


def test_a_map_after_the_sampler_that_changes_the_input_structure_never_skips_the_check():
    """A map after the sampler (masking, a second input) gives the model inputs the sampler's
    raw rows do not fit. The check must then read the mapped dataset's own batches: a mixing
    model is refused, a per-example one passes and is marked checked (it was skipped with a
    warning before)."""
    import tf_dp

    rng = np.random.default_rng(8)
    x = rng.normal(size=(300, 6)).astype("float32")
    y = rng.integers(0, 3, size=300)
    sampler = PoissonSampler(x, y, sampling_probability=0.05)
    mapped = sampler.dataset().map(lambda a, b: ({"values": a, "scale": 2.0 * a[:, :1]}, b))

    def model_with(mixing):
        values, scale = keras.Input((6,), name="values"), keras.Input((1,), name="scale")
        h = L.Concatenate()([values, scale])
        if mixing:
            h = L.Lambda(lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True))(h)
        model = tf_dp.keras.make_private(keras.Model({"values": values, "scale": scale},
                                                     L.Dense(3)(h)))
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with pytest.raises(ValueError, match="independ|mix"):
        model_with(mixing=True).fit(mapped, epochs=1, steps_per_epoch=2, verbose=0)
    good = model_with(mixing=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not check")
        good.fit(mapped, epochs=1, steps_per_epoch=2, verbose=0)
    assert not check_before_private_training(good, mapped, None, None, XENT)  # marked


def test_check_before_training_runs_again_when_the_architecture_changes():
    model = _mlp([L.BatchNormalization(name="bn")])
    model.get_layer("bn").trainable = False
    assert check_before_private_training(model, X, Y, None, XENT)
    assert not check_before_private_training(model, X, Y, None, XENT)
    model.get_layer("bn").trainable = True
    with pytest.raises(ValueError, match="'bn' is a BatchNormalization layer"):
        check_before_private_training(model, X, Y, None, XENT)


# ------------------------------------------------------------------ no false positives

SEQ = RNG.normal(size=(12, 7, 4)).astype("float32")
TOKENS = RNG.integers(0, 20, size=(12, 7))
TOKENS[:, 5:] = 0  # padding, masked by the embedding
IMAGES = RNG.normal(size=(12, 6, 6, 4)).astype("float32")

PER_EXAMPLE = {
    "dropout_family": (lambda: _mlp([L.Dropout(0.5), L.GaussianNoise(0.5), L.GaussianDropout(0.3),
                                     L.AlphaDropout(0.2), L.ActivityRegularization(0.0)]), X),
    "layer_norm": (lambda: _mlp([L.LayerNormalization(), L.UnitNormalization()]), X),
    "spatial_dropout_group_norm": (lambda: _seq(
        L.Conv2D(4, 3, padding="same"), L.GroupNormalization(2), L.SpatialDropout2D(0.5),
        L.Flatten(), L.Dense(3), inp=(6, 6, 4)), IMAGES),
    "rnn_dropout": (lambda: _seq(
        L.LSTM(5, dropout=0.3, recurrent_dropout=0.3, return_sequences=True),
        L.SpatialDropout1D(0.3), L.GRU(4, dropout=0.3, recurrent_dropout=0.2), L.Dense(3),
        inp=(7, 4)), SEQ),
    "masked_bidirectional": (lambda: _seq(
        L.Embedding(20, 6, mask_zero=True),
        L.Bidirectional(L.LSTM(4, dropout=0.3, return_sequences=True)),
        L.Bidirectional(L.GRU(3)), L.Dense(3), inp=(7,), dtype="int32"), TOKENS),
    "transposed_noise": (lambda: _mlp([TransposedNoise()]), X),
    "augmentation": (lambda: _seq(
        L.RandomFlip(), L.RandomRotation(0.2), L.RandomZoom(0.2), L.RandomContrast(0.3),
        L.Conv2D(2, 3), L.GlobalAveragePooling2D(), L.Dense(3), inp=(6, 6, 4)),
        np.abs(IMAGES)),
    "time_distributed": (lambda: _seq(L.TimeDistributed(L.Dense(5)), L.Dropout(0.3),
                                      L.Conv1D(4, 3), L.GlobalMaxPooling1D(), L.Dense(3),
                                      inp=(7, 4)), SEQ),
    "reparametrized": (lambda: reparametrize(_mlp([L.Dropout(0.2), L.Dense(8)]), rank=2), X),
}


@pytest.mark.parametrize("name", sorted(PER_EXAMPLE))
def test_per_example_models_pass(name):
    build, x = PER_EXAMPLE[name]
    model = build()
    variables = carrier_for(model).privatized
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a refusal nor an "unchecked" warning
        check_per_example_independence(model, x, Y, None, XENT, variables=variables)


def test_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        honest = _mlp([L.Dense(16, activation="tanh")])
        mixing = _mlp([BatchMean(name="batch_mean")])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    check_per_example_independence(honest, X, Y, None, XENT)
    with pytest.raises(ValueError, match="'batch_mean'"):
        check_per_example_independence(mixing, X, Y, None, XENT)


def test_attention_mixes_positions_not_examples():
    tokens = keras.Input((7,), dtype="int32")
    h = L.Embedding(20, 8, mask_zero=True)(tokens)
    h = L.LayerNormalization()(h + L.MultiHeadAttention(2, 4, dropout=0.3)(h, h))
    out = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    keras.utils.set_random_seed(2)
    model = keras.Model(tokens, out)
    check_per_example_independence(model, TOKENS, Y, None, XENT)
    # ... and attention over the batch axis is refused.
    seq = keras.Input((6,))
    h = L.Dense(8)(seq)
    h = L.Lambda(lambda t: tf.squeeze(L.Attention()([t[None], t[None]]), 0), name="batch_attn")(h)
    model = keras.Model(seq, L.Dense(3)(h))
    with pytest.raises(ValueError, match="'batch_attn'"):
        check_per_example_independence(model, X, Y, None, XENT)


def test_multi_input_multi_output_dict_model():
    keras.utils.set_random_seed(3)
    image = keras.Input((6, 6, 4), name="image")
    meta = keras.Input((6,), name="meta")
    h = L.Flatten()(L.Conv2D(2, 3)(image))
    h = L.Concatenate()([h, L.Dense(4)(meta)])
    h = L.Dropout(0.3)(h)
    model = keras.Model({"image": image, "meta": meta},
                        {"cls": L.Dense(3, name="cls")(h), "reg": L.Dense(2, name="reg")(h)})
    loss = build_per_example_loss(
        {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        {"cls": 1.0, "reg": 0.5}, ["cls", "reg"])
    x = {"image": IMAGES, "meta": X}
    y = {"cls": Y, "reg": RNG.normal(size=(12, 2)).astype("float32")}
    check_per_example_independence(model, x, y, np.ones(12, "float32"), loss)

    # The same model with one mixing branch is refused.
    mixed = keras.Model(model.inputs, {"cls": model.outputs[0],
                                       "reg": BatchMean(name="reg_mix")(model.outputs[1])})
    with pytest.raises(ValueError, match="'reg_mix'"):
        check_per_example_independence(mixed, x, y, None, loss)


# ------------------------------------------------------------------ why it matters


def test_one_example_moves_the_clipped_sum_of_a_mixing_model_by_many_c():
    """The attack the check prevents. With batch centring before the first Dense, every
    example's gradient is taken at x_j - mean(x): one outlying example drags all the others'
    inputs (and so their clipped gradients) along, and the sum of clipped gradients, whose
    sensitivity DP-SGD assumes to be C, moves by dozens of C when that one example is removed.
    """
    clip = 0.1
    x = np.random.default_rng(5).normal(size=(64, 6)).astype("float32")
    x[0] = 100.0  # the example whose presence the noise should hide
    y = np.zeros(64, "int64")

    def removal_shift(model):
        with_it = clipped_sum(model, x, y, None, XENT, clip).grads
        without = clipped_sum(model, x[1:], y[1:], None, XENT, clip).grads
        return np.sqrt(sum(np.sum(np.square(a.numpy() - b.numpy()))
                           for a, b in zip(with_it, without)))

    honest = _seq(L.Dense(3))
    mixing = _seq(BatchMean(name="centring"), L.Dense(3))
    assert removal_shift(honest) <= clip * (1 + 1e-4)
    assert removal_shift(mixing) > 20 * clip  # measured: 51 C
    with pytest.raises(ValueError, match="'centring' \\(BatchMean\\) mixes the examples"):
        check_per_example_independence(mixing, x, y, None, XENT)


# ------------------------------------------------------------------ adapted preprocessing


def test_adapted_layers_are_found():
    data = RNG.normal(2.0, 3.0, size=(20, 3)).astype("float32")
    adapted = L.Normalization(name="norm_adapted")
    adapted.adapt(data)
    given = L.Normalization(mean=[0.0, 1.0, 2.0], variance=[1.0, 1.0, 1.0], name="norm_given")
    given.build((None, 3))
    untouched = L.Normalization(name="norm_untouched")
    untouched.build((None, 3))
    bins = L.Discretization(num_bins=3, name="bins_adapted")
    bins.adapt(data[:, 0])
    fixed_bins = L.Discretization(bin_boundaries=[0.0, 1.0], name="bins_fixed")
    text = L.TextVectorization(max_tokens=20, name="text_adapted")
    text.adapt(["a private review", "another private review"])
    text_fixed = L.TextVectorization(vocabulary=["a", "review"], name="text_fixed")
    words = L.StringLookup(name="words_adapted")
    words.adapt(["x", "y", "y"])
    ints = L.IntegerLookup(name="ints_adapted")
    ints.adapt(np.array([3, 4, 4]))
    ints_fixed = L.IntegerLookup(vocabulary=[3, 4], name="ints_fixed")

    every = [adapted, given, untouched, bins, fixed_bins, text, text_fixed, words, ints,
             ints_fixed]
    found = [layer.name for layer in every if adapted_preprocessing_layers(layer)]
    assert found == ["norm_adapted", "bins_adapted", "text_adapted", "words_adapted",
                     "ints_adapted"]


def test_adapted_layer_in_a_model_warns():
    norm = L.Normalization(name="stats")
    norm.adapt(X)
    model = keras.Sequential([keras.Input((6,)), norm, L.Dense(3)])
    assert adapted_preprocessing_layers(model) == [norm]
    with pytest.warns(UserWarning, match="'stats' \\(Normalization\\) were fitted with "
                                         "adapt\\(\\).*OUTSIDE the privacy guarantee"):
        assert warn_adapted_layers(model) == [norm]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_adapted_layers(_mlp([])) == []
    # A TextVectorization is reported once, not also through its inner StringLookup.
    text = L.TextVectorization(name="vectorize")
    text.adapt(["some private text"])
    strings = keras.Input((), dtype="string")
    model = keras.Model(strings, L.Embedding(10, 2)(text(strings)))
    assert [layer.name for layer in adapted_preprocessing_layers(model)] == ["vectorize"]
    assert "public" in adapted_layers_warning([text])


# ------------------------------------------------------------------ the check's outcome is not a membership test


def _layer_norm_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((9,)), L.LayerNormalization(), L.Dense(2)])


def _crafted_rounding_example(others, candidates=60):
    """A near-constant input (1e6 and a few ulps): LayerNormalization scales its rounding to
    unit variance. The candidate whose normalised row moves most between unpadded batches of
    8 and 4 rows (the rows after it: the data's next rows, chosen by the adversary)."""
    norm = L.LayerNormalization()
    rng = np.random.default_rng(100)
    best, gap = None, -1.0
    for _ in range(candidates):
        z = (1e6 + 0.0625 * rng.integers(-3, 4, size=(1, 9))).astype(np.float32)
        batch = np.concatenate([z, others[:7]])
        moved = float(np.linalg.norm(norm(batch)[0] - norm(batch[:4])[0]))
        if moved > gap:
            best, gap = z, moved
    return best, gap


def test_a_crafted_example_among_the_probe_rows_does_not_decide_the_check():
    # Session 22 audit F1: the check compared unpadded passes of 8 and 4 rows, where this
    # CPU's kernels round a row by batch size. A crafted example at row 0 made the check
    # refuse a per-example model (10 of 10 trials): whether training started told whether z
    # was in the data. The passes are now padded as the private step pads them.
    rng = np.random.default_rng(0)
    others = rng.normal(size=(40, 9)).astype(np.float32)
    z, gap = _crafted_rounding_example(others)
    assert gap > 1e-3  # precondition: unpadded 8- and 4-row passes differ far beyond rtol
    x = np.concatenate([z, others])
    y = rng.integers(0, 2, size=len(x))
    assert check_per_example_independence(_layer_norm_model(), x, y, None, XENT)
    # A model that mixes is still refused next to it.
    mixing = keras.Sequential([keras.Input((9,)), L.LayerNormalization(), BatchMean(),
                               L.Dense(2)])
    with pytest.raises(ValueError, match="mixes the examples"):
        check_per_example_independence(mixing, x, y, None, XENT)


def _linear(*middle):
    return _seq(L.Dense(8), *middle, L.Dense(3))  # 3e38 overflows to inf logits


def test_an_overflowing_example_among_the_probe_rows_does_not_decide_the_check():
    # Session 22 audit F2: the check weighted rows by multiplication, so one row whose pass
    # overflows made every gradient NaN and the check gave up (UNCHECKED, which voids the
    # report and is saved with the model): the caveat told z was among the first rows. The
    # check now leaves such rows out, as the private step gives them factor 0.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    for at in (0, 5):
        crafted = x.copy()
        crafted[at] = 3e38
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "could not check" warning
            assert check_per_example_independence(_linear(), crafted, y, None, XENT)
            assert check_ghost_rows_are_examples(_linear(), crafted, y, None, XENT)
    mixing = _linear(BatchMean())
    with pytest.raises(ValueError, match="mixes the examples"):
        check_per_example_independence(mixing, crafted, y, None, XENT)
    # Through fit: the report and the caveats are those of the data without z.
    import tf_dp

    model = tf_dp.keras.make_private(_linear())
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(crafted, y, batch_size=8, verbose=0)
    assert model.privacy_caveats == []
    assert model.privacy_report()["guarantee_holds"] is True


def test_a_gradient_just_below_the_float32_maximum_does_not_decide_the_check():
    # Session 22 audit (second sweep): the comparisons weighted rows by up to 1.5, so a row
    # whose gradient was finite at weight 1 (kept by the finite filter) overflowed in them
    # and the check gave up (UNCHECKED) exactly when that example was a probe row with a
    # weight above 1. The weights are now at most 1/n.
    fmax = float(np.finfo(np.float32).max)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    y = rng.normal(size=(40, 1)).astype(np.float32)
    target = 1e19
    for at in range(8):
        crafted_x, crafted_y = x.copy(), y.copy()
        crafted_x[at] = 0.0
        crafted_x[at, 0] = 0.995 * fmax / (2 * target)  # |gradient|: 0.995 of the maximum
        crafted_y[at] = target
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), L.Dense(1, kernel_initializer="zeros")])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "could not check" warning
            assert check_per_example_independence(model, crafted_x, crafted_y, None,
                                                  build_per_example_loss("mse"))


def test_a_row_the_model_raises_on_is_left_out_and_its_values_are_not_quoted():
    # Session 22 audit: an Embedding id beyond the table among the probe rows made the check
    # give up (UNCHECKED) although the row was never sampled, and the warning quoted
    # TensorFlow's message: "indices[3,2] = 999 is not in [0, 50)", the row and its value.
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, size=(40, 6)).astype(np.int32)
    ids[3, 2] = 999
    y = rng.integers(0, 2, size=40)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), L.Embedding(50, 4),
                              L.GlobalAveragePooling1D(), L.Dense(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_per_example_independence(model, ids, y, None, XENT)
        assert check_ghost_rows_are_examples(model, ids, y, None, XENT)
    # A model that fails on every row still says so, without the message.
    ids[:] = 999
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not check_per_example_independence(model, ids, y, None, XENT)
    text = " ".join(str(w.message) for w in caught)
    assert "could not" in text and "999" not in text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
