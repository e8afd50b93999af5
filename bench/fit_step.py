r"""Step time through ``model.fit`` with Poisson sampling, private vs non-private, in one run.

bench/step_time.py times the traced train step on one fixed batch. This times what a user
runs: ``fit(x, y, batch_size=B)`` on N examples, where tf_dp draws Poisson batches (B
expected rows, each step its own size) and pads them (every private batch runs at a
multiple of 16 rows; ``fixed_batch_shape=True`` pads to one size per run; with
``max_physical_batch_size`` the batch runs in parts). Each configuration is one model,
trained in alternation with the others (``--rounds`` fits of ``--steps`` steps each); a
callback times every batch end, and the median step after ``--warmup`` steps of each fit is
kept. Ratios are to the non-private fit of the same run (keras Adam, plain ``fit`` on the
same arrays with shuffled batches of B).

Configurations: ``nonprivate``, ``dp`` (DPAdam, default padding), ``fixed`` (dp with
``fixed_batch_shape=True``), ``parts<M>`` (dp with ``max_physical_batch_size=M``).
The CNN is bench/step_time.py's (the TF Privacy tutorial CNN, 26k parameters) on random
28x28x1 inputs.

  python bench/fit_step.py                                    # nonprivate, dp, fixed, parts32
  python bench/fit_step.py --configs=nonprivate,dp --rounds=4
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _scaling  # noqa: E402  (the models of bench/step_time.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("configs", ["nonprivate", "dp", "fixed", "parts32"], "Configurations.")
flags.DEFINE_integer("n", 60000, "Examples (N).")
flags.DEFINE_integer("batch_size", 256, "Expected batch size (fit's batch_size).")
flags.DEFINE_integer("steps", 120, "Steps per fit.")
flags.DEFINE_integer("warmup", 10, "Steps of each fit left out of its median.")
flags.DEFINE_integer("rounds", 2, "Fits per configuration, alternated.")
flags.DEFINE_integer("threads", 1, "TensorFlow intra-op and inter-op threads.")


class _StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def _model(config):
    keras.utils.set_random_seed(0)  # the initial weights only
    model, loss = _scaling._cnn(), _scaling._sparse_ce()
    if config == "nonprivate":
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        return model, {}
    model = tf_dp.keras.make_private(model)
    model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                         learning_rate=1e-3), loss=loss)
    if config == "dp":
        return model, {}
    if config == "fixed":
        return model, {"fixed_batch_shape": True}
    if config.startswith("parts"):
        return model, {"max_physical_batch_size": int(config[len("parts"):])}
    raise ValueError(f"unknown configuration {config!r}")


def main(argv):
    del argv
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    x, y = _scaling._cnn_batch(FLAGS.n, 0)
    print(f"N {FLAGS.n}, batch {FLAGS.batch_size}, {FLAGS.rounds} x {FLAGS.steps} steps, TF "
          f"{tf.__version__}, load {os.getloadavg()[0]:.1f}, {FLAGS.threads} TF thread(s)")
    models = {c: _model(c) for c in FLAGS.configs}
    medians = {c: [] for c in FLAGS.configs}
    for _ in range(FLAGS.rounds):
        for config, (model, kwargs) in models.items():
            timer = _StepTimes()
            model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, steps_per_epoch=FLAGS.steps,
                      verbose=0, callbacks=[timer], **kwargs)
            medians[config].append(float(np.median(np.diff(timer.ends[FLAGS.warmup:]))))
    base = min(medians["nonprivate"]) if "nonprivate" in medians else None
    print(f"{'configuration':14s} {'median step per fit (ms)':>28s} {'x non-private':>14s}")
    for config, values in medians.items():
        ratio = f"{min(values) / base:14.2f}" if base else f"{'-':>14s}"
        print(f"{config:14s} {', '.join(f'{v * 1e3:.1f}' for v in values):>28s} {ratio}")
    print(f"(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    app.run(main)
