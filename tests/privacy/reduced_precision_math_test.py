"""A private step refuses to run when oneDNN may compute float32 in a lower precision.

Every clip bound rests on worst-case rounding bounds of float32 arithmetic
(tf_dp/core/ghost/precision.py). ``TF_SET_ONEDNN_FPMATH_MODE=BF16`` (read by TensorFlow)
or oneDNN's own ``ONEDNN_DEFAULT_FPMATH_MODE`` let oneDNN's float32 matrix products and
convolutions run in bfloat16 internally on CPUs that have it: the weighted sums could then
add more than C per example. The step must refuse, naming the variable, from the core
function and from Keras ``fit``; unset variables and oneDNN's "STRICT" are accepted.

TensorFlow and oneDNN read the variables once per process, so unsetting one inside the
process (as a notebook user might, after the refusal) changes nothing: a variable set when
the process started or when tf_dp was imported is refused too (checked in fresh processes).
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.core import build_per_example_loss, clipped_sum, private_step

LOSS = build_per_example_loss("mse")
RNG = np.random.default_rng(3)


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(2)])


def _batch():
    return (tf.constant(RNG.normal(size=(6, 4)).astype(np.float32)),
            tf.constant(RNG.normal(size=(6, 2)).astype(np.float32)))


def _private_model_and_loop():
    """A private model compiled with DPSGD, and a traced custom loop step over
    ``clipped_sum`` and its optimizer's ``apply_private``."""
    model = tf_dp.keras.make_private(_model())
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    opt = model.optimizer

    @tf.function
    def loop_step(a, b):
        out = clipped_sum(model, a, b, None, LOSS, 1.0)
        opt.apply_private(out.grads, model.trainable_variables, 8.0)

    return model, loop_step


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in private_step._REDUCED_PRECISION_MATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", private_step._REDUCED_PRECISION_MATH_VARIABLES)
@pytest.mark.parametrize("value", ["BF16", "bf16", "TF32", "ANY", "F16"])
def test_a_reduced_precision_math_mode_is_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    x, y = _batch()
    with pytest.raises(ValueError, match=name):
        clipped_sum(_model(), x, y, None, LOSS, 1.0)


def test_keras_fit_refuses_it_too(monkeypatch):
    monkeypatch.setenv("TF_SET_ONEDNN_FPMATH_MODE", "BF16")
    model = tf_dp.keras.make_private(_model())
    model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0,
                                         learning_rate=1e-3), loss="mse")
    x, y = _batch()
    with pytest.raises(ValueError, match="TF_SET_ONEDNN_FPMATH_MODE"):
        model.fit(x.numpy(), y.numpy(), batch_size=3, epochs=1, verbose=0)


@pytest.mark.parametrize("option", ["auto_mixed_precision_onednn_bfloat16",
                                    "auto_mixed_precision_mkl", "auto_mixed_precision"])
def test_grapplers_mixed_precision_rewrite_is_refused(option):
    # Session 24 audit: it rewrote float32 products and convolutions to bfloat16 on this CPU
    # (per-example norms moved by up to 12.6 %), unrefused. Refused while a step is traced
    # and at every call of Keras' train function; turned on after a custom loop was traced,
    # the steps read while it is on void the report.
    model, loop_step = _private_model_and_loop()
    x, y = _batch()
    model.train_on_batch(x, y)
    loop_step(x, y)
    assert model.privacy_report()["guarantee_holds"]
    tf.config.optimizer.set_experimental_options({option: True})
    try:
        with pytest.raises(ValueError, match=option):
            clipped_sum(_model(), x, y, None, LOSS, 1.0)
        with pytest.raises(ValueError, match=option):
            model.train_on_batch(x, y)
        loop_step(x, y)
        report = model.privacy_report()
    finally:
        tf.config.optimizer.set_experimental_options({option: False})
    assert report["steps"] == 3 and not report["guarantee_holds"]
    assert any(c.startswith("MIXED_PRECISION_REWRITE") for c in report["caveats"])
    model.train_on_batch(x, y)  # off again: runs
    assert model.privacy_report()["steps"] == 4


@pytest.mark.parametrize("route", ["compat.v1", "graph_rewrite"])
def test_a_mixed_precision_rewrite_through_another_route_voids_the_steps(route):
    # Session 25 audit: tf.compat.v1.config.optimizer.set_experimental_options (a separate
    # function from tf.config.optimizer's, which tf_dp wrapped) turned the bfloat16 rewrite
    # on for a custom loop's steps and off before the report: per-example norms moved by
    # 0.95 %, and the report held. tf_dp now records it in TensorFlow's eager context, where
    # every route stores it (also the v1 mixed precision graph rewrite).
    model, loop_step = _private_model_and_loop()
    x, y = _batch()
    loop_step(x, y)
    assert model.privacy_report()["guarantee_holds"]
    options = tf.compat.v1.config.optimizer
    if route == "compat.v1":
        options.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": True})
    else:
        from tensorflow.python.framework import config  # noqa: PLC0415
        # what tf.compat.v1.mixed_precision.enable_mixed_precision_graph_rewrite sets
        config.set_optimizer_experimental_options({"auto_mixed_precision": True})
    try:
        loop_step(x, y)
    finally:
        options.set_experimental_options({"auto_mixed_precision_onednn_bfloat16": False,
                                          "auto_mixed_precision": False})
    report = model.privacy_report()
    assert report["steps"] == 2 and not report["guarantee_holds"]
    assert any(c.startswith("MIXED_PRECISION_REWRITE") for c in report["caveats"])


@pytest.mark.parametrize("setting", [None, "", "STRICT", "strict"])
def test_exact_float32_math_is_accepted(monkeypatch, setting):
    if setting is not None:
        monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", setting)
        monkeypatch.setenv("TF_SET_ONEDNN_FPMATH_MODE", setting if setting else "")
    x, y = _batch()
    res = clipped_sum(_model(), x, y, None, LOSS, 1.0)
    assert all(np.all(np.isfinite(g.numpy())) for g in res.grads)


_UNSET_LATER = """
import os, sys
import numpy as np, tensorflow as tf
name, when = sys.argv[1], sys.argv[2]
x = tf.constant(np.ones((4, 3), np.float32))
tf.linalg.matmul(x, x, transpose_b=True)  # a oneDNN kernel runs while it is set ("start")
if when == "start":
    os.environ.pop(name, None)  # unset before tf_dp is imported: too late for TensorFlow
if when == "import":
    os.environ[name] = "BF16"
import tf_dp  # noqa: F401
from tf_dp.core import build_per_example_loss, clipped_sum
tf.linalg.matmul(x, x, transpose_b=True)  # and while it is set ("import")
os.environ.pop(name, None)  # unset in the process: too late for TensorFlow and oneDNN
model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
try:
    clipped_sum(model, x, tf.zeros((4, 2)), None, build_per_example_loss("mse"), 1.0)
except ValueError as e:
    print("REFUSED", e)
else:
    print("ACCEPTED")
"""


def _run_fresh(name, when):
    env = {k: v for k, v in os.environ.items()
           if k not in private_step._REDUCED_PRECISION_MATH_VARIABLES}
    if when == "start":
        env[name] = "BF16"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _UNSET_LATER, name, when], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("when, said", [("start", "was set when this process started"),
                                        ("import", "was set when tf_dp was imported")])
def test_a_mode_unset_inside_the_process_is_still_refused(when, said):
    if when == "start" and not os.path.exists("/proc/self/environ"):
        pytest.skip("no /proc/self/environ: the process's start environment is unknown")
    name = "TF_SET_ONEDNN_FPMATH_MODE"
    out = _run_fresh(name, when)
    assert "REFUSED" in out and name in out and said in out, out


def test_a_fresh_process_without_the_variables_is_accepted():
    # the control: the same script, nothing set at any time
    assert "ACCEPTED" in _run_fresh("TF_SET_ONEDNN_FPMATH_MODE", "never")


def test_tensor_float_32_with_a_gpu_that_uses_it_is_refused(monkeypatch):
    # Session 25 audit (not testable on this CPU-only machine, so the GPU is pretended):
    # TensorFlow runs float32 products and convolutions in TF32 on Ampere and later GPUs by
    # default, with 10-bit mantissas, outside every rounding bound of the clip. Refused at
    # the trace and at every Keras train call while it is on with such a GPU; turned on
    # between two reads of a custom loop's steps, it voids them.
    config = tf.config.experimental
    monkeypatch.setattr(private_step, "_tf32_capable_gpus",
                        lambda: ("/physical_device:GPU:0 (compute capability 8.0)",))
    model, loop_step = _private_model_and_loop()
    x, y = _batch()
    assert config.tensor_float_32_execution_enabled()  # TensorFlow's default
    try:
        with pytest.raises(ValueError, match="enable_tensor_float_32_execution"):
            model.train_on_batch(x, y)
        config.enable_tensor_float_32_execution(False)
        model.train_on_batch(x, y)
        loop_step(x, y)
        assert model.privacy_report()["guarantee_holds"]
        tf.compat.v1.config.experimental.enable_tensor_float_32_execution(True)
        with pytest.raises(ValueError, match="TensorFloat-32"):
            model.train_on_batch(x, y)
        loop_step(x, y)  # the traced step runs (TF32 applies when its kernels run)
        config.enable_tensor_float_32_execution(False)
        report = model.privacy_report()
        assert report["steps"] == 3 and not report["guarantee_holds"]
        assert any(c.startswith("TENSOR_FLOAT_32") for c in report["caveats"])
    finally:
        config.enable_tensor_float_32_execution(True)
    # Without such a GPU (this machine), TF32 changes nothing and is accepted.
    monkeypatch.setattr(private_step, "_tf32_capable_gpus", lambda: ())
    private_step.settings_on_since(0.0)  # tf_dp sees it off (the pretended GPU is gone)
    fresh, _ = _private_model_and_loop()
    fresh.train_on_batch(x, y)
    assert fresh.privacy_report()["guarantee_holds"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
