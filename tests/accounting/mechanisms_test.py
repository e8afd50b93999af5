"""One-step profiles against direct numerical integration (scipy.integrate.quad)."""

import math
import sys

import numpy as np
import pytest
from scipy import integrate, stats

from tf_dp.accounting import composition, mechanisms, pld


def _quad_hockey(p, q, eps, lo=-40.0, hi=40.0, points=None):
    f = lambda y: max(p(y) - math.exp(eps) * q(y), 0.0)  # noqa: E731
    return integrate.quad(f, lo, hi, points=points, limit=400, epsabs=1e-15, epsrel=1e-12)[0]


@pytest.mark.parametrize("direction", ["remove", "add"])
@pytest.mark.parametrize("eps", [-0.3, 0.0, 0.004, 0.2, 1.5])
def test_subsampled_gaussian_profile_matches_quadrature(direction, eps):
    q, mu = 0.02, 1.4
    mix = lambda y: (1 - q) * stats.norm.pdf(y) + q * stats.norm.pdf(y - mu)  # noqa: E731
    null = stats.norm.pdf
    p, qq = (mix, null) if direction == "remove" else (null, mix)
    fn = mechanisms.remove_profile if direction == "remove" else mechanisms.add_profile
    d, _ = fn(np.array(mu), np.array(eps), q)
    assert float(d) == pytest.approx(_quad_hockey(p, qq, eps, points=[0.0, mu]), abs=1e-10)


#: τ for the tests of how the JL law carries τ: the session-14 value (float32 sums), large
#: enough to move the law measurably; tf_dp's is 2^-20 since its sums are float64.
_TAU = 2.0**-9


def _clear_caches():
    for fn in (mechanisms.jl_mu_law, mechanisms.split_jl_mu_law, composition._probe,
               composition.step_plds):
        fn.cache_clear()


@pytest.fixture
def large_tau(monkeypatch):
    """The law's τ set to ``_TAU`` (the memoised laws are recomputed, before and after)."""
    _clear_caches()
    monkeypatch.setattr(mechanisms, "JL_ROUNDING_SLACK", _TAU)
    yield _TAU
    monkeypatch.undo()
    _clear_caches()


def _jl_one_step_delta(eps, sigma, r, tau=_TAU):
    """E_μ[Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)], μ = (sqrt(r/X) + τ)/σ, X ~ χ²_r, by quad
    over X (τ: the rounding allowance of tf_dp's JL step, docs/privacy.md)."""
    chi2 = stats.chi2(r)

    def integrand(x):
        mu = (math.sqrt(r / x) + tau) / sigma
        g = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        return g * chi2.pdf(x)

    pts = [chi2.ppf(u) for u in (1e-6, 1e-3, 0.1, 0.5, 0.9, 0.999)]
    total = 0.0
    edges = [0.0] + pts + [np.inf]
    for a, b in zip(edges[:-1], edges[1:]):
        total += integrate.quad(integrand, a, b, limit=400, epsabs=1e-14, epsrel=1e-12)[0]
    return total


@pytest.mark.parametrize("r", [1, 3, 10])
def test_jl_one_unsubsampled_step_matches_mixture_integral(r, large_tau):
    sigma, delta_step = 1.0, 1e-3
    eps = np.array([0.0, 0.5, 1.0, 2.0, 4.0])
    cap = 200.0
    upper, _ = composition.step_plds(sigma, 1.0, r, "remove", delta_step, cap)
    ours = pld.delta_for_epsilon(upper, eps)
    for e, d in zip(eps, ours):
        ref = _jl_one_step_delta(float(e), sigma, r, tau=large_tau)
        assert d >= ref - 1e-12, (e, d, ref)  # never below (pessimistic)
        assert d - ref <= 1e-6, (e, d, ref)
        # ... and the allowance is what lifts it above the law without it (Bu et al.'s).
        if e > 0:
            assert d > _jl_one_step_delta(float(e), sigma, r, tau=0.0) + 1e-7, (e, d)


def test_jl_law_has_the_allowance_in_its_support_and_mass(large_tau):
    # μ = (sqrt(r / X) + τ) / σ: nothing below τ / σ, and P(μ <= m) = P(X >= r / (σm - τ)^2).
    sigma, r, tau = 2.0, 4, large_tau
    m = 1.3
    law = mechanisms.jl_mu_law(sigma, r, 40.0, mu_split=m)  # a panel edge at m
    assert law.mu_bottom > tau / sigma
    inside = float(np.sum(law.kronrod_weights))
    assert inside + law.mass_below + law.mass_above == pytest.approx(1.0, abs=1e-9)
    below = float(np.sum(law.kronrod_weights[law.nodes < m])) + law.mass_below
    want = stats.chi2(r).sf(r / (sigma * m - tau) ** 2)
    assert below == pytest.approx(want, abs=1e-9)
    assert stats.chi2(r).sf(r / (sigma * m) ** 2) - want > 1e-5  # without τ: far off


def test_jl_profile_increases_to_gaussian_limit_with_r():
    eps = np.array([0.5, 1.0])
    law_big = mechanisms.jl_mu_law(1.0, 10**6, 30.0)
    d_big = mechanisms.step_profile(law_big, eps, 1.0, "remove").delta_upper
    d_gauss = mechanisms.remove_profile(np.array(1.0), eps, 1.0)[0]
    np.testing.assert_allclose(d_big, d_gauss, rtol=2e-2)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
