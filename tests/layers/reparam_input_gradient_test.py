"""The input gradient of every reparametrized layer is the plain layer's ∂z·Wᵀ.

The forward pass is ``x·sg(W) + (u − sg(u))`` with ``u = (sg(x)·L_eff)·R_eff`` (no m×n
residual ``W − L·R``): ``x`` must get its gradient through the first term only, else the
low-rank part would be counted twice for every layer below.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.layers import ReparamConv2D, ReparamDense, ReparamEinsumDense


def _copy_weights(layer, plain, input_shape):
    layer.build(input_shape)
    plain.build(input_shape)
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=v.shape).astype("float32") for v in plain.weights]
    plain.set_weights(weights)
    layer.set_weights(weights)
    return rng.normal(size=input_shape).astype("float32")


def _input_grad(layer, x, probe):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x) * probe)
    return tape.gradient(loss, x)


_LAYERS = {
    "dense": (lambda **k: ReparamDense(6, activation="tanh", rank=2, seed=1, **k),
              lambda: keras.layers.Dense(6, activation="tanh"), (4, 3, 8)),
    "conv2d": (lambda **k: ReparamConv2D(5, 3, padding="same", rank=2, seed=1, **k),
               lambda: keras.layers.Conv2D(5, 3, padding="same"), (2, 6, 6, 4)),
    "einsum": (lambda **k: ReparamEinsumDense("abc,cde->abde", (None, 3, 4), bias_axes="de",
                                              rank=2, seed=1, **k),
               lambda: keras.layers.EinsumDense("abc,cde->abde", (None, 3, 4), bias_axes="de"),
               (2, 5, 6)),
}


@pytest.mark.parametrize("kind", list(_LAYERS))
@pytest.mark.parametrize("sparsity", [None, 0.5])
def test_input_gradient_matches_the_plain_layer(kind, sparsity):
    make, make_plain, input_shape = _LAYERS[kind]
    layer, plain = make(sparsity=sparsity), make_plain()
    x = _copy_weights(layer, plain, input_shape)
    probe = tf.random.stateless_normal(plain(x).shape, seed=[7, 8])
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-5)
    np.testing.assert_allclose(_input_grad(layer, x, probe), _input_grad(plain, x, probe),
                               rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
