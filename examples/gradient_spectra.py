r"""Gradient spectra along the trajectory, and DP-SGD in the top-k gradient subspace.

Li et al. ("When Does Differentially Private Learning Not Suffer in High Dimensions?",
NeurIPS 2022, §4.2) show that gradients along a training trajectory concentrate in a few
principal directions, and that re-training with every update projected onto the top-k
subspace keeps the accuracy for small k. Repeated here at small scale on Fashion-MNIST with a
3,930-parameter tanh CNN (d = 3,930: every trainable variable is analysed):

1. **Public subspace.** The 10,000 test images are split in two: 5,000 play the role of
   *public* data, the other 5,000 are the test set. A non-private SGD run on the public half
   streams the mean gradient of a public batch at every step into
   `tf_dp.analysis.GradientSpectrum` (Frequent Directions, memory O(ℓ·d); nothing stored):
   its top-k eigenvectors are the subspaces U_k. They depend on public data only.
2. **References.** Non-private SGD and plain DP-SGD (unprojected) on the 60,000 private
   training images. The DP-SGD run also streams public-batch gradients at its own (private)
   weights, for the second spectrum (post-processing of the private weights: no privacy cost)
   and to measure the callback's overhead.
3. **Projected DP-SGD.** For each k, DP-SGD with the same C, σ, q, steps, whose clipped and
   noised update is projected onto U_k (`tf_dp.analysis.ProjectedSGD` wrapped by
   `tf_dp.make_private_optimizer`): post-processing, so ε equals the unprojected run's.

Figures: docs/figures/gradient_spectrum.png (eigenvalues vs index, log y) and
docs/figures/projected_accuracy.png (test accuracy vs k). Noise and Poisson sampling come
from fresh OS entropy; --seed seeds the initialisation and the public/test split only.

--model=transformer repeats the three steps on Rotten Tomatoes (10,246 training snippets)
with the Transformer encoder of examples/rgp_transformer.py (examples/_transformer.py) made
small: vocabulary 2,000, width 32, 2 heads, feed-forward 64, 40 tokens, d = 73,890 (every
trainable variable, the token embedding's 64,000 included). The 2,562 test snippets are
split into 1,281 public and 1,281 test snippets; the TextVectorization vocabulary is adapted
on the public half only, so no statistic of the private texts leaves outside ε. Its figures
are gradient_spectrum_transformer.png and projected_accuracy_transformer.png; the shared
flags take the values in _TRANSFORMER_DEFAULTS unless given.

  python examples/gradient_spectra.py                      # about 6 min on 2 shared cores
  python examples/gradient_spectra.py --model=transformer  # see docs/analysis.md for time
  python examples/gradient_spectra.py --smoke --output_dir=/tmp/gs   # about a minute
  python examples/gradient_spectra.py --smoke --model=transformer --output_dir=/tmp/gs
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

from tf_dp.accounting.functions import epsilon_text  # noqa: E402
from tf_dp.analysis import GradientSpectrum, ProjectedSGD  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "cnn", ["cnn", "transformer"],
                  "cnn: Fashion-MNIST, 3,930-parameter CNN; transformer: Rotten Tomatoes, "
                  "small Transformer encoder (examples/_transformer.py). The flags below "
                  "show the cnn defaults; _TRANSFORMER_DEFAULTS holds the transformer's.")
flags.DEFINE_integer("epochs", 3, "Epochs of every private-data run (DP-SGD, projected, SGD).")
flags.DEFINE_integer("public_epochs", 10, "Epochs of the non-private run on the public half.")
flags.DEFINE_integer("batch_size", 1024, "Expected batch size (Poisson sampling, q = B / N).")
flags.DEFINE_integer("public_batch_size", 128, "Batch size of the non-private runs.")
flags.DEFINE_integer("num_train", 60000, "Private training examples (the first N of the "
                     "training split: 60,000 images, 10,246 snippets).")
flags.DEFINE_float("learning_rate", 2.0, "SGD learning rate (private runs).")
flags.DEFINE_float("public_learning_rate", 0.1, "SGD learning rate (non-private runs).")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_float("l2_norm_clip", 0.5, "Per-example clipping norm C.")
flags.DEFINE_float("noise_multiplier", 1.0, "Noise multiplier σ.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_list("ks", ["1", "4", "16", "32", "64", "128"],
                  "Subspace dimensions k of the projected runs.")
flags.DEFINE_integer("sketch_size", 256, "ℓ of the Frequent Directions sketch (>= max k).")
flags.DEFINE_integer("analysis_batch", 256, "Public examples per analysis gradient.")
flags.DEFINE_integer("max_tokens", 2000, "transformer: vocabulary size (adapted on the public "
                     "texts only).")
flags.DEFINE_integer("sequence_length", 40, "transformer: tokens per snippet.")
flags.DEFINE_integer("embed_dim", 32, "transformer: model width.")
flags.DEFINE_integer("num_heads", 2, "transformer: attention heads.")
flags.DEFINE_integer("ff_dim", 64, "transformer: hidden units of the feed-forward block.")
flags.DEFINE_integer("seed", 0, "Seeds initialisation and the public/test split only.")
flags.DEFINE_string("output_dir", "docs/figures", "Where the two figures go.")
flags.DEFINE_bool("smoke", False, "A seconds-long run (few examples, 1 epoch) for tests.")

# --model=transformer's values of the shared flags, unless given on the command line.
_TRANSFORMER_DEFAULTS = dict(
    epochs=10, public_epochs=20, batch_size=256, public_batch_size=64, learning_rate=0.3,
    public_learning_rate=0.05, l2_norm_clip=1.0, noise_multiplier=1.0,
    ks=["4", "32", "256"], sketch_size=512, analysis_batch=256)


def small_cnn():
    """A 3,930-parameter tanh CNN (28×28×1 → 10 logits)."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="tanh", name="conv1"),
        keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="tanh", name="conv2"),
        keras.layers.MaxPool2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(10, name="logits"),
    ], name="cnn")


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _private_run(build, data, inner, callbacks=()):
    """DP-SGD (inner optimizer's rule after clipping and noise); test accuracy, ε, seconds."""
    (x, y), (x_test, y_test) = data
    keras.utils.set_random_seed(FLAGS.seed)  # the initialisation only
    model = tf_dp.keras.make_private(build(), delta=FLAGS.delta)
    optimizer = tf_dp.make_private_optimizer(inner, l2_norm_clip=FLAGS.l2_norm_clip,
                                             noise_multiplier=FLAGS.noise_multiplier)
    model.compile(optimizer=optimizer, loss=_loss(), metrics=["accuracy"])
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=list(callbacks))
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_test, y_test, batch_size=2048, verbose=0)
    return accuracy, model.epsilon(), seconds


def _plain_run(build, x, y, x_test, y_test, epochs, callbacks=()):
    keras.utils.set_random_seed(FLAGS.seed)
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(FLAGS.public_learning_rate,
                                                 momentum=FLAGS.momentum),
                  loss=_loss(), metrics=["accuracy"])
    model.fit(x, y, batch_size=FLAGS.public_batch_size, epochs=epochs, verbose=0,
              callbacks=list(callbacks))
    _, accuracy = model.evaluate(x_test, y_test, batch_size=2048, verbose=0)
    return model, accuracy


def _plot_spectrum(spectra, d, path, data_label=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    shrunk = any(pca.eigenvalue_error_bound > 0 for _, pca in spectra)
    for (label, pca), marker in zip(spectra, "os"):
        values = pca.eigenvalues(_resolvable(pca)) / pca.trace
        values = values[values > 0]  # log axis; fewer gradients than ℓ leave zeros
        index = np.arange(1, len(values) + 1)
        ax.plot(index, values, marker=marker, markersize=3, linewidth=1.2, label=label)
        err = pca.eigenvalue_error_bound / pca.trace
        if err > 0:
            ax.fill_between(index, values, values + err, alpha=0.15)
    ax.axhline(1.0 / d, color="gray", linestyle=":", label=f"isotropic: every eigenvalue 1/d "
               f"(d = {d:,})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eigenvalue index i (largest first)")
    ax.set_ylabel("eigenvalue λ_i / tr M  (share of gradient energy)")
    note = ("shaded: Frequent Directions error bound" if shrunk
            else "Frequent Directions sketch exact: fewer gradients than 2ℓ")
    head = "Gradients along training concentrate in a few directions"
    if data_label is not None:
        head += f" ({data_label})"
    ax.set_title(f"{head}\n"
                 "M = mean of g gᵀ over the trajectory, g = mean gradient of a public batch\n"
                 f"({note})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _plot_accuracy(ks, accuracies, private_accuracy, plain_accuracy, epsilon, d, path,
                   data_label, majority=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    ax.plot(ks, np.array(accuracies) * 100, marker="o",
            label="DP-SGD, update projected onto the top-k public subspace")
    ax.axhline(private_accuracy * 100, color="C1", linestyle="--",
               label=f"DP-SGD, unprojected (all d = {d:,} directions)")
    ax.axhline(plain_accuracy * 100, color="C2", linestyle=":", label="non-private SGD")
    if majority is not None:
        ax.axhline(majority * 100, color="gray", linestyle="-.", linewidth=1,
                   label="majority class (constant prediction)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel(f"subspace dimension k (of d = {d:,})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"DP-SGD in a k-dimensional gradient subspace, same ε = {epsilon_text(epsilon, 3)} "
                 f"(δ = {FLAGS.delta:g})\n{data_label}, {FLAGS.epochs} epochs; one run per point",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    if majority is None:
        ax.legend(fontsize=8, loc="lower right")
    else:  # the projected points sit at the bottom: the legend goes under the top line
        ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.93))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _load_cnn_data():
    """Fashion-MNIST: private training images; the test images split into public / test."""
    (x_train, y_train), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist")
    x_train = (x_train[:FLAGS.num_train].astype("float32") / 255.0)[..., None]
    y_train = y_train[:FLAGS.num_train].astype("int64")
    x_test = (x_test.astype("float32") / 255.0)[..., None]
    public, test = _public_test_split(len(x_test))
    x_public, y_public = x_test[public], y_test[public].astype("int64")
    x_test, y_test = x_test[test], y_test[test].astype("int64")
    return (x_train, y_train), (x_public, y_public), (x_test, y_test), small_cnn


def _load_transformer_data():
    """Rotten Tomatoes: the same split of the test snippets; the vocabulary is adapted on the
    public half only, so it is public and nothing about the private texts leaves outside ε."""
    import tensorflow as tf

    import _transformer  # examples/_transformer.py, the model of rgp_transformer.py

    (text_train, y_train), (text_test, y_test) = tf_dp.datasets.load("rotten_tomatoes")
    text_train, y_train = text_train[:FLAGS.num_train], y_train[:FLAGS.num_train]
    public, test = _public_test_split(len(text_test))
    vectorize = keras.layers.TextVectorization(max_tokens=FLAGS.max_tokens,
                                               output_sequence_length=FLAGS.sequence_length)
    vectorize.adapt(tf.constant(text_test[public]))

    def tokens(texts):
        return np.asarray(vectorize(tf.constant(texts)), dtype="int64")

    vocab_size = vectorize.vocabulary_size()

    def build():
        return _transformer.transformer_classifier(vocab_size, FLAGS.sequence_length,
                                                   FLAGS.embed_dim, FLAGS.num_heads,
                                                   FLAGS.ff_dim)

    return ((tokens(text_train), y_train.astype("int64")),
            (tokens(text_test[public]), y_test[public].astype("int64")),
            (tokens(text_test[test]), y_test[test].astype("int64")), build)


def _resolvable(pca):
    """At most as many eigen-pairs as gradients streamed: asking StreamingPCA for more pads the
    zero eigenvalues' eigenvectors by a QR of the d × d identity (41 GB at d = 73,890)."""
    return min(pca.sketch_size, pca.num_vectors)


def _public_test_split(n):
    split = np.random.default_rng(FLAGS.seed).permutation(n)
    public, test = split[:n // 2], split[n // 2:]
    if FLAGS.smoke:
        public, test = public[:256], test[:512]
    return public, test


def main(argv):
    del argv
    transformer = FLAGS.model == "transformer"
    if transformer:
        for name, value in _TRANSFORMER_DEFAULTS.items():
            if not FLAGS[name].present:
                FLAGS[name].value = value
    if FLAGS.smoke:
        FLAGS.epochs, FLAGS.public_epochs, FLAGS.num_train, FLAGS.batch_size = 1, 1, 512, 128
        FLAGS.ks, FLAGS.sketch_size, FLAGS.analysis_batch = ["1", "4"], 8, 64
        if transformer:  # tracing the per-example DP step dominates: one projected run
            FLAGS.max_tokens, FLAGS.sequence_length, FLAGS.ks = 200, 16, ["4"]
    ks = sorted(int(k) for k in FLAGS.ks)
    if ks[-1] > FLAGS.sketch_size:
        raise app.UsageError(f"--sketch_size ({FLAGS.sketch_size}) must be >= the largest k "
                             f"({ks[-1]}).")
    load = _load_transformer_data if transformer else _load_cnn_data
    (x_train, y_train), (x_public, y_public), (x_test, y_test), build = load()
    data = ((x_train, y_train), (x_test, y_test))
    d = build().count_params()
    print(f"{FLAGS.model}: {len(x_train)} private training / {len(x_public)} public / "
          f"{len(x_test)} test examples; model {d} parameters (all analysed)")
    majority = None
    if transformer:
        majority = float(np.max(np.bincount(y_test)) / len(y_test))
        print(f"vocabulary {FLAGS.max_tokens} (adapted on the public texts), "
              f"{FLAGS.sequence_length} tokens; majority-class test accuracy {majority:.4f}")

    # 1. The subspace: a non-private run on public data, public gradients along it.
    start = time.perf_counter()
    public_spectrum = GradientSpectrum(x_public, y_public, sketch_size=FLAGS.sketch_size,
                                       batch_size=FLAGS.analysis_batch)
    _, public_accuracy = _plain_run(build, x_public, y_public, x_test, y_test,
                                    FLAGS.public_epochs, [public_spectrum])
    pca = public_spectrum.pca
    print(f"public run: {pca.num_vectors} gradients streamed, test accuracy "
          f"{public_accuracy:.4f}, {time.perf_counter() - start:.0f} s", flush=True)

    # 2. References on the private data.
    start = time.perf_counter()
    _, plain_accuracy = _plain_run(build, x_train, y_train, x_test, y_test, FLAGS.epochs)
    print(f"non-private SGD: test accuracy {plain_accuracy:.4f}, "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    private_spectrum = GradientSpectrum(x_public, y_public, sketch_size=FLAGS.sketch_size,
                                        batch_size=FLAGS.analysis_batch)
    sgd = keras.optimizers.SGD(FLAGS.learning_rate, momentum=FLAGS.momentum)
    private_accuracy, epsilon, seconds = _private_run(build, data, sgd, [private_spectrum])
    overhead = private_spectrum.seconds / (seconds - private_spectrum.seconds)
    print(f"DP-SGD (unprojected): test accuracy {private_accuracy:.4f}, epsilon {epsilon_text(epsilon)} "
          f"at delta {FLAGS.delta:g}, {seconds:.0f} s; GradientSpectrum at every step cost "
          f"{private_spectrum.seconds:.1f} s = {overhead:.1%} of the training time", flush=True)

    # 3. Projected DP-SGD, one run per k.
    accuracies = []
    for k in ks:
        inner = ProjectedSGD(pca.components(k), learning_rate=FLAGS.learning_rate,
                             momentum=FLAGS.momentum)
        accuracy, eps_k, seconds = _private_run(build, data, inner)
        accuracies.append(accuracy)
        print(f"DP-SGD projected, k = {k:4d}: test accuracy {accuracy:.4f}, epsilon {epsilon_text(eps_k)}"
              f", {seconds:.0f} s", flush=True)

    ratios = np.cumsum(pca.explained_variance_ratio(_resolvable(pca)))
    print("public-trajectory spectrum: share of gradient energy in the top k = "
          + ", ".join(f"{k}: {ratios[min(k, len(ratios)) - 1]:.3f}" for k in ks)
          + f"; eigenvalue error bound {pca.eigenvalue_error_bound / pca.trace:.2e} of tr M")
    values = pca.eigenvalues(_resolvable(pca)) / pca.trace
    print("lambda_i / tr M at i = " + ", ".join(
        f"{i}: {values[i - 1]:.2e}" for i in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        if i <= len(values)))
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    suffix = "_transformer" if transformer else ""
    spectrum_path = os.path.join(FLAGS.output_dir, f"gradient_spectrum{suffix}.png")
    accuracy_path = os.path.join(FLAGS.output_dir, f"projected_accuracy{suffix}.png")
    if transformer:
        spectrum_label = "Rotten Tomatoes, Transformer"
        data_label = (f"Rotten Tomatoes, Transformer, {len(x_train):,} private snippets, "
                      f"{len(x_test):,} test")
    else:
        spectrum_label = None
        data_label = f"Fashion-MNIST, {FLAGS.num_train:,} private examples"
    _plot_spectrum([("public run (non-private SGD on the public half); its U_k are used", pca),
                    ("DP-SGD run on the private data (public-batch gradients)",
                     private_spectrum.pca)], d, spectrum_path, spectrum_label)
    _plot_accuracy(ks, accuracies, private_accuracy, plain_accuracy, epsilon, d, accuracy_path,
                   data_label, majority)
    print(f"wrote {spectrum_path} and {accuracy_path}")


if __name__ == "__main__":
    app.run(main)
