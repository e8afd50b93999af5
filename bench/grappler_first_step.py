r"""The private step's first call (tracing, Grappler, one run) with Grappler options changed.

Issue 14 asks for a first step within 2x non-private's; session 17 found the excess in
Grappler's optimisation of the larger graph. This measures, in one process, the
non-private step's first call with TensorFlow's default options, then sets
``tf.config.optimizer.set_experimental_options(--grappler_options)`` (process-wide: a
measurement, not something tf_dp does) and measures the private configuration's first call
and its median step (bench/step_time.py's models, batch and round-robin timing).

  python bench/grappler_first_step.py --grappler_options='{"disable_meta_optimizer": true}'
  python bench/grappler_first_step.py --grappler_options='{"remapping": false}' --configs=jl5
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time  # noqa: E402  (its flags: --models, --configs, --batch_size, --steps, --threads)

FLAGS = flags.FLAGS
flags.DEFINE_string("grappler_options", "{}",
                    "JSON for tf.config.optimizer.set_experimental_options, applied after "
                    "the non-private step's first call.")


def main(argv):
    del argv
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    options = json.loads(FLAGS.grappler_options)
    name = FLAGS.models[0]
    private = [c for c in FLAGS.configs if c != "nonprivate"][0]
    for config in ("nonprivate", "dp_auto"):  # the process's one-off costs, as step_time
        step_time.compiled_step(name, config, 8)
    base, x, y, base_first, _ = step_time.compiled_step(name, "nonprivate", FLAGS.batch_size)
    if options:
        tf.config.optimizer.set_experimental_options(options)
    step, _, _, first, _ = step_time.compiled_step(name, private, FLAGS.batch_size)
    times = {"nonprivate": [], private: []}
    for _ in range(FLAGS.steps):
        for key, fn in (("nonprivate", base), (private, step)):
            t = time.perf_counter()
            float(fn(x, y)["loss"])
            times[key].append(time.perf_counter() - t)
    ratio = np.median(times[private]) / np.median(times["nonprivate"])
    print(f"{name} {private} Grappler {options or 'default'}: first step {first:.3f} s vs "
          f"{base_first:.3f} s non-private ({first / base_first:.2f}x); step {ratio:.2f}x "
          f"non-private ({np.median(times[private]) * 1e3:.1f} ms)")


if __name__ == "__main__":
    app.run(main)
