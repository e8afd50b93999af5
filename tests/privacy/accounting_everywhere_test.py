"""Every noisy update is accounted, exactly once, in any loop (issue 9, part B).

The earlier code counted steps in a fit callback from ``optimizer.iterations``: 50
``train_on_batch`` updates left epsilon at 0, restoring a checkpoint dropped steps, a sampler's
endless dataset gave q from a cardinality of 2^62 (epsilon 0), a repeated dataset gave a q
five times too small, a changed ``noise_multiplier`` was recorded but not applied, and a
``target_epsilon`` was overshot under ``steps_per_execution``. Here each of those is pinned
against ``compute_epsilon`` (the accountant's closed path) for the steps actually applied.
"""

import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.accounting import PrivacyAccountant, compute_epsilon
from tf_dp.data import PoissonSampler

pytestmark = pytest.mark.filterwarnings("ignore:tf_dp. training on fixed")


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


def _model(**kwargs):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    return tf_dp.keras.make_private(model, **kwargs)


def _compiled(sigma=1.0, **kwargs):
    model = _model(**{k: kwargs.pop(k) for k in ("target_epsilon", "delta") if k in kwargs})
    spe = kwargs.pop("steps_per_execution", 1)
    model.compile(optimizer=tf_dp.DPSGD(1.0, sigma, learning_rate=0.01, **kwargs), loss="mse",
                  steps_per_execution=spe)
    return model


def test_train_on_batch_steps_are_accounted_without_amplification():
    x, y = _data()
    model = _compiled(1.0)
    for i in range(50):
        model.train_on_batch(x[i % 10 * 20:(i % 10 + 1) * 20], y[i % 10 * 20:(i % 10 + 1) * 20])
    assert model.accountant.steps == 50
    # tf_dp did not sample these batches: q = 1 (no amplification) is the only valid bound.
    np.testing.assert_allclose(model.epsilon(), compute_epsilon(
        noise_multiplier=1.0, sampling_probability=1.0, steps=50, delta=1e-5), rtol=1e-6)
    # A later fit adds its own steps to them.
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    acc = PrivacyAccountant().step(noise_multiplier=1.0, sampling_probability=1.0, count=50)
    acc.step(noise_multiplier=1.0, sampling_probability=0.1, count=10)
    np.testing.assert_allclose(model.epsilon(), acc.epsilon(1e-5), rtol=1e-6)


def test_a_custom_loop_over_train_step_is_accounted():
    x, y = _data()
    model = _compiled(1.2)
    model.check_before_training(x, y)  # a traced custom loop must run fit's model check first
    step = tf.function(model.train_step)
    for i in range(7):
        step((x[:16], y[:16]))
    assert model.accountant.steps == 7
    np.testing.assert_allclose(model.epsilon(), compute_epsilon(
        noise_multiplier=1.2, sampling_probability=1.0, steps=7, delta=1e-5), rtol=1e-6)


def test_a_custom_loop_over_apply_private_is_in_the_optimizer_ledger():
    opt = tf_dp.DPSGD(1.0, 1.0, learning_rate=0.1)
    v = tf.Variable(tf.zeros([3]))
    for _ in range(4):
        opt.apply_private([tf.ones([3])], [v], 8.0, sampling_probability=0.05)
    opt.apply_private([tf.ones([3])], [v], 8.0)  # no q given: recorded as q = 1
    assert sorted(opt.drain_steps()) == [(1.0, 0.05, None, 4), (1.0, 1.0, None, 1)]
    assert opt.drain_steps() == []  # drained exactly once


def test_restoring_weights_never_lowers_the_spent_budget(tmp_path):
    x, y = _data()
    model = _compiled(1.0)
    model.fit(x, y, batch_size=20, epochs=3, verbose=0)  # 30 steps
    early = str(tmp_path / "early.weights.h5")
    model.save_weights(early)
    model.fit(x, y, batch_size=20, epochs=3, verbose=0)  # 60 steps
    late = str(tmp_path / "late.weights.h5")
    model.save_weights(late)
    sixty = compute_epsilon(noise_multiplier=1.0, sampling_probability=0.1, steps=60, delta=1e-5)
    np.testing.assert_allclose(model.epsilon(), sixty, rtol=1e-6)
    # An older checkpoint into the model that trained further: still 60 (was 30 before).
    model.load_weights(early)
    np.testing.assert_allclose(model.epsilon(), sixty, rtol=1e-6)
    # A fresh model (a resumed run, BackupAndRestore) takes the budget saved with the weights.
    fresh = _compiled(1.0)
    fresh.load_weights(late)
    np.testing.assert_allclose(fresh.epsilon(), sixty, rtol=1e-6)
    fresh.fit(x, y, batch_size=20, epochs=1, verbose=0)
    np.testing.assert_allclose(fresh.epsilon(), compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=70, delta=1e-5), rtol=1e-6)
    # Weights of another run loaded into a model that trained: both runs are accounted.
    other = _compiled(1.0)
    other.fit(x, y, batch_size=20, epochs=1, verbose=0)  # 10 steps of its own
    with pytest.warns(UserWarning, match="both runs"):
        other.load_weights(late)
    np.testing.assert_allclose(other.epsilon(), compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=70, delta=1e-5),
                               rtol=1e-6)


def test_backup_and_restore_resumes_with_the_whole_budget(tmp_path):
    x, y = _data()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("simulated crash")

    backup = str(tmp_path / "backup")
    first = _compiled(1.0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit(x, y, batch_size=20, epochs=4, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    assert first.accountant.steps == 20
    # A new process: a new model, resumed from the backup (epochs 3 and 4 remain).
    second = _compiled(1.0)
    second.fit(x, y, batch_size=20, epochs=4, verbose=0,
               callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert second.accountant.steps == 40
    np.testing.assert_allclose(second.epsilon(), compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=40, delta=1e-5),
                               rtol=1e-6)


def test_sampler_datasets_carry_their_q_through_map_and_prefetch():
    x, y = _data()
    sampler = PoissonSampler(x, y, expected_batch_size=20)
    augment = lambda xb, yb: (xb + 0.01 * tf.random.normal(tf.shape(xb)), yb)
    for data, kwargs in [(sampler.dataset(), dict(steps_per_epoch=20)),
                         (sampler.dataset().map(augment).prefetch(1), dict(steps_per_epoch=20)),
                         (sampler.dataset(), {})]:
        model = _compiled(1.0)
        model.fit(data, epochs=1, verbose=0, **kwargs)
        steps = kwargs.get("steps_per_epoch", sampler.steps_per_epoch)
        np.testing.assert_allclose(model.epsilon(), compute_epsilon(
            noise_multiplier=1.0, sampling_probability=0.1, steps=steps, delta=1e-5),
                                   rtol=1e-6)
    # A transformation that breaks the samples is refused.
    model = _compiled(1.0)
    with pytest.raises(ValueError, match="no longer the Poisson samples"):
        model.fit(sampler.dataset().unbatch().batch(20), epochs=1, steps_per_epoch=2,
                  verbose=0)


def test_other_datasets_need_their_size_and_q_is_never_guessed_from_cardinality():
    x, y = _data()
    model = _compiled(1.0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
    for data in (ds, ds.repeat(5), ds.repeat()):
        with pytest.raises(ValueError, match="dataset_size"):
            model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)
    assert model.accountant.steps == 0
    # With the size: q = 10 / 200 = 0.05 whatever the repetition (was 0.01 for repeat(5)).
    model.fit(ds.repeat(5), epochs=1, verbose=0, dataset_size=len(x))
    assert model.accountant.steps == 100
    np.testing.assert_allclose(model.epsilon(), compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.05, steps=100, delta=1e-5),
                               rtol=1e-6)
    assert any(c.startswith("FIXED_BATCHES") for c in model.privacy_caveats)


@pytest.mark.parametrize("steps_per_execution", [1, 8])
def test_target_epsilon_is_never_exceeded(steps_per_execution):
    x, y = _data()
    # 13 steps fit, the 14th would not
    target = compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=13, delta=1e-5) * 1.0001
    model = _compiled(1.0, target_epsilon=target, steps_per_execution=steps_per_execution)
    history = model.fit(x, y, batch_size=20, epochs=5, verbose=0)
    assert isinstance(history, keras.callbacks.History)
    assert model.accountant.steps == 13
    assert int(model.optimizer.iterations) == 13
    assert model.epsilon() <= target
    # Spent: another fit takes no step, says so and still returns a History.
    with pytest.warns(UserWarning, match="is spent"):
        history = model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    assert isinstance(history, keras.callbacks.History)
    assert int(model.optimizer.iterations) == 13
    with pytest.raises(RuntimeError, match="target epsilon"):
        model.train_on_batch(x[:20], y[:20])


@pytest.mark.parametrize("steps_per_execution", [1, 3, 7, 100])
def test_fit_takes_the_steps_it_was_asked_for_whatever_steps_per_execution(steps_per_execution):
    """Keras rounds each epoch up to a multiple of steps_per_execution on an endless input
    (the Poisson sampler's): 3 epochs of 10 steps ran 33 steps at 3 and 300 at 100 (session 19
    audit). The accounting was right, but the run spent more than planned."""
    x, y = _data()  # 200 examples, batch 20: 10 Poisson steps per epoch
    model = _compiled(1.0, steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=20, epochs=3, verbose=0)
    assert model.accountant.steps == int(model.optimizer.iterations) == 30
    # A repeated tf.data input with its steps_per_epoch, and initial_epoch.
    model = _compiled(1.0, steps_per_execution=steps_per_execution)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(20).repeat()
    with pytest.warns(UserWarning, match="fixed"):
        model.fit(data, dataset_size=200, steps_per_epoch=10, epochs=4, initial_epoch=1,
                  verbose=0)
    assert model.accountant.steps == int(model.optimizer.iterations) == 30


def test_a_target_below_one_step_says_so():
    x, y = _data()
    model = _compiled(0.5, target_epsilon=0.01)
    with pytest.warns(UserWarning, match="cannot take even one step"):
        history = model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    assert isinstance(history, keras.callbacks.History)
    assert model.accountant.steps == 0 and int(model.optimizer.iterations) == 0


def test_the_noise_in_the_graph_is_the_noise_in_the_accountant():
    # sigma cannot change behind the traced step's back (it was recorded but not applied).
    x, y = _data()
    model = _compiled(1.0)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    with pytest.raises(AttributeError, match="noise_multiplier"):
        model.optimizer.noise_multiplier = 10.0
    with pytest.raises(AttributeError, match="l2_norm_clip"):
        model.optimizer.l2_norm_clip = 0.1
    assert [p.noise_multiplier for p in model.accountant.phases] == [1.0]


def test_steps_are_accounted_once_under_accumulation_and_recompilation():
    x, y = _data()
    model = _model()
    opt = tf_dp.DPSGD(1.0, 1.0, learning_rate=0.01, gradient_accumulation_steps=2)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)  # logical batch 20: 10 steps
    model.compile(optimizer=opt, loss="mse")  # re-compiling keeps what was spent
    model.compile(optimizer=tf_dp.DPSGD(1.0, 2.0, learning_rate=0.01), loss="mse")
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    acc = PrivacyAccountant().step(noise_multiplier=1.0, sampling_probability=0.1, count=10)
    acc.step(noise_multiplier=2.0, sampling_probability=0.1, count=10)
    assert model.accountant.steps == 20
    np.testing.assert_allclose(model.epsilon(), acc.epsilon(1e-5), rtol=1e-6)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
