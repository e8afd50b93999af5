r"""Audit a DP-SGD configuration: the audited ε lower bound next to the accountant's ε.

One run = one white-box one-run audit (Steinke, Nasr, Jagielski, NeurIPS 2023) through
tf_dp's own private fit: --num_canaries Dirac gradient canaries, each put in the data with
probability 1/2 by the auditor, Poisson sampling at q = batch/N, DPSGD with the given σ and
C (exact or JL norms), scores from the released per-step updates, 95% lower bound.
A lower bound above the accountant's ε means the implementation is broken.

  python examples/audit.py --target_epsilon=4 --runs=3
  python examples/audit.py --noise_multiplier=0.8 --num_projections=5
  python examples/audit.py --noise_multiplier=0             # non-private: large bound

The noise always comes from fresh OS entropy (no seed is passed to the optimizer); the
canaries' inclusion coins are the auditor's own (numpy default_rng()). docs/audit.md has
the measured results.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import warnings  # noqa: E402

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_float("target_epsilon", None, "Calibrate σ to this ε at --delta for the run "
                   "(exclusive with --noise_multiplier).")
flags.DEFINE_float("noise_multiplier", None, "σ (0: non-private reference).")
flags.DEFINE_float("l2_norm_clip", 1.0, "C.")
flags.DEFINE_integer("num_projections", 0, "r of JL norms (0: exact per-example norms).")
flags.DEFINE_integer("num_canaries", 1000, "m, canaries (each included with probability 1/2).")
flags.DEFINE_integer("num_other_examples", 1000, "Examples with zero gradient (set q).")
flags.DEFINE_integer("expected_batch_size", 15, "E of Poisson sampling: q = E/N.")
flags.DEFINE_integer("epochs", 4, "Epochs of fit (round(1/q) steps each).")
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
              f"({result.scorer}, {result.num_correct}/{result.num_guesses}) | accountant eps "
              f"{result.epsilon:.3f} | exact-clipping eps {result.epsilon_exact_clipping:.3f} | "
              f"q={result.sampling_probability:.4f} steps={result.steps} "
              f"{result.seconds:.1f}s" + ("  VIOLATION" if result.violation else ""),
              flush=True)


if __name__ == "__main__":
    app.run(main)
