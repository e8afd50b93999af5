r"""Peak memory and step time of RGP vs exact per-example gradients vs non-private, in one run.

Configurations, each measured in its own subprocess (so one peak does not hide another):

  baseline     builds the plain model and the batch only (no optimizer, no step): the
               memory every configuration needs anyway, subtracted from the others' peaks.
  nonprivate   keras Adam on the plain model.
  dp_vmap      DPAdam, norm_strategy="vmap": exact per-example gradients of every weight
               (tf.vectorized_map), B x (number of weights) floats held at once.
  dp_auto      DPAdam, norm_strategy="auto" (tf_dp's default exact path): ghost norms for
               Dense / Conv2D / GroupNormalization, no per-example gradients for them.
  rgp          reparametrize(model, rank=r) + DPAdam(norm_strategy="auto"): per-example
               gradients of the rank-r carriers only, r (m + n) floats per example and layer
               (reparametrized layers have no ghost formula yet, so their carriers go
               through the vectorized fallback).

Models: a wide MLP (--mlp_depth x Dense(--mlp_width), ReLU, on --mlp_input features, 10
classes) and a small ResNet with GroupNormalization (one basic block per stage of
--resnet_widths channels, 32x32x3 inputs, 10 classes). Data are random (fixed seed).

Peak memory: VmHWM of /proc/self/status (the process's peak resident set) at the end of
the worker; the table shows it minus the baseline worker's peak for the same model, and the
ratio of that to the non-private one. Step time: median over --steps calls of
``tf.function(model.train_step)`` after --warmup calls. "per-ex floats" is the number of
floats of one example's privatized gradient (what exact per-example storage scales with):
every weight for dp_vmap, the carriers plus the non-reparametrized weights for rgp.

  python bench/rgp_bench.py                       # both models, every configuration
  python bench/rgp_bench.py --models=mlp --mlp_batch=8 --steps=5
"""

import gc
import json
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "resnet"], "Models to benchmark (mlp, resnet).")
flags.DEFINE_list("configs", ["nonprivate", "dp_vmap", "dp_auto", "rgp"],
                  "Configurations (the baseline is always measured).")
flags.DEFINE_integer("rank", 8, "RGP carrier rank r.")
flags.DEFINE_integer("mlp_width", 4096, "Units of each hidden Dense layer of the MLP.")
flags.DEFINE_integer("mlp_depth", 4, "Number of hidden Dense layers of the MLP.")
flags.DEFINE_integer("mlp_input", 1024, "Input features of the MLP.")
flags.DEFINE_integer("mlp_batch", 16, "Batch size for the MLP.")
flags.DEFINE_list("resnet_widths", ["32", "64", "128"], "Channels of the ResNet's stages.")
flags.DEFINE_integer("resnet_batch", 64, "Batch size for the ResNet.")
flags.DEFINE_integer("steps", 10, "Timed steps per configuration.")
flags.DEFINE_integer("warmup", 2, "Untimed steps before timing (the first one traces).")
flags.DEFINE_string("worker", None, "Internal: 'model:config' to measure in this process.")


def _status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


# ----------------------------------------------------------------------------- models


def wide_mlp():
    import keras

    layers = [keras.Input((FLAGS.mlp_input,))]
    layers += [keras.layers.Dense(FLAGS.mlp_width, activation="relu")
               for _ in range(FLAGS.mlp_depth)]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers, name="wide_mlp")


def small_resnet():
    """One basic block (conv-GN-relu-conv-GN + shortcut) per stage; Add layers, no BN."""
    import keras

    def conv(filters, kernel, stride):
        return keras.layers.Conv2D(filters, kernel, strides=stride, padding="same",
                                   use_bias=False)

    widths = [int(w) for w in FLAGS.resnet_widths]
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Activation("relu")(keras.layers.GroupNormalization(4)(
        conv(widths[0], 3, 1)(inputs)))
    for i, filters in enumerate(widths):
        stride = 1 if i == 0 else 2
        y = keras.layers.Activation("relu")(keras.layers.GroupNormalization(4)(
            conv(filters, 3, stride)(x)))
        y = keras.layers.GroupNormalization(4)(conv(filters, 3, 1)(y))
        shortcut = x if (stride == 1 and x.shape[-1] == filters) else conv(filters, 1, stride)(x)
        x = keras.layers.Activation("relu")(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="small_resnet")


def batch_of(model_name):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if model_name == "mlp":
        b = FLAGS.mlp_batch
        x = rng.normal(size=(b, FLAGS.mlp_input)).astype("float32")
    else:
        b = FLAGS.resnet_batch
        x = rng.random((b, 32, 32, 3), dtype=np.float32)
    return tf.constant(x), tf.constant(rng.integers(0, 10, b))


# ----------------------------------------------------------------------------- worker


def measure(model_name, config):
    """Runs one configuration in this process; returns a dict of measurements."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_dp
    from tf_dp.layers import reparametrize

    keras.utils.set_random_seed(0)
    model = {"mlp": wide_mlp, "resnet": small_resnet}[model_name]()
    x, y = batch_of(model_name)
    result = {"params": int(model.count_params())}
    if config == "baseline":
        result["peak_kib"] = _status_kib("VmHWM")
        return result
    if config == "rgp":
        plain = model
        model = reparametrize(plain, rank=FLAGS.rank)
        del plain
        gc.collect()
    if config == "nonprivate":
        optimizer = keras.optimizers.Adam(1e-3)
        result["per_example_floats"] = 0
    else:
        model = tf_dp.keras.make_private(model)
        strategy = "vmap" if config == "dp_vmap" else "auto"
        optimizer = tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3,
                                 norm_strategy=strategy)
        privatized = tf_dp.core.carrier_for(model).privatized
        result["per_example_floats"] = int(sum(np.prod(v.shape) for v in privatized))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    if hasattr(model, "check_before_training"):  # what fit() runs before its first step
        model.check_before_training(x, y)
    step = tf.function(lambda a, b: model.train_step((a, b)))
    for _ in range(FLAGS.warmup):
        float(step(x, y)["loss"])
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        float(step(x, y)["loss"])
        times.append(time.perf_counter() - start)
    result["step_s"] = float(np.median(times))
    result["peak_kib"] = _status_kib("VmHWM")
    return result


# ----------------------------------------------------------------------------- driver


def run_worker(model_name, config):
    argv = [sys.executable, os.path.abspath(__file__), f"--worker={model_name}:{config}"]
    argv += [f"--{name}={value}" for name, value in _forwarded_flags()]
    proc = subprocess.run(argv, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:120]}"}


def _forwarded_flags():
    names = ("rank", "mlp_width", "mlp_depth", "mlp_input", "mlp_batch", "resnet_widths",
             "resnet_batch", "steps", "warmup")
    for name in names:
        value = FLAGS[name].value
        yield name, ",".join(value) if isinstance(value, list) else value


def _describe(model_name):
    if model_name == "mlp":
        return (f"mlp: {FLAGS.mlp_depth} x Dense({FLAGS.mlp_width}) on {FLAGS.mlp_input} "
                f"inputs, batch {FLAGS.mlp_batch}")
    return (f"resnet: widths {'/'.join(FLAGS.resnet_widths)}, GroupNorm, 32x32x3, "
            f"batch {FLAGS.resnet_batch}")


def main(argv):
    del argv
    if FLAGS.worker:
        model_name, config = FLAGS.worker.split(":")
        print("RESULT " + json.dumps(measure(model_name, config)), flush=True)
        return
    import keras
    import tensorflow as tf

    load = os.getloadavg()[0]
    print(f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores, "
          f"load average {load:.1f} at start; rank r = {FLAGS.rank}; median of {FLAGS.steps} "
          f"steps after {FLAGS.warmup} warm-up")
    header = (f"{'model':7s} {'configuration':13s} {'per-ex floats':>14s} {'peak (MiB)':>11s} "
              f"{'- baseline':>11s} {'x non-priv':>10s} {'step (ms)':>10s} {'x non-priv':>10s}")
    for model_name in FLAGS.models:
        print(f"\n{_describe(model_name)}")
        print(header)
        base = run_worker(model_name, "baseline")
        if "error" in base:
            print(f"{model_name:7s} {'baseline':13s} {base['error']}")
            continue
        base_mib = base["peak_kib"] / 1024
        print(f"{model_name:7s} {'baseline':13s} {'':>14s} {base_mib:11.0f} {'':>11s} "
              f"{'':>10s} {'':>10s} {'':>10s}   ({base['params']:,} weights)", flush=True)
        ref_mem = ref_time = None
        for config in FLAGS.configs:
            res = run_worker(model_name, config)
            if "error" in res:
                print(f"{model_name:7s} {config:13s} {res['error']}", flush=True)
                continue
            peak = res["peak_kib"] / 1024
            extra = peak - base_mib
            if config == "nonprivate":
                ref_mem, ref_time = extra, res["step_s"]
            mem_ratio = f"{extra / ref_mem:10.2f}" if ref_mem else f"{'-':>10s}"
            time_ratio = f"{res['step_s'] / ref_time:10.2f}" if ref_time else f"{'-':>10s}"
            floats = res["per_example_floats"]
            print(f"{model_name:7s} {config:13s} {floats:14,d} {peak:11.0f} {extra:11.0f} "
                  f"{mem_ratio} {res['step_s'] * 1e3:10.1f} {time_ratio}", flush=True)


if __name__ == "__main__":
    app.run(main)
