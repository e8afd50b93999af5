"""Private training under tf.distribute.MirroredStrategy on two logical CPUs.

Invariant 1 across replicas: each replica clips its own examples, the clipped sums are
added across replicas, the sum is divided by the *global* batch size, and the noise
N(0, sigma^2 C^2) is added once per global (logical) step, not once per replica. So a
two-replica run must give the weights of a one-device run on the same batches.

Two logical CPU devices must be configured before TensorFlow initialises its runtime, i.e.
before the first TF op of the process: this module does it at import time. Run this file in
its own process: under Bazel every test file is its own process, and `pytest -n 2 --dist
loadfile` (scripts/test.sh) imports every test module at collection before running any
test, and no test module runs a TF op at import. If TF was nevertheless initialised
earlier (fewer than two CPU devices at test time), each test re-runs itself in a fresh
Python process instead of silently testing one replica.
"""

import math
import os
import subprocess
import sys

import tensorflow as tf

_CHILD_ENV = "TF_DP_DISTRIBUTE_TEST_CHILD"


def _configure_two_logical_cpus():
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
    except RuntimeError:
        pass  # runtime already initialised in this process: see _in_two_cpu_process


_configure_two_logical_cpus()

import keras  # noqa: E402  (after the device configuration, on purpose)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tf_dp.core import gaussian_noise  # noqa: E402
from tf_dp.core.randomness import seeded_draw  # noqa: E402
from tf_dp.keras import make_private  # noqa: E402
from tf_dp.optimizers import DPSGD  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:tf_dp. training on a dataset of fixed")


def _in_two_cpu_process(request):
    """True if this process has two logical CPUs; otherwise runs the test in a child process
    (asserting that it passes there) and returns False."""
    if len(tf.config.list_logical_devices("CPU")) >= 2:
        return True
    assert os.environ.get(_CHILD_ENV) != "1", "two logical CPUs could not be configured"
    env = dict(os.environ, **{_CHILD_ENV: "1"})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"{os.path.abspath(__file__)}::{request.node.name}",
         "-q", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return False


def _steps(model):
    # Under a strategy the step counter is a MirroredVariable, which int() does not take.
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


_STRATEGY = []


def _strategy():
    # One MirroredStrategy for the whole process: a second instance restarts the collective
    # instance keys, and its all-reduces then clash with the first one's ("Shape mismatch in
    # the collective instance"); plain Keras fails the same way with two strategies.
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _STRATEGY[0]


def _mlp(seed=0):
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(1),
    ])
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, 0.7, size=w.shape).astype("float32")
                       for w in model.weights])
    return model


def _data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def _train(strategy, opt_fn, fit_fn):
    scope = strategy.scope() if strategy is not None else _nullscope()
    with scope:
        model = make_private(_mlp())
        model.compile(optimizer=opt_fn(), loss="mse")
    fit_fn(model)
    return model


class _nullscope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------ same weights as one device


def test_replicas_draw_whole_table_directions_under_jl(request):
    # Replicas share the step's JL seed and each looks up its own share of the batch: rows
    # drawn per replica would give rank m of one replica and rank m of another one vector
    # whatever their ids, so how the batch splits would decide which examples share a
    # direction (tests/privacy/jl_table_parts_test.py, session 23 audit).
    if not _in_two_cpu_process(request):
        return
    from tf_dp.core import jl

    with jl.one_part_step():
        assert jl.rows_only_allowed()

    def replica():
        with jl.one_part_step():
            return tf.constant(jl.rows_only_allowed())

    per_replica = _strategy().run(replica)
    values = _strategy().experimental_local_results(per_replica)
    assert len(values) == 2 and not any(bool(v) for v in values)


@pytest.mark.parametrize("k", [1, 2])
def test_mirrored_fixed_batches_match_one_device(request, k):
    if not _in_two_cpu_process(request):
        return
    x, y = _data()
    # Clipping active (C below most per-example norms), sigma = 0: the clipped sum is a sum
    # over examples, whichever replica and micro-batch holds them.
    opt_fn = lambda kk=k: DPSGD(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.1,
                                momentum=0.9, gradient_accumulation_steps=kk)
    # 8 = global logical batch: each replica gets 4, split into k micro-batches of 4 / k.
    ds = lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def fit(model):
        model.fit(ds(), epochs=2, verbose=0, dataset_size=len(x))

    single = _train(None, opt_fn, fit)
    mirrored = _train(_strategy(), opt_fn, fit)
    assert mirrored.distribute_strategy.num_replicas_in_sync == 2
    assert _steps(mirrored) == _steps(single) == 8  # every fit step is a logical step
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(),
                                                             _mlp().get_weights()))
    assert moved > 1e-3
    for got, want in zip(mirrored.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if k > 1:  # accumulation is a memory knob: the weights of one device without it
        plain = _train(None, lambda: opt_fn(1), fit)
        for got, want in zip(mirrored.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_replica_with_no_rows_skips_the_model_and_matches_one_device(request):
    # Batches of 1 or 3 rows over 2 replicas: one replica often holds no rows. Its part skips
    # the model (oneDNN's convolution of 0 rows returns its input and crashed the step:
    # empty_batch_test), adds a zero sum, and the weights are one device's.
    if not _in_two_cpu_process(request):
        return
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 5, 5, 2)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")

    def conv():
        model = keras.Sequential([keras.Input((5, 5, 2)), keras.layers.Conv2D(4, 3),
                                  keras.layers.GroupNormalization(groups=2),
                                  keras.layers.Flatten(), keras.layers.Dense(1)])
        model.set_weights([np.random.default_rng(4 + i).normal(0, 0.5, w.shape).astype(
            "float32") for i, w in enumerate(model.weights)])
        return make_private(model)

    def train(strategy):
        with strategy.scope() if strategy is not None else _nullscope():
            model = conv()
            model.compile(optimizer=DPSGD(0.5, 0.0, learning_rate=0.1), loss="mse")
        for size in (1, 3):
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(size), epochs=1,
                      verbose=0, dataset_size=len(x))
        return model

    single, mirrored = train(None), train(_strategy())
    assert _steps(mirrored) == _steps(single) == 11
    for got, want in zip(mirrored.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(
        single.get_weights(), conv().get_weights())) > 1e-3


@pytest.mark.parametrize("clipping", ["adaptive", "per_layer"])
def test_mirrored_adaptive_and_per_layer_clipping_match_one_device(request, clipping):
    """Adaptive clipping's count is summed over replicas (and noised once) so C moves the
    same on every replica as on one device; per-layer clipping clips each replica's own
    examples per layer. sigma = 0: the runs must agree exactly."""
    if not _in_two_cpu_process(request):
        return
    from tf_dp.core.clipping import AdaptiveClipping

    x, y = _data()
    extra = (dict(adaptive_clipping=AdaptiveClipping(target_quantile=0.4, learning_rate=0.5))
             if clipping == "adaptive" else dict(per_layer_clipping="dimension"))
    opt_fn = lambda: DPSGD(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.1,
                           gradient_accumulation_steps=2, **extra)
    ds = lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def fit(model):
        model.fit(ds(), epochs=2, verbose=0, dataset_size=len(x))

    single = _train(None, opt_fn, fit)
    mirrored = _train(_strategy(), opt_fn, fit)
    for got, want in zip(mirrored.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if clipping == "adaptive":
        c_single = float(single.optimizer.current_clip())
        c_mirrored = float(keras.ops.convert_to_numpy(mirrored.optimizer.current_clip()))
        assert c_single != 0.3  # C moved
        assert c_mirrored == pytest.approx(c_single, rel=1e-9)


def test_mirrored_in_place_convolution_buffers_match_one_device(request, monkeypatch):
    """Convolutions whose per-example kernel gradients are written in place into one
    buffer per layer (rules.conv._in_chunks, one example per chunk here): two replicas run
    their steps concurrently, each in a loop over 2 micro-batches. Each replica and
    micro-batch must form its own buffers (shared ones would mix their examples), so the
    weights are those of one device without accumulation. sigma = 0, clipping active."""
    if not _in_two_cpu_process(request):
        return
    from tf_dp.core.ghost.rules import conv

    monkeypatch.setattr(conv, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(conv, "_GROUPED_CHUNK_BYTES", 1)
    calls = []
    in_chunks = conv._in_chunks
    monkeypatch.setattr(conv, "_in_chunks", lambda *a: calls.append(1) or in_chunks(*a))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 10, 10, 2)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def cnn():
        model = keras.Sequential([
            keras.Input((10, 10, 2)),
            keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
            keras.layers.Conv2D(3, 3, padding="same", activation="tanh"),
            keras.layers.Flatten(), keras.layers.Dense(1)])
        w = np.random.default_rng(4)
        model.set_weights([w.normal(0.0, 0.5, size=v.shape).astype("float32")
                           for v in model.weights])
        return model

    def train(strategy, k):
        with strategy.scope() if strategy is not None else _nullscope():
            model = make_private(cnn())
            model.compile(optimizer=DPSGD(l2_norm_clip=0.2, noise_multiplier=0.0,
                                          learning_rate=0.5, gradient_accumulation_steps=k),
                          loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0,
                  dataset_size=len(x))
        return model

    single = train(None, 1)
    mirrored = train(_strategy(), 2)
    assert calls  # the in-place path ran
    assert _steps(mirrored) == _steps(single) == 4
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(),
                                                             cnn().get_weights()))
    assert moved > 1e-3
    for got, want in zip(mirrored.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_mirrored_poisson_sampling_matches_one_device(request, k):
    if not _in_two_cpu_process(request):
        return
    x, y = _data()
    opt_fn = lambda kk=k: DPSGD(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.1,
                                gradient_accumulation_steps=kk)
    # The same four Poisson batches (expected logical size 8, q = 1/4) for every run: the
    # sampler's stream never repeats a draw, and a distributed input pipeline draws (and
    # discards) prefetched batches in another order than a one-device one, so the batches
    # are drawn once here and declared to fit() as Poisson samples at q = 1/4.
    from tf_dp.data import PoissonSampler

    # The case needs realised sizes that vary (the divisor must not). Fresh entropy draws
    # four equal sizes with probability ~0.2% (it happened in CI): draw again until they
    # vary (20 tries all failing: < 1e-50).
    for _ in range(20):
        picks = [b[0].numpy() for b in PoissonSampler(np.arange(len(x)),
                                                       sampling_probability=0.25).dataset(4)]
        if len({len(p) for p in picks}) > 1:
            break
    assert len({len(p) for p in picks}) > 1, picks
    ragged = tf.ragged.constant([p.tolist() for p in picks], dtype=tf.int64)

    def fit_with(micro):
        def fit(model):
            ds = tf.data.Dataset.from_tensor_slices(ragged).map(
                lambda idx: (tf.gather(x, idx), tf.gather(y, idx)))
            model.fit(ds.repeat(), epochs=1, steps_per_epoch=4, verbose=0, dataset_size=len(x),
                      sampling_probability=0.25)
        return fit

    single = _train(None, opt_fn, fit_with(8 // k))
    mirrored = _train(_strategy(), opt_fn, fit_with(8 // k))
    assert _steps(mirrored) == _steps(single) == 4
    # The accountant saw each global step once, at the declared q (not once per replica).
    assert mirrored.accountant.steps == single.accountant.steps == 4
    assert [p.sampling_probability for p in mirrored.accountant.phases] == [0.25]
    for got, want in zip(mirrored.get_weights(), single.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if k > 1:
        plain = _train(None, lambda: opt_fn(1), fit_with(8))
        for got, want in zip(mirrored.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ noise once per global step


def _zero_loss(y_true, y_pred):
    return 0.0 * tf.reduce_sum(y_pred, axis=-1)


@pytest.mark.parametrize("k", [1, 2])
def test_mirrored_noise_is_added_once_per_global_step(request, k):
    if not _in_two_cpu_process(request):
        return
    clip, sigma, seed, batch = 1.0, 2.0, 5, 8
    rng = np.random.default_rng(2)
    x = rng.normal(size=(batch * k, 150)).astype("float32")
    y = np.zeros((batch * k, 140), np.float32)
    with _strategy().scope():
        model = make_private(keras.Sequential([keras.Input((150,)), keras.layers.Dense(140)]))
        model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
        model.compile(optimizer=DPSGD(clip, sigma, learning_rate=1.0, seed=seed,
                                      gradient_accumulation_steps=k), loss=_zero_loss)
    # One logical batch of k * 8 examples: k * 4 per replica, in k micro-batches of 4 each.
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch * k)
    model.fit(ds, epochs=1, verbose=0, dataset_size=batch * k)
    assert _steps(model) == 1
    assert model.accountant.steps == 1  # recorded once, not once per replica
    update = np.concatenate([w.ravel() for w in model.get_weights()])

    # Zero gradients: the update is the noise alone, divided by the logical batch size k * 8:
    # N(0, (sigma C / (k 8))^2). Twice the noise (once per replica) would double its variance;
    # the same seed on both replicas would double its std; noise once per micro-batch would
    # multiply it by sqrt(k).
    std = sigma * clip / (k * batch)
    n = update.size
    assert abs(update.std() / std - 1) < 5 / math.sqrt(2 * n), update.std() / std
    assert abs(update.mean()) < 5 * std / math.sqrt(n)
    noise = gaussian_noise([(w.shape, tf.float64) for w in model.trainable_variables],
                           sigma * clip, seeded_draw(seed, "noise", 0))
    for w, z in zip(model.get_weights(), noise):
        np.testing.assert_allclose(w, -z.numpy() / (k * batch), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ batch-size schedules


@pytest.mark.filterwarnings("ignore:tf_dp. the optimizer was given a `seed`")
def test_mirrored_batch_size_schedule_divides_and_accounts_by_each_steps_phase(request):
    """A schedule's phase index travels with its batch; tf.distribute splits every component
    over the replicas, so the phase goes as a [1] vector one replica receives and the step
    sums it over replicas. Zero loss, seeded noise: the weights after the run are exactly
    -sum_t z_t / E_t with E_t the phase's expected batch, and the accountant holds one step
    per global step at each phase's q (not one per replica, not the first phase's q)."""
    if not _in_two_cpu_process(request):
        return
    from tf_dp.schedules import PiecewiseBatchSize

    clip, sigma, seed, n = 1.0, 2.0, 7, 32
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 20)).astype("float32")
    y = np.zeros((n, 10), np.float32)
    schedule = PiecewiseBatchSize(boundaries=[2], batch_sizes=[4, 16])  # E_t: 4, 4, 16, 16, 16
    with _strategy().scope():
        model = make_private(keras.Sequential([keras.Input((20,)), keras.layers.Dense(10)]))
        model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
        model.compile(optimizer=DPSGD(clip, sigma, learning_rate=1.0, seed=seed),
                      loss=_zero_loss)
    history = model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=5, verbose=0)
    assert _steps(model) == 5
    assert history.history["batch_size"][-1] == 16
    phases = {p.sampling_probability: p.count for p in model.accountant.phases}
    assert phases == {4 / n: 2, 16 / n: 3}
    expected = np.zeros(sum(int(np.prod(w.shape)) for w in model.weights))
    for step, size in enumerate([4, 4, 16, 16, 16]):
        noise = gaussian_noise([(w.shape, tf.float64) for w in model.trainable_variables],
                               sigma * clip, seeded_draw(seed, "noise", step))
        expected -= np.concatenate([z.numpy().ravel() for z in noise]) / size
    got = np.concatenate([w.ravel() for w in model.get_weights()])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_mirrored_batch_size_schedule_builds_the_model_from_the_batch_not_the_phase(request):
    # Review s24b: the model's symbolic build took the schedule's (batch, phase) element as
    # (inputs, targets), so a loss that checks shapes failed before the first step.
    if not _in_two_cpu_process(request):
        return
    from tf_dp.schedules import PiecewiseBatchSize

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    y = rng.integers(0, 2, 48).astype("int32")
    with _strategy().scope():
        model = make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        model.compile(optimizer=DPSGD(1.0, 1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=PiecewiseBatchSize([3], [8, 16]), steps_per_epoch=5, epochs=1,
              verbose=0)
    assert _steps(model) == 5


def test_replicas_sums_are_added_in_float64_before_the_one_rounding(request):
    # Each replica holds its clipped sum in float64 (ghost.SUM_DTYPE). They are added in
    # float64 by apply_private (with the first replica's noise), and rounded to float32 once:
    # 2^24 (replica 0) + 1 + 2^-25 (replica 1) is just above a tie, 16777218 in float32 after
    # that rounding. Rounded to float32 first (1 + 2^-25 is 1), Keras' float32 sum would be
    # the tie 2^24 + 1, rounded to even: 2^24 (docs/privacy.md).
    if not _in_two_cpu_process(request):
        return
    strategy = _strategy()
    with strategy.scope():
        variable = keras.Variable(np.zeros([1], np.float32))
        opt = DPSGD(1.0, 0.0, learning_rate=1.0)
        opt.build([variable])

    def step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        part = tf.where(tf.equal(replica, 0), tf.constant([2.0**24], tf.float64),
                        tf.constant([1.0 + 2.0**-25], tf.float64))
        opt.apply_private([part], [variable], 1.0)

    strategy.run(tf.function(step))
    values = [keras.ops.convert_to_numpy(v) for v in strategy.experimental_local_results(
        variable.value)]
    for value in values:
        np.testing.assert_array_equal(value, np.float32([-16777218.0]))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
