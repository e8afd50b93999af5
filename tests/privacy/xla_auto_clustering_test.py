"""A private step refuses to run under XLA auto-clustering (session 23 review).

Auto-clustering (``tf.config.optimizer.set_jit("autoclustering")``, or ``TF_XLA_FLAGS``'
``--tf_xla_auto_jit``) compiles clusters of the private step with XLA for each shape it
meets, without ``jit_compile``: tf_dp could not see it, so it neither padded batches to one
shape nor reported ``XLA_BATCH_SHAPES``. Through ``train_on_batch``, one example moved the
clipped sum by 28.6 C (a custom RNN cell) and 36.3 C (LSTM) past crafted examples whose
gradients are mostly rounding. ``model.compile(jit_compile=True)`` is the supported route.
TensorFlow reads TF_XLA_FLAGS once per process, so a value set at the process's start is
refused too (checked in a fresh process).
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.core import private_step


def _model():
    keras.utils.set_random_seed(1)
    model = tf_dp.keras.make_private(keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    return model


def _batch(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32)


def test_auto_clustering_set_in_the_process_is_refused(monkeypatch):
    monkeypatch.delenv("TF_XLA_FLAGS", raising=False)
    model = _model()
    tf.config.optimizer.set_jit("autoclustering")
    try:
        with pytest.raises(ValueError, match="auto-clustering"):
            model.train_on_batch(*_batch())
        assert int(model.optimizer.iterations) == 0 and model.accountant.steps == 0
    finally:
        tf.config.optimizer.set_jit(False)
    model = _model()
    model.train_on_batch(*_batch())  # off again: the step runs
    assert model.accountant.steps == 1


@pytest.mark.parametrize("flags, refused", [
    ("--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit", True),
    ("--tf_xla_auto_jit=1", True),
    ("--tf_xla_auto_jit=0", False),
    ("--tf_xla_cpu_global_jit", False),
])
def test_auto_jit_in_tf_xla_flags_is_refused(flags, refused):
    code = ("import numpy as np, keras, tf_dp\n"
            "m = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)), "
            "keras.layers.Dense(2)]))\n"
            "m.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), "
            "loss='mse')\n"
            "try:\n"
            "    m.train_on_batch(np.zeros((8, 4), 'float32'), np.zeros((8, 2), 'float32'))\n"
            "    print('RAN', m.accountant.steps)\n"
            "except ValueError as e:\n"
            "    print('REFUSED', 'TF_XLA_FLAGS' in str(e), m.accountant.steps)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TF_XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("REFUSED True 0" if refused else "RAN 1") in out.stdout, out.stdout + out.stderr[-2000:]


def test_the_flag_parser():
    assert private_step._auto_jit_flag("--tf_xla_auto_jit=2 --foo") == "2"
    assert private_step._auto_jit_flag("--tf_xla_auto_jit=fusible") == "fusible"
    assert private_step._auto_jit_flag("--tf_xla_auto_jit=-1") == ""
    assert private_step._auto_jit_flag(None) == ""


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
