"""tf_dp.audit.membership: reports, log-log ROC, offline LiRA, and the one-run audit with
mislabeled input canaries on a tiny model trained by tf_dp's fit."""

import os
import sys
import warnings

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.audit import bounds, membership


def test_report_on_separated_scores_and_the_png(tmp_path):
    rng = np.random.default_rng(0)
    members, nonmembers = rng.normal(3, 1, 2000), rng.normal(0, 1, 2000)
    r = membership.membership_report(members, nonmembers, 1e-5, 0.95, rng)
    assert r["auc"] == pytest.approx(bounds.roc_auc(members, nonmembers))
    assert 0.95 < r["auc"] < 1
    assert 0 < r["tpr_at_fpr_0.001"] <= r["tpr_at_fpr_0.01"] < 1
    assert r["epsilon_lower_bound"] > 1.0  # 3-GDP has ε ≈ 10 at δ = 1e-5
    path = membership.plot_roc({"shifted": (members, nonmembers)}, str(tmp_path / "roc.png"))
    assert os.path.getsize(path) > 1000
    with pytest.raises(ValueError, match="`curves` must be a non-empty dict"):
        membership.plot_roc({}, str(tmp_path / "x.png"))


def test_lira_offline_standardises_against_out_shadows():
    rng = np.random.default_rng(1)
    k, n = 8, 300
    # each example in exactly half of the shadows (the balanced design of LiRA)
    shadow_in = rng.permuted(np.tile(np.arange(k) < k // 2, (n, 1)), axis=1).T
    # per-example difficulty (offset) and spread: what LiRA calibrates away
    offset, scale = rng.normal(0, 3, n), rng.uniform(0.5, 2, n)
    shadows = offset + rng.normal(0, 1, (k, n)) * scale + 2.0 * scale * shadow_in
    target_in = rng.random(n) < 0.5
    target = offset + rng.normal(0, 1, n) * scale + 2.0 * scale * target_in
    s = membership.lira_offline_scores(target, shadows, shadow_in)
    out = ~shadow_in
    mu = (shadows * out).sum(0) / out.sum(0)
    np.testing.assert_allclose(s[0], (target[0] - mu[0]) / shadows[out[:, 0], 0].std(ddof=1))
    assert bounds.roc_auc(s[target_in], s[~target_in]) > bounds.roc_auc(
        target[target_in], target[~target_in])
    with pytest.raises(ValueError, match="`shadow_in` must be booleans"):
        membership.lira_offline_scores(target, shadows, shadow_in.astype(int))
    with pytest.raises(ValueError, match="at least 2 shadow models"):
        membership.lira_offline_scores(target, shadows, np.ones_like(shadow_in))


def test_lira_online_is_the_gaussian_likelihood_ratio_by_hand():
    # 4 shadows, example 0 in shadows 0 and 1: IN logits 3, 5 (μ 4, var 2), OUT 0, 2 (μ 1,
    # var 2); target 4.5 → log N(4.5; 4, 2) − log N(4.5; 1, 2) = (3.5² − 0.5²)/4 = 3.0.
    shadows = np.array([[3.0, 0.0], [5.0, 1.0], [0.0, 4.0], [2.0, 2.0]])
    inside = np.array([[True, False], [True, False], [False, True], [False, True]])
    target = np.array([4.5, 1.0])
    per_example = membership.lira_online_scores(target, shadows, inside, global_variance=False)
    assert per_example[0] == pytest.approx(3.0)
    # example 1: IN 4, 2 (μ 3, var 2), OUT 0, 1 (μ 0.5, var 0.5); target 1
    expected = (-0.5 * np.log(2.0) - (1 - 3) ** 2 / 4) - (-0.5 * np.log(0.5) - 0.5**2 / 1.0)
    assert per_example[1] == pytest.approx(expected)
    # pooled: IN var (2 + 2)/2 = 2, OUT var (2 + 0.5)/2 = 1.25
    pooled = membership.lira_online_scores(target, shadows, inside)
    expected0 = (-0.5 * np.log(2.0) - 0.5**2 / 4) - (-0.5 * np.log(1.25) - 3.5**2 / 2.5)
    assert pooled[0] == pytest.approx(expected0)
    with pytest.raises(ValueError, match="at least 2 IN shadow"):
        membership.lira_online_scores(target, shadows[:3], inside[:3], global_variance=False)
    with pytest.raises(ValueError, match="at least 1 OUT shadow"):
        membership.lira_online_scores(target, shadows, np.ones_like(inside))


def test_lira_online_separates_members_on_synthetic_confidences():
    rng = np.random.default_rng(5)
    k, n = 8, 400
    shadow_in = rng.permuted(np.tile(np.arange(k) < k // 2, (n, 1)), axis=1).T
    offset = rng.normal(0, 3, n)
    shadows = offset + rng.normal(0, 1, (k, n)) + 2.0 * shadow_in
    target_in = rng.random(n) < 0.5
    target = offset + rng.normal(0, 1, n) + 2.0 * target_in
    s = membership.lira_online_scores(target, shadows, shadow_in)
    assert bounds.roc_auc(s[target_in], s[~target_in]) > 0.8
    assert bounds.roc_auc(s[target_in], s[~target_in]) > bounds.roc_auc(
        target[target_in], target[~target_in])


def test_confidence_logits_from_logits():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Identity()])
    z = np.array([[2.0, 0.0, -1.0], [0.0, 50.0, 0.0]], np.float32)
    phi = membership.confidence_logits(model, z, [0, 1])
    p = np.exp(z[0]) / np.exp(z[0]).sum()
    assert phi[0] == pytest.approx(np.log(p[0] / (1 - p[0])), rel=1e-5)
    assert phi[1] == pytest.approx(50.0 - np.log(2.0), rel=1e-5)  # p_y rounds to 1


def _blobs(rng, n, d=10, classes=4):
    centers = rng.normal(0, 1.5, (classes, d))
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.normal(0, 1, (n, d))).astype(np.float32), y


def _model(noise_multiplier, clip):
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((10,)), keras.layers.Dense(64, "relu"),
                                      keras.layers.Dense(4)]), delta=1e-5)
    model.compile(optimizer=tf_dp.DPAdam(l2_norm_clip=clip, noise_multiplier=noise_multiplier,
                                         learning_rate=1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_mislabeled_canaries_are_memorised_without_noise_and_not_with_it():
    rng = np.random.default_rng(2)  # the synthetic data and the auditor's coins only
    x, y = _blobs(rng, 400)
    cx, cy = _blobs(rng, 200)
    fit = dict(batch_size=64, epochs=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0 warns
        plain = membership.input_canary_audit(lambda: _model(0.0, float("inf")), x, y, 4, 200,
                                              cx, cy, fit, rng=rng)
    assert plain["epsilon"] == float("inf")
    assert plain["membership"]["auc"] > 0.75, plain["membership"]
    # Unseeded model and sampling: over 40 runs the bound was 1.25 +- 0.17 (min 0.92); 0.25 is
    # 6 sd below (0.5 was 4.5 sd: a chance failure ~ 3e-6). The noised run's bound is 0.
    assert plain["epsilon_lower_bound"] > 0.25
    assert plain["gdp"]["mu"] > 0 and plain["gdp"]["num_canaries"] == 200
    private = membership.input_canary_audit(lambda: _model(1.5, 1.0), x, y, 4, 200, cx, cy,
                                            dict(batch_size=64, epochs=5), rng=rng)
    assert private["epsilon_lower_bound"] <= private["epsilon"]
    with pytest.raises(ValueError, match="`canary_x` must hold at least"):
        membership.input_canary_audit(lambda: None, x, y, 4, 300, cx)
    with pytest.raises(ValueError, match="`num_classes` must be an integer >= 2"):
        membership.input_canary_audit(lambda: None, x, y, 1, 20, cx)


def test_a_model_without_an_accountant_is_refused_before_training():
    # A plain Keras model has no epsilon to compare the audit with: refused (it used to be
    # audited and reported epsilon NaN without a word), and before any fit.
    rng = np.random.default_rng(3)
    x, y = _blobs(rng, 40)
    cx, cy = _blobs(rng, 10)
    fitted = []

    def plain():
        model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        model.fit = lambda *a, **k: fitted.append(1)
        return model

    with pytest.raises(ValueError, match="`build_model` must return a compiled tf_dp private "
                                         "model.*got Sequential"):
        membership.input_canary_audit(plain, x, y, 4, 10, cx, cy, rng=rng)
    assert not fitted


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
