"""ReparamEinsumDense: attention-style projections, kernel grouped as input axes × output axes."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.layers import ReparamEinsumDense

# (equation, output_shape, bias_axes, input_shape, permutation of the kernel to
#  (input axes..., output axes...), number of input axes)
_CASES = {
    "query_projection": ("abc,cde->abde", (None, 3, 4), "de", (2, 5, 6), (0, 1, 2), 1),
    "output_projection": ("abcd,cde->abe", (None, 6), "e", (2, 5, 3, 4), (0, 1, 2), 2),
    "ellipsis_dense": ("...b,bc->...c", 7, "c", (2, 3, 5), (0, 1), 1),
    "permuted_kernel": ("abc,edc->abde", (None, 3, 4), None, (2, 5, 6), (2, 0, 1), 1),
}


def _pair(case, rank=2, **kwargs):
    equation, output_shape, bias_axes, input_shape, _, _ = _CASES[case]
    layer = ReparamEinsumDense(
        equation, output_shape, bias_axes=bias_axes, rank=rank, seed=2, **kwargs
    )
    layer.build(input_shape)
    plain = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes)
    plain.build(input_shape)
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=v.shape).astype("float32") for v in plain.weights]
    plain.set_weights(weights)
    layer.set_weights(weights)
    x = rng.normal(size=input_shape).astype("float32")
    return layer, plain, x


def _as_matrix(kernel, case):
    *_, perm, num_input_axes = _CASES[case]
    kernel = np.transpose(np.asarray(kernel), perm)
    m = int(np.prod(kernel.shape[:num_input_axes]))
    return kernel.reshape(m, -1)


def _grads(layer, plain, x):
    probe = tf.random.stateless_normal(plain(x).shape, seed=[5, 6])
    with tf.GradientTape() as tape:
        tape.watch([v.value for v in layer.carrier_variables()])
        loss = tf.reduce_sum(layer(x) * probe)
    grad_left, grad_right, grad_kernel = tape.gradient(
        loss, layer.carrier_variables() + [layer.kernel]
    )
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(plain(x) * probe)
    return grad_left, grad_right, grad_kernel, tape.gradient(loss, plain.kernel)


@pytest.mark.parametrize("case", list(_CASES))
def test_forward_matches_einsum_dense(case):
    layer, plain, x = _pair(case)
    assert [(w.name, tuple(w.shape)) for w in layer.trainable_weights] == [
        (w.name, tuple(w.shape)) for w in plain.weights
    ]
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-5)


@pytest.mark.parametrize("case", ["query_projection", "output_projection", "permuted_kernel"])
def test_carrier_gradients_follow_theorem_2_1(case):
    layer, plain, x = _pair(case)
    grad_left, grad_right, grad_kernel, grad_w = _grads(layer, plain, x)
    assert grad_kernel is None
    grad_w = _as_matrix(grad_w, case)
    m, n = grad_w.shape
    left = layer.left_carrier.numpy().reshape(m, 2)
    right = layer.right_carrier.numpy().reshape(2, n)
    np.testing.assert_allclose(grad_left.numpy().reshape(m, 2), grad_w @ right.T, atol=1e-4)
    np.testing.assert_allclose(grad_right.numpy().reshape(2, n), left.T @ grad_w, atol=1e-4)


@pytest.mark.parametrize("case", ["query_projection", "permuted_kernel"])
def test_full_rank_reconstructs_the_plain_gradient(case):
    layer, plain, x = _pair(case, rank=6)  # m = 6 < n = 12
    grad_left, grad_right, _, grad_w = _grads(layer, plain, x)
    reconstructed = layer.reconstruct_gradient(grad_left, grad_right)
    assert reconstructed.shape == plain.kernel.shape
    np.testing.assert_allclose(reconstructed, grad_w, atol=1e-4)


def test_lsg_masks_on_the_grouped_axes():
    layer, plain, x = _pair("output_projection", sparsity=0.5)  # 12 input units, 6 output
    left_mask, right_mask = (m.numpy() for m in layer.noise_masks())
    assert left_mask.shape == (3, 4, 1) and right_mask.shape == (1, 6)
    matrix = np.abs(_as_matrix(layer.kernel, "output_projection"))
    rows, cols = matrix.sum(axis=1), matrix.sum(axis=0)
    np.testing.assert_array_equal(left_mask.ravel(), rows >= np.sort(rows)[-6])
    np.testing.assert_array_equal(right_mask.ravel(), cols >= np.sort(cols)[-3])
    grad_left, grad_right, _, _ = _grads(layer, plain, x)
    np.testing.assert_array_equal(grad_left.numpy()[left_mask[..., 0] == 0], 0.0)
    np.testing.assert_array_equal(grad_right.numpy()[:, right_mask[0] == 0], 0.0)


def test_save_and_load_round_trip(tmp_path):
    inputs = keras.Input((5, 6))
    outputs = ReparamEinsumDense("abc,cde->abde", (None, 3, 4), bias_axes="de", rank=2, name="re")(
        inputs
    )
    model = keras.Model(inputs, outputs)
    layer = model.get_layer("re")
    layer.kernel.assign_add(0.1 * tf.ones_like(layer.kernel))
    layer.update_carriers()
    path = str(tmp_path / "einsum.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_layer = loaded.get_layer("re")
    assert loaded_layer.get_config() == layer.get_config()
    for a, b in zip(loaded_layer.weights, layer.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x = np.random.default_rng(1).normal(size=(2, 5, 6)).astype("float32")
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)


@pytest.mark.parametrize(
    "equation, kwargs, argument",
    [
        ("abc,bcd->abd", {}, "equation"),  # kernel axis b also in the output: a batch of matrices
        ("ab,bc", {}, "equation"),
        ("ab,bc->ac", {"lora_rank": 2}, "lora_rank"),
        ("ab,bc->ac", {"rank": 1.0}, "rank"),
        ("ab,bc->ac", {"sparsity": 2}, "sparsity"),
        ("ab,bc->ac", {"carrier_init": "Historical"}, "carrier_init"),
    ],
)
def test_bad_arguments(equation, kwargs, argument):
    kwargs = {"rank": 2, **kwargs}
    with pytest.raises(ValueError, match=f"`{argument}`.*got"):
        ReparamEinsumDense(equation, 4, **kwargs)


def test_rank_above_min_dimension_is_refused_at_build():
    with pytest.raises(ValueError, match=r"`rank`.*= 6.*got 7"):
        ReparamEinsumDense("abc,cde->abde", (None, 3, 4), rank=7).build((None, 5, 6))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
