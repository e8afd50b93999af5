"""A private step refuses to run when oneDNN may compute float32 in a lower precision.

Every clip bound rests on worst-case rounding bounds of float32 arithmetic
(tf_dp/core/ghost/precision.py). ``TF_SET_ONEDNN_FPMATH_MODE=BF16`` (read by TensorFlow)
or oneDNN's own ``ONEDNN_DEFAULT_FPMATH_MODE`` let oneDNN's float32 matrix products and
convolutions run in bfloat16 internally on CPUs that have it: the weighted sums could then
add more than C per example. The step must refuse, naming the variable, from the core
function and from Keras ``fit``; unset variables and oneDNN's "STRICT" are accepted.
"""

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


@pytest.mark.parametrize("setting", [None, "", "STRICT", "strict"])
def test_exact_float32_math_is_accepted(monkeypatch, setting):
    if setting is not None:
        monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", setting)
        monkeypatch.setenv("TF_SET_ONEDNN_FPMATH_MODE", setting if setting else "")
    x, y = _batch()
    res = clipped_sum(_model(), x, y, None, LOSS, 1.0)
    assert all(np.all(np.isfinite(g.numpy())) for g in res.grads)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
