"""PoissonSampler: the sampling the accountant assumes (each example in with rate q, alone).

Rates are checked against binomial standard errors over many steps, allowing 5 of them
(false-alarm rate ~ 1e-6 per check); seeds are fixed, so the tests are deterministic. The
examples are their own ids (x[i] = i), so every batch says which examples it holds.
"""

import math
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.data import PoissonSampler, expected_steps


def _ids(n):
    x = np.arange(n, dtype=np.int64)
    return x, x.astype(np.float32)  # y = id too: checks that x and y stay aligned


def _batches(sampler, steps):
    """List of id arrays, one per logical batch (only rows with sample weight > 0 if padded)."""
    out = []
    for element in sampler.dataset(num_steps=steps):
        xb, yb = element[0].numpy(), element[1].numpy()
        np.testing.assert_array_equal(xb.astype(np.float32), yb)
        if len(element) == 3:
            xb = xb[element[2].numpy() > 0]
        out.append(xb)
    return out


def _indicator(batches, n):
    m = np.zeros((len(batches), n), np.int64)
    for t, b in enumerate(batches):
        np.add.at(m[t], b, 1)
    return m


def _within(value, mean, se, what):
    assert abs(value - mean) <= 5 * se, f"{what}: {value} vs {mean} (5 se = {5 * se})"


# ------------------------------------------------------------------ the law of one batch

N, Q, T = 40, 0.25, 2000


@pytest.fixture(scope="module")
def inclusion():
    x, y = _ids(N)
    batches = _batches(PoissonSampler(x, y, sampling_probability=Q, seed=17), T)
    assert len(batches) == T
    m = _indicator(batches, N)
    assert m.max() <= 1  # no example twice in one batch
    return m


def test_each_example_is_included_with_rate_q(inclusion):
    se_all = math.sqrt(Q * (1 - Q) / (N * T))
    _within(inclusion.mean(), Q, se_all, "overall inclusion rate")
    se_one = math.sqrt(Q * (1 - Q) / T)
    for i in range(N):
        _within(inclusion[:, i].mean(), Q, se_one, f"inclusion rate of example {i}")


def test_inclusions_are_independent_across_examples_and_steps(inclusion):
    m = inclusion.astype(np.float64)
    q2 = Q * Q
    se = math.sqrt(q2 * (1 - q2) / T)
    for i, j in [(0, 1), (0, N - 1), (17, 18), (5, 30)]:
        _within(np.mean(m[:, i] * m[:, j]), q2, se, f"joint inclusion of {i} and {j}")
    # The same example at consecutive steps (a seed that ignored the step would give q).
    se_lag = math.sqrt(q2 * (1 - q2) / ((T - 1) * N))
    _within(np.mean(m[1:] * m[:-1]), q2, se_lag, "inclusion at consecutive steps")


def test_batch_sizes_are_binomial(inclusion):
    # Fixed-size sampling without replacement would give variance 0; Poisson sampling gives
    # Binomial(N, q): mean N q, variance N q (1 - q).
    sizes = inclusion.sum(axis=1).astype(np.float64)
    mean, var = N * Q, N * Q * (1 - Q)
    _within(sizes.mean(), mean, math.sqrt(var / T), "mean batch size")
    # Var of the sample variance ~ (mu4 - var^2 (T-3)/(T-1)) / T, mu4 = 3 var^2 + var (1-6pq).
    mu4 = 3 * var ** 2 + var * (1 - 6 * Q * (1 - Q))
    _within(sizes.var(ddof=1), var, math.sqrt((mu4 - var ** 2) / T), "batch size variance")
    assert sizes.min() < mean - 2 and sizes.max() > mean + 2


def test_sampling_probability_one_takes_everything():
    x, y = _ids(7)
    for b in _batches(PoissonSampler(x, y, sampling_probability=1.0, seed=0), 3):
        np.testing.assert_array_equal(np.sort(b), np.arange(7))


# ------------------------------------------------------------------ reproducibility


@pytest.mark.filterwarnings("ignore:tf_dp. PoissonSampler was given")
def test_same_seed_same_batches_other_seed_or_step_other_batches():
    x, y = _ids(50)
    a = _batches(PoissonSampler(x, y, sampling_probability=0.3, seed=5), 6)
    b = _batches(PoissonSampler(x, y, sampling_probability=0.3, seed=5), 6)
    c = _batches(PoissonSampler(x, y, sampling_probability=0.3, seed=6), 6)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert any(len(u) != len(v) or np.any(u != v) for u, v in zip(a, c))
    distinct = {tuple(u) for u in a}
    assert len(distinct) == len(a), "different steps must draw different batches"
    # Iterating the same dataset twice never replays a sample (the accountant composes the
    # two passes as independent samples), even with a debugging seed.
    ds = PoissonSampler(x, y, sampling_probability=0.3, seed=5).dataset(num_steps=3)
    first = [e[0].numpy() for e in ds]
    second = [e[0].numpy() for e in ds]
    assert all(len(u) != len(v) or np.any(u != v) for u, v in zip(first, second))


def test_unseeded_samplers_differ():
    x, y = _ids(50)
    a = _batches(PoissonSampler(x, y, sampling_probability=0.3), 4)
    b = _batches(PoissonSampler(x, y, sampling_probability=0.3), 4)
    assert any(len(u) != len(v) or np.any(u != v) for u, v in zip(a, b))


# ------------------------------------------------------------------ one element, one logical step


def test_each_element_is_one_whole_logical_batch():
    # With gradient accumulation the private train step splits each element into its k
    # micro-batches (tests/keras/dp_model_test.py); the sampler itself knows nothing of k:
    # fit(batch_size=B) with k asks for expected_batch_size = B k, and every element is a
    # whole Poisson batch of that expected size (Binomial(N, q), q = B k / N), not a part.
    n, micro, k, steps = 60, 4, 3, 1500
    x, y = _ids(n)
    sampler = PoissonSampler(x, y, expected_batch_size=micro * k, seed=3)
    q = sampler.sampling_probability
    assert q == pytest.approx(micro * k / n) and sampler.steps_per_epoch == 5
    m = _indicator(_batches(sampler, steps), n)
    assert m.max() <= 1
    sizes = m.sum(axis=1)
    _within(sizes.mean(), micro * k, math.sqrt(n * q * (1 - q) / steps), "mean element size")
    with pytest.raises(TypeError):
        PoissonSampler(x, y, sampling_probability=q, accumulation_steps=2)  # removed, not ignored


# ------------------------------------------------------------------ padding


def test_pad_to_pads_with_weight_zero_rows():
    n, pad = 20, 20
    x = np.arange(1, n + 1, dtype=np.int64)  # ids from 1 so padding (zeros) is visible
    y = x.astype(np.float32)
    weights = np.linspace(0.5, 2.0, n).astype(np.float32)
    sampler = PoissonSampler(x, y, sample_weight=weights, sampling_probability=0.3, pad_to=pad,
                             seed=1)
    ds = sampler.dataset(num_steps=25)
    seen_padding = False
    for xb, yb, wb in ds:
        xb, yb, wb = xb.numpy(), yb.numpy(), wb.numpy()
        assert xb.shape == (pad,) and yb.shape == (pad,) and wb.shape == (pad,)
        real = xb > 0
        m = int(real.sum())
        assert np.all(real[:m]) and not np.any(real[m:]), "examples first, then padding"
        np.testing.assert_array_equal(wb[m:], 0.0)
        np.testing.assert_array_equal(yb[m:], 0.0)
        np.testing.assert_allclose(wb[:m], weights[xb[:m] - 1])
        seen_padding |= m < pad
    assert seen_padding


def test_pad_to_gives_a_static_batch_axis():
    # The point of pad_to (docstring: "pads every batch to a static size ... for XLA or
    # other static-shape needs") is a known batch axis in the dataset's element_spec.
    x, y = _ids(20)
    ds = PoissonSampler(x, y, sampling_probability=0.3, pad_to=16, seed=1).dataset(num_steps=2)
    for spec in tf.nest.flatten(ds.element_spec):
        assert spec.shape[0] == 16, ds.element_spec


def test_pad_to_without_sample_weight_marks_real_rows_with_one():
    x, y = _ids(10)
    for xb, yb, wb in PoissonSampler(x, y, sampling_probability=0.5, pad_to=10,
                                     seed=2).dataset(num_steps=5):
        m = int(np.sum(wb.numpy()))
        np.testing.assert_array_equal(wb.numpy(), [1.0] * m + [0.0] * (10 - m))


def test_pad_to_raises_when_a_batch_exceeds_it():
    # The error must name `pad_to` every time, whatever order tf.data runs the ops of its map
    # function in (hence several fresh pipelines: a race shows up in some of them).
    x, y = _ids(10)
    for seed in range(8):
        ds = PoissonSampler(x, y, sampling_probability=1.0, pad_to=9,
                            seed=seed).dataset(num_steps=1)
        with pytest.raises(tf.errors.InvalidArgumentError, match="pad_to"):
            list(ds)


# ------------------------------------------------------------------ sizes and arguments


def test_expected_batch_size_is_q_times_n():
    x, y = _ids(50)
    s = PoissonSampler(x, y, sampling_probability=0.1)
    assert s.expected_batch_size == pytest.approx(5.0)  # the logical batch: E = q N
    assert s.steps_per_epoch == 10  # logical steps: round(1 / q)
    assert PoissonSampler(x, y, sampling_probability=0.3).steps_per_epoch == 3  # round(3.33)
    assert PoissonSampler(x, y, sampling_probability=0.1, steps_per_epoch=4).steps_per_epoch == 4
    s = PoissonSampler(x, y, expected_batch_size=8)
    assert s.sampling_probability == pytest.approx(8 / 50)
    assert s.expected_batch_size == pytest.approx(8.0)
    assert expected_steps(1000, 10, 2) == 200


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.1"])
def test_sampling_probability_must_be_in_0_1(q):
    x, y = _ids(10)
    with pytest.raises(ValueError, match="`sampling_probability`"):
        PoissonSampler(x, y, sampling_probability=q)


def test_expected_batch_size_larger_than_the_data_set_is_refused():
    x, y = _ids(10)
    with pytest.raises(ValueError, match="`sampling_probability`"):
        PoissonSampler(x, y, expected_batch_size=11)
    with pytest.raises(ValueError, match="`expected_batch_size`"):
        PoissonSampler(x, y, expected_batch_size=0)


def test_other_bad_arguments():
    x, y = _ids(10)
    with pytest.raises(ValueError, match="exactly one"):
        PoissonSampler(x, y)
    with pytest.raises(ValueError, match="exactly one"):
        PoissonSampler(x, y, expected_batch_size=2, sampling_probability=0.2)
    with pytest.raises(ValueError, match="`pad_to`"):
        PoissonSampler(x, y, sampling_probability=0.2, pad_to=0)
    with pytest.raises(ValueError, match="same length"):
        PoissonSampler(x, y[:5], sampling_probability=0.2)



def test_augmentation_after_sampling_keeps_q_and_the_accounting():
    # The README's augmentation pattern: a per-example map after the sampler. fit() takes q
    # from the sampler through the map (no dataset_size needed) and accounts it.
    import keras

    import tf_dp
    from tf_dp import accounting

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6, 6, 1)).astype("float32")
    y = rng.integers(0, 2, size=64)
    sampler = PoissonSampler(x, y, expected_batch_size=16)

    def augment(images, labels):
        flipped = tf.map_fn(tf.image.random_flip_left_right, images)  # one example at a time
        return flipped, labels

    data = sampler.dataset().map(augment, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten(),
        keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, verbose=0)
    steps = sampler.steps_per_epoch
    assert model.accountant.steps == steps
    assert model.epsilon() == pytest.approx(accounting.compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.25, steps=steps, delta=1e-5))
    assert model.privacy_report()["guarantee_holds"]


@pytest.mark.parametrize("n, q", [(60000, 256 / 60000), (100, 0.5), (10, 1.0), (1000, 0.001)])
def test_auto_padding_is_exceeded_with_probability_below_1e9(n, q):
    from scipy import stats

    from tf_dp.data.poisson import safe_pad_to

    b = safe_pad_to(n, q)
    assert stats.binom.sf(b, n, q) < 1e-9 and b <= n
    if b > 1:
        assert stats.binom.sf(b - 1, n, q) >= 1e-9 or b - 1 < q * n  # the smallest such b
    sampler = PoissonSampler(np.zeros((n, 2), "float32"), np.zeros(n), sampling_probability=q,
                             pad_to="auto")
    assert sampler.pad_to == b
    x, _, _ = next(iter(sampler.dataset(num_steps=1)))
    assert x.shape[0] == b  # static padded size

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
