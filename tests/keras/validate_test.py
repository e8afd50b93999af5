"""tf_dp.keras.validate: findings before training, and fix=True for BatchNormalization."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402


class _NoRule(keras.layers.Layer):
    """A custom layer with a weight and no ghost rule."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return x * self.w


def _functional_with_bn():
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 3)(inp)
    h = keras.layers.BatchNormalization(epsilon=1e-3)(h)
    h = keras.layers.Flatten()(keras.layers.ReLU()(h))
    return keras.Model(inp, _NoRule()(keras.layers.Dense(2)(h)))


def _sequential_with_bn():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8),
                             keras.layers.BatchNormalization(), keras.layers.Dense(2)])


def test_findings_name_the_layers_and_the_fallback_cost():
    model = _functional_with_bn()
    found = tf_dp.keras.validate(model)
    errors = [f for f in found if f.level == "error"]
    infos = [f for f in found if f.level == "info"]
    assert [f.layer for f in errors] == [model.layers[2].name]
    assert "BatchNormalization" in errors[0].message
    assert len(infos) == 1 and "no ghost rule for _NoRule" in infos[0].message
    assert "2 parameters" in infos[0].message  # the exact fallback's per-example size
    # Layers with rules (Conv2D, Dense) are not listed.
    assert not [f for f in found if f.layer in (model.layers[1].name, model.layers[5].name)]


def test_adapted_preprocessing_is_a_warning():
    norm = keras.layers.Normalization()
    norm.adapt(np.random.default_rng(0).normal(size=(20, 4)).astype("float32"))
    model = keras.Sequential([keras.Input((4,)), norm, keras.layers.Dense(1)])
    found = tf_dp.keras.validate(model)
    assert [f.level for f in found] == ["warning"] and "outside epsilon" in found[0].message


@pytest.mark.parametrize("build", [_functional_with_bn, _sequential_with_bn])
def test_fix_swaps_batch_norm_keeps_the_rest_and_trains_privately(build):
    model = build()
    bn = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    bn.gamma.assign(tf.fill(bn.gamma.shape, 1.5))
    bn.beta.assign(tf.fill(bn.beta.shape, -0.5))
    fixed, found = tf_dp.keras.validate(model, fix=True)
    assert not [f for f in found if f.level == "error"]
    norms = [l for l in fixed.layers if isinstance(l, keras.layers.GroupNormalization)]
    assert len(norms) == 1 and not any(
        isinstance(l, keras.layers.BatchNormalization) for l in fixed.layers)
    np.testing.assert_array_equal(norms[0].gamma.numpy(), bn.gamma.numpy())
    np.testing.assert_array_equal(norms[0].beta.numpy(), bn.beta.numpy())
    assert norms[0].epsilon == bn.epsilon
    # Every other layer is shared, weights included.
    others = [l for l in model.layers
              if not isinstance(l, (keras.layers.BatchNormalization, keras.layers.InputLayer))]
    assert all(any(l is f for f in fixed.layers) for l in others)
    private = tf_dp.keras.make_private(fixed)
    private.compile(optimizer=tf_dp.DPAdam(1.0, 1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(1).normal(size=(16,) + tuple(model.inputs[0].shape[1:]))
    private.fit(x.astype("float32"), np.random.default_rng(2).integers(0, 2, 16),
                batch_size=4, verbose=0)
    assert private.epsilon() > 0


def test_fix_refuses_subclassed_models_and_bad_input():
    class Sub(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="`fix=True`"):
        tf_dp.keras.validate(Sub(), fix=True)
    with pytest.raises(TypeError, match="`model`"):
        tf_dp.keras.validate("not a model")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
