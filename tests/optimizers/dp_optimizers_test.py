"""DPSGD / DPAdam / DPAdamW: limiting cases, a noisy step by hand, configs, bad arguments.

Every expected value here is computed independently of tf_dp's private step: plain Keras
optimizers on plain models, or per-example gradients from a GradientTape loop over single
examples. The only tf_dp function reused is ``tf_dp.core.gaussian_noise`` (to regenerate
the noise from its documented seed layout ``[seed, logical step]``); its distribution is
checked on its own in tests/core/noise_test.py.
"""

import json
import math
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core import gaussian_noise
from tf_dp.core.randomness import seeded_draw  # noqa: E402
from tf_dp.keras import make_private
from tf_dp.optimizers import DPSGD, DPAdam, DPAdamW

_DP_CLASSES = (DPSGD, DPAdam, DPAdamW)

# Fixed batches are used on purpose here (to compare with plain Keras batch by batch); the
# note that accounting assumes Poisson sampling is tested in tests/keras/dp_model_test.py.
pytestmark = pytest.mark.filterwarnings("ignore:tf_dp. training on a dataset of fixed")


def _mlp(seed=0, in_dim=4, hidden=3, out=1):
    """A tiny MLP with fixed, seed-determined weights (identical across calls)."""
    model = keras.Sequential([
        keras.Input((in_dim,)),
        keras.layers.Dense(hidden, activation="tanh"),
        keras.layers.Dense(out),
    ])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, 0.7, size=w.shape).astype("float32")
                       for w in model.weights])
    return model


def _data(n, in_dim=4, out=1, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, in_dim)).astype("float32")
    y = rng.normal(size=(n, out)).astype("float32")
    return x, y


def _per_example_grads(model, x, y):
    """Gradients of each example's mean-squared error, one GradientTape per example."""
    out = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            pred = model(x[i:i + 1], training=True)
            loss = tf.reduce_mean(tf.square(pred - y[i:i + 1]))
        out.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    return out


def _global_norm(arrays):
    return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))


# ------------------------------------------------------------------ limiting case: C = inf, sigma = 0

_PAIRS = {
    "sgd_momentum": (
        lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        lambda: DPSGD(l2_norm_clip=1e9, noise_multiplier=0.0, learning_rate=0.1, momentum=0.9),
    ),
    "sgd_nesterov": (
        lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.5, nesterov=True),
        lambda: DPSGD(1e9, 0.0, learning_rate=0.05, momentum=0.5, nesterov=True),
    ),
    "adam": (
        lambda: keras.optimizers.Adam(learning_rate=0.01),
        lambda: DPAdam(l2_norm_clip=1e9, noise_multiplier=0.0, learning_rate=0.01),
    ),
    "adamw": (
        lambda: keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.05),
        lambda: DPAdamW(l2_norm_clip=1e9, noise_multiplier=0.0, learning_rate=0.01,
                        weight_decay=0.05),
    ),
}


@pytest.mark.parametrize("name", sorted(_PAIRS))
def test_no_clipping_no_noise_reproduces_the_keras_optimizer(name):
    # Keras' default 'sum_over_batch_size' reduction averages the per-example losses of a
    # batch; the private step divides the clipped sum by the realised batch size when
    # poisson_sampling=False. With C -> inf and sigma = 0 both steps are the same mean
    # gradient, so the weights must agree to float32 round-off after several steps.
    plain_opt, dp_opt = _PAIRS[name]
    x, y = _data(16)
    plain = _mlp(seed=0)
    plain.compile(optimizer=plain_opt(), loss="mse")
    plain.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    private = make_private(_mlp(seed=0))
    private.compile(optimizer=dp_opt(), loss="mse")
    private.fit(x, y, batch_size=4, epochs=2, shuffle=False, poisson_sampling=False, verbose=0)

    assert int(private.optimizer.iterations) == int(plain.optimizer.iterations) == 8
    for got, want in zip(private.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The weights did move: the comparison is not between two untouched models.
    assert _global_norm([a - b for a, b in zip(plain.get_weights(), _mlp(seed=0).get_weights())
                         ]) > 1e-2


# ------------------------------------------------------------------ one noisy step by hand


def test_dpsgd_noisy_steps_match_a_hand_computation():
    n, sigma, lr, seed = 6, 1.3, 0.2, 1234
    x, y = _data(n, out=2, seed=3)
    ref = _mlp(seed=5, out=2)  # a plain twin on which the steps are computed by hand
    # Pick C between the smallest and largest per-example norm so that both the clipped
    # (w_i < 1) and the unclipped (w_i = 1) branches are exercised.
    norms0 = [_global_norm(g) for g in _per_example_grads(ref, x, y)]
    clip = float(np.median(norms0))
    assert min(norms0) < clip < max(norms0)

    private = make_private(_mlp(seed=5, out=2))
    private.compile(optimizer=DPSGD(clip, sigma, learning_rate=lr, seed=seed), loss="mse")
    # batch_size = n: each epoch is one step on the same fixed batch.
    private.fit(x, y, batch_size=n, epochs=2, shuffle=False, poisson_sampling=False, verbose=0)

    variables = ref.trainable_variables
    for step in range(2):
        grads = _per_example_grads(ref, x, y)
        total = [np.zeros(v.shape, np.float32) for v in variables]
        for g in grads:
            factor = min(1.0, clip / _global_norm(g))
            total = [t + factor * gi for t, gi in zip(total, g)]
        # DPOptimizerMixin.apply_private seeds the noise with [seed, logical step].
        noise = gaussian_noise([(v.shape, tf.float64) for v in variables], sigma * clip,
                               seeded_draw(seed, "noise", step))
        for v, t, z in zip(variables, total, noise):
            v.assign(v.numpy() - lr * (t + z.numpy()) / n)

    for got, want in zip(private.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ serialization


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("accumulation", [1, 3])
def test_config_round_trip(cls, accumulation):
    opt = cls(l2_norm_clip=1.5, noise_multiplier=0.7, learning_rate=0.02, seed=42,
              gradient_accumulation_steps=accumulation, norm_strategy="vmap")
    config = opt.get_config()
    json.dumps(config)  # a .keras file stores it as JSON
    for key, value in [("l2_norm_clip", 1.5), ("noise_multiplier", 0.7), ("seed", 42),
                       ("norm_strategy", "vectorized")]:
        assert config[key] == value
    # Accumulation is done by the private train step, never by Keras (whose conditional
    # apply fails under MirroredStrategy): Keras' own attribute stays None.
    assert config["gradient_accumulation_steps"] == accumulation
    assert opt.accumulation_steps == accumulation and opt.gradient_accumulation_steps is None
    clone = cls.from_config(config)
    assert type(clone) is cls
    assert clone.get_config() == config
    assert clone.accumulation_steps == accumulation
    assert clone.gradient_accumulation_steps is None

    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is cls
    assert restored.get_config() == config


# ------------------------------------------------------------------ a DP optimizer alone refuses


def test_dp_optimizer_refuses_a_plain_apply_gradients():
    # Outside a private train step there is no per-example clipping: training would not be
    # private, so the optimizer must refuse rather than update.
    var = keras.Variable(np.ones((3,), np.float32))
    opt = DPSGD(1.0, 1.0, learning_rate=0.1, seed=0)
    with pytest.raises(RuntimeError, match="make_private"):
        opt.apply_gradients([(tf.ones((3,)), var)])
    np.testing.assert_array_equal(var.numpy(), np.ones(3))


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
def test_dp_optimizer_in_a_plain_model_raises_at_fit(cls):
    model = _mlp()
    before = model.get_weights()
    model.compile(optimizer=cls(l2_norm_clip=1.0, noise_multiplier=1.0, seed=0), loss="mse")
    x, y = _data(8)
    with pytest.raises(RuntimeError, match="make_private"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_l2_norm_clip_must_be_positive(cls, value):
    with pytest.raises(ValueError, match=rf"`l2_norm_clip`.*{re.escape(str(value))}"):
        cls(l2_norm_clip=value, noise_multiplier=1.0)


@pytest.mark.parametrize("value", ["1.0", None, True, [1.0]])
def test_l2_norm_clip_must_be_a_number(value):
    with pytest.raises((TypeError, ValueError), match="`l2_norm_clip`"):
        DPSGD(l2_norm_clip=value, noise_multiplier=1.0)


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [-0.1, float("inf"), float("nan")])
def test_noise_multiplier_must_be_finite_and_non_negative(cls, value):
    with pytest.raises(ValueError, match=rf"`noise_multiplier`.*{re.escape(str(value))}"):
        cls(l2_norm_clip=1.0, noise_multiplier=value)


@pytest.mark.parametrize("value", ["1.0", None, False])
def test_noise_multiplier_must_be_a_number(value):
    with pytest.raises((TypeError, ValueError), match="`noise_multiplier`"):
        DPSGD(l2_norm_clip=1.0, noise_multiplier=value)


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_gradient_accumulation_steps_must_be_a_positive_int(cls, value):
    with pytest.raises(ValueError, match="`gradient_accumulation_steps`"):
        cls(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_accumulation_steps=value)


@pytest.mark.parametrize("value", [None, 1, 4])
def test_gradient_accumulation_steps_accepted(value):
    opt = DPSGD(1.0, 1.0, gradient_accumulation_steps=value)
    assert opt.accumulation_steps == (value or 1)


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", ["fast", "", None, "GHOST"])
def test_norm_strategy_must_be_known(cls, value):
    with pytest.raises(ValueError, match="`norm_strategy`"):
        cls(l2_norm_clip=1.0, noise_multiplier=1.0, norm_strategy=value)


@pytest.mark.parametrize("cls", _DP_CLASSES, ids=lambda c: c.__name__)
def test_norm_strategy_objects_names_and_jl(cls):
    import tf_dp

    for given, want in [("auto", tf_dp.Auto()), ("ghost", tf_dp.Ghost()),
                        ("vectorized", tf_dp.Vectorized()), ("vmap", tf_dp.Vectorized()),
                        (tf_dp.Ghost(), tf_dp.Ghost()), (tf_dp.JL(3), tf_dp.JL(3))]:
        opt = cls(1.0, 1.0, norm_strategy=given)
        assert opt.norm_strategy == want
        assert opt.num_projections == want.num_projections
        again = cls.from_config(json.loads(json.dumps(opt.get_config())))
        assert again.norm_strategy == want
    # JL(r) is what the accountant composes (sigma, q, r); exact strategies give r = None.
    assert cls(1.0, 2.0, norm_strategy=tf_dp.JL(4)).mechanism(0.01) == (2.0, 0.01, 4)
    assert cls(1.0, 2.0).mechanism(0.01) == (2.0, 0.01, None)
    assert cls(1.0, 1.0, norm_strategy="jl", num_projections=2).norm_strategy == tf_dp.JL(2)
    assert tf_dp.JL(2) != tf_dp.JL(3) and tf_dp.Auto() != tf_dp.Ghost()


@pytest.mark.parametrize("kwargs, name", [
    (dict(norm_strategy="jl"), "`norm_strategy`"),
    (dict(num_projections=3), "`num_projections`"),
    (dict(norm_strategy="jl", num_projections=0), "`num_projections`"),
    (dict(norm_strategy="jl", num_projections=2.0), "`num_projections`"),
])
def test_norm_strategy_arguments_are_checked(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DPAdam(1.0, 1.0, **kwargs)


def test_jl_alias_is_the_exact_optimizer_with_a_jl_strategy():
    import tf_dp

    alias = tf_dp.DPAdamJL(1.0, 1.1, num_projections=3, learning_rate=0.01)
    direct = tf_dp.DPAdam(1.0, 1.1, norm_strategy=tf_dp.JL(3), learning_rate=0.01)
    assert isinstance(alias, tf_dp.DPAdam)
    a, d = alias.get_config(), direct.get_config()
    assert {k: v for k, v in a.items() if k != "name"} == {
        k: v for k, v in d.items() if k != "name"}
    with pytest.raises(ValueError, match="`norm_strategy`"):
        tf_dp.DPAdamJL(1.0, 1.1, num_projections=3, norm_strategy="auto")


@pytest.mark.parametrize("value", ["7", 1.5])
def test_seed_must_be_an_int(value):
    with pytest.raises((TypeError, ValueError), match="`seed`"):
        DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, seed=value)


def test_numpy_scalars_are_numbers():
    # Calibration code typically hands back numpy scalars (np.float32 from a TF/numpy
    # computation); they are numbers and must be accepted like Python floats.
    opt = DPSGD(l2_norm_clip=np.float32(1.5), noise_multiplier=np.float32(0.5),
                gradient_accumulation_steps=2)
    assert opt.l2_norm_clip == 1.5 and opt.noise_multiplier == 0.5


def test_infinite_clip_is_rejected_or_means_no_clipping():
    # C = inf is either refused up front (ValueError naming `l2_norm_clip`), or it is the
    # "no clipping" limit and then, with sigma = 0, it must be exactly plain SGD. What must
    # never happen is a silent NaN step (w_i = C / max(||g_i||, C) = inf / inf).
    try:
        opt = DPSGD(l2_norm_clip=float("inf"), noise_multiplier=0.0, learning_rate=0.1)
    except ValueError as err:
        assert "`l2_norm_clip`" in str(err)
        return
    x, y = _data(8)
    plain = _mlp(seed=0)
    plain.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    private = make_private(_mlp(seed=0))
    private.compile(optimizer=opt, loss="mse")
    private.fit(x, y, batch_size=4, epochs=1, shuffle=False, poisson_sampling=False, verbose=0)
    for got, want in zip(private.get_weights(), plain.get_weights()):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)



def test_for_target_epsilon_calibrates_sigma_for_the_run_fit_does():
    import tf_dp
    from tf_dp import accounting

    n, batch, epochs, target = 64, 16, 3, 2.0
    opt = DPAdam.for_target_epsilon(target, 1e-5, epochs=epochs, batch_size=batch,
                                    dataset_size=n, l2_norm_clip=1.0, learning_rate=1e-2)
    sigma, q, steps = opt.noise_multiplier, batch / n, epochs * round(n / batch)
    run = dict(sampling_probability=q, steps=steps, delta=1e-5)
    assert accounting.compute_epsilon(noise_multiplier=sigma, **run) <= target
    assert accounting.compute_epsilon(noise_multiplier=sigma * 0.99, **run) > target  # smallest
    rng = np.random.default_rng(0)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)),
                                                      keras.layers.Dense(1)]))
    model.compile(optimizer=opt, loss="mse")
    model.fit(rng.normal(size=(n, 4)).astype("float32"),
              rng.normal(size=(n, 1)).astype("float32"), batch_size=batch, epochs=epochs,
              verbose=0)
    assert model.accountant.steps == steps
    assert 0.95 * target < model.epsilon() <= target
    # JL: calibrated for the JL mechanism with its r.
    jl = tf_dp.DPSGDJL.for_target_epsilon(target, 1e-5, epochs=epochs, batch_size=batch,
                                          dataset_size=n, l2_norm_clip=1.0, num_projections=20)
    assert jl.num_projections == 20
    assert accounting.compute_epsilon(noise_multiplier=jl.noise_multiplier, **run,
                                      num_projections=20) <= target
    assert jl.noise_multiplier > sigma  # JL costs more than exact clipping at equal sigma
    with pytest.raises(ValueError, match="`noise_multiplier`"):
        DPAdam.for_target_epsilon(target, 1e-5, epochs=1, batch_size=8, dataset_size=64,
                                  l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="`epochs`"):
        DPAdam.for_target_epsilon(target, 1e-5, epochs=0, batch_size=8, dataset_size=64,
                                  l2_norm_clip=1.0)

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
