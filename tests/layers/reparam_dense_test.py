"""ReparamDense: forward parity with Dense, carrier gradients, the pipeline protocol, saving."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.layers import ReparamDense
from tf_dp.layers.carriers import power_method


def _pair(units=6, input_dim=8, rank=3, activation=None, use_bias=True, **reparam_kwargs):
    """A built ReparamDense and a plain Dense holding the same kernel and bias."""
    layer = ReparamDense(
        units, activation=activation, use_bias=use_bias, rank=rank, seed=11, **reparam_kwargs
    )
    layer.build((None, input_dim))
    rng = np.random.default_rng(0)
    plain = keras.layers.Dense(units, activation=activation, use_bias=use_bias)
    plain.build((None, input_dim))
    weights = [rng.normal(size=v.shape).astype("float32") for v in plain.weights]
    plain.set_weights(weights)
    layer.set_weights(weights)
    return layer, plain


def _carrier_and_plain_grads(layer, plain, x):
    """Autodiff ∂L, ∂R (and the kernel's, bias's) of a fixed random loss, and the plain ∂W, ∂b."""
    probe = tf.random.stateless_normal(plain.compute_output_shape(x.shape), seed=[1, 2])
    with tf.GradientTape() as tape:
        tape.watch([v.value for v in layer.carrier_variables()])
        loss = tf.reduce_sum(layer(x) * probe)
    grads = tape.gradient(loss, layer.carrier_variables() + [layer.kernel, layer.bias])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(plain(x) * probe)
    plain_grads = tape.gradient(loss, [plain.kernel, plain.bias])
    return grads, plain_grads


@pytest.mark.parametrize("input_shape", [(5, 8), (2, 3, 8)])
@pytest.mark.parametrize("activation, use_bias", [(None, True), ("tanh", False)])
def test_forward_matches_dense(input_shape, activation, use_bias):
    layer, plain = _pair(activation=activation, use_bias=use_bias)
    x = np.random.default_rng(1).normal(size=input_shape).astype("float32")
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-5)


def test_trainable_weights_mirror_dense_and_extras_are_non_trainable():
    layer, plain = _pair()
    assert [w.name for w in layer.trainable_weights] == ["kernel", "bias"]
    assert [tuple(w.shape) for w in layer.trainable_weights] == [
        tuple(w.shape) for w in plain.weights
    ]
    assert [w.name for w in layer.non_trainable_weights] == [
        "reference_kernel",
        "left_carrier",
        "right_carrier",
        "left_mask",
        "right_mask",
        "carrier_step",
    ]
    assert all(not v.trainable for v in layer.carrier_variables())


def test_carrier_gradients_follow_theorem_2_1():
    layer, plain = _pair()
    x = np.random.default_rng(2).normal(size=(5, 8)).astype("float32")
    (grad_left, grad_right, grad_kernel, grad_bias), (grad_w, plain_grad_b) = (
        _carrier_and_plain_grads(layer, plain, x)
    )
    left, right = (v.numpy() for v in layer.carrier_variables())
    np.testing.assert_allclose(grad_left, grad_w.numpy() @ right.T, atol=1e-4)  # ∂L = ∂W·Rᵀ
    np.testing.assert_allclose(grad_right, left.T @ grad_w.numpy(), atol=1e-4)  # ∂R = Lᵀ·∂W
    assert grad_kernel is None  # W only appears under stop_gradient
    np.testing.assert_allclose(grad_bias, plain_grad_b, atol=1e-5)


@pytest.mark.parametrize("units, input_dim", [(6, 4), (4, 6)])
def test_full_rank_reconstructs_the_plain_gradient(units, input_dim):
    layer, plain = _pair(units=units, input_dim=input_dim, rank=min(units, input_dim))
    x = np.random.default_rng(3).normal(size=(5, input_dim)).astype("float32")
    (grad_left, grad_right, _, _), (grad_w, _) = _carrier_and_plain_grads(layer, plain, x)
    np.testing.assert_allclose(layer.reconstruct_gradient(grad_left, grad_right), grad_w, atol=1e-4)


def test_full_rank_sgd_step_through_carriers_equals_plain_sgd_step():
    # STYLE limiting case: rank = full RGP reproduces the non-private optimizer exactly.
    layer, plain = _pair(units=5, input_dim=4, rank=4)
    x = np.random.default_rng(4).normal(size=(6, 4)).astype("float32")
    y = np.random.default_rng(5).normal(size=(6, 5)).astype("float32")

    @tf.function
    def rgp_step():
        layer.update_carriers()
        with tf.GradientTape() as tape:
            tape.watch([v.value for v in layer.carrier_variables()])
            loss = tf.reduce_mean((layer(x) - y) ** 2)
        grad_left, grad_right, grad_bias = tape.gradient(
            loss, layer.carrier_variables() + [layer.bias]
        )
        layer.kernel.assign_sub(0.1 * layer.reconstruct_gradient(grad_left, grad_right))
        layer.bias.assign_sub(0.1 * grad_bias)

    for _ in range(3):
        rgp_step()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((plain(x) - y) ** 2)
        for v, g in zip(plain.trainable_weights, tape.gradient(loss, plain.trainable_weights)):
            v.assign_sub(0.1 * g)
    np.testing.assert_allclose(layer.kernel, plain.kernel, atol=1e-5)
    np.testing.assert_allclose(layer.bias, plain.bias, atol=1e-5)
    assert int(layer.carrier_step) == 3


def _assert_orthonormal_carriers(layer):
    left = np.asarray(layer.left_carrier).reshape(-1, layer.rank)
    right = np.asarray(layer.right_carrier).reshape(layer.rank, -1)
    np.testing.assert_allclose(left.T @ left, np.eye(layer.rank), atol=1e-5)
    np.testing.assert_allclose(right @ right.T, np.eye(layer.rank), atol=1e-5)


def test_carriers_orthonormal_right_after_build():
    layer = ReparamDense(7, rank=3)
    layer.build((None, 5))
    _assert_orthonormal_carriers(layer)
    np.testing.assert_array_equal(layer.reference_kernel, layer.kernel)


def test_update_carriers_uses_weights_in_warmup_then_the_historical_update():
    layer, _ = _pair(units=6, input_dim=8, rank=1, warmup_steps=1)
    update = tf.function(layer.update_carriers)
    update()  # step 0 < warmup_steps: decompose W itself
    expected_left, _ = power_method(layer.kernel, 1, seed=[11, 0])
    np.testing.assert_allclose(np.abs(layer.left_carrier), np.abs(expected_left), atol=1e-5)
    # A rank-one historical update u·vᵀ: after warm-up the carriers are exactly u and v.
    u = np.random.default_rng(6).normal(size=(8, 1)).astype("float32")
    v = np.random.default_rng(7).normal(size=(1, 6)).astype("float32")
    layer.kernel.assign_add(u @ v)
    update()
    _assert_orthonormal_carriers(layer)
    np.testing.assert_allclose(np.abs(layer.left_carrier), np.abs(u) / np.linalg.norm(u), atol=1e-5)
    np.testing.assert_allclose(
        np.abs(layer.right_carrier), np.abs(v) / np.linalg.norm(v), atol=1e-5
    )
    assert int(layer.carrier_step) == 2


def test_update_carriers_falls_back_to_weights_without_history():
    layer, _ = _pair(rank=2)  # warmup_steps=0 and W == W0
    layer.update_carriers()
    expected_left, _ = power_method(layer.kernel, 2, seed=[11, 0])
    np.testing.assert_allclose(np.abs(layer.left_carrier), np.abs(expected_left), atol=1e-5)


def test_random_carriers_are_orthonormal_and_renewed_each_step():
    layer, _ = _pair(rank=2, carrier_init="random")
    before = layer.left_carrier.numpy()
    layer.update_carriers()
    layer.update_carriers()
    _assert_orthonormal_carriers(layer)
    assert not np.allclose(before, layer.left_carrier.numpy())


def test_lsg_masks_freeze_exactly_the_least_important_units():
    layer, plain = _pair(units=6, input_dim=8, rank=2, sparsity=0.5)
    left_mask, right_mask = (m.numpy() for m in layer.noise_masks())
    assert left_mask.shape == (8, 1) and right_mask.shape == (1, 6)
    kernel = np.abs(layer.kernel.numpy())
    rows, cols = kernel.sum(axis=1), kernel.sum(axis=0)
    assert left_mask.sum() == 4 and right_mask.sum() == 3
    np.testing.assert_array_equal(left_mask[:, 0], rows >= np.sort(rows)[-4])
    np.testing.assert_array_equal(right_mask[0], cols >= np.sort(cols)[-3])

    x = np.random.default_rng(8).normal(size=(5, 8)).astype("float32")
    (grad_left, grad_right, _, _), (grad_w, _) = _carrier_and_plain_grads(layer, plain, x)
    left, right = (v.numpy() for v in layer.carrier_variables())
    # Gradients are zero exactly on the frozen rows of ∂L / columns of ∂R, Theorem 2.1 elsewhere.
    np.testing.assert_array_equal(grad_left.numpy()[left_mask[:, 0] == 0], 0.0)
    np.testing.assert_array_equal(grad_right.numpy()[:, right_mask[0] == 0], 0.0)
    np.testing.assert_allclose(grad_left, left_mask * (grad_w.numpy() @ right.T), atol=1e-4)
    np.testing.assert_allclose(grad_right, right_mask * (left.T @ grad_w.numpy()), atol=1e-4)
    assert np.all(grad_left.numpy()[left_mask[:, 0] == 1] != 0)
    # The forward pass is unchanged by the masks.
    np.testing.assert_allclose(layer(x), plain(x), atol=1e-5)
    # Noise times the masks is zero exactly on those entries.
    noise = np.ones(left.shape, np.float32) * left_mask
    np.testing.assert_array_equal(noise == 0, np.broadcast_to(left_mask == 0, left.shape))


def test_noise_masks_are_all_ones_without_sparsity():
    layer, _ = _pair()
    for mask, carrier in zip(layer.noise_masks(), layer.carrier_variables()):
        np.testing.assert_array_equal(np.broadcast_to(mask, carrier.shape), 1.0)


def test_masks_follow_the_weights_at_each_update():
    layer, _ = _pair(units=6, input_dim=8, rank=2, sparsity=0.75)  # keeps 2 of 8 and 2 of 6
    kernel = np.full((8, 6), 0.01, np.float32)
    kernel[:, [2, 5]] += 1.0
    kernel[[1, 6], :] += 0.5
    layer.kernel.assign(kernel)
    tf.function(layer.update_carriers)()
    left_mask, right_mask = (m.numpy() for m in layer.noise_masks())
    np.testing.assert_array_equal(left_mask[:, 0], [0, 1, 0, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(right_mask[0], [0, 0, 1, 0, 0, 1])


def test_set_weights_from_plain_dense_resets_history():
    layer, plain = _pair()
    layer.kernel.assign_add(tf.ones_like(layer.kernel))
    layer.update_carriers()
    layer.set_weights(plain.get_weights())
    np.testing.assert_array_equal(layer.kernel, plain.kernel)
    np.testing.assert_array_equal(layer.reference_kernel, plain.kernel)
    assert int(layer.carrier_step) == 0
    _assert_orthonormal_carriers(layer)
    layer.set_weights(layer.get_weights())  # the full list works as usual


def test_save_and_load_round_trip(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((8,)),
            ReparamDense(6, rank=2, sparsity=0.5, warmup_steps=1, seed=3, name="rd"),
        ]
    )
    layer = model.get_layer("rd")
    layer.update_carriers()
    layer.kernel.assign_add(0.1 * tf.ones_like(layer.kernel))
    layer.update_carriers()
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_layer = loaded.get_layer("rd")
    assert isinstance(loaded_layer, ReparamDense)
    assert loaded_layer.get_config() == layer.get_config()
    assert [w.name for w in loaded_layer.weights] == [w.name for w in layer.weights]
    for a, b in zip(loaded_layer.weights, layer.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(loaded_layer.carrier_step) == 2
    x = np.random.default_rng(9).normal(size=(3, 8)).astype("float32")
    np.testing.assert_allclose(loaded(x), model(x), atol=1e-6)


def test_protocol_before_build_is_refused():
    with pytest.raises(ValueError, match="must be built"):
        ReparamDense(3, rank=1).carrier_variables()


def test_mixed_precision_keeps_carriers_and_kernel_gradient_in_float32():
    layer = ReparamDense(6, rank=2, sparsity=0.5, dtype="mixed_float16")
    layer.build((None, 8))
    x = tf.random.stateless_normal([3, 8], seed=[0, 0])
    with tf.GradientTape() as tape:
        tape.watch([v.value for v in layer.carrier_variables()])
        outputs = layer(x)
        loss = tf.reduce_sum(tf.cast(outputs, tf.float32) ** 2)
    grad_left, grad_right = tape.gradient(loss, layer.carrier_variables())
    assert outputs.dtype == tf.float16 and grad_left.dtype == tf.float32
    grad_kernel = layer.reconstruct_gradient(grad_left, grad_right)
    assert grad_kernel.dtype == tf.float32 and grad_kernel.shape == layer.kernel.shape


def test_config_round_trip():
    layer = ReparamDense(
        4,
        activation="relu",
        use_bias=False,
        rank=2,
        sparsity=0.25,
        power_iterations=2,
        warmup_steps=5,
        carrier_init="random",
        seed=1,
    )
    clone = ReparamDense.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"rank": "3"}, "rank"),
        ({"rank": True}, "rank"),
        ({"rank": 2, "sparsity": 1.0}, "sparsity"),
        ({"rank": 2, "sparsity": -0.1}, "sparsity"),
        ({"rank": 2, "carrier_init": "svd"}, "carrier_init"),
        ({"rank": 2, "power_iterations": 0}, "power_iterations"),
        ({"rank": 2, "warmup_steps": -1}, "warmup_steps"),
        ({"rank": 2, "seed": 1.5}, "seed"),
        ({"rank": 2, "lora_rank": 4}, "lora_rank"),
    ],
)
def test_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`.*got"):
        ReparamDense(4, **kwargs)


def test_rank_above_min_dimension_is_refused_at_build():
    with pytest.raises(ValueError, match=r"`rank` must be <= min\(m, n\) = 3.*got 4"):
        ReparamDense(3, rank=4).build((None, 8))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
