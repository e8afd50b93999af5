r"""Stable rank and historical alignment of per-layer gradients during DP-SGD (RGP §3–4).

RGP (Yu, Zhang, Chen, Yin, Liu, "Large Scale Private Learning via Low-rank
Reparametrization", ICML 2021) rests on two measurements, repeated here with
`tf_dp.analysis.GradientGeometry` on the TF Privacy tutorial CNN trained privately on
Fashion-MNIST (DP-SGD, exact per-example clipping):

* the gradient of each weight matrix has a low stable rank ‖G‖_F² / ‖G‖_2² (a few, against
  a full rank of 10 to 32), so a rank-r gradient carrier can hold most of it
  -> docs/figures/stable_rank.png;
* the current gradient lies mostly in the top-r singular subspaces of the historical update
  W − W0 (what RGP builds its carriers from): the residual ‖(I − P_L) G (I − P_R)‖_F / ‖G‖_F
  is far below that of random subspaces of the same rank
  -> docs/figures/historical_alignment.png.

The statistics are computed once per epoch on a fixed batch of training examples from the
raw (unclipped, un-noised) gradient: they describe private data and are NOT covered by the
run's epsilon (the callback warns). The model's weights, and so its accuracy and epsilon,
are the ordinary private result. Noise and sampling come from fresh OS entropy; --seed
seeds the initialisation and the analysis batch only.

  python examples/gradient_geometry.py                  # ~3 min on 2 shared cores
  python examples/gradient_geometry.py --smoke --output_dir=/tmp/gg   # seconds
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

from tf_dp.accounting.functions import epsilon_text  # noqa: E402
from tf_dp.analysis import GradientGeometry  # noqa: E402
from _models import tutorial_cnn  # noqa: E402  (examples/_models.py)

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 8, "Epochs (of round(N / batch_size) Poisson-sampled steps).")
flags.DEFINE_integer("batch_size", 1024, "Expected batch size (Poisson sampling, q = B / N).")
flags.DEFINE_integer("num_train", 30000, "Training examples used (the first N of 60,000).")
flags.DEFINE_enum("optimizer", "dpsgd", ["dpsgd", "rgp", "lsg", "sgd"],
                  "dpsgd: private (the figures); rgp / lsg: the same DP-SGD with conv1, conv2 and "
                  "dense reparametrized at rank --rank (RGP, Yu et al.; LSG with --sparsity), "
                  "measured at their effective weights; sgd: plain non-private SGD, for contrast "
                  "(use a smaller --learning_rate, e.g. 0.05).")
flags.DEFINE_integer("rank", 4, "RGP / LSG carrier rank r.")
flags.DEFINE_float("sparsity", 0.5, "LSG fraction of units frozen (lsg only).")
flags.DEFINE_string("suffix", None, "Appended to the figure names (default: '' for dpsgd and sgd, "
                    "'_rgp' / '_lsg' for those).")
flags.DEFINE_float("learning_rate", 2.0, "SGD learning rate.")
flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
flags.DEFINE_float("l2_norm_clip", 0.12, "Per-example clipping norm C.")
flags.DEFINE_float("noise_multiplier", 1.5, "Noise multiplier σ.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_list("ranks", ["1", "2", "4", "8"], "Subspace ranks r of the residuals.")
flags.DEFINE_integer("plot_rank", 4, "The rank r of the residual-over-epochs panel.")
flags.DEFINE_integer("analysis_examples", 1024, "Training examples in the analysis batch.")
flags.DEFINE_integer("seed", 0, "Seeds initialisation and the analysis batch only.")
flags.DEFINE_string("output_dir", "docs/figures", "Where the two figures go.")
flags.DEFINE_bool("smoke", False, "A seconds-long run (few examples, 2 epochs) for tests.")

LAYERS = ("conv1", "conv2", "dense", "logits")


def _shapes(model):
    out = {}
    for name in LAYERS:
        kernel = model.get_layer(name).kernel
        m = int(np.prod(kernel.shape[:-1]))
        out[name] = (m, int(kernel.shape[-1]))
    return out


def _plot_stable_rank(history, shapes, title, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(LAYERS):
        values = history[f"stable_rank/{name}"]
        m, n = shapes[name]
        ax.plot(range(len(values)), values, marker="osD^"[i], color=colors[i],
                label=f"{name} ({m}×{n})")
        ax.axhline(min(m, n), color=colors[i], linestyle=":", linewidth=1.5)
    ax.plot([], [], color="gray", linestyle=":", label="full rank min(m, n)")
    ax.set_yscale("log")
    ax.set_ylim(0.8, 45)
    ax.yaxis.set_major_locator(FixedLocator([1, 2, 5, 10, 16, 32]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch (0 = initialisation)")
    ax.set_ylabel("stable rank ‖G‖²_F / ‖G‖²_2 of the batch gradient")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(title="layer (kernel as m×n matrix)", fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _plot_alignment(history, ranks, plot_rank, title, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (over_time, over_rank) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(LAYERS):
        c, mk = colors[i % len(colors)], "osD^"[i]
        hist = history.get(f"residual_history_r{plot_rank}/{name}")
        rand = history.get(f"residual_random_r{plot_rank}/{name}")
        if hist is not None:
            epochs = np.arange(1, len(hist) + 1)
            over_time.plot(epochs, hist, color=c, marker=mk, label=f"{name}: W − W0 subspace")
            over_time.plot(epochs, rand, color=c, marker=mk, linestyle="--", mfc="none",
                           label=f"{name}: random subspace")
        rs = [r for r in ranks if f"residual_history_r{r}/{name}" in history]
        over_rank.plot(rs, [history[f"residual_history_r{r}/{name}"][-1] for r in rs],
                       color=c, marker=mk, label=f"{name}: W − W0")
        over_rank.plot(rs, [history[f"residual_random_r{r}/{name}"][-1] for r in rs],
                       color=c, marker=mk, linestyle="--", mfc="none", label=f"{name}: random")
    over_time.xaxis.set_major_locator(MaxNLocator(integer=True))
    over_time.set_xlabel("epoch")
    over_time.set_ylabel("residual ‖(I − P_L) G (I − P_R)‖_F / ‖G‖_F")
    over_time.set_title(f"rank r = {plot_rank}, over training", fontsize=10)
    over_rank.set_xscale("log", base=2)
    over_rank.set_xticks(ranks, [str(r) for r in ranks])
    over_rank.set_xlabel("subspace rank r")
    over_rank.set_title("after the last epoch, by rank", fontsize=10)
    for ax in (over_time, over_rank):
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
    over_time.legend(fontsize=7, ncol=2, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


class _Progress(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1}  loss {logs.get('loss', float('nan')):.4f}  "
              f"{time.time() - self.start:.0f} s", flush=True)


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    if FLAGS.smoke:
        FLAGS.epochs, FLAGS.num_train, FLAGS.batch_size = 2, 512, 128
        FLAGS.analysis_examples, FLAGS.ranks, FLAGS.plot_rank = 128, ["1", "2"], 2
    ranks = [int(r) for r in FLAGS.ranks]
    if FLAGS.plot_rank not in ranks:
        raise app.UsageError(f"--plot_rank ({FLAGS.plot_rank}) must be one of --ranks "
                             f"({FLAGS.ranks}).")
    (x_train, y_train), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist")
    x_train = (x_train[:FLAGS.num_train].astype("float32") / 255.0)[..., None]
    y_train = y_train[:FLAGS.num_train]
    x_test = (x_test.astype("float32") / 255.0)[..., None]
    pick = np.random.default_rng(FLAGS.seed).choice(len(x_train), FLAGS.analysis_examples,
                                                     replace=False)
    private = FLAGS.optimizer != "sgd"
    if private:
        plain = tutorial_cnn()
        if FLAGS.optimizer in ("rgp", "lsg"):
            # The three layers whose rank-r carriers are smaller than their kernels; the
            # 32x10 classifier stays plain (exactly clipped, as in examples/rgp_fashion_mnist).
            plain = tf_dp.layers.reparametrize(
                plain, rank=FLAGS.rank, layers=["conv1", "conv2", "dense"],
                sparsity=FLAGS.sparsity if FLAGS.optimizer == "lsg" else None)
        model = tf_dp.keras.make_private(plain, delta=FLAGS.delta)
        optimizer = tf_dp.DPSGD(l2_norm_clip=FLAGS.l2_norm_clip,
                                noise_multiplier=FLAGS.noise_multiplier,
                                learning_rate=FLAGS.learning_rate, momentum=FLAGS.momentum)
    else:
        model = tutorial_cnn()
        optimizer = keras.optimizers.SGD(FLAGS.learning_rate, momentum=FLAGS.momentum)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    geometry = GradientGeometry(x_train[pick], y_train[pick], layers=LAYERS, ranks=ranks)
    geometry.set_model(model)
    initial = geometry.measure()  # at initialisation: stable rank only (no history yet)
    start = time.time()
    history = model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
                        verbose=0, callbacks=[geometry, _Progress()]).history
    _, accuracy = model.evaluate(x_test, y_test, batch_size=2048, verbose=0)
    epsilon = model.epsilon() if private else float("inf")
    for name in LAYERS:
        history[f"stable_rank/{name}"].insert(0, initial[f"stable_rank/{name}"])

    shapes = _shapes(model)
    print(f"{len(x_train)} training examples, {FLAGS.epochs} epochs, {time.time() - start:.0f} s:"
          f" test accuracy {accuracy:.4f}, epsilon {epsilon_text(epsilon)} at delta {FLAGS.delta:g}")
    print(f"{'layer':>7} {'m x n':>9} {'stable rank: init':>18} {'last':>6}   "
          + "  ".join(f"res r={r} hist/rand" for r in ranks))
    for name in LAYERS:
        sr = history[f"stable_rank/{name}"]
        res = "  ".join(
            f"{history[f'residual_history_r{r}/{name}'][-1]:8.3f}/"
            f"{history[f'residual_random_r{r}/{name}'][-1]:.3f}"
            if f"residual_history_r{r}/{name}" in history else f"{'-':>14}" for r in ranks)
        print(f"{name:>7} {shapes[name][0]:>5}x{shapes[name][1]:<3} {sr[0]:18.2f} {sr[-1]:6.2f}"
              f"   {res}")

    os.makedirs(FLAGS.output_dir, exist_ok=True)
    method = {"dpsgd": "DP-SGD", "rgp": f"RGP rank {FLAGS.rank} on conv1, conv2, dense",
              "lsg": f"LSG rank {FLAGS.rank}, sparsity {FLAGS.sparsity:g}, on conv1, conv2, "
                     "dense"}.get(FLAGS.optimizer)
    suffix = FLAGS.suffix if FLAGS.suffix is not None else (
        f"_{FLAGS.optimizer}" if FLAGS.optimizer in ("rgp", "lsg") else "")
    if private:
        run = (f"Fashion-MNIST CNN, {method}\n(σ = {FLAGS.noise_multiplier:g}, "
               f"C = {FLAGS.l2_norm_clip:g}, B = {FLAGS.batch_size}), ε = {epsilon_text(epsilon, 3)}, "
               f"δ = {FLAGS.delta:g}, test accuracy {accuracy:.3f}")
    else:
        run = (f"Fashion-MNIST CNN, non-private SGD (B = {FLAGS.batch_size}), "
               f"test accuracy {accuracy:.3f}")
    _plot_stable_rank(history, shapes,
                      "Stable rank of each layer's gradient vs its full rank (dotted)\n" + run
                      + f"\nnon-private statistic on {FLAGS.analysis_examples} training examples",
                      os.path.join(FLAGS.output_dir, f"stable_rank{suffix}.png"))
    _plot_alignment(history, ranks, FLAGS.plot_rank,
                    "How much of the gradient lies outside the top-r singular subspaces of the "
                    "historical update W − W0 (solid) and of random subspaces (dashed):\n"
                    "the part of the gradient RGP's rank-r carriers lose\n" + run
                    + f"; non-private statistic on {FLAGS.analysis_examples} training examples",
                    os.path.join(FLAGS.output_dir, f"historical_alignment{suffix}.png"))
    print(f"wrote {FLAGS.output_dir}/stable_rank{suffix}.png and "
          f"historical_alignment{suffix}.png")


if __name__ == "__main__":
    app.run(main)
