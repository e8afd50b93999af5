"""ReparamConv2D: forward parity with Conv2D, carrier gradients on the matrix view, LSG channels."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import _reference as ref
from tf_dp.layers import ReparamConv2D

_CHANNELS_IN = 3


def _pair(filters=4, kernel_size=3, rank=2, input_shape=(2, 7, 7, _CHANNELS_IN), **kwargs):
    conv_kwargs = {k: v for k, v in kwargs.items() if k not in ("sparsity", "warmup_steps")}
    layer = ReparamConv2D(filters, kernel_size, rank=rank, seed=5, **kwargs)
    layer.build(input_shape)
    plain = keras.layers.Conv2D(filters, kernel_size, **conv_kwargs)
    plain.build(input_shape)
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=v.shape).astype("float32") for v in plain.weights]
    plain.set_weights(weights)
    layer.set_weights(weights)
    return layer, plain


def _grads(layer, plain, x):
    probe = tf.random.stateless_normal(plain.compute_output_shape(x.shape), seed=[3, 4])
    with tf.GradientTape() as tape:
        tape.watch([v.value for v in layer.carrier_variables()])
        loss = tf.reduce_sum(layer(x) * probe)
    grad_left, grad_right, grad_kernel = tape.gradient(
        loss, layer.carrier_variables() + [layer.kernel]
    )
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(plain(x) * probe)
    return grad_left, grad_right, grad_kernel, tape.gradient(loss, plain.kernel)


@pytest.mark.parametrize(
    "kwargs, input_shape",
    [
        ({}, (2, 7, 7, 3)),
        ({"strides": 2, "padding": "same"}, (2, 8, 7, 3)),
        ({"strides": (2, 1), "padding": "valid", "activation": "relu"}, (2, 7, 7, 3)),
        ({"dilation_rate": 2, "use_bias": False}, (2, 9, 9, 3)),
        ({"kernel_size": (3, 1), "padding": "same"}, (2, 6, 5, 3)),
        ({"data_format": "channels_first", "padding": "same"}, (2, 3, 6, 6)),
    ],
    ids=["default", "stride2_same", "stride21_relu", "dilated_nobias", "kernel31", "nchw"],
)
def test_forward_matches_conv2d(kwargs, input_shape):
    if kwargs.get("data_format") == "channels_first" and not ref.cpu_runs_nchw_conv():
        pytest.skip("this TensorFlow build runs no channels_first Conv2D on this CPU")
    kwargs = dict(kwargs)
    kernel_size = kwargs.pop("kernel_size", 3)
    layer, plain = _pair(kernel_size=kernel_size, input_shape=input_shape, **kwargs)
    x = np.random.default_rng(1).normal(size=input_shape).astype("float32")
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-4)


def test_weights_and_carrier_layout():
    layer, plain = _pair(filters=4, kernel_size=(3, 2), rank=2)
    assert [(w.name, tuple(w.shape)) for w in layer.trainable_weights] == [
        (w.name, tuple(w.shape)) for w in plain.weights
    ]
    assert layer.left_carrier.shape == (3, 2, _CHANNELS_IN, 2)  # conv with r filters
    assert layer.right_carrier.shape == (1, 1, 2, 4)  # 1×1 conv
    assert [m.shape for m in layer.noise_masks()] == [(1, 1, _CHANNELS_IN, 1), (1, 1, 1, 4)]


def test_carrier_gradients_follow_theorem_2_1_on_the_matrix_view():
    layer, plain = _pair(strides=2, padding="same")
    x = np.random.default_rng(2).normal(size=(2, 7, 7, _CHANNELS_IN)).astype("float32")
    grad_left, grad_right, grad_kernel, grad_w = _grads(layer, plain, x)
    assert grad_kernel is None
    m = 3 * 3 * _CHANNELS_IN
    grad_w = grad_w.numpy().reshape(m, 4)
    left = layer.left_carrier.numpy().reshape(m, 2)
    right = layer.right_carrier.numpy().reshape(2, 4)
    np.testing.assert_allclose(grad_left.numpy().reshape(m, 2), grad_w @ right.T, atol=1e-3)
    np.testing.assert_allclose(grad_right.numpy().reshape(2, 4), left.T @ grad_w, atol=1e-3)


def test_full_rank_reconstructs_the_plain_gradient():
    layer, plain = _pair(filters=4, rank=4, padding="same")  # m = 27 > n = 4
    x = np.random.default_rng(3).normal(size=(2, 7, 7, _CHANNELS_IN)).astype("float32")
    grad_left, grad_right, _, grad_w = _grads(layer, plain, x)
    reconstructed = layer.reconstruct_gradient(grad_left, grad_right)
    assert reconstructed.shape == plain.kernel.shape
    np.testing.assert_allclose(reconstructed, grad_w, atol=1e-3)


def test_lsg_freezes_whole_channels_by_kernel_level_importance():
    layer, plain = _pair(filters=4, rank=2, sparsity=0.5)  # keeps 2 of 3 inputs, 2 of 4 outputs
    left_mask, right_mask = (m.numpy() for m in layer.noise_masks())
    slices = np.abs(layer.kernel.numpy()).sum(axis=(0, 1))  # [c_in, c_out] kernel-level sums
    inputs, outputs = slices.sum(axis=1), slices.sum(axis=0)
    np.testing.assert_array_equal(left_mask.ravel(), inputs >= np.sort(inputs)[-2])
    np.testing.assert_array_equal(right_mask.ravel(), outputs >= np.sort(outputs)[-2])
    x = np.random.default_rng(4).normal(size=(2, 7, 7, _CHANNELS_IN)).astype("float32")
    grad_left, grad_right, _, _ = _grads(layer, plain, x)
    frozen_in, frozen_out = left_mask.ravel() == 0, right_mask.ravel() == 0
    np.testing.assert_array_equal(grad_left.numpy()[:, :, frozen_in, :], 0.0)
    np.testing.assert_array_equal(grad_right.numpy()[..., frozen_out], 0.0)
    assert np.all(grad_left.numpy()[:, :, ~frozen_in, :] != 0)
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-4)


def test_update_carriers_in_tf_function_keeps_carriers_orthonormal():
    layer, _ = _pair(rank=3, warmup_steps=1)
    update = tf.function(layer.update_carriers)
    for _ in range(2):
        update()
        layer.kernel.assign_add(0.01 * tf.ones_like(layer.kernel))
    left = layer.left_carrier.numpy().reshape(-1, 3)
    right = layer.right_carrier.numpy().reshape(3, -1)
    np.testing.assert_allclose(left.T @ left, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(right @ right.T, np.eye(3), atol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    inputs = keras.Input((6, 6, _CHANNELS_IN))
    outputs = ReparamConv2D(4, 3, strides=2, padding="same", rank=2, sparsity=0.25, name="rc")(
        inputs
    )
    model = keras.Model(inputs, outputs)
    layer = model.get_layer("rc")
    layer.kernel.assign_add(0.1 * tf.ones_like(layer.kernel))
    layer.update_carriers()
    path = str(tmp_path / "conv.keras")
    model.save(path)
    loaded = keras.models.load_model(path).get_layer("rc")
    assert loaded.get_config() == layer.get_config()
    for a, b in zip(loaded.weights, layer.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"groups": 2}, "groups"),
        ({"rank": 0}, "rank"),
        ({"sparsity": 1.0}, "sparsity"),
        ({"carrier_init": "zeros"}, "carrier_init"),
        ({"lora_rank": 2}, "lora_rank"),
        ({"padding": "causal"}, "padding"),
    ],
)
def test_bad_arguments(kwargs, argument):
    kwargs = {"rank": 2, **kwargs}
    with pytest.raises(ValueError, match=f"`{argument}`.*got"):
        ReparamConv2D(4, 3, **kwargs)


def test_rank_above_min_dimension_is_refused_at_build():
    with pytest.raises(ValueError, match=r"`rank`.*= 4.*got 5"):
        ReparamConv2D(4, 3, rank=5).build((None, 7, 7, _CHANNELS_IN))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
