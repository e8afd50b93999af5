"""tf_dp.audit.fdp: the f-DP reading of the one-run audit against a linear program over all
distributions of the number of right guesses, closed forms worked by hand, Steinke et al.'s
exact binomial tail for pure ε-DP, and its soundness on a μ-GDP mechanism."""

import math
import sys

import numpy as np
import pytest
from scipy import integrate, optimize, special, stats

from tf_dp.audit import bounds, fdp


def _lp_p_value(m, r, c, blow_up, slope, points):
    """max P[C ≥ c] over every distribution N of C meeting R_i ≤ b(H_{i−1}), i = 1..r, with the
    concave b replaced by its tangents at ``points`` (a relaxation: the LP's value is ≥ the
    exact one). Brute force in the N_j directly, no recursion."""
    j = np.arange(r + 1)
    rows, rhs = [], []
    for i in range(1, r + 1):
        right = np.where(j >= i, j / m, 0.0)
        wrong = np.where(j >= i - 1, (r - j) / m, 0.0)
        for x in points:
            rows.append(right - slope(x) * wrong)
            rhs.append(blow_up(x) - slope(x) * x)
    res = optimize.linprog(-(j >= c).astype(float), A_ub=np.array(rows), b_ub=np.array(rhs),
                           A_eq=np.ones((1, r + 1)), b_eq=[1.0], bounds=(0, None),
                           method="highs")
    assert res.status == 0
    return -res.fun


def _gdp(mu):
    return (lambda x: float(special.ndtr(special.ndtri(x) + mu)),
            lambda x: math.exp(-mu * float(special.ndtri(x)) - mu * mu / 2))


@pytest.mark.parametrize("m,r,c,mu", [(11, 5, 4, 0.4), (9, 7, 6, 1.26), (14, 10, 9, 0.43),
                                       (28, 17, 17, 2.24), (24, 18, 16, 1.41), (26, 4, 4, 1.11),
                                       (17, 12, 12, 2.13), (12, 12, 9, 0.8)])
def test_recursion_is_the_linear_program_optimum(m, r, c, mu):
    blow_up, slope = _gdp(mu)
    points = special.ndtr(np.linspace(-9, 9, 400))
    lp = _lp_p_value(m, r, c, blow_up, slope, points)
    got = fdp.one_run_fdp_p_value(m, r, c, fdp.gdp_blow_up_inverse(mu))
    assert got <= lp + 1e-6  # the LP relaxes b, so it can only be larger
    assert got == pytest.approx(lp, abs=5e-4)
    assert 0.01 < got < 1  # a case where the constraints bind


def test_one_guess_is_the_bayes_accuracy():
    # m = r = c = 1: τ + b⁻¹(τ) = 1, solved by τ = Φ(μ/2) (the best accuracy of telling
    # N(0, 1) from N(μ, 1) with equal priors) and by τ = e^ε/(1+e^ε) for ε-DP.
    for mu in (0.5, 1.0, 2.0):
        assert fdp.one_run_fdp_p_value(1, 1, 1, fdp.gdp_blow_up_inverse(mu)) == pytest.approx(
            stats.norm.cdf(mu / 2), abs=1e-8)
    for eps in (0.5, 2.0):
        assert fdp.one_run_fdp_p_value(1, 1, 1, fdp.pure_dp_blow_up_inverse(eps)) == \
            pytest.approx(1 / (1 + math.exp(-eps)), abs=1e-8)


def test_mass_needed_by_hand():
    # m = 2, r = c = 1, τ = 0.5, μ = 1: all τ at C = 1, R_1 = τ/2 = 0.25; H_0 ≥ b⁻¹(0.25) =
    # Φ(Φ⁻¹(0.25) − 1); N_0 = H_0 · m / r. Total τ + N_0.
    h0 = stats.norm.cdf(stats.norm.ppf(0.25) - 1.0)
    assert fdp.one_run_fdp_mass_needed(2, 1, 1, 0.5, fdp.gdp_blow_up_inverse(1.0)) == \
        pytest.approx(0.5 + 2 * h0, rel=1e-9)


def test_pure_dp_is_never_below_the_binomial_tail_and_equal_for_perfect_guesses():
    # Randomized response attains P[Binomial(r, e^ε/(1+e^ε)) ≥ c] (Steinke et al., Thm. 3, δ = 0):
    # a sound bound can never be below it.
    rng = np.random.default_rng(3)
    for _ in range(60):
        m = int(rng.integers(2, 60))
        r = int(rng.integers(1, m + 1))
        c = int(rng.integers(1, r + 1))
        eps = float(rng.uniform(0.05, 3.0))
        q = 1 / (1 + math.exp(-eps))
        tail = stats.binom.sf(c - 1, r, q)
        got = fdp.one_run_fdp_p_value(m, r, c, fdp.pure_dp_blow_up_inverse(eps))
        assert got >= tail - 1e-7, (m, r, c, eps)
        if c == r:
            assert got == pytest.approx(q**r, abs=1e-7)


def test_mass_needed_grows_with_the_tail():  # what the bisection on τ relies on
    for m, r, c, mu in [(100, 50, 45, 1.0), (1000, 200, 170, 0.5), (30, 30, 30, 3.0)]:
        inverse = fdp.gdp_blow_up_inverse(mu)
        # (the computation stops once the mass passes 1, so compare below 1)
        mass = [min(fdp.one_run_fdp_mass_needed(m, r, c, t, inverse), 1.0 + 1e-9)
                for t in np.linspace(0, 1, 201)]
        assert np.all(np.diff(mass) >= -1e-12)
        assert mass[0] == 0.0 and mass[-1] > 1.0


def test_gdp_delta_against_numerical_integration_and_its_inverse():
    # δ(ε) = E_{x ~ N(μ, 1)}[(1 − e^{ε − L(x)})_+], L(x) = μx − μ²/2 the privacy loss.
    for mu, eps in [(1.3, 2.0), (0.5, 0.3), (3.0, 8.0)]:
        cut = (eps + mu * mu / 2) / mu
        numeric = integrate.quad(
            lambda x: stats.norm.pdf(x - mu) * -math.expm1(eps - mu * x + mu * mu / 2),
            cut, np.inf, limit=200)[0]
        assert fdp.gdp_delta(mu, eps) == pytest.approx(numeric, rel=1e-6)
        assert fdp.gdp_epsilon(mu, fdp.gdp_delta(mu, eps)) == pytest.approx(eps, abs=1e-6)
    assert fdp.gdp_delta(1.0, 0.0) == pytest.approx(
        stats.norm.cdf(0.5) - stats.norm.cdf(-0.5), rel=1e-12)
    assert fdp.gdp_epsilon(0.01, 1e-5) == pytest.approx(0.0, abs=0.1)


def test_lower_bound_is_where_rejection_stops():
    out = fdp.one_run_gdp_lower_bound(1000, 200, 180, 1e-5, 0.95)
    inverse = fdp.gdp_blow_up_inverse
    assert fdp.one_run_fdp_mass_needed(1000, 200, 180, 0.05, inverse(out["mu"])) > 1
    assert fdp.one_run_fdp_mass_needed(1000, 200, 180, 0.05, inverse(out["mu"] + 1e-3)) <= 1
    assert out["epsilon"] == pytest.approx(fdp.gdp_epsilon(out["mu"], 1e-5))
    # tighter than Steinke et al.'s (ε, δ) reading of the same guesses
    assert out["epsilon"] > bounds.one_run_epsilon_lower_bound(1000, 200, 180, 1e-5, 0.95)
    assert fdp.one_run_gdp_lower_bound(1000, 1000, 500, 1e-5)["mu"] == 0.0


def test_sound_on_a_gaussian_mechanism_and_tighter_than_steinke():
    # Each canary's score is μ·included + N(0, 1): exactly μ-GDP per canary.
    rng = np.random.default_rng(4)
    mu, runs, m = 2.0, 20, 500
    gdp, steinke = [], []
    for _ in range(runs):
        inc = rng.random(m) < 0.5
        scores = mu * inc + rng.normal(size=m)
        gdp.append(fdp.one_run_gdp_from_scores(scores, inc, 1e-5, 0.95, rng=rng))
        steinke.append(bounds.one_run_from_scores(scores, inc, 1e-5, 0.95, rng=rng))
    assert max(g["mu"] for g in gdp) < mu
    assert np.mean([g["mu"] for g in gdp]) > 0.6
    assert np.mean([g["epsilon"] for g in gdp]) > np.mean(
        [s["epsilon_lower_bound"] for s in steinke])


def test_from_scores_uses_the_bonferroni_level():
    inc = np.arange(100) < 50
    out = fdp.one_run_gdp_from_scores(inc.astype(float), inc, 1e-5, 0.95, [(50, 50), (10, 0)])
    assert (out["num_guesses"], out["num_correct"], out["pairs_tried"]) == (100, 100, 2)
    assert out["mu"] == pytest.approx(
        fdp.one_run_gdp_lower_bound(100, 100, 100, 1e-5, 0.975)["mu"], abs=1e-9)


def test_profile_inverse_reproduces_pure_dp_and_gdp():
    one = fdp.profile_blow_up_inverse([1.0], [0.0])
    pure = fdp.pure_dp_blow_up_inverse(1.0)
    for y in (0.0, 0.01, 0.3, 0.9, 1.0):
        assert one(y) == pytest.approx(pure(y), abs=1e-15)
    # μ-GDP's exact profile on a grid of ε: a slightly weaker claim than μ-GDP itself
    mu, grid = 1.0, np.linspace(0, 8, 400)
    profile = fdp.profile_blow_up_inverse(grid, [fdp.gdp_delta(mu, e) for e in grid])
    gdp = fdp.gdp_blow_up_inverse(mu)
    for y in (0.01, 0.2, 0.6, 0.95):
        assert gdp(y) - 1e-5 < profile(y) <= gdp(y) + 1e-12
    p_profile = fdp.one_run_fdp_p_value(1000, 200, 180, profile)
    assert p_profile >= fdp.one_run_fdp_p_value(1000, 200, 180, gdp) - 1e-9
    assert p_profile == pytest.approx(fdp.one_run_fdp_p_value(1000, 200, 180, gdp), abs=1e-3)


@pytest.mark.parametrize("call,message", [
    (lambda: fdp.profile_blow_up_inverse([1.0, 2.0], [0.1]), "`epsilons` and `deltas` must be"),
    (lambda: fdp.profile_blow_up_inverse([1.0], [1.5]), "`deltas` in \\[0, 1\\]"),
    (lambda: fdp.gdp_blow_up_inverse(-1.0), "`mu` must be a finite number >= 0"),
    (lambda: fdp.pure_dp_blow_up_inverse(math.inf), "`epsilon` must be a finite number"),
    (lambda: fdp.gdp_epsilon(1.0, 0.0), "`delta` must be in"),
    (lambda: fdp.one_run_fdp_mass_needed(10, 11, 1, 0.1, abs), "`num_guesses` must be at most"),
    (lambda: fdp.one_run_fdp_mass_needed(10, 5, 1, 1.5, abs), "`tail` must be in"),
    (lambda: fdp.one_run_gdp_lower_bound(10, 5, 6), "`num_correct` must be at most"),
    (lambda: fdp.one_run_gdp_lower_bound(10, 5, 5, confidence=1.0), "`confidence` must be"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
