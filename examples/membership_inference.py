r"""Membership inference on Fashion-MNIST MLPs: loss threshold, offline and online LiRA.

A pool of --pool examples; the target model trains on a random half (members; the other half
are non-members); --shadows shadow models train the same way on balanced random halves (each
example in exactly half of them) for offline LiRA (Carlini et al., S&P 2022: a Gaussian per
example fitted on the shadows that did not train on it; online: a second Gaussian on those
that did, the score their likelihood ratio, with variances pooled over examples as the paper
advises for few shadows). Per setting (--methods: non-private,
DP-Adam at --target_epsilon, and the same DP-Adam on the MLP reparametrized by RGP or LSG,
Yu et al. ICML 2021 §5 / Ito et al.): ROC AUC, TPR at FPR 0.1% and 1%, the ε lower bound of
the best threshold (Clopper–Pearson, threshold chosen on a held-out half), the target
model's test accuracy, and the log-log ROC curves.

  python examples/membership_inference.py                  # ~5 min unloaded, 15-30 loaded
  python examples/membership_inference.py --methods=rgp,lsg --output=docs/figures/audit_roc_rgp.png
  python examples/membership_inference.py --smoke --output=/tmp/roc.png

The DP noise always comes from fresh OS entropy; --seed only chooses the pool and the halves
(the auditor's randomness). docs/audit.md has the measured results.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time  # noqa: E402
import warnings  # noqa: E402

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("pool", 4000, "Examples in the pool (half are members).")
flags.DEFINE_integer("shadows", 6, "Shadow models for offline LiRA (even).")
flags.DEFINE_integer("epochs", 20, "Epochs per model.")
flags.DEFINE_integer("batch_size", 128, "Expected batch size (Poisson).")
flags.DEFINE_float("target_epsilon", 8.0, "ε of the private setting at δ = --delta.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_list("methods", ["nonprivate", "dpadam"],
                  "Settings: nonprivate (σ = 0, no clipping), dpadam (DP-Adam at "
                  "--target_epsilon), rgp / lsg (the same DP-Adam, Dense layers reparametrized "
                  "by tf_dp.layers.reparametrize at --rank, LSG freezing --sparsity).")
flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate (every setting).")
flags.DEFINE_integer("rank", 8, "Carrier rank of rgp / lsg.")
flags.DEFINE_float("sparsity", 0.5, "Fraction of units LSG freezes.")
flags.DEFINE_integer("seed", 0, "Seeds the pool and the member halves only, never DP noise.")
flags.DEFINE_string("output", "docs/figures/audit_roc.png", "Where the ROC figure goes.")
flags.DEFINE_bool("smoke", False, "Tiny sizes, to check that the script runs.")


def main(argv):
    del argv
    import keras

    import tf_dp
    from tf_dp.accounting.functions import epsilon_text
    from tf_dp.audit import (confidence_logits, lira_offline_scores, lira_online_scores,
                             loss_scores, membership_report, plot_roc)
    from tf_dp.layers import reparametrize

    unknown = set(FLAGS.methods) - {"nonprivate", "dpadam", "rgp", "lsg"}
    if unknown or not FLAGS.methods:
        raise app.UsageError(f"--methods: nonprivate, dpadam, rgp, lsg; got {FLAGS.methods}")

    if FLAGS.smoke:
        FLAGS.pool, FLAGS.shadows, FLAGS.epochs = 400, 4, 2
    rng = np.random.default_rng(FLAGS.seed)
    (x, y), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist")
    x_test = (x_test.reshape(len(x_test), -1) / 255.0).astype(np.float32)
    pick = rng.choice(len(x), FLAGS.pool, replace=False)
    x = (x[pick].reshape(FLAGS.pool, -1) / 255.0).astype(np.float32)
    y = y[pick].astype(np.int64)
    n_half = FLAGS.pool // 2

    def train(member_mask, method):
        private = method != "nonprivate"
        model = keras.Sequential([
            keras.Input((784,)), keras.layers.Dense(128, "relu"), keras.layers.Dense(10)])
        if method in ("rgp", "lsg"):  # both Dense layers (min(m, n) > rank)
            model = reparametrize(model, rank=FLAGS.rank,
                                  sparsity=FLAGS.sparsity if method == "lsg" else None)
        model = tf_dp.keras.make_private(model, delta=FLAGS.delta)
        common = dict(learning_rate=FLAGS.learning_rate)
        if private:
            opt = tf_dp.DPAdam.for_target_epsilon(
                FLAGS.target_epsilon, FLAGS.delta, epochs=FLAGS.epochs,
                batch_size=FLAGS.batch_size, dataset_size=n_half, l2_norm_clip=1.0, **common)
        else:
            opt = tf_dp.DPAdam(l2_norm_clip=float("inf"), noise_multiplier=0.0, **common)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), metrics=["accuracy"])
        model.fit(x[member_mask], y[member_mask], batch_size=FLAGS.batch_size,
                  epochs=FLAGS.epochs, verbose=0)
        return model

    curves, rows = {}, []
    names = {"nonprivate": "non-private", "dpadam": "DP-Adam", "rgp": f"RGP r={FLAGS.rank}",
             "lsg": f"LSG r={FLAGS.rank} p={FLAGS.sparsity:g}"}
    for method in FLAGS.methods:
        label = names[method] + ("" if method == "nonprivate"
                                 else f" eps={FLAGS.target_epsilon:g}")
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # σ = 0 warns
            target_in = np.zeros(FLAGS.pool, bool)
            target_in[rng.choice(FLAGS.pool, n_half, replace=False)] = True
            target = train(target_in, method)
            shadow_in = rng.permuted(
                np.tile(np.arange(FLAGS.shadows) < FLAGS.shadows // 2, (FLAGS.pool, 1)),
                axis=1).T
            shadow_phi = np.stack([confidence_logits(train(m, method), x, y)
                                   for m in shadow_in])
        eps = float(target.epsilon())
        accuracy = float(target.evaluate(x_test, y_test, batch_size=1000, verbose=0)[1])
        target_phi = confidence_logits(target, x, y)
        scores = {"loss": loss_scores(target, x, y),
                  "LiRA offline": lira_offline_scores(target_phi, shadow_phi, shadow_in),
                  "LiRA online": lira_online_scores(target_phi, shadow_phi, shadow_in)}
        for attack, s in scores.items():
            r = membership_report(s[target_in], s[~target_in], FLAGS.delta, 0.95, rng)
            if attack != "LiRA offline":  # the figure: the weakest and the strongest attack
                curves[f"{label}, {attack}"] = (s[target_in], s[~target_in])
            rows.append((label, eps, accuracy, attack, r))
        print(f"{label}: {1 + FLAGS.shadows} models in {time.perf_counter() - start:.0f}s",
              flush=True)
    print("| setting | accountant ε | test acc. | attack | AUC | TPR@0.1% | TPR@1% "
          "| ε lower bound (95%) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, eps, accuracy, attack, r in rows:
        print(f"| {label} | {epsilon_text(eps, 3)} | {accuracy:.3f} | {attack} | {r['auc']:.3f} "
              f"| {r['tpr_at_fpr_0.001']:.3f} "
              f"| {r['tpr_at_fpr_0.01']:.3f} | {r['epsilon_lower_bound']:.3f} |")
    os.makedirs(os.path.dirname(FLAGS.output) or ".", exist_ok=True)
    plot_roc(curves, FLAGS.output, f"Fashion-MNIST MLP, {FLAGS.pool // 2} members")
    print(f"wrote {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
