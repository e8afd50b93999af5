"""Privacy profiles of one step of (JL-)DP-SGD: the Poisson-subsampled Gaussian and its μ-mixture.

Notation (add/remove adjacency, noise normalised to N(0, 1), sensitivity-to-noise ratio μ):

* remove direction: P = (1 - q) N(0, 1) + q N(μ, 1) against Q = N(0, 1);
* add direction:    P = N(0, 1) against Q = (1 - q) N(0, 1) + q N(μ, 1).

For each direction we need, at privacy-loss levels ε, the hockey-stick divergence
``δ(ε) = P(L > ε) - e^ε Q(L > ε)`` and the weighted Q-tail ``σ(ε) = e^ε Q(L > ε)``; σ is minus the
slope of δ as a function of e^ε (scaled by e^ε), which the optimistic (lower-bound)
discretisation needs. Both have closed forms because the privacy loss is monotone in the output
(Koskela et al. 2020; Zhu, Dong, Wang 2022, Sec. 5).

The JL mechanism (Bu et al. 2021, "Fast and memory efficient differentially private-SGD via JL
projections", Theorem 4.1) reveals the projections, so one step is a Gaussian mechanism whose
ratio μ = sqrt(r / X) / σ, X ~ χ²_r, is random but known to the adversary; tf_dp composes
μ = (sqrt(r / X) + τ) / σ, with τ = ``JL_ROUNDING_SLACK`` covering the rounding of the summed
gradients that no projection sees. The pair of output
distributions is then the joint law of (μ, output), whose privacy profile is the μ-average of the
per-μ profiles. That average is computed here by Gauss–Kronrod quadrature over μ; the quadrature
error estimate is returned so that callers can add it as a pessimistic margin.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import numpy as np
from scipy import special, stats

# Gauss–Kronrod 15-point nodes and weights on [-1, 1], with the embedded 7-point Gauss weights
# (QUADPACK qk15; the same constants as scipy.integrate._quad_vec).
_GK15_NODES = np.array(
    [
        -0.991455371120812639206854697526329,
        -0.949107912342758524526189684047851,
        -0.864864423359769072789712788640926,
        -0.741531185599394439863864773280788,
        -0.586087235467691130294144838258730,
        -0.405845151377397166906606412076961,
        -0.207784955007898467600689403773245,
        0.0,
        0.207784955007898467600689403773245,
        0.405845151377397166906606412076961,
        0.586087235467691130294144838258730,
        0.741531185599394439863864773280788,
        0.864864423359769072789712788640926,
        0.949107912342758524526189684047851,
        0.991455371120812639206854697526329,
    ]
)
_GK15_WEIGHTS = np.array(
    [
        0.022935322010529224963732008058970,
        0.063092092629978553290700663189204,
        0.104790010322250183839876322541518,
        0.140653259715525918745189590510238,
        0.169004726639267902826583426598550,
        0.190350578064785409913256402421014,
        0.204432940075298892414161999234649,
        0.209482141084727828012999174891714,
        0.204432940075298892414161999234649,
        0.190350578064785409913256402421014,
        0.169004726639267902826583426598550,
        0.140653259715525918745189590510238,
        0.104790010322250183839876322541518,
        0.063092092629978553290700663189204,
        0.022935322010529224963732008058970,
    ]
)
_G7_WEIGHTS = np.array(
    [
        0.0,
        0.129484966168869693270611432679082,
        0.0,
        0.279705391489276667901467771423780,
        0.0,
        0.381830050505118944950369775488975,
        0.0,
        0.417959183673469387755102040816327,
        0.0,
        0.381830050505118944950369775488975,
        0.0,
        0.279705391489276667901467771423780,
        0.0,
        0.129484966168869693270611432679082,
        0.0,
    ]
)

# Standard-normal quantile beyond which we treat Gaussian mass as negligible (Φ(-9) ≈ 1.1e-19).
_Z_TAIL = 9.0
_PHI_MINUS_Z_TAIL = float(special.ndtr(-_Z_TAIL))
# Mass of the χ² law left outside the quadrature panels on each side.
_CHI2_TAIL_MASS = 1e-17


@dataclasses.dataclass(frozen=True)
class MuLaw:
    """Law of the sensitivity-to-noise ratio μ of one step, discretised for quadrature.

    Attributes:
      nodes: quadrature nodes μ_k (ascending, > 0).
      kronrod_weights: probability weights of the Gauss–Kronrod rule (sum ≈ mass inside).
      gauss_weights: probability weights of the embedded Gauss rule, for the error estimate.
      mu_bottom: smallest μ covered by the panels; the mass below it is `mass_below`.
      mu_top: largest μ covered; the mass above it is `mass_above` (μ may be +∞ there).
      mass_below: probability that μ < mu_bottom.
      mass_above: probability that μ > mu_top.
    """

    nodes: np.ndarray
    kronrod_weights: np.ndarray
    gauss_weights: np.ndarray
    mu_bottom: float
    mu_top: float
    mass_below: float
    mass_above: float

    @property
    def is_point_mass(self) -> bool:
        return self.nodes.size == 1 and self.mass_above == 0.0 and self.mass_below == 0.0


def gaussian_mu_law(noise_multiplier: float) -> MuLaw:
    """The degenerate law μ = 1/σ of exact clipping (Abadi et al. 2016)."""
    mu = 1.0 / noise_multiplier
    one = np.ones(1)
    return MuLaw(np.array([mu]), one, one, mu, mu, 0.0, 0.0)


#: τ of the JL mechanism's sensitivity ``C (sqrt(r / X) + τ)``: the private step keeps every
#: JL clip bound at or above E_i / τ, E_i the rounding its weighted sums can add for example
#: i beyond its exact gradient (``tf_dp.core.norm_strategies.jl_clip_bounds``), so an example
#: adds at most ``C (||g_i|| / M_i + τ)``. 2^-9 while the sums were float32 (session 14);
#: the sums are float64 since session 15 (E_i is gamma_{2BT+2} in float64 times the sum of
#: the example's terms' sizes), so 2^-20 clips an example below its estimate only when its
#: terms exceed its gradient ~10^5-fold at B T = 10^5, and costs ~1e-6 of ε.
JL_ROUNDING_SLACK = 2.0**-20


def _mu_from_chi2(x: np.ndarray, noise_multiplier: float, num_projections: int) -> np.ndarray:
    with np.errstate(divide="ignore"):  # X = 0 is μ = ∞
        return (np.sqrt(num_projections / x) + JL_ROUNDING_SLACK) / noise_multiplier


def _chi2_from_mu(mu: np.ndarray, noise_multiplier: float, num_projections: int) -> np.ndarray:
    """The X of μ = (sqrt(r / X) + τ) / σ; +∞ at and below the support's bottom, τ / σ."""
    above = noise_multiplier * np.asarray(mu, dtype=float) - JL_ROUNDING_SLACK
    with np.errstate(divide="ignore"):
        return np.where(above > 0.0, num_projections / np.where(above > 0.0, above, 1.0) ** 2,
                        np.inf)


def jl_saturation_mu(epsilon_max: float, sampling_probability: float) -> float:
    """μ beyond which every profile value up to `epsilon_max` equals its μ → ∞ limit to 1e-19.

    For the remove direction, the q-component exceeds loss ε once μY + μ²/2 > A with
    A = log((e^ε - 1 + q) / q) ≤ ε + log(1/q); μ ≥ sqrt(2A) + 9 makes that certain up to Φ(-9).
    """
    a = max(epsilon_max, 0.0) + math.log(1.0 / sampling_probability) + 1.0
    return math.sqrt(2.0 * a) + _Z_TAIL + 1.0


@functools.lru_cache(maxsize=64)
def jl_mu_law(
    noise_multiplier: float,
    num_projections: int,
    mu_saturation: float,
    num_quantile_panels: int = 20,
    mu_step: float = 1.0,
    mu_step_far: float = 2.0,
    mu_split: Optional[float] = None,
) -> MuLaw:
    """Quadrature panels for μ = (sqrt(r / X) + τ) / σ with X ~ χ²_r (Bu et al. 2021, Thm. 4.1;
    τ = ``JL_ROUNDING_SLACK``).

    Panel breakpoints are the union of (a) quantiles of μ at normal scores in [-9, 9], which
    resolve the density of μ (it is very narrow for large r), and (b) a grid of step `mu_step` in
    μ up to 20 and `mu_step_far` beyond, which resolves the transitions of the per-μ profile in
    μ: at level ε it jumps around μ = sqrt(2A) over a width O(1) in μ whatever the level, so
    the panels must stay O(1) wide far out too (a geometric grid there left a 2% quadrature error
    estimate at ε ~ 10^6 for r = 2). Only the panels near the transition are evaluated at each
    level (`step_profile`). Panels stop at `mu_saturation`, beyond which the per-μ profile is
    replaced by its μ → ∞ limit (an upper bound, since the subsampled Gaussian profile grows
    with μ).

    Args:
      noise_multiplier: σ.
      num_projections: r ≥ 1.
      mu_saturation: μ above which the mechanism is treated as the μ → ∞ limit.
      num_quantile_panels: panels from the quantile grid.
      mu_step: μ-grid step below 20.
      mu_step_far: μ-grid step above 20.
      mu_split: an extra panel breakpoint (so that the law can be split there).

    Returns:
      The discretised law.
    """
    chi2 = stats.chi2(num_projections)
    # μ decreases in X: the μ-quantile u corresponds to the X-quantile 1 - u.
    z = np.linspace(-_Z_TAIL, _Z_TAIL, num_quantile_panels + 1)
    x_quantiles = chi2.isf(special.ndtr(z))  # increasing in z: small X (large μ) first
    mu_q = np.sort(_mu_from_chi2(x_quantiles, noise_multiplier, num_projections))
    mu_bottom = float(mu_q[0])
    mu_top = float(min(mu_q[-1], mu_saturation))
    uniform = np.arange(0.0, min(20.0, mu_top) + mu_step, mu_step)
    far = np.arange(20.0, max(mu_top, 20.0) + mu_step_far, mu_step_far)
    extra = [] if mu_split is None else [mu_split]
    breaks = np.concatenate([mu_q, uniform, far, [mu_bottom, mu_top], extra])
    breaks = np.unique(breaks[(breaks >= mu_bottom) & (breaks <= mu_top)])

    # Probability of each panel, from the χ² cdf (accurate in both tails).
    x_breaks = _chi2_from_mu(breaks, noise_multiplier, num_projections)
    cdf_mu = chi2.sf(x_breaks)  # P(μ ≤ b) = P(X ≥ x(b))
    panel_mass = np.diff(cdf_mu)
    keep = panel_mass > 1e-22  # empty panels cost time only
    lo, hi = breaks[:-1][keep], breaks[1:][keep]
    dropped = float(panel_mass[~keep].sum())

    half = 0.5 * (hi - lo)
    mid = 0.5 * (hi + lo)
    nodes = (mid[:, None] + half[:, None] * _GK15_NODES[None, :]).ravel()
    x_nodes = _chi2_from_mu(nodes, noise_multiplier, num_projections)
    # density of μ: f_X(x(μ)) |dx/dμ| with x = r / (σμ - τ)², |dx/dμ| = 2xσ / (σμ - τ)
    log_density = chi2.logpdf(x_nodes) + np.log(
        2.0 * x_nodes * noise_multiplier / (noise_multiplier * nodes - JL_ROUNDING_SLACK))
    density = np.exp(log_density)
    kronrod = (half[:, None] * _GK15_WEIGHTS[None, :]).ravel() * density
    gauss = (half[:, None] * _G7_WEIGHTS[None, :]).ravel() * density
    mass_below = float(cdf_mu[0])
    # Dropped empty panels are moved to the top (largest μ): pessimistic.
    mass_above = (
        float(chi2.cdf(_chi2_from_mu(np.array([mu_top]), noise_multiplier, num_projections))[0])
        + dropped
    )
    return MuLaw(nodes, kronrod, gauss, mu_bottom, mu_top, mass_below, mass_above)


@functools.lru_cache(maxsize=64)
def split_jl_mu_law(
    noise_multiplier: float, num_projections: int, mu_saturation: float, mu_split: float
) -> Optional[Tuple[float, MuLaw, MuLaw]]:
    """The JL law of μ split at `mu_split`: (P(μ > mu_split), law given μ ≤ it, law given μ > it).

    One JL step is the mixture, with μ revealed, of its two conditional mechanisms, so its PLD is
    the same mixture of theirs. Returns None when the split point is outside the panels.
    """
    law = jl_mu_law(noise_multiplier, num_projections, mu_saturation, mu_split=mu_split)
    if not law.mu_bottom < mu_split < law.mu_top:
        return None
    x = _chi2_from_mu(np.array([mu_split]), noise_multiplier, num_projections)
    chi2 = stats.chi2(num_projections)
    p_tail = float(chi2.cdf(x)[0])  # P(μ > mu_split) = P(X < x(mu_split))
    p_bulk = float(chi2.sf(x)[0])
    if p_tail <= 0.0 or p_bulk <= 0.0:
        return None
    below = law.nodes < mu_split
    bulk = MuLaw(
        law.nodes[below],
        law.kronrod_weights[below] / p_bulk,
        law.gauss_weights[below] / p_bulk,
        law.mu_bottom,
        mu_split,
        law.mass_below / p_bulk,
        0.0,
    )
    tail = MuLaw(
        law.nodes[~below],
        law.kronrod_weights[~below] / p_tail,
        law.gauss_weights[~below] / p_tail,
        mu_split,
        law.mu_top,
        0.0,
        min(law.mass_above / p_tail, 1.0),
    )
    return p_tail, bulk, tail


def _log_excess_remove(epsilon: float, q: float) -> float:
    """A = log((e^ε - (1 - q)) / q) for ε > log(1 - q)."""
    if q == 1.0:
        return epsilon
    return epsilon + math.log1p(-(1.0 - q) * math.exp(-epsilon)) - math.log(q)


def _log_excess(eps: np.ndarray, q: float, direction: str) -> Tuple[np.ndarray, np.ndarray]:
    """(inside, A): levels whose per-μ profile depends on μ, and the log-excess there.

    remove: A = log((e^ε - (1 - q)) / q), inside for ε > log(1 - q);
    add:    A = log((e^{-ε} - (1 - q)) / q), inside for ε < -log(1 - q).
    The per-μ loss crosses the level at the output y* = A/μ + μ/2 (`_threshold`).
    """
    sign = 1.0 if direction == "remove" else -1.0
    e = sign * eps
    inside = e > (math.log1p(-q) if q < 1 else -math.inf)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        safe = np.where(inside, e, 0.0)
        excess = np.where(inside, safe + np.log1p(-(1.0 - q) * np.exp(-safe)) - math.log(q), 0.0)
    return inside, excess


def _threshold(log_excess: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """y* = A/μ + μ/2, the output at which the per-μ privacy loss crosses the level."""
    return log_excess / mu + 0.5 * mu


def remove_profile(
    mu: np.ndarray, epsilons: np.ndarray, sampling_probability: float
) -> Tuple[np.ndarray, np.ndarray]:
    """δ(ε) and σ(ε) = e^ε Q(L > ε) for P = (1-q)N(0,1) + qN(μ,1) vs Q = N(0,1).

    Args:
      mu: array of μ > 0 (broadcast against `epsilons`); μ = inf gives the limit.
      epsilons: privacy-loss levels.
      sampling_probability: q in (0, 1].

    Returns:
      (delta, weighted_q_tail), broadcast shape.
    """
    q = sampling_probability
    mu, eps = np.broadcast_arrays(np.asarray(mu, float), np.asarray(epsilons, float))
    log1mq = math.log1p(-q) if q < 1 else -math.inf
    inside = eps > log1mq
    # A = log((e^ε - (1 - q)) / q), evaluated stably.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_excess = np.where(
            inside,
            eps + np.log1p(-(1.0 - q) * np.exp(-np.where(inside, eps, 0.0))) - math.log(q),
            0.0,
        )
        finite_mu = np.isfinite(mu)
        mu_safe = np.where(finite_mu, mu, 1.0)
        y = _threshold(log_excess, mu_safe)
        log_q_tail = special.log_ndtr(-y)  # log Φ̄(y*)
        p_tail_q_part = special.ndtr(mu_safe - y)  # Φ̄(y* - μ)
        delta = q * (p_tail_q_part - np.exp(log_excess + log_q_tail))
        weighted = np.exp(eps + log_q_tail)
        # μ = ∞: the q-component has infinite loss, the rest has loss log(1 - q).
        delta = np.where(finite_mu, delta, q)
        weighted = np.where(finite_mu, weighted, 0.0)
        delta = np.where(inside, np.maximum(delta, 0.0), -np.expm1(np.minimum(eps, 0.0)))
        weighted = np.where(inside, weighted, np.exp(eps))
    return delta, weighted


def add_profile(
    mu: np.ndarray, epsilons: np.ndarray, sampling_probability: float
) -> Tuple[np.ndarray, np.ndarray]:
    """δ(ε) and σ(ε) = e^ε Q(L > ε) for P = N(0,1) vs Q = (1-q)N(0,1) + qN(μ,1).

    The privacy loss -log(1 - q + q e^{μy - μ²/2}) is decreasing in y and bounded by -log(1 - q).
    """
    q = sampling_probability
    mu, eps = np.broadcast_arrays(np.asarray(mu, float), np.asarray(epsilons, float))
    top = -math.log1p(-q) if q < 1 else math.inf
    inside = eps < top
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.where(inside, eps, 0.0)
        # B = log((e^{-ε} - (1 - q)) / q)
        log_excess = -e + np.log1p(-(1.0 - q) * np.exp(e)) - math.log(q)
        finite_mu = np.isfinite(mu)
        mu_safe = np.where(finite_mu, mu, 1.0)
        y = _threshold(log_excess, mu_safe)
        cdf_y = special.ndtr(y)
        cdf_y_shift = special.ndtr(y - mu_safe)
        # δ = (1 - (1-q)e^ε) Φ(y*) - q e^ε Φ(y* - μ); the first factor is q e^{ε + B} > 0.
        delta = (
            -np.expm1(e + math.log1p(-q)) * cdf_y - q * np.exp(e) * cdf_y_shift
            if q < 1
            else (cdf_y - np.exp(e) * cdf_y_shift)
        )
        weighted = np.exp(e) * ((1.0 - q) * cdf_y + q * cdf_y_shift)
        # μ = ∞: all of P sits at loss -log(1 - q); a (1 - q) share of Q sits there too.
        delta_inf = np.maximum(-np.expm1(e + (math.log1p(-q) if q < 1 else -math.inf)), 0.0)
        weighted_inf = (1.0 - q) * np.exp(e)
        delta = np.where(finite_mu, delta, delta_inf)
        weighted = np.where(finite_mu, weighted, weighted_inf)
        delta = np.where(inside, np.maximum(delta, 0.0), 0.0)
        weighted = np.where(inside, weighted, 0.0)
    return delta, weighted


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Privacy profile of one step at a set of loss levels, with two-sided numerical bounds.

    Attributes:
      epsilons: loss levels (ascending).
      delta_upper: upper bound on δ(ε) (quadrature value + error estimate + pessimistic tails).
      delta_lower: lower bound on δ(ε).
      weighted_q_tail: e^ε Q(L > ε), used for the tangent (optimistic) discretisation.
    """

    epsilons: np.ndarray
    delta_upper: np.ndarray
    delta_lower: np.ndarray
    weighted_q_tail: np.ndarray


def step_profile(
    law: MuLaw,
    epsilons: np.ndarray,
    sampling_probability: float,
    direction: str,
) -> StepProfile:
    """Privacy profile of one step whose μ follows `law`, in the given direction.

    δ_mix(ε) = E_μ[δ_μ(ε)] (μ revealed: the privacy loss distribution of the pair is the μ-mixture
    of the per-μ ones). Mass above `law.mu_top` uses the μ → ∞ limit (upper bound) or μ_top
    (lower bound); mass below `law.mu_bottom` uses μ_bottom (upper) or μ = 0, i.e. δ = (1-e^ε)_+
    (lower; every pair has δ(ε) ≥ 1 - e^ε).

    Args:
      law: discretised law of μ.
      epsilons: loss levels, 1-D.
      sampling_probability: q.
      direction: "remove" or "add".

    Returns:
      A `StepProfile`.
    """
    profile_fn = {"remove": remove_profile, "add": add_profile}[direction]
    q = sampling_probability
    eps = np.asarray(epsilons, float)
    if law.is_point_mass:
        d, w = profile_fn(law.nodes[0], eps, q)
        return StepProfile(eps, d, d.copy(), w)

    # Per level, only μ with |A/μ ± μ/2| ≤ 9 see a non-saturated profile, i.e. μ within 9 of
    # sqrt(81 + 2|A|) (A: the log-excess of `_log_excess`). Below that range the per-μ profile
    # equals its μ = 0 value, above it its μ = ∞ value: each Φ term is within Φ(-9) of 0 or 1,
    # and the e^A-weighted one is bounded through the Mills ratio (e^A φ(y*) = φ(y* - μ)), so
    # δ and e^ε Q(L > ε) are off by at most 2 Φ(-9) / (1 - q) (coefficients ≤ e^ε < 1/(1 - q)
    # inside the add direction). That bound goes into the error margin. Levels are taken in
    # chunks that share one node range.
    inside, excess = _log_excess(eps, q, direction)
    d_zero = np.maximum(-np.expm1(np.minimum(eps, 0.0)), 0.0)
    with np.errstate(over="ignore"):
        w_zero = np.where(eps < 0, np.exp(np.minimum(eps, 0.0)), 0.0)
    d_inf, w_inf = profile_fn(np.inf, eps, q)
    saturation = 2.0 * _PHI_MINUS_Z_TAIL / (1.0 - q if q < 1 else 1.0)
    kron = np.zeros_like(eps)
    gauss = np.zeros_like(eps)
    weighted = np.zeros_like(eps)
    pruned = np.zeros_like(eps)
    cum_kron = np.concatenate([[0.0], np.cumsum(law.kronrod_weights)])
    cum_gauss = np.concatenate([[0.0], np.cumsum(law.gauss_weights)])
    start = 0
    while start < eps.size:
        # Up to 64 levels; fewer where their μ windows spread (sparse far levels).
        levels = 64
        while True:
            stop = min(eps.size, start + levels)
            sl = slice(start, stop)
            a = np.abs(excess[sl][inside[sl]])
            if a.size == 0:  # no level depends on μ: every node gives the closed form
                first = last = 0
                break
            mu_lo = math.sqrt(_Z_TAIL**2 + 2.0 * float(a.min())) - _Z_TAIL
            mu_hi = math.sqrt(_Z_TAIL**2 + 2.0 * float(a.max())) + _Z_TAIL
            if mu_hi - mu_lo <= 4.0 * _Z_TAIL or levels == 1:
                first = int(np.searchsorted(law.nodes, mu_lo))
                last = max(first, int(np.searchsorted(law.nodes, mu_hi, side="right")))
                break
            levels //= 2
        d, w = profile_fn(law.nodes[first:last, None], eps[None, sl], q)
        below_k, above_k = cum_kron[first], cum_kron[-1] - cum_kron[last]
        below_g, above_g = cum_gauss[first], cum_gauss[-1] - cum_gauss[last]
        kron[sl] = law.kronrod_weights[first:last] @ d + below_k * d_zero[sl] + above_k * d_inf[sl]
        gauss[sl] = law.gauss_weights[first:last] @ d + below_g * d_zero[sl] + above_g * d_inf[sl]
        weighted[sl] = (
            law.kronrod_weights[first:last] @ w + below_k * w_zero[sl] + above_k * w_inf[sl]
        )
        pruned[sl] = np.where(inside[sl], (below_k + above_k) * saturation, 0.0)
        start = stop
    error = np.abs(kron - gauss) + pruned

    d_top, w_top = profile_fn(law.mu_top, eps, q)
    d_bottom, w_bottom = profile_fn(law.mu_bottom, eps, q)
    upper = kron + error + law.mass_above * d_inf + law.mass_below * d_bottom
    lower = np.maximum(kron - error, 0.0) + law.mass_above * d_top + law.mass_below * d_zero
    weighted = weighted + law.mass_above * w_top + law.mass_below * w_bottom
    return StepProfile(eps, np.minimum(upper, 1.0), np.minimum(lower, upper), weighted)


def loss_support(
    law: MuLaw, sampling_probability: float, direction: str
) -> Tuple[float, Optional[float]]:
    """Range [lowest, highest] of loss levels carrying all but ~Φ(-9) of the P-mass.

    Returns (lowest, highest); highest is None when the loss is unbounded above.
    """
    q = sampling_probability
    # Nodes of negligible probability only lift (pessimistically) mass below the range.
    heavy = law.kronrod_weights > 1e-20
    mus = np.concatenate([law.nodes[heavy], [law.mu_bottom]])
    if law.mass_above > 1e-20:
        mus = np.concatenate([mus, [law.mu_top]])
    if direction == "remove":
        if q < 1:
            return math.log1p(-q), None
        # q = 1: L = μZ + μ²/2 under P.
        return float(np.min(0.5 * mus**2 - _Z_TAIL * mus)), None
    # add: L = -log(1 - q + q exp(μ y - μ²/2)), lowest at y = +9 under P = N(0, 1).
    expo = _Z_TAIL * mus - 0.5 * mus**2
    lowest = -np.logaddexp(math.log1p(-q), math.log(q) + expo) if q < 1 else -expo
    return float(np.min(lowest)), (-math.log1p(-q) if q < 1 else None)
