"""JL per-example norms (Bu et al. 2021, Algorithm 1) against brute force and statistics.

The estimator: for r standard Gaussian directions v_j over all trainable parameters,
``P_ij = <g_i, v_j> ~ N(0, ||g_i||^2)`` independently over j, so with
``M_i^2 = mean_j P_ij^2``

    r * M_i^2 / ||g_i||^2  ~  chi^2_r        (mean 1 for M^2/||g||^2, relative sd sqrt(2/r))

Every statistical tolerance below comes from that law (chi^2 quantiles or the sampling
distribution of a variance), at a stated false-alarm level; the seeds are fixed, so the
tests are deterministic. Exact per-example gradients come from a Python loop over single
examples (one GradientTape each), independently of tf_dp's exact strategies.
"""

import json
import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tests import _reference as ref
from tf_dp.core import build_per_example_loss, clipped_sum, jl
from tf_dp.keras import make_private
from tf_dp.optimizers import DPAdamJL, DPAdamWJL, DPSGDJL

L = keras.layers
_JL_CLASSES = (DPSGDJL, DPAdamJL, DPAdamWJL)

# Family-wise false-alarm level of each statistical test (split by a union bound over the
# examples / projection counts it checks).
_ALPHA = 1e-4


# ------------------------------------------------------------------ models and brute force


def _cnn(dtype="float32"):
    return keras.Sequential([
        keras.Input((8, 8, 1), dtype=dtype),
        L.Conv2D(3, 3, activation="tanh", dtype=dtype),
        L.MaxPooling2D(2, dtype=dtype),
        L.Flatten(dtype=dtype),
        L.Dense(3, dtype=dtype),
    ])


def _lstm(dtype="float32", bidirectional=False):
    rnn = L.LSTM(3, dtype=dtype)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        L.Embedding(20, 4, dtype=dtype),
        L.Bidirectional(rnn, dtype=dtype) if bidirectional else rnn,
        L.Dense(1, dtype=dtype),
    ])


def _cnn_case(seed=0, n=4, dtype="float32"):
    keras.utils.set_random_seed(seed)
    model = _cnn(dtype)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype(dtype)
    y = rng.integers(0, 3, size=n)
    loss = build_per_example_loss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y, loss


def _lstm_case(seed=0, n=4, dtype="float32", bidirectional=False):
    keras.utils.set_random_seed(seed)
    model = _lstm(dtype, bidirectional)
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 20, size=(n, 5)).astype("int32")
    y = rng.normal(size=(n, 1)).astype(dtype)
    return model, x, y, build_per_example_loss("mse")


class _Scale(L.Layer):
    """A custom layer: no ghost rule, so its weight's projections come from forward mode."""

    def build(self, shape):
        self.s = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.s


def _mixed_case(seed=0, n=4, dtype="float32"):
    """A custom layer (forward-mode JVPs) after an Embedding and a GRU, before a Dense
    (projections from their factors)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,), dtype="int32"), L.Embedding(20, 4, dtype=dtype),
                              L.GRU(3, dtype=dtype), _Scale(dtype=dtype), L.Dense(1, dtype=dtype)])
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 20, size=(n, 5)).astype("int32")
    y = rng.normal(size=(n, 1)).astype(dtype)
    return model, x, y, build_per_example_loss("mse")


_CASES = {"cnn": _cnn_case, "lstm": _lstm_case, "mixed": _mixed_case}


def _brute_force(model, loss_fn, x, y):
    """Per-example gradients (float64 NumPy) by a loop over single examples."""
    out = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y[i:i + 1], model(x[i:i + 1], training=True), None))
        grads = tape.gradient(loss, model.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        out.append([tf.convert_to_tensor(g).numpy().astype(np.float64) for g in grads])
    return out


def _norm(arrays):
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays))


def _dot(a, b):
    return sum(float(np.sum(np.asarray(s, np.float64) * np.asarray(t, np.float64)))
               for s, t in zip(a, b))


def _seed(a, b):
    return tf.constant([a, b], tf.int64)


def _jl(model, x, y, loss_fn, r, clip=1e9, seed=(7, 0)):
    # As the Keras step runs one part: a table's directions on its looked-up rows alone.
    with jl.one_part_step():
        return clipped_sum(model, x, y, None, loss_fn, clip, norm_strategy="jl",
                           num_projections=r, seed=_seed(*seed))


def _jl_norms_fn(model, x, y, loss_fn, r):
    """A compiled ``seed -> JL norms`` (traced once; each call draws fresh directions)."""
    x, y = tf.constant(x), tf.constant(y)
    fn = tf.function(lambda s: clipped_sum(model, x, y, None, loss_fn, 1e9, norm_strategy="jl",
                                           num_projections=r, seed=s).norms)
    return lambda step: fn(_seed(7, step)).numpy().astype(np.float64)


def _ratios(model, x, y, loss_fn, r, num_seeds):
    """(num_seeds, B) samples of M_i^2 / ||g_i||^2, one per step seed."""
    exact = np.array([_norm(g) for g in _brute_force(model, loss_fn, x, y)])
    norms = _jl_norms_fn(model, x, y, loss_fn, r)
    return np.stack([norms(k) for k in range(num_seeds)]) ** 2 / exact ** 2


# ------------------------------------------------------------------ statistics of M


@pytest.mark.parametrize("name", sorted(_CASES))
def test_squared_estimate_is_unbiased_and_chi2_distributed(name):
    model, x, y, loss_fn = _CASES[name]()
    r, k = 4, 400
    ratio = _ratios(model, x, y, loss_fn, r, k)
    b = ratio.shape[1]
    # Unbiasedness: sum over seeds of r M^2/||g||^2 ~ chi^2_{k r} for each example.
    total = r * ratio.sum(axis=0)
    lo, hi = stats.chi2.ppf([_ALPHA / (4 * b), 1 - _ALPHA / (4 * b)], k * r)
    assert np.all((total > lo) & (total < hi)), (
        f"mean M^2/||g||^2 = {ratio.mean(axis=0)}, allowed ({lo / (k * r):.3f}, "
        f"{hi / (k * r):.3f})")
    # Not just the mean: r M^2 / ||g||^2 follows chi^2_r (the law the JL accountant assumes;
    # non-Gaussian directions or reused directions would change it).
    for i in range(b):
        p = stats.kstest(r * ratio[:, i], stats.chi2(r).cdf).pvalue
        assert p > _ALPHA / (2 * b), f"example {i}: KS p-value {p:g} against chi^2_{r}"


def _spread_bounds(r, k, level):
    """Acceptance band of the sample sd of M^2/||g||^2 (true sd sqrt(2/r)) over k seeds.

    The sample variance s^2 of k draws with kurtosis kappa has relative sd about
    sqrt((kappa - 1) / k); chi^2_r has kappa = 3 + 12 / r. The band is that many sds wide
    at the normal quantile for ``level`` (loose at r = 1, whose law is very skewed).
    """
    z = stats.norm.ppf(1 - level / 2)
    rel = z * math.sqrt((2 + 12 / r) / k)
    sd = math.sqrt(2 / r)
    return sd * math.sqrt(max(1 - rel, 0.0)), sd * math.sqrt(1 + rel)


@pytest.mark.parametrize("name,projections", [("cnn", (1, 4, 16)), ("lstm", (1, 4))])
def test_relative_spread_shrinks_like_sqrt_2_over_r(name, projections):
    model, x, y, loss_fn = _CASES[name]()
    _check_concentration(model, x, y, loss_fn, projections, k=200)


@pytest.mark.slow  # r = 64 projections per weight, 200 seeds: minutes on 2 shared cores
@pytest.mark.parametrize("name,projections", [("cnn", (16, 64)), ("lstm", (16, 64))])
def test_relative_spread_large_r(name, projections):
    model, x, y, loss_fn = _CASES[name]()
    _check_concentration(model, x, y, loss_fn, projections, k=200)


def _check_concentration(model, x, y, loss_fn, projections, k):
    level = _ALPHA / (len(projections) * x.shape[0])
    spreads = []
    for r in projections:
        ratio = _ratios(model, x, y, loss_fn, r, k)
        # RMS error of M^2 around the exact ||g||^2 (includes any bias), per example.
        spread = np.sqrt(np.mean((ratio - 1.0) ** 2, axis=0))
        lo, hi = _spread_bounds(r, k, level)
        assert np.all((spread > lo) & (spread < hi)), (
            f"r={r}: relative spread {spread}, expected sqrt(2/r)={math.sqrt(2 / r):.3f} "
            f"within ({lo:.3f}, {hi:.3f})")
        spreads.append(spread.mean())
    assert all(a > b for a, b in zip(spreads, spreads[1:])), spreads
    if projections[-1] >= 64:
        # Large r: every single estimate M (k seeds x B examples) is close to the exact norm:
        # |M/||g|| - 1| ~ |M^2/||g||^2 - 1| / 2, whose sd is sqrt(2/r) / 2 (6 sds allowed).
        r = projections[-1]
        assert np.max(np.abs(np.sqrt(ratio) - 1.0)) < 3 * math.sqrt(2 / r)


# ------------------------------------------------------------------ the clipped sum


@pytest.mark.parametrize("name", sorted(_CASES))
def test_clipped_contribution_is_gradient_over_max_1_m_over_c(name):
    model, x, y, loss_fn = _CASES[name]()
    bf = _brute_force(model, loss_fn, x, y)
    exact = np.array([_norm(g) for g in bf])
    clip = 0.5 * float(np.median(exact))  # some examples clipped, probably not all
    # One example at a time: the contribution is exactly g_i * min(1, C / M_i).
    for i in range(len(x)):
        res = _jl(model, x[i:i + 1], y[i:i + 1], loss_fn, r=3, clip=clip, seed=(7, i))
        m = float(res.norms.numpy()[0])
        w = min(1.0, clip / m)
        for got, want, v in zip(res.grads, bf[i], model.trainable_variables):
            np.testing.assert_allclose(got.numpy(), w * want, rtol=2e-4, atol=1e-6,
                                       err_msg=f"example {i}, {v.path}")
        # Its norm: min(M, C) * ||g|| / M, i.e. at most C sqrt(r / chi^2_r).
        np.testing.assert_allclose(_norm([g.numpy() for g in res.grads]),
                                   min(m, clip) * exact[i] / m, rtol=1e-4)
    # The whole batch: one backward pass of sum_i l_i / max(1, M_i / C).
    res = _jl(model, x, y, loss_fn, r=3, clip=clip)
    w = np.minimum(1.0, clip / res.norms.numpy().astype(np.float64))
    assert np.any(w < 1)
    for j, (got, v) in enumerate(zip(res.grads, model.trainable_variables)):
        want = sum(w[i] * bf[i][j] for i in range(len(x)))
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=1e-6, err_msg=v.path)
    # The per-example losses returned are the model's (for metrics).
    want_losses = loss_fn(y, model(x, training=True), None).numpy()
    np.testing.assert_allclose(res.losses.numpy(), want_losses, rtol=1e-5)


# ------------------------------------------------------------------ JVPs vs finite differences


def _float64_case(name):
    previous = keras.config.floatx()
    keras.config.set_floatx("float64")
    try:
        return _CASES[name](seed=3, n=3, dtype="float64")
    finally:
        keras.config.set_floatx(previous)


def _central_differences(model, x, y, loss_fn, direction, h=1e-5):
    """(l_i(theta + h v) - l_i(theta - h v)) / 2h for every example i."""
    variables = model.trainable_variables
    theta = [v.numpy() for v in variables]
    out = []
    for sign in (1.0, -1.0):
        for v, t, d in zip(variables, theta, direction):
            v.assign(t + sign * h * d.numpy())
        out.append(loss_fn(y, model(x, training=True), None).numpy())
    for v, t in zip(variables, theta):
        v.assign(t)
    return (out[0] - out[1]) / (2 * h)


@pytest.mark.parametrize("name", sorted(_CASES))
@pytest.mark.parametrize("r", [1, 3])
def test_projections_match_finite_differences(name, r):
    model, x, y, loss_fn = _float64_case(name)
    variables = model.trainable_variables
    seed = _seed(11, 5)
    dirs = jl.directions(variables, r, seed)
    fd = np.stack([_central_differences(model, x, y, loss_fn, d) for d in dirs])  # (r, B)
    # clipped_sum draws its directions from the same seed (an embedding table's on the
    # batch's ids only): M_i = sqrt(mean_j fd_ij^2) along them.
    with jl.one_part_step():  # as the Keras step runs one part
        res = clipped_sum(model, x, y, None, loss_fn, 1e9, norm_strategy="jl",
                          num_projections=r, seed=seed)
    step_fd = np.stack([_central_differences(model, x, y, loss_fn, d)
                        for d in ref.jl_step_directions(model, x, r, seed)])
    np.testing.assert_allclose(res.norms.numpy(), np.sqrt(np.mean(step_fd ** 2, axis=0)),
                               rtol=1e-6)
    # ... and <exact g_i, v_j> (brute force) is the number the differences approximate.
    bf = _brute_force(model, loss_fn, x, y)
    dots = np.array([[_dot(g, [t.numpy() for t in d]) for g in bf] for d in dirs])
    np.testing.assert_allclose(fd, dots, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ seeds and r = 1


def test_same_seed_same_result_different_step_different_projections():
    model, x, y, loss_fn = _cnn_case()
    a = _jl(model, x, y, loss_fn, r=2, clip=0.1, seed=(5, 3))
    b = _jl(model, x, y, loss_fn, r=2, clip=0.1, seed=(5, 3))
    np.testing.assert_array_equal(a.norms.numpy(), b.norms.numpy())
    for s, t in zip(a.grads, b.grads):
        np.testing.assert_array_equal(s.numpy(), t.numpy())
    d1 = jl.directions(model.trainable_variables, 2, _seed(5, 3))
    d2 = jl.directions(model.trainable_variables, 2, _seed(5, 3))
    for u, v in zip(tf.nest.flatten(d1), tf.nest.flatten(d2)):
        np.testing.assert_array_equal(u.numpy(), v.numpy())
    for other in [(5, 4), (6, 3)]:  # next step; another optimizer seed
        c = _jl(model, x, y, loss_fn, r=2, clip=0.1, seed=other)
        assert np.all(np.abs(c.norms.numpy() - a.norms.numpy()) > 1e-6 * a.norms.numpy())
        d3 = jl.directions(model.trainable_variables, 2, _seed(*other))
        for u, v in zip(tf.nest.flatten(d1), tf.nest.flatten(d3)):
            assert not np.allclose(u.numpy(), v.numpy())
    # Directions j within one step are distinct too.
    assert not np.allclose(d1[0][0].numpy(), d1[1][0].numpy())


def _train_two_steps(opt):
    """Two private steps on fixed batches (the compiled train step; no accountant queries)."""
    keras.utils.set_random_seed(0)
    model = make_private(keras.Sequential([keras.Input((4,)), L.Dense(3, activation="tanh"),
                                           L.Dense(1)]))
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model.check_before_training(x, y)  # before a traced custom loop (fit runs it itself)
    step = tf.function(lambda a, b: model.train_step((a, b)))
    for lo in (0, 8):
        step(x[lo:lo + 8], y[lo:lo + 8])
    return model


@pytest.mark.parametrize("r", [1, 4])
def test_optimizer_steps_are_reproducible_from_the_seed(r):
    a = _train_two_steps(DPAdamJL(0.1, 1.0, num_projections=r, learning_rate=0.01, seed=3))
    b = _train_two_steps(DPAdamJL(0.1, 1.0, num_projections=r, learning_rate=0.01, seed=3))
    c = _train_two_steps(DPAdamJL(0.1, 1.0, num_projections=r, learning_rate=0.01, seed=4))
    assert int(a.optimizer.iterations) == 2
    for wa, wb, wc in zip(a.get_weights(), b.get_weights(), c.get_weights()):
        assert np.all(np.isfinite(wa))
        np.testing.assert_array_equal(wa, wb)
        assert not np.allclose(wa, wc)


# ------------------------------------------------------------------ dropout: one set of masks


def _dropout_model(kind):
    keras.utils.set_random_seed(8)
    if kind == "lstm_dropout":
        return keras.Sequential([keras.Input((4,), dtype="int32"), L.Embedding(20, 4),
                                 L.LSTM(4, dropout=0.5, recurrent_dropout=0.5), L.Dense(1)])
    noise = {"dropout": L.Dropout(0.5), "gaussian_noise": L.GaussianNoise(1.0),
             "gaussian_dropout": L.GaussianDropout(0.5)}[kind]
    return keras.Sequential([keras.Input((6,)), L.Dense(16, activation="relu"), noise,
                             L.Dense(1)])


@pytest.mark.parametrize("kind", ["dropout", "gaussian_noise", "gaussian_dropout",
                                  "lstm_dropout"])
def test_norm_estimate_and_clipped_gradient_share_the_random_masks(kind):
    # For one example the JL norm is sqrt(mean_j <g, v_j>^2) of the gradient g whose
    # masks its projections saw, and the clipped gradient is g * min(1, C / M) for the gradient g of
    # the backward pass. Both are the same g iff every pass used the same masks: then
    # M^2 = mean_j <grad / w, v_j>^2 holds to rounding. With other masks it fails by far
    # (the second call below, whose masks differ, is the control).
    model = _dropout_model(kind)
    rng = np.random.default_rng(8)
    if kind == "lstm_dropout":
        x = rng.integers(1, 20, size=(1, 4)).astype("int32")
    else:
        x = (rng.normal(size=(1, 6)) * 3).astype("float32")
    y = np.array([[2.0]], "float32")
    loss_fn = build_per_example_loss("mse")
    r, clip, seed = 4, 0.05, (21, 0)
    dirs = [[t.numpy() for t in d] for d in
            ref.jl_step_directions(model, x, r, _seed(*seed))]

    def rms_projection(res):
        m = float(res.norms.numpy()[0])
        g = [t.numpy() / min(1.0, clip / m) for t in res.grads]  # undo the clip factor
        return m, math.sqrt(np.mean([_dot(g, d) ** 2 for d in dirs])), g

    first = _jl(model, x, y, loss_fn, r, clip=clip, seed=seed)
    m1, proj1, g1 = rms_projection(first)
    assert m1 > clip  # the clip factor is active
    np.testing.assert_allclose(proj1, m1, rtol=1e-4)
    np.testing.assert_allclose(_norm([t.numpy() for t in first.grads]), clip * _norm(g1) / m1,
                               rtol=1e-5)
    # Control: the same directions with the next call's masks give another gradient, whose
    # projections do not reproduce the first norm estimate.
    second = _jl(model, x, y, loss_fn, r, clip=clip, seed=seed)
    m2, proj2, g2 = rms_projection(second)
    np.testing.assert_allclose(proj2, m2, rtol=1e-4)
    assert _norm([a - b for a, b in zip(g1, g2)]) > 1e-2 * _norm(g1), "masks did not change"
    assert abs(math.sqrt(np.mean([_dot(g2, d) ** 2 for d in dirs])) - m1) > 1e-3 * m1


# ------------------------------------------------------------------ arguments and config


_BAD_R = [0, -1, 2.5, 5.0, "5", None, True, False]


@pytest.mark.parametrize("cls", _JL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", _BAD_R, ids=repr)
def test_optimizer_rejects_bad_num_projections(cls, value):
    with pytest.raises(ValueError, match=r"`num_projections` must be an integer >= 1, got"):
        cls(1.0, 1.0, num_projections=value)


@pytest.mark.parametrize("value", [
    0, -1, 2.5, None, True,
], ids=repr)
def test_clipped_sum_rejects_bad_num_projections(value):
    model, x, y, loss_fn = _cnn_case(n=2)
    with pytest.raises(ValueError, match="`num_projections`"):
        clipped_sum(model, x, y, None, loss_fn, 1.0, norm_strategy="jl",
                    num_projections=value, seed=_seed(0, 0))


def test_clipped_sum_jl_needs_a_seed():
    model, x, y, loss_fn = _cnn_case(n=2)
    with pytest.raises(ValueError, match="`seed`"):
        clipped_sum(model, x, y, None, loss_fn, 1.0, norm_strategy="jl", num_projections=2)


@pytest.mark.parametrize("cls", _JL_CLASSES, ids=lambda c: c.__name__)
def test_jl_optimizer_config_round_trip(cls):
    opt = cls(l2_norm_clip=1.5, noise_multiplier=0.7, num_projections=7, learning_rate=0.02,
              seed=42, gradient_accumulation_steps=2)
    assert opt.norm_strategy == tf_dp.JL(7) and opt.num_projections == 7
    config = opt.get_config()
    json.dumps(config)  # a .keras file stores it as JSON
    assert config["num_projections"] == 7
    assert config["l2_norm_clip"] == 1.5 and config["noise_multiplier"] == 0.7
    assert config["seed"] == 42 and config["gradient_accumulation_steps"] == 2
    clone = cls.from_config(config)
    assert type(clone) is cls
    assert clone.num_projections == 7 and clone.norm_strategy == tf_dp.JL(7)
    assert clone.get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is cls and restored.num_projections == 7
    assert restored.get_config() == config


def test_saved_model_keeps_its_jl_optimizer(tmp_path):
    model = _train_two_steps(DPSGDJL(0.5, 1.0, num_projections=3, learning_rate=0.1,
                                     momentum=0.9, seed=1))
    path = str(tmp_path / "jl.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is DPSGDJL
    assert loaded.optimizer.num_projections == 3 and loaded.optimizer.norm_strategy == tf_dp.JL(3)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
