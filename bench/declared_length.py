r"""Step time of a private model whose keras.Input declares its sequence length vs one that
declares it None (tf_dp keeps a declared-None length unknown in every step: docs/privacy.md),
both fed the same fixed-length batches, with non-private Adam in the same process.

  python bench/declared_length.py --model=bilstm   # Embedding -> BiLSTM(64) -> Dense, T = 150
  python bench/declared_length.py --model=cnn1d    # Embedding -> Conv1D -> LayerNorm -> pool

Median of 12 round-robin ``train_on_batch`` calls after 3 warm-up calls, batch 256, one
TensorFlow thread; DPAdam (C = 1, sigma = 1), exact or ``--num_projections=r`` JL.
Results: docs/step_time.md.
"""

import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "bilstm", ["bilstm", "cnn1d"], "Model.")
flags.DEFINE_integer("length", 150, "Sequence length of every batch.")
flags.DEFINE_integer("batch_size", 256, "Batch size.")
flags.DEFINE_integer("steps", 12, "Timed rounds (after 3 warm-up calls).")
flags.DEFINE_integer("num_projections", 0, "JL projections r (0: exact norms).")


def _bilstm(length):
    return keras.Sequential([
        keras.Input((length,), dtype="int32"), keras.layers.Embedding(8000, 64),
        keras.layers.Bidirectional(keras.layers.LSTM(64)), keras.layers.Dense(64, "relu"),
        keras.layers.Dense(1)])


def _cnn1d(length):
    return keras.Sequential([
        keras.Input((length,), dtype="int32"), keras.layers.Embedding(8000, 64),
        keras.layers.Conv1D(64, 5, activation="relu"), keras.layers.LayerNormalization(),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def _compiled(build, length, private):
    keras.utils.set_random_seed(0)  # weight initialisation only
    model = build(length)
    if private:
        model = tf_dp.keras.make_private(model)
        jl = ({"norm_strategy": tf_dp.JL(FLAGS.num_projections)} if FLAGS.num_projections
              else {})
        opt = tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3, **jl)
    else:
        opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def main(argv):
    del argv
    warnings.simplefilter("ignore")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    build = {"bilstm": _bilstm, "cnn1d": _cnn1d}[FLAGS.model]
    rng = np.random.default_rng(0)
    x = rng.integers(1, 8000, size=(FLAGS.batch_size, FLAGS.length)).astype("int32")
    y = rng.integers(0, 2, size=(FLAGS.batch_size, 1)).astype("float32")
    runs = {}
    for name, length, private in (("nonprivate", FLAGS.length, False),
                                  ("declared_T", FLAGS.length, True),
                                  ("declared_None", None, True)):
        model = _compiled(build, length, private)
        start = time.perf_counter()
        model.train_on_batch(x, y)
        first = time.perf_counter() - start
        for _ in range(2):
            model.train_on_batch(x, y)
        runs[name] = (model, first, [])
    for _ in range(FLAGS.steps):  # round-robin: the machine's load drifts over all alike
        for model, _, times in runs.values():
            start = time.perf_counter()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
    base = np.median(runs["nonprivate"][2])
    for name, (_, first, times) in runs.items():
        step = np.median(times)
        print(f"{FLAGS.model} {name:14s} step {1000 * step:7.1f} ms  x{step / base:5.2f}  "
              f"first {first:5.2f} s")


if __name__ == "__main__":
    app.run(main)
