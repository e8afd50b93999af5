"""reparametrize(model) and reparam_layers(model): swapped layers, same predictions."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.layers import (
    ReparamConv2D,
    ReparamDense,
    ReparamEinsumDense,
    reparam_layers,
    reparametrize,
)


def _functional_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Conv2D(2, 1, name="narrow_conv")(x)  # min(m, n) = 2: left alone
    x = keras.layers.Reshape((36, 2), name="tokens")(x)
    x = keras.layers.EinsumDense("abc,cde->abde", (36, 2, 4), bias_axes="de", name="qkv")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(3, name="logits")(x)
    model = keras.Model(inputs, outputs)
    # Non-trivial BatchNorm statistics, so that copying non-reparam weights is tested too.
    model.get_layer("bn").moving_mean.assign(0.3 * tf.ones([8]))
    return model


def _sequential_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(8, activation="tanh", name="d1"),
            keras.layers.Dropout(0.1, name="drop"),
            keras.layers.Dense(6, name="d2"),
            keras.layers.Dense(1, name="d3"),
        ]
    )


def test_functional_model_keeps_its_predictions():
    model = _functional_model()
    new_model = reparametrize(model, rank=2)
    swapped = {layer.name: type(layer) for layer in reparam_layers(new_model)}
    # The "qkv" kernel is 2x8 (m = 2 input channels): not eligible at rank 2.
    assert swapped == {"conv": ReparamConv2D, "hidden": ReparamDense, "logits": ReparamDense}
    assert type(new_model.get_layer("narrow_conv")) is keras.layers.Conv2D
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(new_model(x), model(x), atol=1e-4)
    for layer in reparam_layers(new_model):
        np.testing.assert_array_equal(layer.kernel, model.get_layer(layer.name).kernel)
        np.testing.assert_array_equal(layer.reference_kernel, layer.kernel)
    assert not reparam_layers(model)  # the original is untouched


def test_einsum_layer_is_swapped_when_rank_fits():
    model = _functional_model()
    new_model = reparametrize(model, rank=1, layers=["qkv", "hidden"])
    assert type(new_model.get_layer("qkv")) is ReparamEinsumDense
    assert [layer.name for layer in reparam_layers(new_model)] == ["qkv", "hidden"]
    x = np.random.default_rng(1).normal(size=(2, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(new_model(x), model(x), atol=1e-4)


def test_sequential_model_keeps_its_predictions_and_options():
    model = _sequential_model()
    new_model = reparametrize(model, rank=2, sparsity=0.5, warmup_steps=3, seed=10)
    assert isinstance(new_model, keras.Sequential)
    layers = reparam_layers(new_model)
    assert [layer.name for layer in layers] == ["d1", "d2"]  # d3 has min(m, n) = 1
    assert [layer.seed for layer in layers] == [10, 11]
    assert all(layer.sparsity == 0.5 and layer.warmup_steps == 3 for layer in layers)
    x = np.random.default_rng(2).normal(size=(4, 10)).astype("float32")
    np.testing.assert_allclose(new_model(x), model(x), atol=1e-5)


def test_nested_models_are_searched():
    inner = _sequential_model()
    inputs = keras.Input((10,))
    outer = keras.Model(inputs, keras.layers.Dense(4, name="head")(inner(inputs)))
    new_model = reparametrize(outer, rank=1)
    assert sorted(layer.name for layer in reparam_layers(new_model)) == ["d1", "d2"]
    x = np.random.default_rng(3).normal(size=(4, 10)).astype("float32")
    np.testing.assert_allclose(new_model(x), outer(x), atol=1e-5)


def test_reparametrized_model_trains_through_the_protocol():
    # A minimal stand-in for the pipeline: update carriers, carrier grads, reconstruct, apply.
    model = reparametrize(_sequential_model(), rank=2)
    layers = reparam_layers(model)
    carriers = [v for layer in layers for v in layer.carrier_variables()]
    others = [v for v in model.trainable_variables if not any(v is l.kernel for l in layers)]
    x = np.random.default_rng(5).normal(size=(16, 10)).astype("float32")
    y = np.random.default_rng(6).normal(size=(16, 1)).astype("float32")

    @tf.function
    def step():
        for layer in layers:
            layer.update_carriers()
        with tf.GradientTape() as tape:
            tape.watch([v.value for v in carriers])
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, carriers + others)
        for i, layer in enumerate(layers):
            layer.kernel.assign_sub(0.05 * layer.reconstruct_gradient(*grads[2 * i : 2 * i + 2]))
        for v, g in zip(others, grads[len(carriers) :]):
            v.assign_sub(0.05 * g)
        return loss

    losses = [float(step()) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert all(int(layer.carrier_step) == 5 for layer in layers)


def test_per_example_carrier_gradients_vectorize():
    # The pipeline's exact fallback takes per-example gradients with tf.vectorized_map; every
    # reparam layer must convert (no while-loop fallback) and agree with a Python loop.
    model = _functional_model()
    model = reparametrize(model, rank=1, sparsity=0.5, layers=["conv", "qkv", "hidden"])
    carriers = [v.value for layer in reparam_layers(model) for v in layer.carrier_variables()]
    xb = tf.random.stateless_normal([3, 6, 6, 3], seed=[0, 1])

    def one(xi):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(carriers)
            loss = tf.reduce_sum(model(xi[None]) ** 2)
        return tape.gradient(loss, carriers)

    vectorized = tf.function(lambda xb: tf.vectorized_map(one, xb, fallback_to_while_loop=False))(
        xb
    )
    looped = [one(xb[i]) for i in range(3)]
    for j, grads in enumerate(vectorized):
        expected = np.stack([looped[i][j].numpy() for i in range(3)])
        np.testing.assert_allclose(grads, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2, "sparsity": 1.0}, "sparsity"),
        ({"rank": 2, "carrier_init": "svd"}, "carrier_init"),
        ({"rank": 2, "layers": ["nope"]}, "layers"),
        ({"rank": 2, "layers": ["drop"]}, "layers"),
        ({"rank": 2, "layers": "d1"}, "layers"),
        ({"rank": 2, "layers": ["d3"]}, "rank"),
        ({"rank": 2, "learning_rate": 0.1}, "carrier_options"),
    ],
)
def test_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        reparametrize(_sequential_model(), **kwargs)


def test_subclassed_model_is_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(np.zeros((1, 6), "float32"))
    with pytest.raises(ValueError, match="`model`"):
        reparametrize(net, rank=2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
