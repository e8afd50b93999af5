r"""Mega-batch DP-AdamW pre-training of a tiny masked-language model (Anil et al. 2021).

Anil, Ghazi, Gupta, Kumar, Manurangsi, "Large-Scale Differentially Private BERT" (2021):
at a fixed epsilon and a fixed number of steps, larger batches raise the gradient
signal-to-noise ratio of DP-SGD (§5.2.1) and the masked-token accuracy; an increasing
batch-size schedule reaches the large batch's accuracy with fewer examples processed
(§5.2.2). This example repeats the comparison at small scale on the Rotten Tomatoes snippets
that ship offline (tf_dp.datasets, 10,246 training / 2,562 held-out snippets):

- model: token + learned position Embedding -> 2 pre-LayerNorm Transformer encoder blocks
  (keras.layers.MultiHeadAttention, GELU feed-forward) -> LayerNorm -> Dense over the
  vocabulary; every layer has a ghost-norm rule, so clipping is exact and per example;
- BERT-style masking: 15 % of each snippet's word tokens are selected (at least one), of
  which 80 % become [MASK], 10 % a random word, 10 % stay; the masks are redrawn every
  time a snippet is sampled (a per-example map after the Poisson sampler, RoBERTa's dynamic
  masking), the held-out snippets are masked once with the seed;
- per-example loss: the cross-entropy averaged over the example's selected positions, so
  each snippet is one unit of privacy whatever its length;
- the configurations, all DP-AdamW at the same (epsilon, delta) and the same number of
  logical steps, sigma calibrated for each by ``DPAdamW.for_target_epsilon``: expected
  batch B, 4B, 16B (large logical batches through ``max_physical_batch_size``, i.e.
  accumulated micro-batches with noise once per logical step), and an increasing schedule
  4B -> 8B -> 12B -> 16B in four equal stages (``tf_dp.schedules.PiecewiseBatchSize``; it
  starts at a quarter of the final batch, as the paper's 262K -> 1M); plus
  non-private AdamW at 16B for reference, and optionally DP-AdamW at 16B with other weight
  decays (--weight_decays);
- measured: the private gradient SNR of every logical step (``fit(gradient_snr="private")``,
  computed from the noised update, inside the guarantee) and the masked-token accuracy on
  the held-out snippets.

  python examples/mlm_megabatch.py                       # the table and docs/figures/mlm_*.png
  python examples/mlm_megabatch.py --weight_decays=1    # + DP-AdamW at 16B with weight decay 1
  python examples/mlm_megabatch.py --smoke --output_dir=/tmp/mlm   # a few minutes

The vocabulary (TextVectorization adapted on the training snippets) is a statistic of the
private texts computed without noise: it is outside the epsilon printed (a vocabulary from
public text would not be). Seeds choose the data split, the masking and the initial weights
only; noise and Poisson sampling come from fresh OS entropy.
"""

import json
import math
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402

from tf_dp.accounting.functions import epsilon_text  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 16, "B: the smallest expected logical batch.")
flags.DEFINE_integer("steps", 300, "Logical steps of every configuration.")
flags.DEFINE_list("configs", ["B", "4B", "16B", "schedule", "nonprivate"],
                  "Configurations to run: B, 4B, 16B (expected batch), schedule (4B, 8B, "
                  "12B, 16B in four equal stages by default), nonprivate (AdamW at 16B).")
flags.DEFINE_list("schedule_multiples", ["4", "8", "12", "16"],
                  "Batch sizes of the schedule's equal-length stages, in multiples of B.")
flags.DEFINE_list("weight_decays", [],
                  "Extra DP-AdamW runs at 16B with these weight decays (the sweep).")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay of the main configurations.")
flags.DEFINE_float("target_epsilon", 5.0, "Epsilon every private configuration is calibrated to.")
flags.DEFINE_float("delta", 1e-5, "Delta.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clipping norm C.")
flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate (constant).")
flags.DEFINE_integer("max_physical_batch_size", 256,
                     "At most this many examples through the model at once.")
flags.DEFINE_integer("max_tokens", 1000, "Vocabulary size (with padding and [UNK]).")
flags.DEFINE_integer("sequence_length", 24, "Tokens per snippet (padded / truncated).")
flags.DEFINE_integer("embed_dim", 64, "Model width.")
flags.DEFINE_integer("num_heads", 2, "Attention heads.")
flags.DEFINE_integer("ff_dim", 128, "Feed-forward hidden units.")
flags.DEFINE_integer("num_blocks", 2, "Encoder blocks.")
flags.DEFINE_float("mask_rate", 0.15, "Fraction of word tokens selected for prediction.")
flags.DEFINE_integer("eval_every", 50, "Held-out MLM accuracy every this many steps.")
flags.DEFINE_integer("seed", 0, "Seeds the masking and the initial weights only (the same "
                     "for every configuration). Noise and sampling use fresh OS entropy.")
flags.DEFINE_string("output_dir", "docs/figures", "Where mlm_snr.png and mlm_accuracy.png go.")
flags.DEFINE_string("save_results", None, "Also write every configuration's results (JSON) "
                    "here, to merge runs made in separate processes with --load_results.")
flags.DEFINE_list("load_results", [], "Train nothing: the table and figures of these "
                  "--save_results files (made with the same other flags).")
flags.DEFINE_bool("smoke", False, "A short run (tiny data and model, 4 steps; the schedule and "
                  "non-private configurations unless --configs is given) for tests.")

PAD, UNK = 0, 1


# ----------------------------------------------------------------------------- data


def bert_masking(tokens, vocab_size, mask_id, rate, max_predictions):
    """BERT's masking of integer `tokens` (B, T), redrawn at every call (tf.random, so inside
    a tf.data map every sampled batch gets new masks): returns ((inputs, positions), labels).

    Each row alone: its word tokens (not padding, not [UNK]) are selected with probability
    `rate` each, at least one and at most `max_predictions` (BERT's max_predictions_per_seq,
    the excess dropped at random); 80 % of the selected become [MASK], 10 % a random word,
    10 % stay. `positions` (B, K) are the selected positions and `labels` (B, K) their
    original ids, padded with position 0 and label -1.
    """
    tokens = tf.cast(tokens, tf.int64)
    shape = tf.shape(tokens)
    length = tokens.shape[1]
    words = tokens > UNK
    draw = tf.random.uniform(shape)
    selected = words & (draw < rate)
    # A snippet with no selected word gets its word of smallest draw: one at random.
    nothing = ~tf.reduce_any(selected, axis=1, keepdims=True)
    one = tf.one_hot(tf.argmin(tf.where(words, draw, 2.0), axis=1), length) > 0
    selected |= nothing & one & words
    priority = tf.where(selected, tf.random.uniform(shape), -1.0)
    top, positions = tf.math.top_k(priority, max_predictions)
    valid = top >= 0.0
    positions = tf.where(valid, positions, 0)
    labels = tf.where(valid, tf.gather(tokens, positions, batch_dims=1), -1)
    chosen = tf.reduce_max(tf.one_hot(positions, length) * tf.cast(valid, tf.float32)[..., None],
                           axis=1) > 0
    action = tf.random.uniform(shape)
    random_words = tf.random.uniform(shape, UNK + 1, vocab_size, dtype=tf.int64)
    inputs = tf.where(chosen & (action < 0.8), tf.constant(mask_id, tf.int64),
                      tf.where(chosen & (action < 0.9), random_words, tokens))
    return (inputs, tf.cast(positions, tf.int64)), tf.cast(labels, tf.int64)


def max_predictions() -> int:
    return max(1, math.ceil(FLAGS.mask_rate * FLAGS.sequence_length))


def load_data():
    """(training token ids (N, T), held-out ((inputs, positions), labels) masked once,
    vocabulary size)."""
    (text_train, _), (text_test, _) = tf_dp.datasets.load("rotten_tomatoes")
    if FLAGS.smoke:
        text_train, text_test = text_train[:600], text_test[:200]
    vectorize = keras.layers.TextVectorization(max_tokens=FLAGS.max_tokens,
                                               output_sequence_length=FLAGS.sequence_length)
    vectorize.adapt(tf.constant(text_train))
    vocab_size = vectorize.vocabulary_size()
    train = np.asarray(vectorize(tf.constant(text_train))).astype("int64")
    tf.random.set_seed(FLAGS.seed)  # the held-out masking: one fixed draw, the same for all
    (inputs, positions), labels = bert_masking(vectorize(tf.constant(text_test)), vocab_size,
                                               vocab_size, FLAGS.mask_rate, max_predictions())
    test = ((inputs.numpy(), positions.numpy()), labels.numpy())
    return train, test, vocab_size


def remask(vocab_size):
    """A per-example map for a batch ``((tokens, _), _)``: new BERT masks for every row.

    The first element carries the raw tokens (the ``_`` are one static masking, there only so
    that the sampler's source has the model's input structure for fit's independence check).
    """
    def fn(x, y):
        del y
        return bert_masking(x[0], vocab_size, vocab_size, FLAGS.mask_rate, max_predictions())

    return fn


# ----------------------------------------------------------------------------- model


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class Positions(keras.layers.Layer):
    """Position ids ``[0, T)`` per example (weightless; the table is an Embedding)."""

    def call(self, tokens):
        return tf.broadcast_to(tf.range(tf.shape(tokens)[1])[None, :], tf.shape(tokens))


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class GatherPositions(keras.layers.Layer):
    """``(B, T, D)``, ``(B, K)`` positions -> ``(B, K, D)``: the states to predict from.

    The output head then runs on K ~ 15 % of the positions (BERT's
    max_predictions_per_seq), not on all T: the vocabulary-sized head dominates the cost.
    """

    def call(self, inputs):
        states, positions = inputs
        return tf.gather(states, positions, batch_dims=1)


@keras.saving.register_keras_serializable(package="tf_dp_examples")
class KeyMask(keras.layers.Layer):
    """``(B, 1, T)`` mask of the non-padding keys, for MultiHeadAttention."""

    def call(self, tokens):
        return (tokens > PAD)[:, None, :]


def encoder(vocab_size) -> keras.Model:
    d = FLAGS.embed_dim
    tokens = keras.Input((FLAGS.sequence_length,), dtype="int64", name="tokens")
    predict_at = keras.Input((max_predictions(),), dtype="int64", name="predict_positions")
    x = keras.layers.Embedding(vocab_size + 1, d, name="token_embedding")(tokens)
    positions = keras.layers.Embedding(FLAGS.sequence_length, d,
                                       name="position_embedding")(Positions()(tokens))
    x = keras.layers.Add()([x, positions])
    mask = KeyMask()(tokens)
    for i in range(FLAGS.num_blocks):
        # Pre-LayerNorm blocks: stabler than post-LN without a warm-up schedule.
        h = keras.layers.LayerNormalization(name=f"block{i}_ln1")(x)
        h = keras.layers.MultiHeadAttention(FLAGS.num_heads, d // FLAGS.num_heads,
                                            name=f"block{i}_attention")(h, h,
                                                                        attention_mask=mask)
        x = keras.layers.Add()([x, h])
        h = keras.layers.LayerNormalization(name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(FLAGS.ff_dim, activation="gelu", name=f"block{i}_ff1")(h)
        x = keras.layers.Add()([x, keras.layers.Dense(d, name=f"block{i}_ff2")(h)])
    x = keras.layers.LayerNormalization(name="final_ln")(x)
    logits = keras.layers.Dense(vocab_size, name="mlm_head")(GatherPositions()([x, predict_at]))
    return keras.Model([tokens, predict_at], logits)


def masked_lm_loss(labels, logits):
    """Per-example loss (B,): cross-entropy averaged over the example's selected tokens
    (labels -1 are padding)."""
    labels = tf.cast(labels, tf.int64)
    selected = tf.cast(labels >= 0, logits.dtype)
    token_loss = keras.losses.sparse_categorical_crossentropy(
        tf.maximum(labels, 0), logits, from_logits=True)
    return tf.reduce_sum(token_loss * selected, axis=1) / tf.maximum(
        tf.reduce_sum(selected, axis=1), 1.0)


def mlm_metrics(model, inputs, labels) -> tuple:
    """(accuracy, cross-entropy) over the selected held-out tokens."""
    logits = model.predict(list(inputs), batch_size=512, verbose=0)
    selected = labels >= 0
    logits, targets = logits[selected].astype("float64"), labels[selected]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    loss = -np.mean(log_probs[np.arange(targets.size), targets])
    return float(np.mean(np.argmax(logits, axis=-1) == targets)), float(loss)


class StepLog(keras.callbacks.Callback):
    """Keeps every logical step's logs (gradient_snr, batch_size) and a periodic accuracy."""

    def __init__(self, test, eval_every):
        super().__init__()
        self.test, self.eval_every = test, eval_every
        self.snr, self.batch_sizes, self.accuracy = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        if "gradient_snr" in logs:
            self.snr.append(float(logs["gradient_snr"]))
        if "batch_size" in logs:
            self.batch_sizes.append(float(logs["batch_size"]))
        step = batch + 1
        if step % self.eval_every == 0:
            self.accuracy.append((step, mlm_metrics(self.model, *self.test)[0]))


# ----------------------------------------------------------------------------- runs


def batch_of(config):
    """The expected batch (a number or a PiecewiseBatchSize) of a configuration."""
    b = FLAGS.batch_size
    if config == "schedule":
        multiples = [float(m) for m in FLAGS.schedule_multiples]
        stage = FLAGS.steps / len(multiples)
        boundaries = [max(1, round(stage * i)) for i in range(1, len(multiples))]
        return tf_dp.schedules.PiecewiseBatchSize(boundaries, [b * m for m in multiples])
    if config == "nonprivate" or config.startswith("wd="):
        return 16 * b
    multiple = config[:-1] or "1"
    if not config.endswith("B") or not multiple.isdigit():
        raise ValueError(f"`configs` entries must be B, <k>B, schedule or nonprivate, got "
                         f"{config!r}.")
    return int(multiple) * b


def examples_seen(batch, steps) -> float:
    if isinstance(batch, tf_dp.schedules.PiecewiseBatchSize):
        return batch.examples_seen(steps)
    return float(batch) * steps


def run(config, train, test, vocab_size):
    batch = batch_of(config)
    private = config != "nonprivate"
    weight_decay = float(config[3:]) if config.startswith("wd=") else FLAGS.weight_decay
    keras.utils.set_random_seed(FLAGS.seed)  # the same initial weights for every run
    model = encoder(vocab_size)
    n = len(train)
    log = StepLog(test, FLAGS.eval_every)
    mask = remask(vocab_size)
    start = time.time()
    if private:
        optimizer = tf_dp.DPAdamW.for_target_epsilon(
            FLAGS.target_epsilon, FLAGS.delta, epochs=1, batch_size=batch, dataset_size=n,
            l2_norm_clip=FLAGS.l2_norm_clip, steps_per_epoch=FLAGS.steps,
            learning_rate=FLAGS.learning_rate, weight_decay=weight_decay)
        model = tf_dp.keras.make_private(model, delta=FLAGS.delta)
        model.compile(optimizer=optimizer, loss=masked_lm_loss)
        # Dynamic masking: the sampler draws the snippets (Poisson, q = batch / N), then a
        # per-example map masks each sampled snippet anew, so a snippet sampled twice is
        # asked different questions (RoBERTa's dynamic masking) and q is unchanged.
        (_, positions), labels = bert_masking(train, vocab_size, vocab_size, FLAGS.mask_rate,
                                              max_predictions())
        sampler = tf_dp.data.PoissonSampler((train, positions.numpy()), labels.numpy(),
                                            expected_batch_size=batch)
        if isinstance(batch, tf_dp.schedules.PiecewiseBatchSize):
            data = sampler.dataset().map(lambda xy, phase: (mask(*xy), phase))
        else:
            data = sampler.dataset().map(mask)
        model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps,
                  max_physical_batch_size=FLAGS.max_physical_batch_size,
                  gradient_snr="private", verbose=0, callbacks=[log])
        sigma, epsilon = optimizer.noise_multiplier, model.epsilon()
    else:
        model.compile(optimizer=keras.optimizers.AdamW(FLAGS.learning_rate,
                                                       weight_decay=weight_decay),
                      loss=masked_lm_loss)
        data = (tf.data.Dataset.from_tensor_slices(train).repeat().shuffle(n, seed=FLAGS.seed)
                .batch(batch).map(lambda t: mask((t, None), None)).prefetch(2))
        model.fit(data, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0, callbacks=[log])
        sigma, epsilon = 0.0, math.inf
    accuracy, loss = mlm_metrics(model, *test)
    if not log.accuracy or log.accuracy[-1][0] != FLAGS.steps:
        log.accuracy.append((FLAGS.steps, accuracy))
    return {
        "config": config, "batch": batch, "sigma": sigma, "epsilon": epsilon,
        "weight_decay": weight_decay, "examples": examples_seen(batch, FLAGS.steps),
        "accuracy": accuracy, "loss": loss, "snr": np.array(log.snr),
        "batch_sizes": log.batch_sizes,
        "accuracy_curve": log.accuracy, "seconds": time.time() - start,
    }


# ----------------------------------------------------------------------------- report


def describe(batch) -> str:
    if isinstance(batch, tf_dp.schedules.PiecewiseBatchSize):
        return "schedule " + " -> ".join(f"{s:g}" for s in batch.batch_sizes)
    return f"{batch:g}"


def label(r) -> str:
    if r["config"] == "nonprivate":
        return f"non-private AdamW, batch {describe(r['batch'])}"
    text = f"{r['config']} = {describe(r['batch'])}" if r["config"] not in ("schedule",) else (
        describe(r["batch"]))
    if r["config"].startswith("wd="):
        text = f"batch {describe(r['batch'])}, weight decay {r['weight_decay']:g}"
    return text


def snr_summary(snr) -> str:
    if snr.size == 0:
        return "-"
    tail = snr[-max(1, snr.size // 4):]
    return f"{np.median(snr[: max(1, snr.size // 4)]):.3f} / {np.median(tail):.3f}"


def print_table(results, baseline):
    print()
    print(f"| configuration | sigma | weight decay | examples seen | held-out MLM accuracy | "
          f"held-out MLM loss | epsilon (delta={FLAGS.delta:g}) | private SNR, median first / "
          f"last quarter | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        eps = "inf (non-private)" if math.isinf(r["epsilon"]) else epsilon_text(r['epsilon'], 3)
        sigma = "-" if r["sigma"] == 0 else f"{r['sigma']:.3f}"
        print(f"| {label(r)} | {sigma} | {r['weight_decay']:g} | {r['examples']:,.0f} | "
              f"{r['accuracy']:.4f} | {r['loss']:.3f} | {eps} | {snr_summary(r['snr'])} | "
              f"{r['seconds']:.0f} |")
    print(f"\nunigram reference (the training tokens' frequencies, no context): held-out "
          f"accuracy {baseline[0]:.4f}, loss {baseline[1]:.3f}", flush=True)


def moving_average(values, window):
    if values.size < window:
        return np.arange(1, values.size + 1), values
    kernel = np.ones(window) / window
    return np.arange(window, values.size + 1), np.convolve(values, kernel, mode="valid")


def plot(results, baseline, output_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    # The weight-decay sweep is in the table only: each figure compares batch sizes.
    results = [r for r in results if not r["config"].startswith("wd=")]
    private = [r for r in results if r["snr"].size]
    window = max(1, min(25, FLAGS.steps // 10))
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for r in private:
        steps, smooth = moving_average(r["snr"], window)
        ax.plot(steps, np.maximum(smooth, 1e-4), label=f"{label(r)} (σ={r['sigma']:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("logical step")
    ax.set_ylabel(f"gradient SNR ‖clipped sum‖ / ‖noise‖\n(private estimate, "
                  f"{window}-step moving average)")
    ax.set_title(f"DP-AdamW MLM on Rotten Tomatoes, ε = {FLAGS.target_epsilon:g} "
                 f"(δ = {FLAGS.delta:g}), {FLAGS.steps} steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    snr_path = os.path.join(output_dir, "mlm_snr.png")
    fig.savefig(snr_path, dpi=130)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for r in results:
        steps = [s for s, _ in r["accuracy_curve"]]
        seen = [examples_seen(r["batch"], s) for s in steps]
        ax.plot(seen, [a for _, a in r["accuracy_curve"]], marker="o", markersize=3,
                linestyle="--" if r["config"] == "nonprivate" else "-", label=label(r))
    ax.axhline(baseline[0], color="gray", linestyle=":",
               label=f"unigram (most frequent word, no context): {baseline[0]:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("examples seen (expected, log scale)")
    ax.set_ylabel("held-out masked-token accuracy")
    ax.set_title(f"MLM accuracy against examples processed, ε = {FLAGS.target_epsilon:g}, "
                 f"{FLAGS.steps} steps each")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    accuracy_path = os.path.join(output_dir, "mlm_accuracy.png")
    fig.savefig(accuracy_path, dpi=130)
    plt.close(fig)
    return snr_path, accuracy_path


def main(argv):
    del argv
    output_dir = FLAGS.output_dir
    if FLAGS.smoke:
        FLAGS.batch_size, FLAGS.steps, FLAGS.eval_every = 8, 4, 2
        FLAGS.max_tokens, FLAGS.sequence_length, FLAGS.embed_dim = 300, 16, 16
        FLAGS.ff_dim, FLAGS.max_physical_batch_size = 16, 64
        if output_dir == flags.FLAGS["output_dir"].default:
            output_dir = tempfile.mkdtemp(prefix="mlm_smoke_")
    configs = list(FLAGS.configs)
    if FLAGS.smoke and not FLAGS["configs"].present:
        # Tracing a private step takes about a minute here: the schedule alone exercises
        # Poisson phases, micro-batches and the SNR.
        configs = ["schedule", "nonprivate"]
    configs += [f"wd={w}" for w in FLAGS.weight_decays]
    for c in configs:
        batch_of(c)  # bad names fail before any training
    train, test, vocab_size = load_data()
    counts = np.bincount(train[train > UNK], minlength=vocab_size)
    targets = test[1][test[1] >= 0]
    frequencies = (counts + 1) / (counts + 1).sum()  # add-one smoothing
    baseline = (float(np.mean(targets == np.argmax(counts))),
                float(-np.mean(np.log(frequencies[targets]))))
    print("note: the vocabulary was adapted on the training snippets without noise: it is "
          "outside the epsilon below (a vocabulary from public text would be covered).")
    print(f"rotten_tomatoes MLM: {len(train)} training / {len(test[1])} held-out snippets, "
          f"vocabulary {vocab_size} (+[MASK]), {FLAGS.sequence_length} tokens, "
          f"{int((train > UNK).sum())} training word tokens (masks redrawn at every sampling), "
          f"{int((test[1] >= 0).sum())} masked held-out tokens; "
          f"{FLAGS.steps} logical steps per configuration, target epsilon "
          f"{FLAGS.target_epsilon:g} at delta {FLAGS.delta:g}, C {FLAGS.l2_norm_clip:g}, "
          f"lr {FLAGS.learning_rate:g}", flush=True)
    results = []
    for path in FLAGS.load_results:
        with open(path) as f:
            for r in json.load(f):
                results.append({**r, "batch": batch_of(r["config"]), "snr": np.array(r["snr"]),
                                "accuracy_curve": [tuple(a) for a in r["accuracy_curve"]]})
    # Table order: fixed batches by size, the schedule, non-private, the weight-decay sweep.
    results.sort(key=lambda r: (
        (0, float(r["batch"])) if r["config"].endswith("B") else
        (1 if r["config"] == "schedule" else 2 if r["config"] == "nonprivate" else 3,
         r["weight_decay"])))
    for config in configs if not FLAGS.load_results else []:
        r = run(config, train, test, vocab_size)
        results.append(r)
        if FLAGS.save_results:
            with open(FLAGS.save_results, "w") as f:
                json.dump([{**r, "batch": None, "snr": r["snr"].tolist()} for r in results], f,
                          default=float)
        eps = "inf" if math.isinf(r["epsilon"]) else epsilon_text(r['epsilon'])
        print(f"{label(r)}: sigma {r['sigma']:.3f}  held-out MLM accuracy "
              f"{r['accuracy']:.4f}  loss {r['loss']:.3f}  epsilon {eps}  {r['seconds']:.0f} s; "
              "accuracy at steps " + ", ".join(f"{t}: {a:.4f}" for t, a in r["accuracy_curve"]),
              flush=True)
    print_table(results, baseline)
    for path in plot(results, baseline, output_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
