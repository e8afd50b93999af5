"""Callbacks that steer training from un-noised metrics void the guarantee (session 19 audit).

Keras' logs are computed on the sampled batches before clipping and noise. A callback that
decides from them (``EarlyStopping``, ``ReduceLROnPlateau``, ``TerminateOnNaN``,
``ModelCheckpoint(save_best_only=True)``) makes the released model a function of them. The
attacks below show one example deciding, with certainty whatever the noise, how many noisy
steps a run releases (``TerminateOnNaN``) and whether a checkpoint file is written
(``ModelCheckpoint(save_best_only=True)``): no epsilon covers that. Before session 19 such a run reported its epsilon
with ``guarantee_holds`` True and no caveat.

Pinned here:
* the attack itself, and that such a run now says the guarantee does not hold;
* which callbacks and metrics void it (training metrics, ``val_*`` from ``validation_split``),
  which are noted (``val_*`` from ``validation_data``), and which are free (tf_dp's
  ``epsilon``; ``gradient_snr`` estimated from the noised update; checkpoints that save every
  time; schedules, loggers, backups).
"""

import sys
import warnings

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.keras import steering

N = 64


def _data(target=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    y = np.zeros((N, 1), np.float32)
    if target == "outlier":
        # Its squared error alone lifts the batch's mean loss above 1e6.
        x[0], y[0] = 1.0, 1e4
    elif target == "overflow":
        # Its prediction overflows: its loss is inf (its gradient adds nothing, session 16).
        x[0] = 1e30
    return x, y


def _model(noise_multiplier=1.0):
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
                                        learning_rate=0.01), loss="mse")
    return model


def _fit(model, x, y, callbacks, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=kwargs.pop("batch_size", N), epochs=kwargs.pop("epochs", 5),
                  verbose=0, callbacks=callbacks, **kwargs)
    return [str(w.message) for w in caught]


def _says_it_does_not_hold(model, messages, name):
    report = model.privacy_report()
    assert report["guarantee_holds"] is False
    (caveat,) = [c for c in report["caveats"] if c.startswith("METRIC_STEERED")]
    assert name in caveat and "training batches" in caveat
    assert any("METRIC_STEERED" in m for m in messages)
    assert "DOES NOT HOLD" in model.privacy_statement()


def test_one_example_decides_how_many_noisy_steps_terminate_on_nan_releases():
    released = {}
    for target in ("overflow", None):
        for _ in range(2):  # fresh noise each run: the outcome does not vary with it
            model = _model()
            x, y = _data(target)
            # batch_size = N: q = 1, so the target is in every step's loss.
            messages = _fit(model, x, y, [keras.callbacks.TerminateOnNaN()])
            released.setdefault(target, set()).add(model.privacy_report()["steps"])
            _says_it_does_not_hold(model, messages, "TerminateOnNaN(monitor='loss')")
    # With the target the run releases 1 noisy step, without it all 5: a deterministic
    # function of one example, which no epsilon covers.
    assert released == {"overflow": {1}, None: {5}}


def test_one_example_decides_whether_a_best_only_checkpoint_is_written(tmp_path):
    written = {}
    for target in ("outlier", None):
        for run in range(2):
            path = tmp_path / f"{target}_{run}.keras"
            model = _model()
            x, y = _data(target)
            messages = _fit(model, x, y, [keras.callbacks.ModelCheckpoint(
                str(path), monitor="loss", save_best_only=True, initial_value_threshold=1e3)],
                epochs=2)
            written.setdefault(target, set()).add(path.exists())
            _says_it_does_not_hold(model, messages, "ModelCheckpoint(monitor='loss')")
    assert written == {"outlier": {False}, None: {True}}


def _kinds(callbacks, validation_private=False, gradient_snr=None):
    caveats = steering.steering_caveats(callbacks, validation_private=validation_private,
                                        gradient_snr=gradient_snr)
    return [c.split(":")[0] for c in caveats]


@pytest.mark.parametrize("callback", [
    keras.callbacks.EarlyStopping(monitor="loss"),
    keras.callbacks.EarlyStopping(monitor="accuracy", restore_best_weights=True),
    keras.callbacks.ReduceLROnPlateau(monitor="loss"),
    keras.callbacks.TerminateOnNaN(),
    keras.callbacks.ModelCheckpoint("/tmp/unused.keras", monitor="loss", save_best_only=True),
    keras.callbacks.EarlyStopping(monitor="gradient_snr"),  # fit's default: not logged noised
    keras.callbacks.EarlyStopping(monitor="gradient_spectrum_top1"),  # an analysis callback's
])
def test_callbacks_deciding_from_training_metrics_void_the_guarantee(callback):
    assert _kinds([callback]) == ["METRIC_STEERED"]


def test_a_subclass_and_a_callback_list_are_seen():
    class Patient(keras.callbacks.EarlyStopping):
        pass

    assert _kinds(keras.callbacks.CallbackList([Patient(monitor="loss")])) == ["METRIC_STEERED"]
    # Nested lists (Keras runs what is inside them), a tuple, a generator.
    nested = keras.callbacks.CallbackList([keras.callbacks.CallbackList([Patient(monitor="loss")])])
    assert _kinds([nested]) == ["METRIC_STEERED"]
    assert _kinds((Patient(monitor="loss"),)) == ["METRIC_STEERED"]
    assert _kinds(c for c in [Patient(monitor="loss")]) == ["METRIC_STEERED"]
    assert _kinds(Patient(monitor="loss")) == ["METRIC_STEERED"]


def test_validation_metrics_void_on_a_split_and_are_noted_on_validation_data():
    stop = keras.callbacks.EarlyStopping(monitor="val_loss")
    assert _kinds([stop], validation_private=True) == ["METRIC_STEERED"]
    assert _kinds([stop], validation_private=False) == ["VALIDATION_STEERED"]


@pytest.mark.parametrize("callback", [
    keras.callbacks.EarlyStopping(monitor="epsilon", baseline=3.0),
    keras.callbacks.ModelCheckpoint("/tmp/unused.keras", monitor="loss", save_best_only=False),
    keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
    keras.callbacks.CSVLogger("/tmp/unused.csv"),
    keras.callbacks.History(),
    keras.callbacks.BackupAndRestore("/tmp/unused_backup"),
])
def test_callbacks_that_decide_nothing_from_private_metrics_are_free(callback):
    assert _kinds([callback]) == []


def test_the_noised_gradient_snr_is_free_and_the_exact_one_is_not():
    stop = keras.callbacks.EarlyStopping(monitor="gradient_snr")
    assert _kinds([stop], gradient_snr="private") == []
    assert _kinds([stop], gradient_snr="exact") == ["METRIC_STEERED"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_through_fit_a_split_voids_validation_data_is_noted_and_epsilon_is_free():
    x, y = _data()
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=10)

    model = _model()
    _fit(model, x, y, [stop], batch_size=16, epochs=1, validation_split=0.25)
    assert model.privacy_report()["guarantee_holds"] is False
    assert [c.split(":")[0] for c in model.privacy_caveats] == ["METRIC_STEERED"]

    model = _model()
    messages = _fit(model, x, y, keras.callbacks.CallbackList([stop]), batch_size=16, epochs=1,
                    validation_data=(x[:8], y[:8]))
    report = model.privacy_report()
    assert report["guarantee_holds"] is True
    assert [c.split(":")[0] for c in report["caveats"]] == ["VALIDATION_STEERED"]
    assert any("VALIDATION_STEERED" in m for m in messages)

    model = _model()
    _fit(model, x, y, [keras.callbacks.EarlyStopping(monitor="epsilon", mode="max", baseline=100.0)],
         batch_size=16, epochs=2)
    report = model.privacy_report()
    assert report["caveats"] == [] and report["guarantee_holds"] is True
    # A later fit without the callback does not clear the caveat: the steered steps stay in
    # the model's history.
    model = _model()
    _fit(model, x, y, [keras.callbacks.EarlyStopping(monitor="loss")], batch_size=16, epochs=1)
    _fit(model, x, y, [], batch_size=16, epochs=1)
    assert model.privacy_report()["guarantee_holds"] is False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
