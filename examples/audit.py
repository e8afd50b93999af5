r"""Audit a DP configuration: the audited ε lower bound next to the accountant's ε.

--canaries=gradient (default): one run = one white-box one-run audit (Steinke, Nasr,
Jagielski, NeurIPS 2023) through tf_dp's own private fit: --num_canaries Dirac gradient
canaries, each put in the data with probability 1/2 by the auditor, Poisson sampling at
q = batch/N, DPSGD with the given σ and C (exact or JL norms), scores from the released
per-step updates, 95% lower bound.

--canaries=input: the black-box one-run audit with mislabeled input-space canaries on real
data: --num_canaries Fashion-MNIST test images given a wrong label, each added with
probability 1/2 to --num_other_examples Fashion-MNIST training examples; one DP-Adam fit of a
784-128-10 MLP (σ = 0: plain Adam, no clipping); canaries scored by minus their loss on the
final model (tf_dp.audit.input_canary_audit).

A lower bound above the accountant's ε means the implementation is broken.

  python examples/audit.py --target_epsilon=4 --runs=3
  python examples/audit.py --noise_multiplier=0.8 --num_projections=5
  python examples/audit.py --noise_multiplier=0             # non-private: large bound
  python examples/audit.py --canaries=input --target_epsilon=8 --runs=2

The noise always comes from fresh OS entropy (no seed is passed to the optimizer); the
canaries' inclusion coins are the auditor's own (numpy default_rng()). docs/audit.md has
the measured results.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import warnings  # noqa: E402

from absl import app, flags  # noqa: E402
from tf_dp.accounting.functions import epsilon_text  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("target_epsilon", None, "Calibrate σ to this ε at --delta for the run "
                   "(exclusive with --noise_multiplier).")
flags.DEFINE_float("noise_multiplier", None, "σ (0: non-private reference).")
flags.DEFINE_enum("canaries", "gradient", ["gradient", "input"],
                  "gradient: white-box Dirac gradient canaries; input: mislabeled Fashion-MNIST "
                  "canaries on an MLP, scored by loss (black box).")
flags.DEFINE_float("l2_norm_clip", 1.0, "C.")
flags.DEFINE_integer("num_projections", 0, "r of JL norms (0: exact per-example norms).")
flags.DEFINE_integer("num_canaries", 1000, "m, canaries (each included with probability 1/2).")
flags.DEFINE_integer("num_other_examples", 1000, "Examples with zero gradient (set q).")
flags.DEFINE_integer("expected_batch_size", 15, "E of Poisson sampling: q = E/N "
                     "(--canaries=input: 64 unless given).")
flags.DEFINE_integer("epochs", 4, "Epochs of fit (round(1/q) steps each; --canaries=input: 20 "
                     "unless given).")
flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate (--canaries=input).")
flags.DEFINE_float("delta", 1e-5, "δ of the accountant and of the bound.")
flags.DEFINE_float("confidence", 0.95, "Confidence of the lower bound.")
flags.DEFINE_list("scorers", ["likelihood_ratio", "repeated_noise"],
                  "Scorers (tf_dp.audit.SCORERS); Bonferroni-corrected over them.")
flags.DEFINE_integer("runs", 1, "Independent audits (one training run each).")


def main(argv):
    del argv
    import tf_dp
    from tf_dp.audit import gradient_canary_audit

    if (FLAGS.target_epsilon is None) == (FLAGS.noise_multiplier is None):
        raise app.UsageError("give exactly one of --target_epsilon and --noise_multiplier")
    if FLAGS.canaries == "input":
        return input_canaries()
    kwargs = dict(l2_norm_clip=FLAGS.l2_norm_clip, learning_rate=1.0)
    if FLAGS.num_projections:
        kwargs["norm_strategy"] = tf_dp.JL(FLAGS.num_projections)
    if FLAGS.target_epsilon is not None:
        n = FLAGS.num_canaries // 2 + FLAGS.num_other_examples  # expected dataset size
        sigma = tf_dp.DPSGD.for_target_epsilon(
            FLAGS.target_epsilon, FLAGS.delta, epochs=FLAGS.epochs,
            batch_size=FLAGS.expected_batch_size, dataset_size=n, **kwargs).noise_multiplier
    else:
        sigma = FLAGS.noise_multiplier
    print(f"sigma={sigma:.4f} C={FLAGS.l2_norm_clip:g} "
          f"norms={'JL(%d)' % FLAGS.num_projections if FLAGS.num_projections else 'exact'} "
          f"m={FLAGS.num_canaries} other={FLAGS.num_other_examples} "
          f"E={FLAGS.expected_batch_size} epochs={FLAGS.epochs}")
    for run in range(FLAGS.runs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # σ = 0 and JL's large ε warn; the table says so
            result = gradient_canary_audit(
                lambda: tf_dp.DPSGD(noise_multiplier=sigma, **kwargs),
                num_canaries=FLAGS.num_canaries, expected_batch_size=FLAGS.expected_batch_size,
                epochs=FLAGS.epochs, num_other_examples=FLAGS.num_other_examples,
                delta=FLAGS.delta, confidence=FLAGS.confidence, scorers=FLAGS.scorers)
        print(f"run {run}: audited eps >= {result.epsilon_lower_bound:.3f} "
              f"({result.scorer}, {result.num_correct}/{result.num_guesses}) | f-DP: not "
              f"{result.gdp_mu:.3f}-GDP, its eps {result.gdp_epsilon:.3f}, p(accountant's "
              f"profile) {result.claim_p_value:.3g} | accountant eps "
              f"{epsilon_text(result.epsilon)} | exact-clipping eps {epsilon_text(result.epsilon_exact_clipping)} | "
              f"q={result.sampling_probability:.4f} steps={result.steps} "
              f"{result.seconds:.1f}s"
              + ("  VIOLATION" if result.violation or result.claim_rejected else ""),
              flush=True)


def input_canaries():
    import keras
    import numpy as np

    import tf_dp
    from tf_dp.audit import input_canary_audit

    batch = FLAGS.expected_batch_size if FLAGS["expected_batch_size"].present else 64
    epochs = FLAGS.epochs if FLAGS["epochs"].present else 20
    n = FLAGS.num_other_examples
    m = FLAGS.num_canaries
    (x, y), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist")
    rng = np.random.default_rng()  # the auditor's: which examples, canary labels, coins
    pick = rng.choice(len(x), n, replace=False)
    x = (x[pick].reshape(n, -1) / 255.0).astype(np.float32)
    y = y[pick].astype(np.int64)
    pick = rng.choice(len(x_test), m, replace=False)
    canary_x = (x_test[pick].reshape(m, -1) / 255.0).astype(np.float32)
    canary_y = y_test[pick].astype(np.int64)
    common = dict(learning_rate=FLAGS.learning_rate)
    if FLAGS.target_epsilon is not None:
        sigma = tf_dp.DPAdam.for_target_epsilon(
            FLAGS.target_epsilon, FLAGS.delta, epochs=epochs, batch_size=batch,
            dataset_size=n + m // 2, l2_norm_clip=FLAGS.l2_norm_clip, **common).noise_multiplier
    else:
        sigma = FLAGS.noise_multiplier
    clip = FLAGS.l2_norm_clip if sigma > 0 else float("inf")

    def build_model():
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((784,)), keras.layers.Dense(128, "relu"), keras.layers.Dense(10)]),
            delta=FLAGS.delta)
        model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=clip, noise_multiplier=sigma,
                                             **common),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    print(f"input canaries: sigma={sigma:.4f} C={clip:g} m={m} other={n} E={batch} "
          f"epochs={epochs} lr={FLAGS.learning_rate:g}")
    for run in range(FLAGS.runs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # σ = 0 warns
            r = input_canary_audit(build_model, x, y, 10, m, canary_x, canary_y,
                                   dict(batch_size=batch, epochs=epochs), FLAGS.delta,
                                   FLAGS.confidence, rng=rng)
        mi = r["membership"]
        print(f"run {run}: audited eps >= {r['epsilon_lower_bound']:.3f} "
              f"({r['num_correct']}/{r['num_guesses']}) | f-DP: not {r['gdp']['mu']:.3f}-GDP, its "
              f"eps {r['gdp']['epsilon']:.3f} | accountant eps {epsilon_text(r['epsilon'])} | "
              f"canary AUC {mi['auc']:.3f} TPR@1% {mi['tpr_at_fpr_0.01']:.3f} | "
              f"{r['seconds']:.1f}s" + ("  VIOLATION" if r["epsilon_lower_bound"] > r["epsilon"]
                                       else ""), flush=True)


if __name__ == "__main__":
    app.run(main)
