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
from tf_dp.data.poisson import exact_rate


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
        real = xb > 0  # (the rows are in a random order: test_padded_rows_are_in_...)
        assert len(set(xb[real])) == int(real.sum())  # each sampled example once
        np.testing.assert_array_equal(wb[~real], 0.0)
        np.testing.assert_array_equal(yb[~real], 0.0)
        np.testing.assert_allclose(wb[real], weights[xb[real] - 1])
        np.testing.assert_allclose(yb[real], xb[real])
        seen_padding |= not np.all(real)
    assert seen_padding



def test_padded_rows_are_in_a_secret_uniformly_random_order():
    """A padded batch's rows (examples and padding) are shuffled per step: with one batch
    shape, adding an example must not shift the others' rows (a kernel may round a row by
    its position; docs/privacy.md). Each example's row is uniform over the slots (chi-square
    over 400 steps), the order is fresh per step and per unseeded sampler, and a seeded
    sampler draws the same samples with and without pad_to (the order has its own stream)."""
    from scipy import stats

    x = np.arange(1, 11, dtype=np.int64)
    y = x.astype(np.float32)
    slots = np.zeros((10, 20))
    orders = set()
    for xb, yb, wb in PoissonSampler(x, y, sampling_probability=1.0,
                                     pad_to=20).dataset(num_steps=400):
        xb = xb.numpy()
        np.testing.assert_array_equal(yb.numpy(), xb)  # x and y rows move together
        np.testing.assert_array_equal(wb.numpy(), xb > 0)
        for slot, example in enumerate(xb):
            if example:
                slots[example - 1, slot] += 1
        orders.add(tuple(xb))
    assert len(orders) == 400
    for example in range(10):
        assert stats.chisquare(slots[example]).pvalue > 1e-6, slots[example]
    first = [tuple(next(iter(PoissonSampler(x, y, sampling_probability=1.0, pad_to=20)
                             .dataset(num_steps=1)))[0].numpy()) for _ in range(2)]
    assert first[0] != first[1]
    with pytest.warns(UserWarning, match="seed"):
        seeded = [_batches(PoissonSampler(x, y, sampling_probability=0.4, pad_to=pad, seed=3),
                           5) for pad in (None, 10)]
    for plain, padded in zip(*seeded):
        np.testing.assert_array_equal(np.sort(padded), plain)

def test_pad_to_gives_a_static_batch_axis_only_when_no_sample_can_exceed_it():
    # pad_to >= N: no Poisson batch exceeds it, so the batch axis is static (XLA, ...).
    # pad_to < N: a batch may exceed it and is then padded to a multiple of it, so the axis
    # is None (fit(max_physical_batch_size=pad_to) gives fixed physical batches).
    x, y = _ids(20)
    for pad, want in [(20, 20), (25, 25), (16, None)]:
        ds = PoissonSampler(x, y, sampling_probability=0.3, pad_to=pad).dataset(num_steps=2)
        for spec in tf.nest.flatten(ds.element_spec):
            assert spec.shape[0] == want, (pad, ds.element_spec)


def test_pad_to_without_sample_weight_marks_real_rows_with_one():
    x, y = _ids(10)
    for xb, yb, wb in PoissonSampler(x, y, sampling_probability=0.5, pad_to=10,
                                     seed=2).dataset(num_steps=5):
        assert set(np.unique(wb.numpy())) <= {0.0, 1.0}
        # the padding rows are rows of zeros (an example's label is its id, >= 0; x is 1-D)
        np.testing.assert_array_equal(xb.numpy()[wb.numpy() == 0], 0)


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_a_batch_larger_than_pad_to_is_padded_to_the_next_multiple_never_truncated(source):
    # q = 1 takes all 10 examples every step; pad_to = 4 is exceeded: the batch is padded to
    # 12 (the next multiple), with every sampled example in it (dropping one would change the
    # mechanism the accountant counts) and no error.
    x = np.arange(1, 11, dtype=np.int64)  # ids from 1 so padding (zeros) is visible
    y = x.astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)) if source == "dataset" else x
    sampler = PoissonSampler(data, *([] if source == "dataset" else [y]),
                             sampling_probability=1.0, pad_to=4)
    for xb, yb, wb in sampler.dataset(num_steps=3):
        assert xb.shape == (12,) and yb.shape == (12,) and wb.shape == (12,)
        real = wb.numpy() == 1.0
        np.testing.assert_array_equal(np.sort(xb.numpy()[real]), x)
        np.testing.assert_array_equal(xb.numpy()[~real], 0)
        assert real.sum() == 10
    # Sizes are multiples of pad_to: pad_to itself unless the sample is larger.
    x, y = _ids(30)
    # q N = 10.5: about half the samples exceed 10 (P(none in 40 steps) ~ 1e-12).
    sizes = {int(e[0].shape[0]) for e in PoissonSampler(x, y, sampling_probability=0.35,
                                                        pad_to=10).dataset(num_steps=40)}
    assert sizes <= {10, 20, 30} and {10, 20} <= sizes, sizes


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
    assert x.shape[0] == b  # exceeded (then a multiple of b) with probability < 1e-9


# ------------------------------------------------------------------ both sources, unseeded
#
# The checks below draw from fresh OS entropy (no seed); each statistical check is a test at
# level <= 1e-7, so a correct sampler fails one about once in a million runs, while the
# samplings that break the accounting (fixed-size batches, a repeated sample, a wrong rate)
# fail every time (test_the_poisson_checks_reject_other_samplings).

ALPHA = 1e-7


def _id_dataset(n, known_size=True):
    """A tf.data source of n examples (x, y) = (i, float(i)); with known_size=False,
    TensorFlow does not know its cardinality (as after filter(), files, generators)."""
    ds = tf.data.Dataset.range(n).map(lambda i: (i, tf.cast(i, tf.float32)))
    return ds if known_size else ds.filter(lambda i, y: i >= 0)


def _source(kind, n):
    """(args, kwargs) of a PoissonSampler over n id examples of this kind of source."""
    if kind == "arrays":
        return _ids(n), {}
    return (_id_dataset(n, known_size=False),), {"dataset_size": n}


def _check_poisson(m, q, what):
    """Fails unless the T x N inclusion matrix ``m`` looks like T independent Poisson samples
    at rate q: no example twice, per-example and overall rates q (binomial tests), batch
    sizes Binomial(N, q) (chi-square), inclusion at t independent of t - 1 (chi-square)."""
    from scipy import stats

    t, n = m.shape
    assert m.max() <= 1, f"{what}: an example twice in one batch"
    p = stats.binomtest(int(m.sum()), t * n, q).pvalue
    assert p > ALPHA, f"{what}: overall rate {m.mean():.4f} vs q = {q} (p = {p:.2g})"
    for i in range(n):
        p = stats.binomtest(int(m[:, i].sum()), t, q).pvalue
        assert p > ALPHA / n, f"{what}: example {i} included at {m[:, i].mean():.3f} (p {p:.2g})"
    sizes = m.sum(axis=1)
    expected = stats.binom.pmf(np.arange(n + 1), n, q) * t
    observed = np.bincount(sizes, minlength=n + 1).astype(np.float64)
    # Merge the tails until every bin expects at least 5 batches (the chi-square regime).
    lo, hi = int(np.argmax(expected >= 5)), n - int(np.argmax(expected[::-1] >= 5))
    exp = np.concatenate([[expected[:lo + 1].sum()], expected[lo + 1:hi], [expected[hi:].sum()]])
    obs = np.concatenate([[observed[:lo + 1].sum()], observed[lo + 1:hi], [observed[hi:].sum()]])
    p = stats.chisquare(obs, exp).pvalue
    assert p > ALPHA, f"{what}: batch sizes are not Binomial({n}, {q}) (p = {p:.2g})"
    # Example i at step t against example i at step t + 1 (pooled 2 x 2 table).
    a, b = m[:-1].ravel(), m[1:].ravel()
    table = [[np.sum((a == u) & (b == v)) for v in (0, 1)] for u in (0, 1)]
    p = stats.chi2_contingency(table).pvalue
    assert p > ALPHA, f"{what}: inclusions at consecutive steps are dependent (p = {p:.2g})"


@pytest.mark.parametrize("kind, steps", [("arrays", 1500), ("dataset", 500)])
def test_samples_are_independent_poisson_samples(kind, steps):
    n, q = 40, 0.25
    args, kwargs = _source(kind, n)
    m = _indicator(_batches(PoissonSampler(*args, sampling_probability=q, **kwargs), steps), n)
    _check_poisson(m, q, kind)


def test_the_poisson_checks_reject_other_samplings():
    # The checks above have the power to fail: each sampling that breaks the accounting is
    # rejected (synthetic inclusion matrices; the generator seed is data, not a DP seed).
    rng = np.random.default_rng(0)
    t, n, q = 500, 40, 0.25

    def poisson(rate):
        return (rng.uniform(size=(t, n)) < rate).astype(np.int64)

    _check_poisson(poisson(q), q, "reference")  # the reference passes
    fixed = np.zeros((t, n), np.int64)  # shuffled fixed-size batches of q N examples
    for row in fixed:
        row[rng.choice(n, int(q * n), replace=False)] = 1
    repeated = np.repeat(poisson(q)[::2], 2, axis=0)  # every sample used for two steps
    for bad, name in [(fixed, "fixed"), (repeated, "repeated"), (poisson(0.28), "rate")]:
        with pytest.raises(AssertionError):
            _check_poisson(bad, q, name)


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_two_samplers_and_two_iterations_never_repeat_a_sample(kind):
    args, kwargs = _source(kind, 50)

    def draws(sampler, steps=4):
        ds = sampler.dataset(num_steps=steps)
        return [tuple(b) for b in _batches_of(ds)], [tuple(b) for b in _batches_of(ds)]

    first, again = draws(PoissonSampler(*args, sampling_probability=0.3, **kwargs))
    other, _ = draws(PoissonSampler(*args, sampling_probability=0.3, **kwargs))
    assert first != again and first != other  # identical by chance: probability ~ 1e-60
    assert len(set(first + again + other)) == 12


def _batches_of(ds):
    return [e[0].numpy() for e in ds]


# ------------------------------------------------------------------ dataset sources


def test_a_dataset_source_takes_n_from_its_cardinality_or_dataset_size():
    s = PoissonSampler(_id_dataset(30), expected_batch_size=6)
    assert s.dataset_size == 30 and s.sampling_probability == pytest.approx(0.2)
    s = PoissonSampler(_id_dataset(30, known_size=False), expected_batch_size=6,
                       dataset_size=30)
    assert s.dataset_size == 30 and s.expected_batch_size == pytest.approx(6)
    with pytest.raises(ValueError, match="`dataset_size=N`"):
        PoissonSampler(_id_dataset(30, known_size=False), expected_batch_size=6)
    with pytest.raises(ValueError, match="`dataset_size` must be the dataset's cardinality"):
        PoissonSampler(_id_dataset(30), expected_batch_size=6, dataset_size=31)
    with pytest.raises(ValueError, match="`dataset_size`"):
        PoissonSampler(_id_dataset(30, known_size=False), expected_batch_size=6,
                       dataset_size=0)
    with pytest.raises(ValueError, match="infinite"):
        PoissonSampler(_id_dataset(30).repeat(), expected_batch_size=6)
    with pytest.raises(ValueError, match="no examples"):
        PoissonSampler(_id_dataset(30).take(0), expected_batch_size=6)
    x, y = _ids(30)
    with pytest.raises(ValueError, match="`dataset_size` must be the number of examples"):
        PoissonSampler(x, y, expected_batch_size=6, dataset_size=29)


@pytest.mark.parametrize("size, error", [(31, "fewer"), (29, "more")])
def test_a_wrong_dataset_size_stops_the_pass(size, error):
    # q N is the denominator of the private mean: a source that yields another number of
    # examples than declared must not train (more is caught at the (N+1)-th example).
    sampler = PoissonSampler(_id_dataset(30, known_size=False), sampling_probability=0.5,
                             dataset_size=size)
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"{error} than `dataset_size`"):
        list(sampler.dataset(num_steps=2))


def test_a_dataset_source_refuses_batches_targets_beside_it_and_ragged_examples():
    with pytest.raises(ValueError, match="yields batches"):
        PoissonSampler(_id_dataset(30).batch(4), expected_batch_size=6)
    with pytest.raises(ValueError, match="yields batches"):
        PoissonSampler(_id_dataset(30).batch(4).map(lambda x, y: (x, y)).prefetch(1),
                       expected_batch_size=6)
    PoissonSampler(_id_dataset(30).batch(4).unbatch(), expected_batch_size=6, dataset_size=30)
    with pytest.raises(ValueError, match="`y` and `sample_weight`"):
        PoissonSampler(_id_dataset(30), np.arange(30), expected_batch_size=6)
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3]]))
    with pytest.raises(ValueError, match="dense tensors"):
        PoissonSampler(ragged, sampling_probability=0.5)


def test_each_step_is_one_pass_over_a_dataset_source():
    # The documented cost: a logical step reads the whole source once (Poisson sampling
    # decides for every example); `from_generator` starts one generator per pass.
    passes = []

    def examples():
        passes.append(1)
        yield from ((np.float32(i), np.float32(i)) for i in range(12))

    ds = tf.data.Dataset.from_generator(examples, output_signature=(
        tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32)))
    sampler = PoissonSampler(ds, sampling_probability=0.5, dataset_size=12)
    assert len(list(sampler.dataset(num_steps=5))) == 5
    assert len(passes) == 5


# ------------------------------------------------------------------ structures and empty steps


def _structured(n):
    ids = np.arange(n)
    x = {"a": np.stack([ids, 2 * ids, 3 * ids], axis=1).astype(np.float32),
         "text": np.array([f"ex{i}é" for i in range(n)])}
    return x, ids.astype(np.int64), (ids + 1).astype(np.float32)


def _structured_source(kind, n):
    x, y, w = _structured(n)
    if kind == "dataset":
        return (tf.data.Dataset.from_tensor_slices((x, y, w)),), {}
    return (x, y), {"sample_weight": w}


def _check_rows(xb, yb, wb):
    ids = yb.numpy()
    np.testing.assert_array_equal(xb["a"].numpy(), np.stack([ids, 2 * ids, 3 * ids], 1))
    assert [t.decode() for t in xb["text"].numpy()] == [f"ex{i}é" for i in ids]
    np.testing.assert_array_equal(wb.numpy(), ids + 1)
    assert wb.dtype == tf.float32


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_dict_inputs_text_and_sample_weights_stay_aligned(kind):
    args, kwargs = _structured_source(kind, 30)
    seen = 0
    for xb, yb, wb in PoissonSampler(*args, sampling_probability=0.4,
                                     **kwargs).dataset(num_steps=5):
        _check_rows(xb, yb, wb)
        seen += len(yb)
    assert seen > 0


def test_inputs_without_targets():
    x = np.arange(20, dtype=np.float32)[:, None]
    for data in (x, tf.data.Dataset.from_tensor_slices(x)):
        for xb, yb in PoissonSampler(data, sampling_probability=0.5).dataset(num_steps=3):
            assert yb is None and xb.shape[1:] == (1,)
        for xb, yb, wb in PoissonSampler(data, sampling_probability=0.5,
                                         pad_to=20).dataset(num_steps=2):
            assert yb is None and xb.shape == (20, 1)
            np.testing.assert_array_equal(xb.numpy()[wb.numpy() == 0], 0)


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_empty_samples_are_steps_with_the_right_shapes(kind):
    # q N = 0.4: about two thirds of the samples are empty; each is still a step (the
    # accountant counts it) with zero rows of every component's shape and dtype.
    args, kwargs = _structured_source(kind, 20)
    batches = list(PoissonSampler(*args, sampling_probability=0.02,
                                  **kwargs).dataset(num_steps=30))
    assert len(batches) == 30
    empty = [b for b in batches if b[1].shape[0] == 0]
    assert empty  # none in 30 steps: probability 1e-14
    for xb, yb, wb in batches:
        m = yb.shape[0]
        assert xb["a"].shape == (m, 3) and xb["text"].shape == (m,) and wb.shape == (m,)
        assert xb["a"].dtype == tf.float32 and xb["text"].dtype == tf.string
        _check_rows(xb, yb, wb)
    padded = list(PoissonSampler(*args, sampling_probability=0.02, pad_to=4,
                                 **kwargs).dataset(num_steps=30))
    assert all(b[1].shape == (4,) for b in padded)
    assert any(np.all(b[2].numpy() == 0) for b in padded)  # an empty step: all padding


# ------------------------------------------------------------------ array sources


def test_arrays_are_not_embedded_in_the_graph():
    # The arrays used to be tf.constants in the dataset's graph (2 GB GraphDef limit, a copy
    # of the data); the graph now holds a reference: its size does not depend on N.
    sizes = {}
    for n in (10, 200_000):
        x = np.zeros((n, 8), np.float32)
        ds = PoissonSampler(x, np.arange(n), sampling_probability=0.01).dataset(num_steps=2)
        sizes[n] = len(ds._as_serialized_graph().numpy())
    assert sizes[200_000] - sizes[10] < 100 and sizes[10] < 50_000, sizes  # data: 6.4 MB


def test_a_memmap_is_a_file_backed_source(tmp_path):
    # np.load(mmap_mode="r") arrays are held by reference (never read whole into memory):
    # each step reads only its sampled rows.
    n = 500
    np.save(tmp_path / "x.npy", np.arange(3 * n, dtype=np.float32).reshape(n, 3))
    np.save(tmp_path / "y.npy", np.arange(n))
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    y = np.load(tmp_path / "y.npy", mmap_mode="r")
    sampler = PoissonSampler(x, y, expected_batch_size=20)
    assert sampler.source[0] is x
    seen = 0
    for xb, yb in sampler.dataset(num_steps=4):
        np.testing.assert_array_equal(xb.numpy(), np.asarray(x)[yb.numpy()])
        seen += len(yb)
    assert seen > 0


# ------------------------------------------------------------------ fit


def _dp_model():
    import keras

    import tf_dp

    model = tf_dp.keras.DPSequential([keras.Input((3,)), keras.layers.Dense(4, "tanh"),
                                      keras.layers.Dense(1)])
    return model


def _regression_source(n):
    rng = np.random.default_rng(1)  # data, not sampling
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
    return x, y


def test_fit_trains_on_a_dataset_source_and_accounts_its_q_every_step():
    import tf_dp

    x, y = _regression_source(64)
    source = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
    sampler = PoissonSampler(source, expected_batch_size=16, dataset_size=64)
    # Per-example augmentation after the sampler keeps q (README pattern).
    noisy = sampler.dataset().map(lambda a, b: (a + tf.random.normal(tf.shape(a), 0, 0.01), b))
    model = _dp_model()
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        learning_rate=0.1), loss="mse")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(noisy, epochs=2, verbose=0)
    steps = 2 * sampler.steps_per_epoch
    assert model.accountant.steps == steps == 8
    report = model.privacy_report()
    assert report["guarantee_holds"]
    assert [(p["sampling_probability"], p["count"]) for p in report["phases"]] == [(0.25, steps)]
    assert np.all(np.isfinite(history.history["loss"]))
    assert any(np.any(a != b) for a, b in zip(model.get_weights(), before))


def test_fit_takes_empty_steps():
    # q N = 0.1: nearly every step is an empty batch; each is a step (noise alone) and is
    # accounted, none is dropped or fails.
    import tf_dp

    x, y = _regression_source(10)
    model = _dp_model()
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                        learning_rate=0.1), loss="mse", metrics=["mae"])
    sampler = PoissonSampler(tf.data.Dataset.from_tensor_slices((x, y)),
                             sampling_probability=0.01)
    model.fit(sampler, epochs=1, steps_per_epoch=5, verbose=0)
    assert int(model.optimizer.iterations) == 5
    assert model.privacy_report()["phases"] == [
        {"noise_multiplier": 1.0, "sampling_probability": exact_rate(0.01),
         "num_projections": None, "count": 5}]


@pytest.mark.filterwarnings("ignore:ε = inf")  # sigma = 0
@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_padding_rows_are_inert_in_training(kind):
    # q = 1 and sigma = 0 make fit deterministic without any seed: all 10 examples every
    # step. pad_to = 4 pads each batch to 12 (two weight-0 rows of zeros) and
    # max_physical_batch_size = 4 runs it as 3 physical batches of 4: the weights and the
    # logged loss must be those of the unpadded run (the padding adds nothing to the
    # clipped sum and is not in the metrics).
    import tf_dp

    x, y = _regression_source(10)
    data = tf.data.Dataset.from_tensor_slices((x, y)) if kind == "dataset" else x
    extra = [] if kind == "dataset" else [y]
    init = _dp_model().get_weights()
    results = []
    for pad_to, rows in [(None, None), (4, 4)]:
        model = _dp_model()
        model.set_weights(init)
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=0.5, noise_multiplier=0.0,
                                            learning_rate=0.1), loss="mse")
        sampler = PoissonSampler(data, *extra, sampling_probability=1.0, pad_to=pad_to)
        history = model.fit(sampler, epochs=1, steps_per_epoch=3, verbose=0,
                            max_physical_batch_size=rows)
        results.append((model.get_weights(), history.history["loss"]))
    (w0, loss0), (w1, loss1) = results
    for a, b in zip(w0, w1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss0, loss1, rtol=1e-5)
    assert any(np.any(np.abs(a - b) > 1e-3) for a, b in zip(w0, init))


def test_a_list_of_inputs_is_sampled_and_trains_a_multi_input_model():
    """Keras takes a list of arrays for a multi-input model; tf.data would stack a list of
    tensors into one, so the sampler carries it as a tuple (found by the MLM example)."""
    import keras

    import tf_dp

    rng = np.random.default_rng(3)
    a = rng.normal(size=(100, 3)).astype("float32")
    b = rng.normal(size=(100, 2)).astype("float32")
    y = rng.integers(0, 2, size=100)
    batch = next(iter(PoissonSampler([a, b], y, expected_batch_size=30).dataset(num_steps=1)))
    (xa, xb), yb = batch[0], batch[1]
    assert xa.shape[1:] == (3,) and xb.shape[1:] == (2,) and len(xa) == len(xb) == len(yb)
    ia, ib = keras.Input((3,)), keras.Input((2,))
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([ia, ib]))
    model = tf_dp.keras.make_private(keras.Model([ia, ib], out))
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit([a, b], y, batch_size=20, epochs=1, verbose=0)
    assert model.privacy_report()["steps"] == 5



def test_what_the_accounting_reads_cannot_change_after_the_sampler_is_made():
    # Session 13 audit: q lowered after dataset() was accepted; fit accounted the new q
    # (epsilon 0.46) while the batches kept the old one (15.1).
    sampler = PoissonSampler(np.arange(20, dtype=np.float32)[:, None], np.zeros(20),
                             sampling_probability=0.5)
    for name, value in (("sampling_probability", 0.01), ("dataset_size", 2000),
                        ("seed", 3), ("_stream", None)):
        with pytest.raises(AttributeError, match=name):
            setattr(sampler, name, value)
    assert sampler.sampling_probability == 0.5 and sampler.dataset_size == 20
    sampler.pad_to = 4  # still free before any dataset is made
    sampler.dataset(num_steps=1)
    for name in ("pad_to", "schedule"):
        with pytest.raises(AttributeError, match=f"{name}.*dataset"):
            setattr(sampler, name, None)
    sampler.steps_per_epoch = 7  # not read by the sampling or the accounting


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
