"""Increasing batch-size schedules (issue 12 part 2; Anil et al. 2021, §5.2.2).

Each step is Poisson-sampled at its phase's q_t (statistical test), divided by q_t N (the
update of identical examples), recorded at q_t (the report equals the composition of the
phases), calibrated for the whole schedule, and stopped at a target epsilon.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.accounting import PrivacyAccountant  # noqa: E402
from tf_dp.data import PoissonSampler  # noqa: E402
from tf_dp.schedules import PiecewiseBatchSize  # noqa: E402
from tf_dp.data.poisson import exact_rate  # noqa: E402


def test_schedule_phases_and_refusals():
    s = PiecewiseBatchSize([3, 10], [8, 16, 64])
    assert [s(t) for t in (0, 2, 3, 9, 10, 99)] == [8, 8, 16, 16, 64, 64]
    assert s.phases(12) == [(8, 3), (16, 7), (64, 2)]
    assert s.phases(2) == [(8, 2)]
    assert s.examples_seen(12) == 8 * 3 + 16 * 7 + 64 * 2
    assert PiecewiseBatchSize.from_config(s.get_config()) == s
    for bad, match in [(([3, 3], [1, 2, 3]), "increasing"), (([0], [1, 2]), "boundaries"),
                       (([3], [1]), "one more"), (([3], [1, -2]), "batch_sizes")]:
        with pytest.raises(ValueError, match=match):
            PiecewiseBatchSize(*bad)


def test_each_phase_samples_at_its_own_rate():
    n = 2000
    x = np.arange(n, dtype="float32").reshape(n, 1)
    for source in (x, tf.data.Dataset.from_tensor_slices(x)):
        sampler = PoissonSampler(source, expected_batch_size=PiecewiseBatchSize([25], [20, 200]))
        # the rates actually used (data/poisson.exact_rate: on the float64 uniforms' grid)
        assert sampler.phase_probabilities == (exact_rate(0.01), exact_rate(0.1))
        sizes = {0: [], 1: []}
        for t, (batch, phase) in enumerate(sampler.dataset(num_steps=50)):
            assert int(phase) == (0 if t < 25 else 1)
            rows = batch[0].numpy()[:, 0] if isinstance(batch, tuple) else batch.numpy()[:, 0]
            assert len(set(rows)) == len(rows)  # no example twice in a batch
            sizes[int(phase)].append(len(rows))
        for phase, q in ((0, 0.01), (1, 0.1)):
            total = np.sum(sizes[phase])
            mean, sd = 25 * n * q, np.sqrt(25 * n * q * (1 - q))
            assert abs(total - mean) < 5.5 * sd, (phase, total, mean)
    with pytest.raises(ValueError, match="pad_to"):
        PoissonSampler(x, expected_batch_size=PiecewiseBatchSize([2], [4, 8]), pad_to=16)
    with pytest.raises(ValueError, match="above the number of examples"):
        PoissonSampler(x, expected_batch_size=PiecewiseBatchSize([2], [4, 4000]))


def _model():
    keras.utils.set_random_seed(0)  # initialisation only
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, use_bias=False)])


class _Record(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights, self.sizes = [self.model.get_weights()[0].copy()], []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(self.model.get_weights()[0].copy())
        self.sizes.append(float(logs["batch_size"]))


def test_each_step_is_divided_by_its_phase_expected_size_and_accounted_at_its_q():
    """Identical examples whose gradient is always clipped: with sigma = 0 an update is
    lr * m * C / E_t along a fixed direction (m the realised size), so the mean of
    |update| / (lr C) over a phase's steps is about 1 only if each is divided by E_t."""
    n, k = 4000, 2
    x = np.ones((n, 4), "float32")
    y = np.full((n, 1), 50.0, "float32")
    model = tf_dp.keras.make_private(_model())
    lr, clip = 1e-2, 0.01
    with pytest.warns(UserWarning, match="not private"):
        opt = tf_dp.DPSGD(l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=lr,
                          gradient_accumulation_steps=k)
    model.compile(optimizer=opt, loss="mse")
    record = _Record()
    schedule = PiecewiseBatchSize([12], [20, 200])  # logical: 40 then 400 (k = 2)
    with pytest.warns(RuntimeWarning, match="no noise"):
        model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=24, verbose=0,
                  callbacks=[record], max_physical_batch_size=64)
    assert record.sizes == [40.0] * 12 + [400.0] * 12  # what the progress bar shows
    moves = np.array([np.linalg.norm(b - a) for a, b in zip(record.weights,
                                                              record.weights[1:])])
    ratio = moves / (lr * clip)  # = m / E_t
    for phase in (slice(0, 12), slice(12, 24)):
        e = 40.0 if phase.start == 0 else 400.0
        assert abs(ratio[phase].mean() - 1.0) < 5 * np.sqrt(e) / e / np.sqrt(12) + 0.02
    phases = [(p["sampling_probability"], p["count"]) for p in model.privacy_report()["phases"]]
    assert phases == [(exact_rate(40 / n), 12), (exact_rate(400 / n), 12)]


def test_report_is_the_composition_of_the_phases_and_calibration_reaches_the_target():
    n = 1000
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    schedule = PiecewiseBatchSize([20, 40], [10, 40, 100])
    opt = tf_dp.DPSGD.for_target_epsilon(2.0, 1e-5, epochs=2, batch_size=schedule,
                                         dataset_size=n, l2_norm_clip=1.0, learning_rate=0.01,
                                         steps_per_epoch=30)
    sigma = opt.noise_multiplier

    def composed(s):
        acc = PrivacyAccountant()
        for size, count in schedule.phases(60):
            acc.step(noise_multiplier=s, sampling_probability=size / n, count=count)
        return acc.epsilon(1e-5)

    assert composed(sigma) <= 2.0 < composed(sigma * 0.99)
    model = tf_dp.keras.make_private(_model())
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=schedule, epochs=2, steps_per_epoch=30, verbose=0)
    report = model.privacy_report()
    assert report["steps"] == 60
    assert report["epsilon"] == pytest.approx(composed(sigma), rel=1e-9)
    assert report["epsilon"] <= 2.0


def test_target_epsilon_stops_a_scheduled_run_within_budget():
    n = 1000
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    model = tf_dp.keras.make_private(_model(), target_epsilon=2.0)
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    schedule = PiecewiseBatchSize([10], [20, 60])
    model.fit(x, y, batch_size=schedule, epochs=10, steps_per_epoch=10, verbose=0)
    report = model.privacy_report()

    def composed(m):
        acc = PrivacyAccountant()
        for size, count in schedule.phases(m):
            acc.step(noise_multiplier=1.0, sampling_probability=size / n, count=count)
        return acc.epsilon(1e-5)

    steps = report["steps"]
    assert report["epsilon"] <= 2.0
    assert 10 < steps < 100  # stopped inside the second phase
    # Exactly the last affordable step: one more would have exceeded the target.
    assert composed(steps) <= 2.0 < composed(steps + 1)


def _phases(model):
    return [(p.sampling_probability, p.count) for p in model.accountant.phases]


def test_a_second_fit_continues_the_schedule_where_the_first_stopped():
    # As a Keras learning-rate schedule, a batch-size schedule follows the optimizer's step
    # count: fit's steps 3-5 are in the second phase (until session 14 every fit restarted
    # at phase 0: accounted at the q actually used, but not the schedule asked for).
    n = 400
    rng = np.random.default_rng(2)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    model = tf_dp.keras.make_private(_model())
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    schedule = PiecewiseBatchSize([4], [20, 80])
    model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=3, verbose=0)
    assert _phases(model) == [(exact_rate(20 / n), 3)]
    model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=3, verbose=0)
    assert _phases(model) == [(exact_rate(20 / n), 4), (exact_rate(80 / n), 2)]


def test_a_sampler_dataset_starts_its_schedule_at_first_step():
    # first_step = 2 with boundaries [2]: every batch is in phase 1 (its size ~ 80, not 20);
    # a bad first_step is refused, naming it.
    x = np.zeros((400, 1), np.float32)
    sampler = PoissonSampler(x, expected_batch_size=PiecewiseBatchSize([2], [20, 80]))
    phases = [int(phase) for _, phase in sampler.dataset(num_steps=3, first_step=2)]
    assert phases == [1, 1, 1]
    start = tf.Variable(1, dtype=tf.int64)
    ds = sampler.dataset(num_steps=3, first_step=start)
    start.assign(0)  # read when the first element is made, not when the dataset is
    assert [int(phase) for _, phase in ds] == [0, 0, 1]
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="`first_step` must be an integer >= 0"):
            sampler.dataset(num_steps=1, first_step=bad)


def _built_private():
    model = tf_dp.keras.make_private(_model())
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    model.build((None, 4))
    return model


def _crashed_at(step, x, y, schedule, backup):
    """A private model whose fit (BackupAndRestore in ``backup``, every batch) crashed
    after its optimizer's ``step``-th step."""
    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == step:
                raise RuntimeError("simulated crash")

    model = _built_private()
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(x, y, batch_size=schedule, epochs=3, steps_per_epoch=3, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), Crash()])
    return model


def test_a_run_restored_by_backup_and_restore_resumes_its_schedule(tmp_path):
    # A killed run restarted with the same BackupAndRestore directory: the restored step
    # count (read after the restore, when the first batch is drawn) places the new steps in
    # the phase the schedule gives them.
    n = 400
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    schedule = PiecewiseBatchSize([4], [20, 80])

    backup = str(tmp_path / "backup")
    first = _crashed_at(5, x, y, schedule, backup)
    assert int(first.optimizer.iterations) == 5
    second = _built_private()
    second.fit(x, y, batch_size=schedule, epochs=3, steps_per_epoch=3, verbose=0,
               callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    q0, q1 = exact_rate(20 / n), exact_rate(80 / n)
    # Restored at step 5 (in phase 1): every step the second process applied is at q1, the
    # first process's 4 + 1 at q0 and q1 came back with the budget.
    resumed = int(second.optimizer.iterations) - 5
    assert resumed > 0
    assert _phases(second) == [(q0, 4), (q1, 1 + resumed)], _phases(second)



def _scheduled_composition(n, schedule, start, stop, spent=()):
    acc = PrivacyAccountant()
    for q, count in spent:
        acc.step(noise_multiplier=1.0, sampling_probability=q, count=count)
    for size, count in schedule.phases(stop, start=start):
        acc.step(noise_multiplier=1.0, sampling_probability=exact_rate(size / n), count=count)
    return acc.epsilon(1e-5)


def test_a_target_is_costed_from_where_a_second_fit_continues_the_schedule(tmp_path):
    """Session 21 audit: a second fit continues the schedule at the optimizer's step, but its
    affordable steps were costed as if the schedule restarted at step 0 (the cheap first
    phase): ε 8.15 against a target of 5.92. Now costed from the step it continues at; so
    is a run that BackupAndRestore moves to another step when training begins; a dataset
    the user made from the sampler (its start unknown here) is costed at the costliest
    phase."""
    n = 64
    rng = np.random.default_rng(4)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    schedule = PiecewiseBatchSize([4], [4, 32])  # q = 1/16, then 1/2
    q0, q1 = exact_rate(4 / n), exact_rate(32 / n)

    model = _built_private()
    model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=6, verbose=0)
    target = model.epsilon() + 1.0
    model.target_epsilon = target
    model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=40, verbose=0)
    steps = model.accountant.steps
    assert model.epsilon() <= target
    # the last affordable step, costed in the phase the steps were taken in
    assert _scheduled_composition(n, schedule, 0, steps) <= target < _scheduled_composition(
        n, schedule, 0, steps + 1)
    assert _phases(model) == [(q0, 4), (q1, steps - 4)]

    # A dataset the user made from a scheduled sampler: every step costed at q1.
    model = _built_private()
    model.fit(x, y, batch_size=schedule, epochs=1, steps_per_epoch=2, verbose=0)
    model.target_epsilon = model.epsilon() + 3.0
    sampler = PoissonSampler(x, y, expected_batch_size=schedule)
    model.fit(sampler.dataset(first_step=4), epochs=1, steps_per_epoch=40, verbose=0)
    assert model.epsilon() <= model.target_epsilon
    taken = model.accountant.steps - 2
    assert 0 < taken < 40
    assert _scheduled_composition(n, schedule, 0, 2, spent=[(q1, taken)]) <= (
        model.target_epsilon)



def test_a_target_is_costed_again_where_backup_and_restore_resumes_the_schedule(tmp_path):
    """A restarted process's fit starts at step 0 until BackupAndRestore restores step 5
    (phase 1) when training begins: costed from 0, the limit would let the resumed steps,
    all at q1, exceed the target. _ScheduleStart costs them again from the restored step."""
    n = 64
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    schedule = PiecewiseBatchSize([8], [4, 32])  # q = 1/16 for 8 steps, then 1/2
    q0, q1 = exact_rate(4 / n), exact_rate(32 / n)

    backup = str(tmp_path / "backup")
    first = _crashed_at(9, x, y, schedule, backup)
    assert _phases(first) == [(q0, 8), (q1, 1)]
    # room for 2 more steps at q1 (costed from step 0 instead: 3 at q0 ... more than that)
    target = _scheduled_composition(n, schedule, 0, 11) + 1e-9
    second = _built_private()
    second.target_epsilon = target
    second.fit(x, y, batch_size=schedule, epochs=5, steps_per_epoch=3, verbose=0,
               callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert second.epsilon() <= target
    assert _phases(second) == [(q0, 8), (q1, 3)], _phases(second)

def test_calibration_over_phases():
    from tf_dp.accounting import calibrate_noise_multiplier

    one = calibrate_noise_multiplier(sampling_probability=0.01, steps=400, target_epsilon=2.0,
                                     delta=1e-5)
    split = calibrate_noise_multiplier(sampling_probability=[0.01, 0.01], steps=[100, 300],
                                       target_epsilon=2.0, delta=1e-5)
    assert split == one
    rising = calibrate_noise_multiplier(sampling_probability=[0.01, 0.04], steps=[200, 200],
                                        target_epsilon=2.0, delta=1e-5)
    assert rising > one
    with pytest.raises(ValueError, match="same length"):
        calibrate_noise_multiplier(sampling_probability=[0.01, 0.04], steps=[200],
                                   target_epsilon=2.0, delta=1e-5)


def test_a_schedule_needs_arrays_or_a_scheduled_sampler():
    model = tf_dp.keras.make_private(_model())
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    ds = tf.data.Dataset.from_tensor_slices((np.zeros((8, 4)), np.zeros((8, 1)))).batch(4)
    with pytest.raises(ValueError, match="schedule needs array inputs"):
        model.fit(ds, batch_size=PiecewiseBatchSize([2], [2, 4]), dataset_size=8)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
