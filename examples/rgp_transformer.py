r"""A small Transformer encoder on Rotten Tomatoes snippets, trained with RGP / LSG or DP-Adam.

Model: TextVectorization (adapted on the training split only, applied outside the model; its
vocabulary is a statistic of the private texts released outside epsilon, see main()) ->
token Embedding + learned positional Embedding -> --num_blocks x [multi-head self-attention
-> Add -> LayerNorm -> Dense(ff, relu) -> Dense -> Add -> LayerNorm] -> masked mean pooling
-> Dense(2).

RGP (Yu et al., ICML 2021) is applied, through `tf_dp.layers.reparametrize`, to the
attention projections (query, key, value, output: EinsumDense) and to the feed-forward
Dense layers; LSG (Ito et al.) adds unit sparsity. The embeddings, LayerNorms, biases and the
classifier are privatized as usual (exact per-example clipping).

Why the attention is written out (--attention=functional, the default) rather than using
keras.layers.MultiHeadAttention: `reparametrize` clones the model layer by layer, and
MultiHeadAttention is one layer whose four EinsumDense projections are built inside it. They
are never swapped, even when named in `layers=[...]`, and no error is raised (see
docs/rgp_results.md, "Bugs"). The functional attention below has the same math (scaled
dot-product attention, per-head projections as EinsumDense with MultiHeadAttention's
equations) with the projections as top-level layers, which `reparametrize` does swap.
--attention=keras uses MultiHeadAttention and so reparametrizes only the feed-forward layers
(the example prints which layers were swapped).

  python examples/rgp_transformer.py --method=rgp --rank=4
  python examples/rgp_transformer.py --method=dpsgd          # DP-Adam, no reparametrization
  python examples/rgp_transformer.py --method=lsg --sparsity=0.25
  python examples/rgp_transformer.py --attention=keras       # RGP on feed-forward only
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from _report import fit_and_report  # noqa: E402  (examples/_report.py)
from tf_dp.accounting import calibrate_noise_multiplier, compute_epsilon  # noqa: E402
from tf_dp.layers import reparam_layers, reparametrize  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("method", "rgp", ["dpsgd", "rgp", "lsg", "nonprivate"],
                  "dpsgd: DP-Adam on the plain model; rgp / lsg: DP-Adam on the "
                  "reparametrized model; nonprivate: Adam.")
flags.DEFINE_enum("attention", "functional", ["functional", "keras"],
                  "functional: attention projections as top-level EinsumDense layers (RGP "
                  "reaches them); keras: keras.layers.MultiHeadAttention (it does not).")
flags.DEFINE_integer("rank", 4, "Carrier rank r (rgp, lsg).")
flags.DEFINE_float("sparsity", 0.25, "LSG fraction p of units frozen (lsg only).")
flags.DEFINE_integer("max_tokens", 5000, "Vocabulary size of TextVectorization.")
flags.DEFINE_integer("sequence_length", 40, "Tokens per snippet (padded / truncated).")
flags.DEFINE_integer("embed_dim", 64, "Model width.")
flags.DEFINE_integer("num_heads", 4, "Attention heads.")
flags.DEFINE_integer("ff_dim", 128, "Hidden units of the feed-forward block.")
flags.DEFINE_integer("num_blocks", 1, "Transformer blocks.")
flags.DEFINE_integer("epochs", 10, "Epochs (of round(N / batch_size) Poisson-sampled steps).")
flags.DEFINE_integer("batch_size", 256, "Expected batch size (Poisson sampling).")
flags.DEFINE_float("noise_multiplier", None,
                   "Noise multiplier sigma; default: calibrated to --target_epsilon.")
flags.DEFINE_float("target_epsilon", 3.0, "Epsilon to calibrate sigma to (if no sigma given).")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clipping norm C.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_float("delta", 1e-5, "Target delta.")
flags.DEFINE_integer("seed", 0, "Seed for initialisation and carriers only. Noise and Poisson "
                     "sampling always come from fresh OS entropy.")


# ----------------------------------------------------------------------------- layers


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class Positions(keras.layers.Layer):
    """Position ids ``[0, T)`` for every example; weightless, so the table is an Embedding
    (which has an exact per-example norm formula)."""

    def call(self, tokens):
        length = tf.shape(tokens)[1]
        return tf.broadcast_to(tf.range(length)[None, :], tf.shape(tokens))


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class ScaledDotProductAttention(keras.layers.Layer):
    """``softmax(q kᵀ / sqrt(d) + mask) v`` per head; weightless.

    Inputs ``[q, k, v, tokens]`` with ``q, k, v`` of shape ``(B, T, heads, d)``; keys at
    padding tokens (id 0) are masked out.
    """

    def call(self, inputs):
        query, key, value, tokens = inputs
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
        scores = tf.einsum("bqhd,bkhd->bhqk", query * scale, key)
        keep = tf.cast(tokens > 0, scores.dtype)[:, None, None, :]
        scores += (1.0 - keep) * -1e9
        return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, axis=-1), value)


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class MaskedMeanPooling(keras.layers.Layer):
    """Mean over the non-padding positions of ``(B, T, D)``; inputs ``[x, tokens]``."""

    def call(self, inputs):
        x, tokens = inputs
        keep = tf.cast(tokens > 0, x.dtype)[:, :, None]
        return tf.reduce_sum(x * keep, axis=1) / tf.maximum(tf.reduce_sum(keep, axis=1), 1.0)


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class AttentionMask(keras.layers.Layer):
    """``(B, 1, T)`` boolean mask of the non-padding keys, for MultiHeadAttention."""

    def call(self, tokens):
        return (tokens > 0)[:, None, :]


# ----------------------------------------------------------------------------- model


def _functional_attention(x, tokens, name):
    """Self-attention with MultiHeadAttention's EinsumDense equations, as top-level layers."""
    heads, dim = FLAGS.num_heads, FLAGS.embed_dim
    head_dim = dim // heads

    def projection(part):
        return keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, heads, head_dim),
                                        bias_axes="de", name=f"{name}_{part}")(x)

    attended = ScaledDotProductAttention(name=f"{name}_sdpa")(
        [projection("query"), projection("key"), projection("value"), tokens])
    return keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, dim), bias_axes="e",
                                    name=f"{name}_output")(attended)


def _keras_attention(x, tokens, name):
    mask = AttentionMask(name=f"{name}_mask")(tokens)
    return keras.layers.MultiHeadAttention(FLAGS.num_heads, FLAGS.embed_dim // FLAGS.num_heads,
                                           name=f"{name}_mha")(x, x, attention_mask=mask)


def transformer_classifier(vocab_size) -> keras.Model:
    tokens = keras.Input((FLAGS.sequence_length,), dtype="int64", name="tokens")
    x = keras.layers.Embedding(vocab_size, FLAGS.embed_dim, name="token_embedding")(tokens)
    positions = keras.layers.Embedding(FLAGS.sequence_length, FLAGS.embed_dim,
                                       name="position_embedding")(Positions()(tokens))
    x = keras.layers.Add()([x, positions])
    attention = _functional_attention if FLAGS.attention == "functional" else _keras_attention
    for i in range(FLAGS.num_blocks):
        name = f"block{i}"
        # keras.layers.Add, not `x + y`: reparametrize() fails on operator nodes.
        x = keras.layers.Add()([x, attention(x, tokens, f"{name}_attention")])
        x = keras.layers.LayerNormalization(name=f"{name}_ln1")(x)
        y = keras.layers.Dense(FLAGS.ff_dim, activation="relu", name=f"{name}_ff1")(x)
        y = keras.layers.Dense(FLAGS.embed_dim, name=f"{name}_ff2")(y)
        x = keras.layers.LayerNormalization(name=f"{name}_ln2")(keras.layers.Add()([x, y]))
    pooled = MaskedMeanPooling()([x, tokens])
    # Zero-initialised classifier: the first steps start from the uniform prediction (loss
    # log 2) instead of from random logits, which noisy private steps are slow to undo.
    logits = keras.layers.Dense(2, kernel_initializer="zeros", name="classifier")(pooled)
    return keras.Model(tokens, logits)


def reparametrized(model: keras.Model) -> keras.Model:
    """RGP / LSG on every EinsumDense and on the feed-forward Dense layers."""
    names = [layer.name for layer in model._flatten_layers(include_self=False, recursive=True)
             if type(layer) is keras.layers.EinsumDense
             or (type(layer) is keras.layers.Dense and "_ff" in layer.name)]
    top = {layer.name for layer in model.layers}
    nested = [n for n in names if n not in top]
    if nested:
        print(f"note: {nested} are nested inside MultiHeadAttention; reparametrize() cannot "
              "swap them (it clones top-level layers only), so RGP covers the feed-forward "
              "layers only. Use --attention=functional for RGP on the attention projections.")
    names = [n for n in names if n in top]
    return reparametrize(model, rank=FLAGS.rank,
                         sparsity=FLAGS.sparsity if FLAGS.method == "lsg" else None,
                         layers=names, seed=FLAGS.seed)


# ----------------------------------------------------------------------------- training


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    (text_train, y_train), (text_test, y_test) = tf_dp.datasets.load("rotten_tomatoes")
    # Vocabulary from the training split only; the vectorizer stays outside the model so
    # per-example gradients see integer tokens.
    vectorize = keras.layers.TextVectorization(max_tokens=FLAGS.max_tokens,
                                               output_sequence_length=FLAGS.sequence_length)
    vectorize.adapt(tf.constant(text_train))
    # No public text ships with the data, so the vocabulary (the most frequent training words)
    # is computed from the private texts without noise; say so next to the epsilon.
    print("note: the TextVectorization vocabulary was adapted on the training texts: it is "
          "released with the model OUTSIDE the privacy guarantee (the epsilon below does not "
          "cover it; a vocabulary from public text, or hashing, would be covered).")
    x_train = np.asarray(vectorize(tf.constant(text_train)), dtype="int64")
    x_test = np.asarray(vectorize(tf.constant(text_test)), dtype="int64")
    vocab_size = vectorize.vocabulary_size()

    model = transformer_classifier(vocab_size)
    if FLAGS.method in ("rgp", "lsg"):
        model = reparametrized(model)
    swapped = reparam_layers(model)
    n = len(x_train)
    q = FLAGS.batch_size / n
    steps = FLAGS.epochs * max(1, round(1.0 / q))
    private = FLAGS.method != "nonprivate"
    sigma = FLAGS.noise_multiplier
    if private and sigma is None:
        sigma = calibrate_noise_multiplier(sampling_probability=q, steps=steps,
                                           target_epsilon=FLAGS.target_epsilon, delta=FLAGS.delta)
    if private:
        model = tf_dp.keras.make_private(model, delta=FLAGS.delta)
        optimizer = tf_dp.DPAdam(FLAGS.l2_norm_clip, sigma, learning_rate=FLAGS.learning_rate)
    else:
        optimizer = keras.optimizers.Adam(FLAGS.learning_rate)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(f"rotten_tomatoes: {n} train / {len(x_test)} test snippets, vocabulary {vocab_size}, "
          f"{FLAGS.sequence_length} tokens; {trainable} trainable weights; method "
          f"{FLAGS.method}, attention {FLAGS.attention}")
    if swapped:
        kernels = sum(int(np.prod(layer.kernel.shape)) for layer in swapped)
        carriers = sum(int(np.sum(np.broadcast_to(mask.numpy(), var.shape)))
                       for layer in swapped
                       for var, mask in zip(layer.carrier_variables(), layer.noise_masks()))
        print(f"reparametrized at rank {FLAGS.rank}: {[layer.name for layer in swapped]}; "
              f"their {kernels} kernel weights are noised through {carriers} carrier entries")
    if private:
        planned = compute_epsilon(noise_multiplier=sigma, sampling_probability=q, steps=steps,
                                  delta=FLAGS.delta)
        print(f"sigma {sigma:.4f}  C {FLAGS.l2_norm_clip}  q {q:.5f}  steps {steps}  planned "
              f"epsilon {planned:.3f} at delta "
              f"{FLAGS.delta:g}")
    print(f"batch {FLAGS.batch_size}  epochs {FLAGS.epochs}  lr {FLAGS.learning_rate}  "
          f"seed {FLAGS.seed}", flush=True)

    fit_and_report(model, (x_train, y_train), (x_test, y_test), FLAGS.batch_size, FLAGS.epochs,
                   private, FLAGS.delta)

if __name__ == "__main__":
    app.run(main)
