"""The one-run audit analysed in f-DP (NumPy/SciPy only): a tighter reading of the same guesses.

Steinke et al.'s bound (``tf_dp.audit.bounds``) treats every guess as ε-randomized response
plus a δ-term; for a Gaussian mechanism that is loose, and with δ = 1e-5 the 2mδ term caps the
bound near 4 at a few thousand canaries. Mahloujifar, Melis and Chaudhuri, "Auditing
f-Differential Privacy in One Run" (ICML 2025), test instead "the run is f-DP" for a whole
trade-off curve f, here the Gaussian μ-GDP family of Dong, Roth and Su (2019).

The constraints (derived for this module; the same as the paper's recursion). m canaries,
each in with probability 1/2, exactly c' guesses, C right; N_j = P[C = j]. I is a uniform
random canary, independent of the run, so

```
R_i = P[guess on I right, C ≥ i] = Σ_{j≥i} N_j · j / m
H_i = P[guess on I wrong,  C ≥ i] = Σ_{j≥i} N_j · (c' − j) / m
```

The event "guess on I is *in* and at least i − 1 other guesses are right" does not depend on
I's own bit: with I in it is {I right, C ≥ i}, with I out {I wrong, C ≥ i − 1}; the same for
*out* guesses. f-DP gives P_in[E] ≤ b(P_out[E]) with the blow-up b(x) = 1 − f(x), concave,
so averaging (Jensen) gives for i = 1..c'

```
R_i ≤ b(H_{i−1})
```

A mechanism is consistent with P[C ≥ c] ≥ τ only if some N ≥ 0 with Σ N_j = 1 meets all of
them. The least mass is needed when the τ sits at exactly c (more right guesses raise R and
lower H, both forcing more mass below), and then going down from c every H_i takes its
least value max(H_{i+1}, b⁻¹(R_{i+1})), which fixes N_i. If that needs total mass > 1, the
hypothesis "f-DP" is rejected at level τ. The tests compare this against a linear program
over all N (``tests/audit/fdp_test.py``) and against Steinke et al.'s exact binomial tail
for pure ε-DP, where randomized response attains it.

The result is a lower bound on μ: "the run is not μ-GDP" at the stated confidence. Its
``epsilon`` is the ε(δ) of a μ-GDP mechanism — an ε lower bound *within the Gaussian family*
(the paper reports the same), not a statement about every (ε, δ) claim.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from tf_dp.audit import bounds

__all__ = [
    "gdp_blow_up_inverse",
    "gdp_delta",
    "gdp_epsilon",
    "one_run_fdp_mass_needed",
    "one_run_fdp_p_value",
    "one_run_gdp_from_scores",
    "one_run_gdp_lower_bound",
    "profile_blow_up_inverse",
    "pure_dp_blow_up_inverse",
]


def _mu(mu) -> float:
    value = float(mu)
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"`mu` must be a finite number >= 0, got {mu!r}.")
    return value


def gdp_blow_up_inverse(mu: float):
    """b⁻¹ of μ-GDP, y ↦ Φ(Φ⁻¹(y) − μ): the least P_out[E] an event with P_in[E] = y can have
    (b(x) = 1 − G_μ(x) = Φ(Φ⁻¹(x) + μ), Dong, Roth and Su 2019)."""
    m = _mu(mu)
    return lambda y: float(special.ndtr(special.ndtri(y) - m)) if 0.0 < y < 1.0 else y


def pure_dp_blow_up_inverse(epsilon: float):
    """b⁻¹ of ε-DP: y ↦ max(e^{−ε} y, 1 − e^{ε}(1 − y))."""
    eps = float(epsilon)
    if not eps >= 0.0 or math.isinf(eps):
        raise ValueError(f"`epsilon` must be a finite number >= 0, got {epsilon!r}.")
    return lambda y: max(math.exp(-eps) * y, 1.0 - math.exp(eps) * (1.0 - y), 0.0)


def profile_blow_up_inverse(epsilons, deltas):
    """b⁻¹ of a mechanism that is (ε_k, δ_k)-DP for every k (a privacy profile, e.g. an
    accountant's pessimistic δ(ε) on a grid of ε, both adjacency directions):
    y ↦ max_k max(0, e^{−ε_k}(y − δ_k), 1 − δ_k − e^{ε_k}(1 − y)).

    The p-value of ``one_run_fdp_p_value`` with it tests the accountant's whole claim at
    once, not ε at one δ.
    """
    eps = np.asarray(epsilons, np.float64).reshape(-1)
    dl = np.asarray(deltas, np.float64).reshape(-1)
    if eps.size == 0 or eps.shape != dl.shape:
        raise ValueError(f"`epsilons` and `deltas` must be non-empty and of one length, got "
                         f"{eps.size} and {dl.size}.")
    if np.any(~(eps >= 0)) or np.any(~((dl >= 0) & (dl <= 1))):
        raise ValueError("`epsilons` must be >= 0 and `deltas` in [0, 1].")
    keep = np.isfinite(eps)
    eps, dl = eps[keep], dl[keep]
    shrink, grow = np.exp(-eps), np.exp(np.minimum(eps, 700.0))

    def inverse(y):
        return float(max(0.0, np.max(shrink * (y - dl)), np.max(1.0 - dl - grow * (1.0 - y)))) \
            if eps.size else 0.0

    return inverse


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth, Su 2019, Cor. 2.13)."""
    m = _mu(mu)
    eps = float(epsilon)
    if m == 0.0:
        return 0.0
    # e^ε Φ(·) in log space: it over- and underflows separately for large ε.
    second = math.exp(eps + float(special.log_ndtr(-eps / m - m / 2)))
    return max(float(special.ndtr(-eps / m + m / 2)) - second, 0.0)


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε at which μ-GDP is (ε, δ)-DP: the root of ``gdp_delta(mu, ε) = delta`` (0 if
    δ(0) ≤ δ), by bisection to 1e-9."""
    m = _mu(mu)
    d = float(delta)
    if not 0.0 < d < 1.0:
        raise ValueError(f"`delta` must be in (0, 1), got {delta!r}.")
    if gdp_delta(m, 0.0) <= d:
        return 0.0
    lo, hi = 0.0, 1.0
    while gdp_delta(m, hi) > d:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-9 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if gdp_delta(m, mid) > d:
            lo = mid
        else:
            hi = mid
    return hi


def _check_counts(num_canaries, num_guesses, num_correct):
    m = bounds._count(num_canaries, "num_canaries")
    r = bounds._count(num_guesses, "num_guesses")
    v = bounds._count(num_correct, "num_correct")
    if r > m:
        raise ValueError(f"`num_guesses` must be at most `num_canaries` ({m}), got {r}.")
    if v > r:
        raise ValueError(f"`num_correct` must be at most `num_guesses` ({r}), got {v}.")
    return m, r, v


def one_run_fdp_mass_needed(num_canaries: int, num_guesses: int, num_correct: int,
                            tail: float, blow_up_inverse) -> float:
    """The least total probability an f-DP run needs to have P[C ≥ c] ≥ ``tail``. Above 1
    (the computation stops as soon as it passes 1, so the value is then only "> 1"): no
    f-DP run has that tail, the hypothesis is rejected at level ``tail``.

    Args:
      num_canaries: m.
      num_guesses: c', the guesses made (exactly this many in every run).
      num_correct: c.
      tail: τ in [0, 1].
      blow_up_inverse: b⁻¹ of the hypothesised f (``gdp_blow_up_inverse``,
        ``pure_dp_blow_up_inverse``, or any increasing y ↦ 1 − f⁻¹-style map).
    """
    m, r, c = _check_counts(num_canaries, num_guesses, num_correct)
    t = float(tail)
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"`tail` must be in [0, 1], got {tail!r}.")
    if c == 0 or t == 0.0:
        return t
    right, wrong, mass = t * c / m, t * (r - c) / m, t  # R_c, H_c with all of τ at C = c
    for i in range(c - 1, -1, -1):
        least = blow_up_inverse(right)  # R_{i+1} ≤ b(H_i)
        if least > wrong:
            n_i = (least - wrong) * m / (r - i)
            mass += n_i
            right += i * n_i / m
            wrong = least
        if mass > 1.0:
            return mass
    return mass


def one_run_fdp_p_value(num_canaries: int, num_guesses: int, num_correct: int,
                        blow_up_inverse, tolerance: float = 1e-9) -> float:
    """Upper bound on P[C ≥ c] for an f-DP run: the largest τ whose mass needed is ≤ 1
    (bisection; the mass needed grows with τ)."""
    _check_counts(num_canaries, num_guesses, num_correct)
    if one_run_fdp_mass_needed(num_canaries, num_guesses, num_correct, 1.0,
                               blow_up_inverse) <= 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tolerance:
        mid = 0.5 * (lo + hi)
        if one_run_fdp_mass_needed(num_canaries, num_guesses, num_correct, mid,
                                   blow_up_inverse) <= 1.0:
            lo = mid
        else:
            hi = mid
    return hi


def one_run_gdp_lower_bound(num_canaries: int, num_guesses: int, num_correct: int,
                            delta: float = 1e-5, confidence: float = 0.95,
                            tolerance: float = 1e-4) -> dict:
    """The largest μ for which "the run is μ-GDP" is rejected at 1 − ``confidence``, and the
    ε(δ) of that μ-GDP mechanism.

    Returns:
      dict: ``mu`` (0 when nothing is rejected; rounded down to ``tolerance``) and
      ``epsilon`` (``gdp_epsilon(mu, delta)``).
    """
    m, r, v = _check_counts(num_canaries, num_guesses, num_correct)
    level = 1.0 - bounds._confidence(confidence)
    if not tolerance > 0:
        raise ValueError(f"`tolerance` must be > 0, got {tolerance!r}.")

    def rejected(mu):
        return one_run_fdp_mass_needed(m, r, v, level, gdp_blow_up_inverse(mu)) > 1.0

    if v == 0 or not rejected(0.0):
        return {"mu": 0.0, "epsilon": 0.0}
    # μ = 64 is ε in the thousands; no audit of this size reaches it.
    mu = bounds._largest_rejected(rejected, tolerance, cap=64)
    if math.isinf(mu):
        return {"mu": math.inf, "epsilon": math.inf}
    return {"mu": mu, "epsilon": gdp_epsilon(mu, bounds._delta(delta)) if mu > 0 else 0.0}


def one_run_gdp_from_scores(scores, included, delta: float = 1e-5, confidence: float = 0.95,
                            guesses=None, rng=None) -> dict:
    """``one_run_gdp_lower_bound`` from canary scores, guesses as in
    ``tf_dp.audit.one_run_from_scores`` (top k_in "in", bottom k_out "out", Bonferroni over
    the pairs tried).

    Returns:
      dict: ``mu``, ``epsilon`` (of μ-GDP at ``delta``), ``num_guesses``, ``num_correct``,
      ``k_in``, ``k_out`` of the best pair, ``num_canaries``, ``pairs_tried``.
    """
    counts = bounds.guess_counts(scores, included, guesses, rng)
    conf = 1.0 - (1.0 - bounds._confidence(confidence)) / len(counts)
    m = len(np.asarray(scores).reshape(-1))
    best = None
    for k_in, k_out, correct in counts:
        out = one_run_gdp_lower_bound(m, k_in + k_out, correct, delta, conf)
        if best is None or out["mu"] > best["mu"]:
            best = {**out, "num_guesses": k_in + k_out, "num_correct": correct,
                    "k_in": k_in, "k_out": k_out}
    best.update(num_canaries=m, pairs_tried=len(counts))
    return best
