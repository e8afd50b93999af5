"""The private model records its steps in the accountant: epsilon in History, budget stop."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.accounting.functions import epsilon_text  # noqa: E402
from tf_dp.accounting import compute_epsilon  # noqa: E402


def _data(n=400, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


def _model(**kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    return tf_dp.keras.make_private(model, **kwargs)


def test_history_has_epsilon_of_the_steps_taken():
    x, y = _data()
    model = _model(delta=1e-5)
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.2, learning_rate=0.05, seed=0), loss="mse")
    hist = model.fit(x, y, batch_size=40, epochs=2, verbose=0)
    q, steps_per_epoch = 40 / 400, 10
    assert int(model.optimizer.iterations) == 2 * steps_per_epoch
    want = [compute_epsilon(noise_multiplier=1.2, sampling_probability=q,
                            steps=steps_per_epoch * (e + 1), delta=1e-5) for e in range(2)]
    # History holds epsilon rounded up to the progress bar's 4 decimals (shown_up).
    np.testing.assert_allclose(hist.history["epsilon"], want, rtol=1e-6, atol=1e-4)
    assert all(h >= w * (1 - 1e-6) for h, w in zip(hist.history["epsilon"], want))
    assert hist.history["epsilon"][0] < hist.history["epsilon"][1]
    np.testing.assert_allclose(model.epsilon(), want[-1], rtol=1e-6)


def test_the_progress_bar_never_shows_an_epsilon_below_the_accountants(capsys):
    # Session 23 audit: Keras prints the logs with %.4f, rounded to nearest: 2.8545 was shown
    # for 2.85452747. The logs now hold epsilon rounded up to the digits shown.
    import re

    from tf_dp.keras.privacy_callback import shown_up

    x, y = _data()
    model = _model(delta=1e-5)
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.2, learning_rate=0.05), loss="mse")
    for _ in range(3):
        hist = model.fit(x, y, batch_size=40, epochs=1, verbose=2)
        shown = [float(v) for v in re.findall(r"epsilon: ([0-9.e+-]+)", capsys.readouterr().out)]
        assert shown and shown[-1] >= model.epsilon(), (shown, model.epsilon())
        assert hist.history["epsilon"][-1] == shown_up(model.epsilon())
    for value in (2.85452747, 0.000123451, 1e-3, 9.99995, 0.3, 3.2e30, 1e300, 5e-324):
        up = shown_up(value)
        text = f"{up:.4f}" if up > 1e-3 else f"{up:.4e}"
        assert float(text) >= value and up - value <= max(1.0001e-4, 1e-15 * value), (
            value, text)  # 3.2e30 raised decimal.InvalidOperation and stopped fit


def test_accumulation_records_logical_steps_at_the_logical_rate():
    x, y = _data()
    model = _model()
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.2, learning_rate=0.05, seed=0,
                                        gradient_accumulation_steps=2), loss="mse")
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)  # logical batch 40: q = 0.1
    assert int(model.optimizer.iterations) == 10
    np.testing.assert_allclose(model.epsilon(), compute_epsilon(
        noise_multiplier=1.2, sampling_probability=0.1, steps=10, delta=1e-5), rtol=1e-6)


def test_target_epsilon_stops_before_the_step_that_would_exceed_it(caplog):
    x, y = _data()
    # 7 steps fit, the 8th would not
    target = compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=7, delta=1e-5) * 1.0001
    assert compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=8, delta=1e-5) > target
    model = _model(target_epsilon=target)
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0, learning_rate=0.05, seed=0), loss="mse")
    model.fit(x, y, batch_size=40, epochs=5, verbose=2)
    assert int(model.optimizer.iterations) == 7
    assert model.epsilon() <= target
    assert "would exceed the target epsilon" in caplog.text
    # The budget is spent: a second fit does not train.
    model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 7


def test_saved_model_carries_the_spent_budget(tmp_path):
    x, y = _data()
    model = _model(delta=1e-6)
    model.compile(optimizer=tf_dp.DPAdam(1.0, 1.1, seed=0), loss="mse")
    model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.privacy_delta == 1e-6
    np.testing.assert_allclose(loaded.epsilon(), model.epsilon(), rtol=1e-9)
    loaded.fit(x, y, batch_size=40, epochs=1, verbose=0)
    np.testing.assert_allclose(loaded.epsilon(), compute_epsilon(
        noise_multiplier=1.1, sampling_probability=0.1, steps=20, delta=1e-6), rtol=1e-6)


def test_jl_steps_are_recorded_with_their_projections(caplog):
    x, y = _data()
    model = _model()
    model.compile(optimizer=tf_dp.DPSGDJL(1.0, 1.0, num_projections=20, seed=0), loss="mse")
    hist = model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    jl_eps = model.epsilon()
    exact = compute_epsilon(noise_multiplier=1.0, sampling_probability=0.1, steps=10, delta=1e-5)
    np.testing.assert_allclose(jl_eps, compute_epsilon(
        noise_multiplier=1.0, sampling_probability=0.1, steps=10, delta=1e-5, num_projections=20),
                               rtol=1e-6)
    assert jl_eps > exact
    # The training output shows the JL epsilon next to what exact clipping would cost.
    np.testing.assert_allclose(hist.history["epsilon"], [jl_eps], rtol=1e-9, atol=1e-4)
    np.testing.assert_allclose(hist.history["epsilon_exact_clipping"], [exact], rtol=1e-6,
                               atol=1e-4)
    assert hist.history["epsilon"][0] >= jl_eps
    np.testing.assert_allclose(model.epsilon(exact_clipping=True), exact, rtol=1e-6)
    if jl_eps > 1.5 * exact:
        assert "exact clipping at the same sigma" in caplog.text


def test_exact_clipping_epsilon_counts_every_step():
    """epsilon(exact_clipping=True) is what all the steps would cost with exact norms: equal
    to epsilon() for an exact run (it was 0), and for exact steps followed by JL steps both
    phases at r = None (it counted only the JL ones)."""
    x, y = _data()
    model = _model()
    model.compile(optimizer=tf_dp.DPSGD(1.0, 1.0), loss="mse")
    model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    assert model.epsilon(exact_clipping=True) == pytest.approx(model.epsilon(), rel=1e-9)
    model.compile(optimizer=tf_dp.DPSGDJL(1.0, 1.0, num_projections=20), loss="mse")
    model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    both = compute_epsilon(noise_multiplier=1.0, sampling_probability=0.1, steps=20,
                           delta=1e-5)
    assert model.epsilon(exact_clipping=True) == pytest.approx(both, rel=1e-6)
    assert model.epsilon() > both


def test_make_private_rejects_bad_budget_arguments():
    with pytest.raises(ValueError, match="`delta`"):
        _model(delta=0.0)
    with pytest.raises(ValueError, match="`target_epsilon`"):
        _model(target_epsilon=-1.0)



def test_privacy_report_and_statement_say_what_epsilon_covers():
    from tf_dp import accounting as _accounting

    x = np.zeros((64, 4), "float32")
    y = np.zeros((64, 1), "float32")

    def run(optimizer, **fit_kwargs):
        model = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)),
                                                           keras.layers.Dense(1)]))
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, **fit_kwargs)
        return model

    model = run(tf_dp.DPAdam(1.0, 1.1))
    report = model.privacy_report()
    want = _accounting.compute_rdp_epsilon(
        noise_multiplier=1.1, sampling_probability=0.25, steps=4, delta=1e-5)
    assert report["rdp_epsilon"] == pytest.approx(want, rel=1e-9)
    assert report["rdp_epsilon"] >= report["epsilon"]  # RDP is the looser bound
    assert report["sampling"].startswith("Poisson sampling")
    assert "one training example" in report["unit_of_privacy"] and report["not_covered"]
    text = model.privacy_statement()
    # Rounded up at 4 significant digits, never below the accountant's ε (session 22 audit:
    # %.4g printed 2.316 for 2.31636).
    shown = epsilon_text(report["epsilon"])
    assert f"epsilon = {shown} at delta = 1e-05" in text
    assert float(shown) >= report["epsilon"] and float(shown) - report["epsilon"] < 1e-3 * max(
        1.0, report["epsilon"])
    assert "4 steps at noise_multiplier 1.1, sampling_probability 0.25" in text
    assert "the guarantee holds" in text
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fixed = run(tf_dp.DPAdam(1.0, 1.1), poisson_sampling=False)
    assert "fixed (shuffled) batches" in fixed.privacy_report()["sampling"]
    assert "DOES NOT HOLD" in fixed.privacy_statement()
    jl = run(tf_dp.DPAdamJL(1.0, 1.1, num_projections=3))
    assert jl.privacy_report()["rdp_epsilon"] == float("inf")
    assert "JL norms r = 3" in jl.privacy_statement()

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
