"""tf_dp.audit.bounds: the one-run bound and the (TPR, FPR) bound against hand computations,
their soundness on mechanisms with a known ε, the ROC tools, and bad inputs."""

import math
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from tf_dp.audit import bounds


# ----------------------------------------------------------------- one run: p-value
def test_p_value_without_delta_is_the_binomial_tail():
    # Steinke et al. 2023, Theorem 3 with δ = 0: P[Binomial(r, e^ε/(1+e^ε)) ≥ v].
    q = math.e / (1 + math.e)
    by_hand = sum(math.comb(10, j) * q**j * (1 - q) ** (10 - j) for j in range(8, 11))
    assert bounds.one_run_p_value(100, 10, 8, 1.0) == pytest.approx(by_hand, rel=1e-12)


def test_p_value_delta_term_worked_by_hand():
    # r = v = 2, m = 10, δ = 1e-3, ε = 1 (Algorithm 2 of the paper):
    # β = q² ; α = max(P[B=1]/1, (P[B=1] + P[B=0])/2) = 2q(1-q); p = β + α·2mδ.
    q = math.e / (1 + math.e)
    beta, p1, p0 = q * q, 2 * q * (1 - q), (1 - q) ** 2
    alpha = max(p1, (p1 + p0) / 2)
    assert alpha == p1
    expected = beta + alpha * 2 * 10 * 1e-3
    assert expected == pytest.approx(0.542311, abs=1e-6)
    assert bounds.one_run_p_value(10, 2, 2, 1.0, 1e-3) == pytest.approx(expected, rel=1e-12)


def test_p_value_is_capped_at_one_and_zero_correct_is_no_evidence():
    assert bounds.one_run_p_value(1000, 10, 10, 0.0, 0.5) == 1.0
    assert bounds.one_run_p_value(10, 5, 0, 3.0) == 1.0


# ----------------------------------------------------------------- one run: ε bound
@pytest.mark.parametrize("r", [1, 10, 100, 1000])
def test_perfect_guesses_without_delta_closed_form(r):
    # v = r: p(ε) = q^r, so the bound is log(q/(1-q)) at q = (1 - confidence)^(1/r).
    q = 0.05 ** (1 / r)
    expected = max(0.0, math.log(q / (1 - q)))
    got = bounds.one_run_epsilon_lower_bound(1000, r, r, 0.0, 0.95)
    assert got == pytest.approx(expected, abs=2e-6)
    assert got <= expected  # rounded down


def test_hand_values_of_perfect_guessing():
    # r = 10 all right at 95%: q = 0.05^0.1 = 0.741134, ε = log(q/(1-q)) = 1.05187.
    assert bounds.one_run_epsilon_lower_bound(10, 10, 10) == pytest.approx(1.05187, abs=1e-5)
    # 100 right guesses of 100: 3.49296 without δ; δ = 1e-5 with m = 1000 costs a little.
    assert bounds.one_run_epsilon_lower_bound(1000, 100, 100) == pytest.approx(3.49296, abs=1e-5)
    with_delta = bounds.one_run_epsilon_lower_bound(1000, 100, 100, 1e-5)
    assert 3.3 < with_delta < 3.49296


def test_bound_is_where_the_p_value_crosses_the_level():
    m, r, v, d = 1000, 200, 170, 1e-5
    eps = bounds.one_run_epsilon_lower_bound(m, r, v, d, 0.95)
    assert bounds.one_run_p_value(m, r, v, eps, d) < 0.05
    assert bounds.one_run_p_value(m, r, v, eps + 1e-5, d) >= 0.05


def test_monotone_in_correct_guesses_confidence_and_delta():
    e = [bounds.one_run_epsilon_lower_bound(1000, 200, v, 1e-6) for v in (120, 150, 180, 200)]
    assert e == sorted(e) and e[0] > 0
    assert (bounds.one_run_epsilon_lower_bound(1000, 200, 180, 0, 0.99)
            < bounds.one_run_epsilon_lower_bound(1000, 200, 180, 0, 0.95))
    assert (bounds.one_run_epsilon_lower_bound(1000, 200, 180, 1e-3)
            < bounds.one_run_epsilon_lower_bound(1000, 200, 180, 0.0))


def test_chance_level_guessing_gives_zero():
    assert bounds.one_run_epsilon_lower_bound(1000, 1000, 500, 1e-5) == 0.0
    assert bounds.one_run_epsilon_lower_bound(1000, 100, 0) == 0.0


def _randomized_response_guesses(rng, m, eps):
    """m canaries in/out w.p. 1/2, released through ε-DP randomized response: the optimal
    guesses are the released bits; each is right with probability e^ε/(1+e^ε)."""
    included = rng.random(m) < 0.5
    flip = rng.random(m) >= math.exp(eps) / (1 + math.exp(eps))
    return included, included ^ flip


def test_sound_on_randomized_response_and_tight_with_many_canaries():
    # ε-DP randomized response is exactly ε-DP: the 95% bound exceeds ε at most 5% of the
    # time, and with 10^5 canaries it comes close to ε.
    rng = np.random.default_rng(0)  # the auditor's simulation, not a DP mechanism
    m, eps = 2000, 1.0
    above = 0
    for _ in range(200):
        included, guess = _randomized_response_guesses(rng, m, eps)
        v = int(np.sum(guess == included))
        above += bounds.one_run_epsilon_lower_bound(m, m, v) > eps
    assert above <= 0.05 * 200 + 6  # 5% of 200 plus ~2.3 standard deviations
    included, guess = _randomized_response_guesses(rng, 100_000, eps)
    tight = bounds.one_run_epsilon_lower_bound(100_000, 100_000, int(np.sum(guess == included)))
    assert 0.95 < tight <= 1.0 + 0.02


def test_from_scores_counts_guesses_at_both_ends_with_bonferroni():
    included = np.array([True] * 6 + [False] * 6)
    scores = np.arange(12.0)[::-1]  # included canaries score highest
    out = bounds.one_run_from_scores(scores, included, guesses=[(3, 3), (6, 0)])
    assert (out["num_guesses"], out["num_correct"]) in ((6, 6),)
    assert out["epsilon_lower_bound"] == pytest.approx(
        bounds.one_run_epsilon_lower_bound(12, 6, 6, 0.0, 1 - 0.05 / 2), abs=1e-6)
    assert out["pairs_tried"] == 2
    # wrong-way scores: every guess wrong, no evidence
    assert bounds.one_run_from_scores(-scores, included)["epsilon_lower_bound"] == 0.0


def test_from_scores_breaks_ties_at_random():
    # constant scores carry no information: the guesses must not follow the input order
    included = np.array([True] * 50 + [False] * 50)
    out = [bounds.one_run_from_scores(np.zeros(100), included, guesses=[(50, 0)],
                                      rng=np.random.default_rng(i))["num_correct"]
           for i in range(20)]
    assert max(out) < 50 and len(set(out)) > 1


# ----------------------------------------------------------------- membership: (TPR, FPR)
def test_clopper_pearson_matches_the_beta_quantiles():
    lo, hi = bounds.clopper_pearson(7, 20, 0.95)
    assert lo == pytest.approx(stats.beta.ppf(0.025, 7, 14))
    assert hi == pytest.approx(stats.beta.ppf(0.975, 8, 13))
    # the exact-tail definition: P[Bin(20, hi) <= 7] = 0.025 = P[Bin(20, lo) >= 7]
    assert stats.binom.cdf(7, 20, hi) == pytest.approx(0.025, abs=1e-9)
    assert stats.binom.sf(6, 20, lo) == pytest.approx(0.025, abs=1e-9)
    assert bounds.clopper_pearson(0, 10)[0] == 0.0 and bounds.clopper_pearson(10, 10)[1] == 1.0


def test_membership_bound_worked_by_hand():
    # 500/1000 members flagged, 5/1000 non-members: ε ≥ log((TPR_lo - δ)/FPR_hi).
    tpr_lo = stats.beta.ppf(0.025, 500, 501)
    fpr_hi = stats.beta.ppf(0.975, 6, 995)
    expected = math.log((tpr_lo - 1e-5) / fpr_hi)
    got = bounds.membership_epsilon_lower_bound(500, 1000, 5, 1000, 1e-5)
    assert got == pytest.approx(expected, rel=1e-9)
    assert 3.6 < got < 3.8  # point estimate log(0.5/0.005) = 4.6, the interval costs ~0.9


def test_membership_bound_symmetric_form():
    # almost every non-member rejected, some members missed: the (1-FPR)/(1-TPR) form wins
    tpr_lo = stats.beta.ppf(0.025, 995, 6)
    fpr_hi = stats.beta.ppf(0.975, 500, 501)
    expected = math.log((1 - fpr_hi) / (1 - tpr_lo))
    assert bounds.membership_epsilon_lower_bound(995, 1000, 499, 1000) == pytest.approx(expected)


def test_membership_bound_zero_at_chance():
    assert bounds.membership_epsilon_lower_bound(100, 1000, 100, 1000, 1e-5) == 0.0


def test_scores_bound_is_sound_for_the_gaussian_mechanism():
    # μ-GDP Gaussian scores (members shifted by μ): the 95% bound stays below the mechanism's
    # exact ε at δ (the GDP privacy profile) in at least ~95% of repetitions.
    rng = np.random.default_rng(1)
    mu, delta = 2.0, 1e-5

    def gdp_delta(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    from scipy.optimize import brentq
    true_eps = brentq(lambda e: gdp_delta(e) - delta, 0, 50)
    above = 0
    for _ in range(40):
        out = bounds.scores_epsilon_lower_bound(rng.normal(mu, 1, 2000), rng.normal(0, 1, 2000),
                                                delta, 0.95, rng)
        above += out["epsilon_lower_bound"] > true_eps
        assert 0 <= out["fpr"] <= 1
    assert above <= 4


# ----------------------------------------------------------------- ROC
def test_roc_auc_and_tpr_at_fpr_by_hand():
    members, nonmembers = [3.0, 2.0, 0.5], [1.0, 0.0, 0.5, -1.0]
    # pairs (member > nonmember): 3→4, 2→4, 0.5→2 (+ one tie counted 1/2) → 10.5 / 12
    assert bounds.roc_auc(members, nonmembers) == pytest.approx(10.5 / 12)
    fpr, tpr, _ = bounds.roc_curve(members, nonmembers)
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert bounds.tpr_at_fpr(members, nonmembers, 0.0) == pytest.approx(2 / 3)
    assert bounds.tpr_at_fpr(members, nonmembers, 0.25) == pytest.approx(2 / 3)
    assert bounds.tpr_at_fpr(members, nonmembers, 0.5) == pytest.approx(1.0)


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize("call, message", [
    (lambda: bounds.one_run_p_value(10, 11, 1, 1.0), "`num_guesses` must be at most"),
    (lambda: bounds.one_run_p_value(10, 5, 6, 1.0), "`num_correct` must be at most"),
    (lambda: bounds.one_run_p_value(10, 5, 2, -1.0), "`epsilon` must be >= 0"),
    (lambda: bounds.one_run_p_value(-1, 0, 0, 1.0), "`num_canaries` must be a non-negative"),
    (lambda: bounds.one_run_p_value(10, 5.0, 2, 1.0), "`num_guesses` must be a non-negative"),
    (lambda: bounds.one_run_epsilon_lower_bound(10, 5, 2, delta=1.5), "`delta` must be in"),
    (lambda: bounds.one_run_epsilon_lower_bound(10, 5, 2, confidence=1.0),
     "`confidence` must be in"),
    (lambda: bounds.clopper_pearson(3, 0), "`trials` must be > 0"),
    (lambda: bounds.clopper_pearson(4, 3), "`successes` must be at most"),
    (lambda: bounds.membership_epsilon_lower_bound(1, 0, 1, 10), "`num_members` must be > 0"),
    (lambda: bounds.roc_auc([], [1.0]), "`member_scores` must hold at least one"),
    (lambda: bounds.roc_auc([np.nan], [1.0]), "`member_scores` must be finite"),
    (lambda: bounds.tpr_at_fpr([1.0], [0.0], 2.0), "`fpr` must be in"),
    (lambda: bounds.one_run_from_scores([1.0, 2.0], [1, 0]), "`included` must be booleans"),
    (lambda: bounds.one_run_from_scores([1.0, 2.0], [True]), "`included` must have one"),
    (lambda: bounds.one_run_from_scores([1.0, 2.0], [True, False], guesses=[(2, 1)]),
     "`guesses` must be non-empty"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bounds_import_without_tensorflow():
    code = ("import sys, tf_dp.audit; tf_dp.audit.one_run_epsilon_lower_bound(10, 10, 10); "
            "assert 'tensorflow' not in sys.modules, 'tensorflow loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
