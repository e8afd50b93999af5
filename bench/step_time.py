r"""Median train-step time of private optimizers vs non-private Adam, in one run.

Models: the TF Privacy tutorial CNN on 28x28x1 inputs (26,010 parameters), a BiLSTM text
model (Embedding(8000, 64) -> Bidirectional(LSTM(64)) -> Dense(64) -> Dense(1), sequence 150)
and a small Transformer encoder (examples/_transformer.py: token + positional Embedding, 2
blocks of keras.layers.MultiHeadAttention (4 heads) + LayerNorm + FFN(128), width 64,
sequence 64, vocabulary 8000, 2 classes).
For each, the median over timed steps of a compiled train step (tf.function, after warm-up)
for: non-private Adam, DPAdam with norm_strategy="auto" (ghost where a layer formula exists),
DPAdam with norm_strategy="vmap" (vectorized per-example gradients forced) and DPAdamJL with
r = 1, 3, 5 projections. Ratios are to the non-private step measured in the same process.

All configurations of a model are built and traced first, then timed round-robin (one step of
each in turn, ``--steps`` rounds), so that the load of a shared machine drifts over all of
them alike. Steps are traced with an unknown batch dimension, as Poisson-sampled batches are.
The "first step" column is the wall time of each configuration's first call (tracing, graph
optimisation and one execution), measured in the same process before any timing, after
throw-away non-private and private models (batch 8) have paid the process's one-off costs
(printed on their own line).

TensorFlow runs with --threads intra-op and inter-op threads (1 by default: the machine's
cores are shared, and one thread gives the most stable ratios).

  python bench/step_time.py [--batch_size=256] [--steps=20] [--models=cnn,bilstm,transformer]
  python bench/step_time.py --configs=nonprivate,dp_auto,dp_auto_snr,dp_auto_snr_exact
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _transformer import transformer_classifier  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 256, "Batch size.")
flags.DEFINE_integer("steps", 20, "Timed steps per configuration (after 3 warm-up steps).")
flags.DEFINE_list("models", ["cnn", "bilstm", "transformer"], "Models to benchmark.")
flags.DEFINE_integer("threads", 1, "TensorFlow intra-op and inter-op threads.")
flags.DEFINE_list("configs", ["nonprivate", "dp_auto", "dp_vmap", "jl1", "jl3", "jl5"],
                  "Configurations: nonprivate, dp_auto, dp_vmap, jl<r>, dp_auto_snr (exact "
                  "norms with fit(gradient_snr='private')'s per-step SNR), dp_auto_snr_exact.")


def cnn():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(10),
    ]), keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def bilstm():
    return keras.Sequential([
        keras.Input((150,), dtype="int32"),
        keras.layers.Embedding(8000, 64),
        keras.layers.Bidirectional(keras.layers.LSTM(64)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1),
    ]), keras.losses.BinaryCrossentropy(from_logits=True)


def transformer():
    return transformer_classifier(vocab_size=8000, sequence_length=64, embed_dim=64,
                                  num_heads=4, ff_dim=128, num_blocks=2, attention="keras"), \
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)


MODELS = {"cnn": cnn, "bilstm": bilstm, "transformer": transformer}


def data(name, n, rng):
    if name == "cnn":
        return rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n)
    if name == "transformer":
        return rng.integers(1, 8000, (n, 64)).astype("int64"), rng.integers(0, 2, n)
    return rng.integers(0, 8000, (n, 150)).astype("int32"), rng.integers(0, 2, (n, 1)).astype(
        "float32")


def compiled_step(name, config, batch):
    """A traced ``(x, y) -> logs`` train step for one configuration, its batch, the wall
    time of its first call (tracing included) and that of the model checks fit() runs once
    per architecture before it (``check_before_training``; 0 for non-private)."""
    keras.utils.set_random_seed(0)
    model, loss = MODELS[name]()
    dp = dict(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3)
    if config == "nonprivate":
        opt = keras.optimizers.Adam(1e-3)
    elif config.startswith("jl"):
        model = tf_dp.keras.make_private(model)
        opt = tf_dp.DPAdamJL(num_projections=int(config[2:]), **dp)
    else:
        model = tf_dp.keras.make_private(model)
        opt = tf_dp.DPAdam(norm_strategy="vmap" if config == "dp_vmap" else "auto", **dp)
    if config.startswith("dp_auto_snr"):
        # What fit(gradient_snr=...) sets (the step is traced directly here, without fit).
        model._dp_gradient_snr = "exact" if config.endswith("exact") else "private"
    model.compile(optimizer=opt, loss=loss, jit_compile=False)
    x, y = data(name, batch, np.random.default_rng(0))
    x, y = tf.constant(x), tf.constant(y)
    spec = [tf.TensorSpec([None, *x.shape[1:]], x.dtype),
            tf.TensorSpec([None, *y.shape[1:]], y.dtype)]
    t = time.perf_counter()
    if hasattr(model, "check_before_training"):  # what fit() runs before its first step
        model.check_before_training(x, y)
    checks = time.perf_counter() - t
    step = tf.function(lambda a, b: model.train_step((a, b)), input_signature=spec)
    t = time.perf_counter()
    float(step(x, y)["loss"])
    first = time.perf_counter() - t
    for _ in range(2):
        step(x, y)
    return step, x, y, first, checks


def main(argv):
    del argv
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.threads)
    print(f"batch {FLAGS.batch_size}, median of {FLAGS.steps} round-robin steps, TF "
          f"{tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores, load "
          f"{os.getloadavg()[0]:.1f}, {FLAGS.threads} TF thread(s)")
    print(f"{'model':12s} {'configuration':14s} {'step (ms)':>10s} {'x non-private':>14s} "
          f"{'first step (s)':>15s} {'x non-private':>14s} {'checks (s)':>11s}")
    for name in FLAGS.models:
        # One-off costs of a process (TensorFlow's start-up; for the private step also the
        # AutoGraph conversion of the Keras train step): paid by throw-away models of batch 8,
        # reported on their own line, so the column compares configurations alike.
        once = [compiled_step(name, c, 8)[3] for c in ("nonprivate", "dp_auto")]
        print(f"{name:12s} one-off first steps of the process (batch 8): non-private "
              f"{once[0]:.2f} s, then private {once[1]:.2f} s", flush=True)
        steps = {c: compiled_step(name, c, FLAGS.batch_size) for c in FLAGS.configs}
        times = {c: [] for c in FLAGS.configs}
        for _ in range(FLAGS.steps):
            for config, (step, x, y, *_) in steps.items():
                t = time.perf_counter()
                float(step(x, y)["loss"])
                times[config].append(time.perf_counter() - t)
        med = {c: float(np.median(v)) for c, v in times.items()}
        base = med.get("nonprivate")
        first_base = steps["nonprivate"][3] if "nonprivate" in steps else None
        for config in FLAGS.configs:
            ratio = f"{med[config] / base:14.2f}" if base else f"{'-':>14s}"
            first = steps[config][3]
            first_ratio = f"{first / first_base:14.2f}" if first_base else f"{'-':>14s}"
            print(f"{name:12s} {config:14s} {med[config] * 1e3:10.1f} {ratio} {first:15.2f} "
                  f"{first_ratio} {steps[config][4]:11.2f}", flush=True)
    print(f"(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    app.run(main)
