r"""Sentiment classification with a BiLSTM trained by DP-Adam-JL (Bu et al. 2021, §3.1).

The model has the paper's shape (the TensorFlow text-classification tutorial it follows):
a vocabulary of 8,000 tokens, sequences of 150 tokens,
Embedding(8000, 64) -> Bidirectional(LSTM(64)) -> Dense(64, relu) -> Dense(1) (598,209
parameters). It trains with DP-Adam-JL (per-example norms from r JL projections,
``tf_dp.DPAdamJL``) and prints held-out accuracy, epsilon and seconds per epoch after every
epoch. ``--compare`` also trains non-private Adam and exact DP-Adam (same model, data,
batch, learning rate, sigma and C) and prints the three side by side.

Data: the Rotten Tomatoes review snippets that ship offline
(``tf_dp.datasets.load("rotten_tomatoes")``: 10,246 train / 2,562 test, 58% "fresh"), or
IMDb reviews (``--dataset=imdb_reviews``, 25,000 / 25,000) on machines that have a prepared
tensorflow-datasets copy. Snippets are short (about 20 tokens), so most of the 150 positions
are padding; the embedding masks them (``--mask_zero``).

Privacy of the vocabulary: with ``--vocabulary=train`` (the default, as in the paper) the
TextVectorization vocabulary is adapted on the private training texts, so the set of
frequent words is itself computed from private data WITHOUT any privacy protection, and the
reported epsilon does not cover it. ``--vocabulary=hashing`` maps every word to one of
``max_tokens - 1`` hash buckets instead (fixed, data independent): the whole pipeline is then
covered by epsilon, usually at some cost in accuracy. A vocabulary adapted on public text
would also do; none ships with the data here.

Epsilon of the JL optimizers comes from the JL accountant (the clipped contribution has norm
up to C sqrt(r / chi2_r)), which is much larger than for exact clipping at small r; r = 1 has
no finite epsilon at all. The training log also shows epsilon under exact clipping for
reference. Hyper-parameters below are this example's, not the paper's (which are tuned for
IMDb on a GPU).

  python examples/sentiment_bilstm.py                         # DP-Adam-JL, r = 3
  python examples/sentiment_bilstm.py --compare                   # + Adam, exact DP-Adam
  python examples/sentiment_bilstm.py --vocabulary=hashing
  python examples/sentiment_bilstm.py --dataset=imdb_reviews  # needs the tfds copy
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.accounting.functions import epsilon_text  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("dataset", "rotten_tomatoes", ["rotten_tomatoes", "imdb_reviews"],
                  "Data set (tf_dp.datasets.load).")
flags.DEFINE_string("data_dir", None, "tensorflow-datasets data directory (imdb_reviews).")
flags.DEFINE_enum("optimizer", "dpadam_jl", ["dpadam_jl", "dpsgd_jl", "dpadam", "adam"],
                  "Optimizer of the main run (adam: non-private).")
flags.DEFINE_bool("compare", False, "Also train non-private Adam and exact DP-Adam; print all.")
flags.DEFINE_integer("num_projections", 3, "JL projections r (JL optimizers).")
flags.DEFINE_enum("norm_strategy", "auto", ["auto", "ghost", "vmap"],
                  "Per-example norms of exact DP-Adam: auto/ghost use the LSTM ghost rule "
                  "(about 1.8x a non-private step here), vmap vectorized per-example gradients "
                  "(several times slower, and a 16-example batch needs over 4 GiB).")
flags.DEFINE_float("learning_rate", 1e-2, "Learning rate (Adam).")
flags.DEFINE_float("momentum", 0.9, "Momentum (dpsgd_jl).")
flags.DEFINE_float("noise_multiplier", 0.8, "Noise multiplier sigma.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clipping norm C.")
flags.DEFINE_integer("batch_size", 256, "Expected (logical) batch size (Poisson sampling).")
flags.DEFINE_integer("micro_batches", 1,
                     "Private optimizers: split each logical batch into this many micro-batches "
                     "(gradient_accumulation_steps; same result and privacy, less memory).")
flags.DEFINE_integer("epochs", 20, "Epochs (JL needs about 8 before it leaves the majority class; docs/jl_results.md).")
flags.DEFINE_integer("max_tokens", 8000, "Vocabulary size (including padding and OOV).")
flags.DEFINE_integer("sequence_length", 150, "Tokens per text (padded or truncated).")
flags.DEFINE_enum("vocabulary", "train", ["train", "hashing"],
                  "train: TextVectorization adapted on the training texts (leaks the "
                  "vocabulary, see the docstring); hashing: fixed hash buckets (no leak).")
flags.DEFINE_bool("mask_zero", False, "Mask the padding in the embedding (Keras masking semantics; "
                  "the LSTM ghost rule and JL projections support it).")
flags.DEFINE_integer("max_train_examples", 0, "Use only the first N training texts (0: all).")
flags.DEFINE_float("delta", 1e-5, "Target delta.")
flags.DEFINE_integer("seed", 0, "Seed for initialisation only. Noise, JL projections and Poisson "
                     "sampling always come from fresh OS entropy.")


# ------------------------------------------------------------------ data


def _standardize(texts):
    # TextVectorization's default standardization: lower case, punctuation stripped.
    texts = tf.strings.lower(texts)
    return tf.strings.regex_replace(texts, r"[!\"#$%&()\*\+,-\./:;<=>?@\[\\\]^_`{|}~']", "")


def vectorize(train_texts, test_texts):
    """Token ids (N, sequence_length) int32 for both splits; 0 is padding."""
    n, length = FLAGS.max_tokens, FLAGS.sequence_length
    if FLAGS.vocabulary == "train":
        # Adapted on the TRAIN texts only (the test split never informs the vocabulary).
        layer = keras.layers.TextVectorization(max_tokens=n, output_sequence_length=length)
        layer.adapt(tf.constant(train_texts.astype(str)))
        return [layer(tf.constant(t.astype(str))).numpy().astype("int32")
                for t in (train_texts, test_texts)]

    def hashed(texts):
        words = tf.strings.split(_standardize(tf.constant(texts.astype(str))))
        # Buckets 1..n-1; 0 stays the padding id.
        ids = tf.strings.to_hash_bucket_fast(words, n - 1) + 1
        return ids.to_tensor(0, shape=[None, length]).numpy().astype("int32")

    return hashed(train_texts), hashed(test_texts)


def load_data():
    try:
        (x_train, y_train), (x_test, y_test) = tf_dp.datasets.load(FLAGS.dataset, FLAGS.data_dir)
    except tf_dp.datasets.DatasetNotAvailableError as err:
        sys.exit(f"{FLAGS.dataset} is not available on this machine: {err}")
    if FLAGS.max_train_examples:
        x_train, y_train = x_train[:FLAGS.max_train_examples], y_train[:FLAGS.max_train_examples]
    tokens_train, tokens_test = vectorize(x_train, x_test)
    return ((tokens_train, y_train.astype("float32")[:, None]),
            (tokens_test, y_test.astype("float32")[:, None]))


# ------------------------------------------------------------------ model and training


def bilstm(mask_zero: bool) -> keras.Model:
    """Embedding(8000, 64) -> Bidirectional(LSTM(64)) -> Dense(64) -> Dense(1): 598,209."""
    return keras.Sequential([
        keras.Input((FLAGS.sequence_length,), dtype="int32"),
        keras.layers.Embedding(FLAGS.max_tokens, 64, mask_zero=mask_zero),
        keras.layers.Bidirectional(keras.layers.LSTM(64)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1),
    ])


def make_optimizer(name):
    dp = dict(l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=FLAGS.noise_multiplier,
              learning_rate=FLAGS.learning_rate,
              gradient_accumulation_steps=FLAGS.micro_batches)
    if name == "adam":
        return keras.optimizers.Adam(FLAGS.learning_rate)
    if name == "dpadam":
        return tf_dp.DPAdam(norm_strategy=FLAGS.norm_strategy, **dp)
    if name == "dpadam_jl":
        return tf_dp.DPAdamJL(num_projections=FLAGS.num_projections, **dp)
    if name == "dpsgd_jl":
        return tf_dp.DPSGDJL(num_projections=FLAGS.num_projections, momentum=FLAGS.momentum,
                             **dp)
    raise ValueError(name)


class _Report(keras.callbacks.Callback):
    """Held-out accuracy, epsilon and seconds per epoch, printed and kept."""

    def __init__(self, name, x_test, y_test, private):
        super().__init__()
        self.name, self.x_test, self.y_test, self.private = name, x_test, y_test, private
        self.rows = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.time() - self.start
        _, acc = self.model.evaluate(self.x_test, self.y_test, batch_size=512, verbose=0)
        logs = logs or {}
        eps = logs.get("epsilon") if self.private else None
        exact = logs.get("epsilon_exact_clipping")
        self.rows.append((acc, eps, seconds))
        text = "n/a (non-private)" if not self.private else epsilon_text(eps)
        if exact is not None and exact != eps:
            text += f" (exact clipping at this sigma: {epsilon_text(exact)})"
        print(f"[{self.name}] epoch {epoch + 1:2d}  held-out accuracy {acc:.4f}  epsilon {text} "
              f"(delta={FLAGS.delta:g})  {seconds:.1f} s", flush=True)


def train(name, data):
    (x_train, y_train), (x_test, y_test) = data
    keras.utils.set_random_seed(FLAGS.seed)
    model = bilstm(FLAGS.mask_zero)
    private = name != "adam"
    if private:
        model = tf_dp.keras.make_private(model, delta=FLAGS.delta)
    model.compile(optimizer=make_optimizer(name),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")])
    report = _Report(name, x_test, y_test, private)
    # fit's batch_size is one micro-batch for a private model (the logical batch is
    # micro_batches of them).
    batch = FLAGS.batch_size // FLAGS.micro_batches if private else FLAGS.batch_size
    model.fit(x_train, y_train, batch_size=batch, epochs=FLAGS.epochs, verbose=0,
              callbacks=[report])
    acc, eps, _ = report.rows[-1]
    seconds = [s for _, _, s in report.rows]
    return {"accuracy": acc, "epsilon": eps, "first_epoch_s": seconds[0],
            "epoch_s": float(np.mean(seconds[1:])) if len(seconds) > 1 else seconds[0]}


_LABELS = {"adam": "non-private Adam", "dpadam": "DP-Adam (exact, {norm_strategy})",
           "dpadam_jl": "DP-Adam-JL (r={r})", "dpsgd_jl": "DP-SGD-JL (r={r})"}


def main(argv):
    del argv
    data = load_data()
    (x_train, y_train), (x_test, y_test) = data
    majority = max(float(np.mean(y_test)), 1 - float(np.mean(y_test)))
    print(f"{FLAGS.dataset}: {len(x_train)} train / {len(x_test)} held-out texts; vocabulary "
          f"{FLAGS.vocabulary} ({FLAGS.max_tokens} ids), length {FLAGS.sequence_length}; "
          f"majority class {majority:.4f}; batch {FLAGS.batch_size}, lr {FLAGS.learning_rate:g}, "
          f"sigma {FLAGS.noise_multiplier:g}, C {FLAGS.l2_norm_clip:g}", flush=True)
    if FLAGS.vocabulary == "train":
        print("note: the TextVectorization vocabulary was adapted on the private training texts: "
              "it is outside the reported epsilon (use --vocabulary=hashing for a vocabulary "
              "that reveals nothing).", flush=True)
    names = [FLAGS.optimizer]
    if FLAGS.compare:
        names += [n for n in ("adam", "dpadam") if n != FLAGS.optimizer]
    results = {name: train(name, data) for name in names}
    print(f"\n{'optimizer':28s} {'accuracy':>9s} {'epsilon':>9s} {'s/epoch':>8s} "
          f"{'1st epoch s':>11s}   ({FLAGS.epochs} epochs; 1st epoch includes tracing)")
    for name, r in results.items():
        label = _LABELS[name].format(r=FLAGS.num_projections, norm_strategy=FLAGS.norm_strategy)
        eps = "n/a" if r["epsilon"] is None else epsilon_text(r['epsilon'])
        print(f"{label:28s} {r['accuracy']:9.4f} {eps:>9s} {r['epoch_s']:8.1f} "
              f"{r['first_epoch_s']:11.1f}")


if __name__ == "__main__":
    app.run(main)
