"""Custom code on the batched-pass paths is said in the privacy report (session 13 audit).

A layer that mixes examples only for some input values, e.g. ``x + relu(max(x, axis=0) -
100)``, passes the first-batch independence probe; on the layer-formula (ghost) and JL paths
one example then moved the clipped sum by 7.6 C. The vectorized path runs every example
alone and stays within C. So:

* every strategy but the vectorized one notes PER_EXAMPLE_ASSUMED, naming the custom code
  (custom layer classes, Lambda functions, a subclassed model's call) whose per-example
  behaviour the guarantee then assumes; built-in layers alone, or the vectorized strategy,
  note nothing;
* under the vectorized strategy that layer's neighbouring clipped sums differ by at most C
  even for the example that triggers the mixing.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.core import build_per_example_loss, clipped_sum


class Gated(keras.layers.Layer):
    """Mixes examples only once some example has an input above 100."""

    def call(self, x):
        return x + keras.ops.relu(keras.ops.max(x, axis=0) - 100.0)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def _caveats(model, strategy):
    model = tf_dp.keras.make_private(model)
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0, norm_strategy=strategy), loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    model.fit(x, np.zeros((16, 1), np.float32), batch_size=4, epochs=1, verbose=0)
    return [c for c in model.privacy_caveats if c.startswith("PER_EXAMPLE_ASSUMED")]


def _sequential(*middle):
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), *middle,
                             keras.layers.Dense(1)])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_custom_code_on_the_batched_path_is_noted_by_name():
    (gated,) = _caveats(_sequential(Gated()), "auto")
    assert "Gated" in gated and "vmap" in gated
    (lam,) = _caveats(_sequential(keras.layers.Lambda(lambda t: 2.0 * t, name="twice")),
                      tf_dp.JL(2))
    assert "Lambda(<lambda>)" in lam
    (sub,) = _caveats(Subclassed(), "auto")
    assert "Subclassed" in sub


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_built_in_layers_or_the_vectorized_path_note_nothing():
    assert _caveats(_sequential(keras.layers.LayerNormalization()), "auto") == []
    assert _caveats(_sequential(Gated()), "vmap") == []


def test_the_vectorized_path_bounds_the_value_dependent_mixing():
    keras.utils.set_random_seed(3)
    model = _sequential(Gated())
    loss = build_per_example_loss("mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 3)).astype(np.float32)
    x[2] = 1e4  # the example that switches the mixing on
    y = rng.normal(size=(6, 1)).astype(np.float32)
    clip = 0.05
    worst = 0.0
    for j in range(6):
        with_j, without_j = np.ones(6, np.float32), np.ones(6, np.float32)
        without_j[j] = 0.0
        sums = [clipped_sum(model, tf.constant(x), tf.constant(y), tf.constant(w), loss, clip,
                            norm_strategy="vmap").grads for w in (with_j, without_j)]
        diff = np.sqrt(sum(float(np.sum((a.numpy() - b.numpy()) ** 2))
                           for a, b in zip(*sums)))
        worst = max(worst, diff)
    assert worst <= clip * (1 + 1e-6), worst / clip


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
