r"""DP-SGD on least squares: excess empirical loss vs dimension for several feature spectra.

The synthetic experiment of Li, Liu, Hashimoto, Inan, Kulkarni, Lee, Thakurta, "When Does
Differentially Private Learning Not Suffer in High Dimensions?" (NeurIPS 2022, §4.1): the
error of DP-SGD on a convex problem grows with the dimension d only when the curvature is
spread over all d directions. With a feature covariance whose eigenvalues decay fast
(λ_k = k^-α, α > 1, bounded trace) the noise in the many small directions costs almost no
loss (the gradients are "restricted Lipschitz": small in all but a few directions) and the
excess loss stays flat in d; without decay (α = 0) it grows with d.

For each decay α and dimension d (and each data draw): n examples x ~ N(0, diag(λ)), labels
y = x·w* (no label noise, w* on the 4 top directions, so the problem to learn is the same
for every d), a tf_dp private linear model (DPSequential with one bias-free Dense unit,
weights from 0) trained with DPSGD and Poisson sampling at the same σ, q, steps (hence the
same ε for every d), then L(w_T) − min L with the minimum by NumPy least squares. The DP
noise always comes from fresh OS entropy; --data_seeds only chooses the synthetic data.

  python examples/restricted_lipschitz.py                 # ~3 min on 2 shared cores
  python examples/restricted_lipschitz.py --smoke --output=/tmp/rl.png   # seconds

Writes docs/figures/restricted_lipschitz.png and prints the table; docs/analysis.md has the
measured results.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402
from tf_dp.accounting.functions import epsilon_text  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("dims", ["10", "30", "100", "300", "1000"], "Dimensions d.")
flags.DEFINE_list("decays", ["0", "1", "2", "3"],
                  "Decay rates α of the feature covariance's eigenvalues λ_k = k^-α (0: none).")
flags.DEFINE_integer("data_seeds", 2, "Independent data draws per (α, d); the plot shows their "
                     "mean and range. Seeds the synthetic data only, never the DP noise.")
flags.DEFINE_integer("num_examples", 2000, "n, training examples.")
flags.DEFINE_integer("num_informative", 4, "Non-zero coordinates of w* (top directions).")
flags.DEFINE_integer("batch_size", 200, "Expected batch size (Poisson sampling, q = B / n).")
flags.DEFINE_integer("epochs", 10, "Epochs of round(n / B) Poisson-sampled steps.")
flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate.")
flags.DEFINE_float("l2_norm_clip", 1.0, "Per-example clipping norm C.")
flags.DEFINE_float("target_epsilon", 3.0, "ε the noise multiplier is calibrated to.")
flags.DEFINE_float("noise_multiplier", None,
                   "σ, overriding --target_epsilon (0: clipping only, no privacy).")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_string("output", "docs/figures/restricted_lipschitz.png", "Figure path.")
flags.DEFINE_bool("smoke", False, "A seconds-long run (tiny grid) for tests.")


def _train(x, y, sigma):
    import keras

    import tf_dp


    model = tf_dp.keras.DPSequential([
        keras.Input((x.shape[1],)),
        keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
    ])
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=sigma,
                                        learning_rate=FLAGS.learning_rate),
                  loss="mse")
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0)
    return model.layers[-1].kernel.numpy()[:, 0], model.epsilon(FLAGS.delta)


def _plot(dims, decays, excess, title, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    markers = "osD^v<>"
    for i, decay in enumerate(decays):
        values = excess[i]  # [dims, seeds]
        mean = values.mean(axis=1)
        label = (r"no decay ($\lambda_k = 1$)" if decay == 0
                 else rf"$\lambda_k = k^{{-{decay:g}}}$")
        line, = ax.plot(dims, mean, marker=markers[i % len(markers)], label=label)
        if values.shape[1] > 1:
            ax.fill_between(dims, values.min(axis=1), values.max(axis=1), alpha=0.2,
                            color=line.get_color(), linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("dimension d (number of features)")
    ax.set_ylabel("excess empirical loss  L(w_T) − min L\n(half mean squared error)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(title="feature covariance eigenvalues", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv):
    del argv
    from tf_dp.accounting import calibrate_noise_multiplier
    from tf_dp.analysis import excess_empirical_loss, least_squares_loss, linear_regression_data

    if FLAGS.smoke:
        FLAGS.dims, FLAGS.decays = ["4", "16"], ["0", "2"]
        FLAGS.data_seeds, FLAGS.num_examples, FLAGS.batch_size, FLAGS.epochs = 1, 200, 50, 1
    dims = [int(d) for d in FLAGS.dims]
    decays = [float(a) for a in FLAGS.decays]
    if min(dims) < FLAGS.num_informative:
        raise app.UsageError(f"--dims must all be >= --num_informative "
                             f"({FLAGS.num_informative}), got {FLAGS.dims}.")
    q = FLAGS.batch_size / FLAGS.num_examples
    steps = FLAGS.epochs * round(1 / q)
    sigma = FLAGS.noise_multiplier
    if sigma is None:
        sigma = calibrate_noise_multiplier(sampling_probability=q, steps=steps,
                                           target_epsilon=FLAGS.target_epsilon,
                                           delta=FLAGS.delta)
    print(f"DP-SGD: n = {FLAGS.num_examples}, q = {q:g}, {steps} steps, sigma = {sigma:.3f}, "
          f"C = {FLAGS.l2_norm_clip:g}, lr = {FLAGS.learning_rate:g}", flush=True)
    print(f"{'alpha':>5} {'d':>6} {'L(0)':>9} {'excess (mean over data draws)':>30} "
          f"{'epsilon':>8} {'s':>5}", flush=True)
    excess = np.zeros((len(decays), len(dims), FLAGS.data_seeds))
    epsilon = float("inf")
    start = time.time()
    for i, decay in enumerate(decays):
        for j, dim in enumerate(dims):
            t = time.time()
            for s in range(FLAGS.data_seeds):
                x, y, _ = linear_regression_data(
                    FLAGS.num_examples, dim, decay, num_informative=FLAGS.num_informative,
                    label_noise=0.0, seed=1000 * s + dim)
                weights, epsilon = _train(x, y, sigma)
                excess[i, j, s] = excess_empirical_loss(x, y, weights)
            initial = least_squares_loss(x, y, np.zeros(dim))
            print(f"{decay:5g} {dim:6d} {initial:9.4f} {excess[i, j].mean():30.3e} "
                  f"{epsilon_text(epsilon):>8s} {time.time() - t:5.1f}", flush=True)
    title = (f"DP-SGD on least squares, ε = {epsilon_text(epsilon, 3)}, δ = {FLAGS.delta:g} for every d\n"
             f"(n = {FLAGS.num_examples}, σ = {sigma:.2f}, q = {q:g}, {steps} steps; "
             f"mean and range over {FLAGS.data_seeds} data draws)")
    _plot(dims, decays, excess, title, FLAGS.output)
    print(f"wrote {FLAGS.output}  ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    app.run(main)
