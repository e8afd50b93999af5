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
docs/rgp_results.md, "Bugs"). The functional attention (examples/_transformer.py, shared with
gradient_spectra.py) has the same math (scaled dot-product attention, per-head projections as
EinsumDense with MultiHeadAttention's equations) with the projections as top-level layers,
which `reparametrize` does swap.
--attention=keras uses MultiHeadAttention and so reparametrizes only the feed-forward layers
(the example prints which layers were swapped).

  python examples/rgp_transformer.py --method=rgp --rank=4
  python examples/rgp_transformer.py --method=dpsgd          # DP-Adam, no reparametrization
  python examples/rgp_transformer.py --method=lsg --sparsity=0.25
  python examples/rgp_transformer.py --attention=keras       # RGP on feed-forward only
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402

from tf_dp.accounting.functions import epsilon_text  # noqa: E402
from _report import fit_and_report  # noqa: E402  (examples/_report.py)
import _transformer  # noqa: E402  (examples/_transformer.py: the model)
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


# ----------------------------------------------------------------------------- model


def transformer_classifier(vocab_size) -> keras.Model:
    return _transformer.transformer_classifier(
        vocab_size, FLAGS.sequence_length, FLAGS.embed_dim, FLAGS.num_heads, FLAGS.ff_dim,
        FLAGS.num_blocks, FLAGS.attention)


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
              f"epsilon {epsilon_text(planned)} at delta "
              f"{FLAGS.delta:g}")
    print(f"batch {FLAGS.batch_size}  epochs {FLAGS.epochs}  lr {FLAGS.learning_rate}  "
          f"seed {FLAGS.seed}", flush=True)

    fit_and_report(model, (x_train, y_train), (x_test, y_test), FLAGS.batch_size, FLAGS.epochs,
                   private, FLAGS.delta)

if __name__ == "__main__":
    app.run(main)
