"""Any Keras optimizer made private (issue 10, item 2): RMSprop, Lion, Lamb, Adafactor.

Limiting case (optax style): with noise 0 and no clipping (C = inf), the private optimizer
takes exactly the non-private optimizer's steps on the mean gradient of the batch. With
noise, the update's noise has std sigma C / E per coordinate before the optimizer's rule
(checked for RMSprop through its first step). Plus serialization and bad inputs.
"""

import math
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.optimizers import make_private_optimizer, private_class

BASES = ["RMSprop", "Lion", "Lamb", "Adafactor"]


def _data(n=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, (x @ rng.normal(size=(3, 2))).astype("float32")


def _mlp():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(2)])


@pytest.mark.parametrize("base", BASES)
def test_noise_zero_and_no_clip_reproduce_the_keras_optimizer(base):
    x, y = _data()
    cls = getattr(keras.optimizers, base)
    plain = _mlp()
    plain.compile(optimizer=cls(learning_rate=0.01), loss="mse")
    private = tf_dp.keras.make_private(_mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # noise_multiplier=0 warns: no privacy
        opt = make_private_optimizer(cls(learning_rate=0.01), l2_norm_clip=math.inf,
                                     noise_multiplier=0.0)
    assert type(opt).__name__ == f"DP{base}" and isinstance(opt, cls)
    private.compile(optimizer=opt, loss="mse")
    for _ in range(3):
        plain.train_on_batch(x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private.train_on_batch(x, y)
    for got, want in zip(private.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert private.accountant.steps == 3


def test_private_rmsprop_adds_noise_once_per_step_with_std_sigma_c_over_e():
    # Zero gradients: RMSprop's first step is -lr * g / (sqrt(rho * 0 + (1-rho) g^2) + eps)
    # = -lr * sign(g) / sqrt(1 - rho) (eps negligible): its signs are the noise's signs, and
    # the accumulator holds (1 - rho) g^2, from which |g| = noise / E is read back.
    n, dim_in, dim_out, sigma, clip, rho = 8, 60, 50, 2.0, 1.0, 0.9
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((dim_in,)),
                                                       keras.layers.Dense(dim_out)]))
    model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
    model.compile(optimizer=make_private_optimizer(keras.optimizers.RMSprop(
        learning_rate=1e-3, rho=rho, epsilon=1e-12), l2_norm_clip=clip, noise_multiplier=sigma),
        loss=lambda yt, yp: 0.0 * tf.reduce_sum(yp, axis=-1))
    x = np.ones((n, dim_in), np.float32)
    model.train_on_batch(x, np.zeros((n, dim_out), np.float32))
    slots = [v.numpy() for v in model.optimizer.variables if "velocity" in v.path]
    g = np.concatenate([np.sqrt(s.ravel() / (1 - rho)) for s in slots])
    std = sigma * clip / n
    # |N(0, s^2)| has RMS s (5 standard errors); noise added per replica or per micro-batch,
    # or left unscaled by E, would miss by a factor >= sqrt(2).
    assert abs(np.sqrt(np.mean(g**2)) / std - 1) < 5 / math.sqrt(2 * g.size)


@pytest.mark.parametrize("base", BASES)
def test_config_round_trip_and_load_model(base, tmp_path):
    cls = private_class(getattr(keras.optimizers, base))
    opt = cls(1.5, 1.1, learning_rate=0.02, gradient_accumulation_steps=2)
    again = cls.from_config(opt.get_config())
    for key in ("l2_norm_clip", "noise_multiplier", "accumulation_steps", "num_projections",
                "norm_strategy"):
        assert getattr(again, key) == getattr(opt, key), key
    assert float(again.learning_rate) == pytest.approx(0.02)
    jl = cls(1.0, 1.0, norm_strategy=tf_dp.JL(3))
    jl_again = cls.from_config(jl.get_config())
    assert jl_again.num_projections == 3 and jl_again.norm_strategy.name == "jl"
    x, y = _data()
    model = tf_dp.keras.make_private(_mlp())
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer).__name__ == f"DP{base}"
    assert loaded.optimizer.accumulation_steps == 2
    np.testing.assert_allclose(loaded.epsilon(), model.epsilon(), rtol=1e-9)


def test_bad_inputs_are_refused_with_the_argument_named():
    with pytest.raises(TypeError, match="`optimizer`"):
        make_private_optimizer("adam", 1.0, 1.0)
    with pytest.raises(TypeError, match="`base`"):
        private_class(tf_dp.DPSGD)
    with pytest.raises(TypeError, match="`base`"):
        private_class(int)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        make_private_optimizer(keras.optimizers.Lion(gradient_accumulation_steps=4), 1.0, 1.0)
    with pytest.raises(ValueError, match="`l2_norm_clip`"):
        make_private_optimizer(keras.optimizers.Lamb(), -1.0, 1.0)
    with pytest.raises(ValueError, match="`num_projections`"):
        make_private_optimizer(keras.optimizers.Lamb(), 1.0, 1.0, norm_strategy="jl", num_projections=0)
    opt = make_private_optimizer(keras.optimizers.RMSprop(), 1.0, 1.0)
    with pytest.raises(AttributeError, match="`noise_multiplier`"):
        opt.noise_multiplier = 0.1
    # A private optimizer in a plain model refuses to train (it would train without privacy).
    plain = _mlp()
    plain.compile(optimizer=make_private_optimizer(keras.optimizers.Lion(), 1.0, 1.0),
                  loss="mse")
    with pytest.raises(Exception, match="WITHOUT privacy"):
        plain.train_on_batch(*_data())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
