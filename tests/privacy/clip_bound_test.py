"""Every example adds at most C to the clipped sum, for any input and in any precision.

The contribution of example i is measured as the global norm of ``clipped_sum`` on the batch
in which only example i has a non-zero sample weight: the others add exactly nothing (their
loss, hence every output gradient, is 0), so this is what example i adds to the sum the
optimizer noises, as the library forms it (its rounding included). Required for every exact
norm strategy, every ghost rule and every Keras policy: at most ``C (1 + 1e-6)``. The JL
strategy clips an estimate M_i of the norm, so for it the requirement is that nothing is
lost in precision: a contribution is at most ``C ||g_i|| / M_i (1 + 1e-6)``.

Adversarial inputs (seeded draws, a property test without a property-testing library):

* cancellation: inputs alternating along the sequence axis (+M u, -M u, ... plus noise),
  so that ``sum_t a_t g_t^T`` is a small difference of terms ~M times larger: the Gram form
  ``sum((A A^T) * (G G^T))`` then loses kappa^2 of the squared norm in float32 and can go
  negative;
* magnitudes from 1e-30 to 1e30 (inputs and sample weights), where float32 squares
  overflow or underflow.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.core import build_per_example_loss, clipped_sum

L = keras.layers

_TOL = 1e-6


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _linear_loss(coefficients):
    """``l_i = sw_i * sum_j c_j y_pred_ij``: gradients stay finite for any input size."""
    c = tf.constant(np.asarray(coefficients, np.float32).ravel())

    def loss(y_true, y_pred, sample_weight):
        flat = tf.reshape(tf.cast(y_pred, tf.float32), [tf.shape(y_pred)[0], -1])
        per = tf.linalg.matvec(flat, c)
        return per if sample_weight is None else per * tf.cast(sample_weight, tf.float32)

    return loss


def _contributions(model, x, loss_fn, clip, strategy, weights, **kwargs):
    """(norm of what each example alone adds / C, norms reported for it), one traced step."""
    n = len(x)
    y = np.zeros((n, 1), np.float32)

    @tf.function
    def run(sample_weight):
        res = clipped_sum(model, x, y, sample_weight, loss_fn, clip, norm_strategy=strategy,
                          **kwargs)
        total = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float64))) for g in res.grads])
        return tf.sqrt(total), res.norms

    out, norms = [], []
    for i in range(n):
        sw = np.zeros(n, np.float32)
        sw[i] = weights[i]
        total, nm = run(tf.constant(sw))
        out.append(float(total) / clip)
        norms.append(float(nm[i]))
    return np.array(out), np.array(norms)


def _alternating(rng, shape, magnitude):
    """(T, ..., C) inputs that alternate in sign along T (and along W for images)."""
    u = rng.normal(size=shape[-1])
    sign = np.ones(shape[:-1])
    for axis in range(len(shape) - 1):
        idx = [None] * (len(shape) - 1)
        idx[axis] = slice(None)
        sign = sign * ((-1.0) ** np.arange(shape[axis]))[tuple(idx)]
    return sign[..., None] * magnitude * u + rng.normal(size=shape)


def _adversarial_batch(rng, shape):
    """Examples: two cancelling ones, inputs of 1e30 and 1e-30, and normal inputs with sample
    weights 1e30, 1e-30 and 1. Returns (x, sample weights)."""
    xs = [_alternating(rng, shape, 7e3), _alternating(rng, shape, 1e5),
          1e30 * rng.normal(size=shape), 1e-30 * rng.normal(size=shape),
          rng.normal(size=shape), rng.normal(size=shape), rng.normal(size=shape)]
    weights = [1.0, 1.0, 1.0, 1.0, 1e30, 1e-30, 1.0]
    return np.stack(xs).astype("float32"), np.array(weights)


def _small(model, scale):
    # Small recurrent kernels keep the gates out of saturation for the alternating inputs.
    model.set_weights([w * scale for w in model.get_weights()])
    return model


def _dense():
    return keras.Sequential([keras.Input((32, 64)), L.Dense(32), L.GlobalAveragePooling1D()])


def _conv1d():
    return keras.Sequential([keras.Input((16, 8)), L.Conv1D(16, 3), L.GlobalAveragePooling1D()])


def _conv2d():
    return keras.Sequential([keras.Input((4, 4, 8)), L.Conv2D(8, 3, padding="same"),
                             L.GlobalAveragePooling2D()])


def _einsum_dense():
    return keras.Sequential([keras.Input((32, 64)),
                             L.EinsumDense("abc,cd->abd", (32, 32), bias_axes="d"),
                             L.GlobalAveragePooling1D()])


def _einsum_direct():
    # Contracts over the sequence axis too: not an outer product, a direct per-example term.
    return keras.Sequential([keras.Input((32, 64)), L.EinsumDense("abc,cd->ad", 8,
                                                                  bias_axes="d")])


def _layer_norm():
    return keras.Sequential([keras.Input((32, 64)), L.LayerNormalization(), L.Dense(4),
                             L.GlobalAveragePooling1D()])


def _group_norm():
    return keras.Sequential([keras.Input((32, 8)), L.GroupNormalization(groups=2),
                             L.GlobalAveragePooling1D()])


def _lstm():
    return _small(keras.Sequential([keras.Input((8, 16)), L.LSTM(8, return_sequences=True),
                                    L.GlobalAveragePooling1D()]), 1e-3)


def _gru():
    return _small(keras.Sequential([keras.Input((8, 16)), L.GRU(8, return_sequences=True),
                                    L.GlobalAveragePooling1D()]), 1e-3)


# rule -> (model builder, input shape of one example, whose Gram form the case targets)
_RULES = {
    "dense": (_dense, (32, 64)),
    "conv1d": (_conv1d, (16, 8)),
    "conv2d": (_conv2d, (4, 4, 8)),
    "einsum_dense_outer": (_einsum_dense, (32, 64)),
    "einsum_dense_direct": (_einsum_direct, (32, 64)),
    "layer_norm": (_layer_norm, (32, 64)),
    "group_norm": (_group_norm, (32, 8)),
    "lstm": (_lstm, (8, 16)),
    "gru": (_gru, (8, 16)),
}


def _check_bound(got, norms, clip, label):
    assert np.all(np.isfinite(got)), f"{label}: contributions {got}"
    assert np.all(got <= 1 + _TOL), f"{label}: contributions / C = {got}"
    # Not bought by over-clipping: a clipped example still adds (nearly) C. (Under float16 an
    # example whose gradient overflows has an infinite norm and adds nothing.)
    clipped = np.isfinite(norms) & (norms > clip * (1 + 1e-3))
    assert np.all(got[clipped] > 1 - 1e-3), f"{label}: clipped examples add {got[clipped]} C"


@pytest.mark.parametrize("strategy", ["ghost", "vmap"])
@pytest.mark.parametrize("rule", sorted(_RULES))
def test_adversarial_inputs_never_exceed_the_clip(rule, strategy):
    build, shape = _RULES[rule]
    keras.utils.set_random_seed(0)
    model = build()
    rng = np.random.default_rng(sorted(_RULES).index(rule))
    x, weights = _adversarial_batch(rng, shape)
    out_size = int(np.prod(model.output_shape[1:]))
    loss = _linear_loss(rng.normal(size=out_size))
    clip = 1e-2
    got, norms = _contributions(model, x, loss, clip, strategy, weights)
    _check_bound(got, norms, clip, f"{rule}/{strategy}")


def test_ghost_norms_of_a_cancelling_dense_input_are_exact():
    # The crafted case: T = 32 steps alternating ~7e3, where the float32 Gram form gave a
    # norm far below the true one (or a negative square). Exact norm in float64 by hand.
    keras.utils.set_random_seed(0)
    model = _dense()
    rng = np.random.default_rng(1)
    x = np.stack([_alternating(rng, (32, 64), m) for m in (7e3, 3e4, 1e5)]).astype("float32")
    coefficients = rng.normal(size=32)
    loss = _linear_loss(coefficients)
    res = clipped_sum(model, x, np.zeros((3, 1), np.float32), None, loss, 1e-3,
                      norm_strategy="ghost")
    dz = np.asarray(coefficients, np.float32).astype(np.float64) / 32  # GAP of a linear loss
    want = [np.sqrt(np.sum(np.outer(xi.astype(np.float64).sum(0), dz) ** 2)
                    + np.sum((32 * dz) ** 2))
            for xi in x]
    np.testing.assert_allclose(res.norms.numpy(), want, rtol=1e-4)


def test_embedding_with_cancelling_repeated_tokens():
    # Rows of one repeated token receive output gradients that alternate in sign (a Dense
    # kernel alternating +-7e3 over the time steps): their sum is a small difference.
    keras.utils.set_random_seed(0)
    steps, width = 32, 8
    model = keras.Sequential([keras.Input((steps,), dtype="int32"), L.Embedding(10, width),
                              L.Flatten(), L.Dense(1)])
    rng = np.random.default_rng(5)
    v = rng.normal(size=width)
    kernel = np.concatenate([((-1) ** t) * 7e3 * v + rng.normal(size=width)
                             for t in range(steps)])[:, None]
    model.layers[-1].set_weights([kernel.astype("float32"), np.zeros(1, "float32")])
    x = np.stack([np.full(steps, 3), np.tile([1, 2], steps // 2), rng.integers(0, 10, steps),
                  np.full(steps, 7), rng.integers(0, 10, steps)]).astype("int32")
    weights = np.array([1.0, 1.0, 1.0, 1e30, 1e-30])
    loss = _linear_loss([1.0])
    for strategy in ("ghost", "vmap"):
        got, norms = _contributions(model, x, loss, 1e-2, strategy, weights)
        _check_bound(got, norms, 1e-2, f"embedding/{strategy}")


# ------------------------------------------------------------------ policies


def _mixed_model():
    return keras.Sequential([
        keras.Input((12, 6)),
        L.Conv1D(8, 3, activation="tanh"),
        L.LayerNormalization(),
        L.LSTM(6, return_sequences=True),
        L.Dense(5, activation="tanh"),
        L.GlobalAveragePooling1D(),
        L.Dense(3, dtype="float32"),
    ])


#: Norms of the policy batch are about 1e-20, 1.2, 3.2, 3.3, 5 and 3e4: some clipped.
_POLICY_CLIP = 3.0


def _policy_batch():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 12, 6)).astype("float32")
    x[1] *= 30.0
    weights = np.array([1.0, 1.0, 1e4, 0.3, 1.0, 1e-20])
    return x, weights, _linear_loss(rng.normal(size=3))


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"],
                         indirect=True)
@pytest.mark.parametrize("strategy", ["ghost", pytest.param("vmap", marks=pytest.mark.slow)])
def test_exact_strategies_stay_within_the_clip_under_every_policy(policy, strategy):
    keras.utils.set_random_seed(1)
    model = _mixed_model()
    x, weights, loss = _policy_batch()
    got, norms = _contributions(model, x, loss, _POLICY_CLIP, strategy, weights)
    _check_bound(got, norms, _POLICY_CLIP, f"{policy}/{strategy}")


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"],
                         indirect=True)
def test_jl_clip_factors_lose_no_precision_under_every_policy(policy):
    # JL clips M_i, an estimate of ||g_i||: what example i adds is w_i g_i with
    # w_i = min(1, C / M_i), so at most C ||g_i|| / M_i, never rounded up.
    keras.utils.set_random_seed(2)
    model = _mixed_model()
    x, weights, loss = _policy_batch()
    seed = tf.constant([3, 4], tf.int64)
    kwargs = dict(num_projections=3, seed=seed)
    # w_i = 1 (a clip far above every norm): the norm of g_i itself.
    big = 1e30
    unclipped, _ = _contributions(model, x, loss, big, "jl", weights, **kwargs)
    g_norms = unclipped * big
    got, estimates = _contributions(model, x, loss, _POLICY_CLIP, "jl", weights, **kwargs)
    # w_i ||g_i|| / C = ||g_i|| / max(C, M_i) (also when M_i underflowed to 0: w_i = 1).
    allowed = g_norms / np.maximum(_POLICY_CLIP, estimates)
    live = g_norms > 0
    assert np.any(estimates[live] > _POLICY_CLIP) and np.any(estimates[live] < _POLICY_CLIP)
    assert np.all(got[live] <= allowed[live] * (1 + _TOL)), got[live] / allowed[live] - 1


# ------------------------------------------------------------------ mixed_float16


def _two_layer(policy, weights=None):
    """Dense-tanh-Dense with a float32 output layer (the Keras advice for mixed precision)."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), L.Dense(16, activation="tanh"),
                                  L.Dense(1, dtype="float32")])
        if weights is not None:
            model.set_weights(weights)
        return model
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _relative_errors(got, want):
    return [float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                  / np.linalg.norm(np.asarray(b, np.float64))) for a, b in zip(got, want)]


def _tiny_mse(y_true, y_pred):
    # Per-example output gradients ~1e-7: float16 keeps them only with loss scaling.
    return 1e-7 * tf.square(y_true - y_pred)


def _regression(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 6)).astype("float32"),
            (3 * rng.normal(size=(n, 1))).astype("float32"))


def test_fixed_loss_scale_only_when_a_layer_computes_in_float16():
    from tf_dp.keras import make_private
    from tf_dp.core import loss_scale

    mixed = _two_layer("mixed_float16")
    assert loss_scale.fixed_loss_scale(mixed) == loss_scale.DEFAULT_LOSS_SCALE
    # A private wrapper made outside the policy scope: its layers still compute in float16.
    assert loss_scale.fixed_loss_scale(make_private(mixed)) == loss_scale.DEFAULT_LOSS_SCALE
    assert loss_scale.fixed_loss_scale(mixed, 1024) == 1024.0
    assert loss_scale.fixed_loss_scale(_two_layer("float32")) is None
    assert loss_scale.fixed_loss_scale(_two_layer("mixed_bfloat16")) is None
    for bad in (0, -4.0, 3.0, float("inf"), True):
        with pytest.raises(ValueError, match="`loss_scale`"):
            loss_scale.fixed_loss_scale(mixed, bad)


def test_scaled_clipped_sum_keeps_float16_gradients_that_would_underflow():
    from tf_dp.core import loss_scale
    x, y = _regression()
    loss = build_per_example_loss(_tiny_mse)
    reference = _two_layer("float32")
    mixed = _two_layer("mixed_float16", reference.get_weights())
    clip = 2e-7  # some examples clipped, some not
    want = clipped_sum(reference, x, y, None, loss, clip).grads
    scale = loss_scale.fixed_loss_scale(mixed)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        scaled = loss_scale.scaled_clipped_sum(mixed, x, y, None, loss, clip, scale)
        unscaled = clipped_sum(mixed, x, y, None, loss, clip)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert max(_relative_errors(scaled.grads, want)) < 2e-2
    assert max(_relative_errors(unscaled.grads, want)) > 5e-2  # why the scale is needed
    # The unscaled norms are reported, and every example still adds at most C.
    norms = clipped_sum(reference, x, y, None, loss, clip).norms.numpy()
    np.testing.assert_allclose(scaled.norms.numpy(), norms, rtol=2e-2)
    for i in range(3):
        sw = np.zeros(len(x), np.float32)
        sw[i] = 1.0
        one = loss_scale.scaled_clipped_sum(mixed, x, y, sw, loss, clip, scale)
        total = np.sqrt(sum(np.sum(np.square(g.numpy().astype(np.float64))) for g in one.grads))
        assert total <= clip * (1 + _TOL)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_an_example_that_overflows_float16_adds_nothing_and_stops_nothing(policy):
    # Its output gradient (2e6) exceeds float16's range: its factor is 0, the others' sums
    # are untouched, and no error stops the step (nor would a skip reveal the example).
    model = _two_layer(policy)
    x, y = _regression(8, seed=1)
    y[0] = 1e6
    loss = build_per_example_loss("mse")
    got = clipped_sum(model, x, y, None, loss, 1.0)
    rest = clipped_sum(model, x[1:], y[1:], None, loss, 1.0)
    assert not np.isfinite(got.norms.numpy()[0])
    for a, b in zip(got.grads, rest.grads):
        assert np.all(np.isfinite(a.numpy()))
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def _fit_one_step(model, x, y):
    from tf_dp import DPSGD

    model.compile(optimizer=DPSGD(l2_norm_clip=2e-7, noise_multiplier=0.0, learning_rate=1e6),
                  loss=_tiny_mse)
    before = model.get_weights()
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, poisson_sampling=False,
              verbose=0)
    return [a - b for a, b in zip(model.get_weights(), before)]


@pytest.mark.filterwarnings("ignore")
def test_mixed_float16_fit_trains_with_a_fixed_loss_scale():
    from tf_dp.keras import make_private

    x, y = _regression()
    reference = make_private(_two_layer("float32"))
    mixed = make_private(_two_layer("mixed_float16", reference.get_weights()))
    want = _fit_one_step(reference, x, y)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        got = _fit_one_step(mixed, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Without loss scaling the first layer's update is off by 40-110% (float16 underflow).
    assert max(_relative_errors(got, want)) < 2e-2



def test_the_clip_norm_is_not_rounded_to_float32():
    # A Python C goes to float64 as is: rounded to float32 first (2.0299 -> 2.02990007...),
    # a float64 model would clip to a slightly larger norm than it was given.
    from tf_dp.core import clip_factors

    c = 2.0299
    w = clip_factors(tf.constant([2 * c, 4 * c], tf.float64), c, tf.float64)
    np.testing.assert_array_equal(w.numpy(), [0.5, 0.25])


def test_clip_factors_zero_a_non_finite_example_by_default():
    # Session 24 review: the public clip_factors stopped on a NaN norm by default (a stop
    # that tells the example was sampled); it gives it factor 0.
    from tf_dp.core import clip_factors

    w = clip_factors(tf.constant([2.0, np.nan, np.inf], tf.float64), 1.0, tf.float64)
    np.testing.assert_array_equal(w.numpy(), [0.5, 0.0, 0.0])


def _victim_model():
    model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(10, 1),
                              keras.layers.Flatten(), keras.layers.Dense(1, use_bias=False)])
    # The output gradient of token t is y * kernel_t: +1000 and -1000 + 0.9 (C = 1).
    model.layers[-1].set_weights([np.array([[1000.0], [-1000.0 + 0.9]], np.float32)])
    return model


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("strategy", ["ghost", "vectorized"])
def test_one_example_moves_an_embeddings_sum_by_at_most_c_under_xla_too(strategy, jit_compile):
    """The victim (tokens [3, 3], terms +1000 C and -1000 C + 0.9 C: norm 0.9 C) is
    ill-conditioned, so its row sums are formed again in float64. Under XLA the gathered
    version of that (tf.where, tf.unique) was padded to B*T entries, copies of token 0 that
    landed in example 0's rows: with any other example present the victim's norm rose to
    ~2000 C and it was clipped to nothing, so one ordinary example (the attacker) moved the
    sum by 1.76 C (session 18 audit). Its contribution must stay within C, with or without
    XLA, and the victim alone must keep its 0.9 C."""
    model = _victim_model()

    def loss(y, pred, sw):
        per = tf.reduce_sum(pred * y, axis=-1)
        return per if sw is None else per * sw

    @tf.function(jit_compile=jit_compile)
    def summed(x, y):
        out = clipped_sum(model, x, y, tf.ones([tf.shape(x)[0]]), loss, 1.0,
                          variables=[model.layers[0].embeddings], norm_strategy=strategy)
        return out.grads[0]

    victim = np.array([[3, 3]], np.int32), np.array([[1.0]], np.float32)
    attacker = np.array([[3, 7]], np.int32), np.array([[-1.0]], np.float32)
    alone = summed(*victim).numpy().astype(np.float64)
    both = summed(*(np.concatenate(p) for p in zip(victim, attacker))).numpy().astype(
        np.float64)
    np.testing.assert_allclose(np.linalg.norm(alone), 0.9, rtol=1e-4)
    assert np.linalg.norm(both - alone) <= 1.0 + 1e-6

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
