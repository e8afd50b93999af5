"""Discretised privacy loss distributions (PLDs): construction, FFT composition, queries.

A `LatticePld` is a distribution of the privacy loss L under P on the lattice {kΔ}, plus a mass
at +∞. The hockey-stick divergence of the pair it represents is

    δ(ε) = P(L = ∞) + Σ_{ℓ > ε} p_ℓ (1 - e^{ε - ℓ})                      (1)

(Koskela, Jälkö, Honkela 2020; Meiser, Mohammadi 2018). Composition of mechanisms adds
independent losses, i.e. convolves the PMFs, which is done by FFT.

Every PLD here is either *pessimistic* (its δ(ε) upper-bounds the true one for every ε) or
*optimistic* (lower-bounds it). The two are carried side by side so that each answer comes
with its numerical error: the true value lies between them.

* Pessimistic one-step PMF: "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi
  2022, Algorithm 1): exact δ values at support points ε_j, interpolated linearly in e^ε. Since δ
  is convex in e^ε, the chords lie above it, and the PMF is a dominating pair.
* Optimistic one-step PMF: the same construction with values taken from tangent lines,
  v_j = δ(ε_{j+1}) + e^{ε_{j+1}} Q(L > ε_{j+1}) (1 - e^{-(ε_{j+1} - ε_j)}), i.e. the tangent at
  ε_{j+1} read at ε_j. Each chord then lies under a tangent, hence under δ: a dominated pair.
* Truncation keeps the direction: pessimistic PMFs send mass above a cap to +∞ and lift mass below
  a floor to the floor; optimistic ones lower mass above the cap to the cap and drop mass below
  the floor (stochastically smaller losses can only lower (1)).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple, Union

import numpy as np
from scipy import fft, signal, special

# Mass of the composed distribution allowed outside the FFT window (added to +∞ when
# pessimistic), as in dp-accounting's self_convolve.
TAIL_MASS_TRUNCATION = 1e-15


@dataclasses.dataclass(frozen=True)
class LatticePld:
    """PMF of the privacy loss on the lattice {kΔ : k = offset, ..., offset + len(probs) - 1}.

    Attributes:
      discretization: lattice step Δ > 0.
      offset: lattice index of probs[0].
      probs: probability masses (non-negative).
      infinity_mass: P(L = +∞).
      pessimistic: whether this PMF upper-bounds (True) or lower-bounds (False) δ(ε).
      roundoff: an estimate of the absolute error of δ(ε) read from `probs` that the FFT
        round-off of the compositions behind it leaves (per entry the largest negative output
        entry, pure round-off, or the FFT's error scale 2^-52 log2(n) max if larger, times the
        window, summed over compositions: `_clipped`): the clipped noise is
        otherwise read as mass (session 22 audit: at δ = 1e-12 the reported ε was 0.8 below
        the exact one). δ queries add it to a pessimistic PMF's δ and subtract it from an
        optimistic one's (an estimate, not a proof); 0 for PMFs built without FFT.
    """

    discretization: float
    offset: int
    probs: np.ndarray
    infinity_mass: float
    pessimistic: bool
    roundoff: float = 0.0

    @property
    def size(self) -> int:
        return int(self.probs.size)

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(self.size)) * self.discretization


def ctd_masses(epsilons: np.ndarray, values: np.ndarray, value_at_zero: float, value_at_inf: float):
    """Masses of the PLD whose δ, as a function of x = e^ε, interpolates given values linearly.

    The function is f(x) = p_∞ + Σ_j p_j (1 - x e^{-ε_j})_+, piecewise linear in x with kinks at
    x_j = e^{ε_j}; f(0) = `value_at_zero`, f(x_j) = values[j], f = `value_at_inf` = p_∞ beyond the
    last point. Its slope jumps by p_j e^{-ε_j} at x_j, which gives (Doroshenko et al. 2022, eq. for
    Algorithm 1)

        p_j = (v_{j+1} - v_j) / expm1(d_j) + (v_j - v_{j-1}) / expm1(-d_{j-1}),  d_j = ε_{j+1} - ε_j,

    with d_{-1} = d_n = ∞. Negative masses (non-convex input) are returned as they are.

    Args:
      epsilons: support points, strictly increasing.
      values: f at the support points.
      value_at_zero: f(0), the total finite-plus-infinite P-mass.
      value_at_inf: f beyond the last support point (the mass at +∞).

    Returns:
      Array of masses p_j.
    """
    v = np.concatenate([[value_at_zero], values, [value_at_inf]])
    gaps = np.diff(epsilons)
    right = np.empty(values.size)
    left = np.empty(values.size)
    # (v_{j+1} - v_j) / expm1(d_j); for the last point d = ∞ gives 0... unless v_{n+1} != v_n
    with np.errstate(over="ignore"):
        right[:-1] = (v[2:-1] - v[1:-2]) / np.expm1(gaps)
    right[-1] = 0.0 if value_at_inf == values[-1] else (value_at_inf - values[-1]) / math.inf
    left[0] = -(v[1] - v[0])  # (v_1 - v_0) / expm1(-∞)
    left[1:] = (v[2:-1] - v[1:-2]) / np.expm1(-gaps)
    return right + left


def _convex_chain(epsilons: np.ndarray, values: np.ndarray, value_at_zero: float) -> np.ndarray:
    """Lower convex hull (in x = e^ε) of the points, as values re-interpolated at every ε.

    Monotone chain: a point is dropped when its connect-the-dots mass with respect to its hull
    neighbours would be negative. The dropped points take the value of the hull chord, which is
    below the original value. Works in ε directly (no overflow for large ε).
    """
    stack = [-1]  # -1 stands for x = 0 (ε = -∞)

    def expm1(x: float) -> float:
        return math.expm1(x) if x < 700.0 else math.inf

    def mass(a: int, b: int, c: int) -> float:
        vb = values[b]
        va = value_at_zero if a < 0 else values[a]
        left = -(vb - va) if a < 0 else (vb - va) / expm1(epsilons[a] - epsilons[b])
        return (values[c] - vb) / expm1(epsilons[c] - epsilons[b]) + left

    for c in range(values.size):
        while len(stack) >= 2 and mass(stack[-2], stack[-1], c) < 0:
            stack.pop()
        stack.append(c)
    hull = np.array(stack[1:])
    out = values.copy()
    for a, c in zip(hull[:-1], hull[1:]):
        if c - a > 1:
            mid = np.arange(a + 1, c)
            lam = np.exp(
                np.log(-np.expm1(epsilons[a] - epsilons[mid])) + epsilons[mid] - epsilons[c]
            ) / -math.expm1(epsilons[a] - epsilons[c])
            out[mid] = (1.0 - lam) * values[a] + lam * values[c]
    if hull.size and hull[0] > 0:
        mid = np.arange(0, hull[0])
        lam = np.exp(epsilons[mid] - epsilons[hull[0]])
        out[mid] = (1.0 - lam) * value_at_zero + lam * values[hull[0]]
    return np.minimum(out, values)


def _chain_masses(eps: np.ndarray, v: np.ndarray, at_zero: float) -> np.ndarray:
    """Connect-the-dots masses of the points (eps, v) themselves, the last point excluded.

    Same formula as `ctd_masses`, with the first point's left neighbour at x = 0 (value at_zero).
    """
    gaps = np.diff(eps)
    with np.errstate(over="ignore"):
        right = (v[1:] - v[:-1]) / np.expm1(np.minimum(gaps, 700.0))
    left = np.empty(v.size - 1)
    left[0] = -(v[0] - at_zero)
    left[1:] = (v[1:-1] - v[:-2]) / np.expm1(-gaps[:-1])
    return right + left


def _lower_convex_values(
    epsilons: np.ndarray, values: np.ndarray, value_at_zero: float, max_passes: int = 200
) -> np.ndarray:
    """Values of the lower convex hull (in x = e^ε) of the points, at every ε.

    A point whose connect-the-dots mass with respect to its current neighbours is negative lies
    above the chord of two other points, so it is not a hull vertex: each pass drops all such
    points at once (vectorised), and the next pass looks at the new neighbours. What remains is
    convex, hence the hull; dropped points take the chord's value, below their own (the
    optimistic direction). Masses above -1e-18 are left for the caller to clip. The last point
    (value 0, the end of the support) and x = 0 (value `value_at_zero`) always stay.
    """
    eps = np.asarray(epsilons, dtype=float)
    v = np.asarray(values, dtype=float)
    keep = np.arange(v.size)
    if v.size > 2 and v[-1] == 0.0:
        # The hull's last edge runs from the end point (x_n, 0) to the point of least steep chord
        # v_j / (x_n - x_j); everything in between lies above it. Found directly, because the
        # passes would peel those points one at a time.
        with np.errstate(divide="ignore"):
            steepness = v[:-1] / -np.expm1(eps[:-1] - eps[-1])
        j = int(np.argmin(steepness))
        keep = np.concatenate([keep[: j + 1], keep[-1:]])
    if keep.size > 2:
        # Likewise the first edge, from (0, value_at_zero) to the point of steepest chord. Far
        # below 0 the values round to value_at_zero and would also be peeled one by one.
        with np.errstate(over="ignore"):
            slope = (v[keep[:-1]] - value_at_zero) * np.exp(-np.maximum(eps[keep[:-1]], -700.0))
        j = int(np.argmin(slope))
        keep = keep[j:]
    for _ in range(max_passes):
        p = _chain_masses(eps[keep], v[keep], value_at_zero)
        bad = p < -1e-18
        if not bad.any():
            break
        keep = keep[np.concatenate([~bad, [True]])]
    else:
        return _convex_chain(eps, v, value_at_zero)
    if keep.size == v.size:
        return v
    out = v.copy()
    dropped = np.setdiff1d(np.arange(v.size), keep, assume_unique=True)
    pos = np.searchsorted(keep, dropped)  # keep[pos] is the hull vertex right of each
    right = keep[pos]
    e_r, v_r = eps[right], v[right]
    first = pos == 0
    left = keep[np.maximum(pos - 1, 0)]
    e_l = eps[left]
    v_l = np.where(first, value_at_zero, v[left])
    e = eps[dropped]
    # λ = (x - x_l) / (x_r - x_l) with x = e^ε, without overflow; x_l = 0 before the first vertex.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lam = np.exp(e - e_r) * np.expm1(e_l - e) / np.expm1(e_l - e_r)
    lam = np.where(first, np.exp(e - e_r), lam)
    out[dropped] = np.minimum((1.0 - lam) * v_l + lam * v_r, v[dropped])
    return out


def _dense(k: np.ndarray, masses: np.ndarray) -> np.ndarray:
    probs = np.zeros(int(k[-1] - k[0]) + 1)
    np.add.at(probs, k - k[0], masses)
    return probs


def pessimistic_pld(
    lattice_index: np.ndarray, discretization: float, delta: np.ndarray
) -> LatticePld:
    """Connect-the-dots PLD (an upper bound) from δ upper bounds at lattice points.

    Args:
      lattice_index: strictly increasing integers k_j; support points ε_j = k_j Δ.
      discretization: Δ.
      delta: upper bounds on δ(ε_j). The last one becomes the mass at +∞ (Doroshenko et al. 2022).

    Returns:
      The lattice PLD, stored densely from k_0 to k_n.
    """
    k = np.asarray(lattice_index, dtype=np.int64)
    eps = k * discretization
    # A non-increasing envelope of upper bounds is still an upper bound.
    delta = np.minimum(np.maximum.accumulate(np.asarray(delta)[::-1])[::-1], 1.0)
    masses = np.maximum(ctd_masses(eps, delta, 1.0, float(delta[-1])), 0.0)  # clipping adds mass
    return LatticePld(discretization, int(k[0]), _dense(k, masses), float(delta[-1]), True)


def _keep_mass_at_the_bottom(
    eps: np.ndarray,
    delta: np.ndarray,
    weighted: np.ndarray,
    at_left: np.ndarray,
    at_right: np.ndarray,
    left_tangent_usable: np.ndarray,
) -> Tuple[np.ndarray, np.ndarray]:
    """Per cell, the left-end tangent instead of the chosen line where that costs less mean loss.

    Near the bottom of the support a left-end value below the line δ follows under the support,
    t_0(x) = δ(x_0) - Q(L > ε_0)(x - x_0), leaves the hull of (0, 1) through a steeper first
    edge: a Q-mass above Q(L > ε_0), the lost δ spread over all ε below the support. As
    E_P[L] = ∫ (δ(ε) - (1 - e^ε)_+) dε, a shortfall s below t_0 at x_a lowers the mean loss of
    the step by about s·x_0/x_a: first order, where a shortfall inside the support costs about s
    times the cell width. The left-end tangent never falls below t_0 (it supports δ ≥ t_0 with a
    slope -Q(L > ε_a) ≥ -Q(L > ε_0)), but it may fall short at the right end x_b, which can lower
    δ everywhere beyond: by a factor 1 - s_b/δ(x_b) at worst, a mean loss of s_b/δ(x_b) times
    ∫_{ε_b}^∞ δ. The cheaper of the two is kept. Where P-mass piles up at the lowest loss
    log(1 - q) of a subsampled step, the chosen lines left the mean loss per step 2e-5 short
    (σ = 0.6, q = 0.02, Δ = 1e-3; 2e-7 with the left-end tangent there), a lower bound on ε 0.2
    low after 10^4 steps. With a near point mass inside the cell (JL steps with μ > 8) the
    left-end tangent would drop the whole tail: there the chosen line stays.
    """
    gaps = np.diff(eps)
    rise = np.minimum(eps[:-1] - eps[0], 700.0)
    under_support = delta[0] - weighted[0] * np.expm1(rise)
    below_cost = np.maximum(under_support - at_left, 0.0) * np.exp(-rise)
    # ∫_{ε_b}^∞ δ(ε) dε at each right end (trapezoids; δ is 0 beyond the last point)
    cell_area = 0.5 * (delta[1:] + delta[:-1]) * gaps
    area_beyond = np.concatenate([np.cumsum(cell_area[::-1])[::-1][1:], [0.0]])
    with np.errstate(invalid="ignore", over="ignore"):
        tangent_right = delta[:-1] - weighted[:-1] * np.expm1(gaps)
        relative_drop = np.maximum(at_right - tangent_right, 0.0) / np.maximum(
            delta[1:], np.finfo(float).tiny
        )
        switch = left_tangent_usable & (below_cost > relative_drop * area_beyond)
    return np.where(switch, delta[:-1], at_left), np.where(switch, tangent_right, at_right)


def optimistic_pld(
    lattice_index: np.ndarray,
    discretization: float,
    delta: np.ndarray,
    weighted_q_tail: np.ndarray,
    midpoint_delta: np.ndarray,
    midpoint_weighted_q_tail: np.ndarray,
    total_mass: float = 1.0,
) -> LatticePld:
    """Tangent-line PLD (a lower bound) from δ lower bounds at lattice points and cell midpoints.

    On the cell [x_j, x_{j+1}] (x = e^ε) the interpolation follows, from below, the tangent of δ
    at the midpoint m_j = (ε_j + ε_{j+1}) / 2: t_j(x) = δ(m_j) - Q(L > m_j)(x - e^{m_j}). Vertex
    values are the smaller of the two adjacent cells' tangents, so every chord lies below a
    tangent, hence below the convex δ. The last vertex is 0 (no mass at +∞).

    Args:
      lattice_index: strictly increasing integers k_j.
      discretization: Δ.
      delta: lower bounds on δ(ε_j).
      weighted_q_tail: e^{ε_j} Q(L > ε_j).
      midpoint_delta: lower bounds on δ at the cell midpoints (length n - 1).
      midpoint_weighted_q_tail: e^{m} Q(L > m) at the midpoints.
      total_mass: P-mass of the distribution (below 1 for an optimistic PLD that dropped mass):
        δ at ε → -∞.

    Returns:
      The lattice PLD.
    """
    k = np.asarray(lattice_index, dtype=np.int64)
    eps = k * discretization
    gaps = np.diff(eps)
    half = 0.5 * gaps
    delta = np.asarray(delta, dtype=float)
    weighted = np.asarray(weighted_q_tail, dtype=float)
    with np.errstate(over="ignore", invalid="ignore"):
        # Three supporting lines per cell, each read at both ends: the tangent at the left end,
        # at the midpoint and at the right end. The midpoint one is best where δ is smooth on the
        # scale of a cell; the end ones where it bends sharply inside the cell (the kink of the
        # subsampled mechanism near ε = 0 on a coarse lattice) or where cells are wide.
        candidates = [
            (delta[:-1], delta[:-1] - weighted[:-1] * np.expm1(gaps)),
            (
                midpoint_delta + midpoint_weighted_q_tail * -np.expm1(-half),
                midpoint_delta - midpoint_weighted_q_tail * np.expm1(half),
            ),
            (delta[1:] + weighted[1:] * -np.expm1(-gaps), delta[1:]),
        ]
    # A line that is negative at an end is not usable (the chord to 0 could cross δ there); the
    # right-end tangent is never negative, so every cell has one. Per cell, keep the line whose
    # values at the two ends fall least short, relatively, of the best value each end can get.
    usable = [np.isfinite(l) & np.isfinite(r) & (r >= 0.0) for l, r in candidates]
    best_left = np.max([np.where(ok, l, 0.0) for ok, (l, _) in zip(usable, candidates)], axis=0)
    best_right = np.max([np.where(ok, r, 0.0) for ok, (_, r) in zip(usable, candidates)], axis=0)
    tiny = np.finfo(float).tiny
    at_left, at_right = candidates[2]
    shortfall = (
        1.0 - at_left / np.maximum(best_left, tiny) + 1.0 - at_right / np.maximum(best_right, tiny)
    )
    for ok, (left, right) in zip(usable[:2], candidates[:2]):
        with np.errstate(invalid="ignore", over="ignore"):
            short = 2.0 - left / np.maximum(best_left, tiny) - right / np.maximum(best_right, tiny)
        better = ok & (short < shortfall)
        at_left = np.where(better, left, at_left)
        at_right = np.where(better, right, at_right)
        shortfall = np.where(better, short, shortfall)
    at_left, at_right = _keep_mass_at_the_bottom(eps, delta, weighted, at_left, at_right, usable[0])
    v = delta.copy()
    v[:-1] = np.minimum(v[:-1], at_left)
    v[1:] = np.minimum(v[1:], at_right)
    v[-1] = 0.0
    v = np.maximum(v, 0.0)
    # ε_0 is at or below the smallest loss (up to ~1e-19 of P-mass), where δ is linear in e^ε:
    # the chord from (0, 1) to (x_0, v_0 ≤ δ(x_0)) lies below δ.
    at_zero = min(float(total_mass), 1.0)
    v = np.minimum(v, at_zero)
    v = _lower_convex_values(eps, v, at_zero)
    masses = np.maximum(ctd_masses(eps, v, at_zero, 0.0), 0.0)
    return LatticePld(discretization, int(k[0]), _dense(k, masses), 0.0, False)


def with_null_outcome(pld: LatticePld, weight: float) -> LatticePld:
    """PLD of the mechanism that, with probability `weight`, runs the one of `pld` and otherwise
    reveals nothing (loss 0 under both hypotheses). The chance is data-independent and known, so
    the PLD is the weighted mixture; the direction (pessimistic/optimistic) is kept."""
    lo = min(pld.offset, 0)
    hi = max(pld.offset + pld.size - 1, 0)
    probs = np.zeros(hi - lo + 1)
    probs[pld.offset - lo : pld.offset - lo + pld.size] = weight * pld.probs
    probs[-lo] += 1.0 - weight
    return LatticePld(pld.discretization, lo, probs, weight * pld.infinity_mass, pld.pessimistic,
                      pld.roundoff)


def truncate(pld: LatticePld, floor_index: Optional[int], cap_index: Optional[int]) -> LatticePld:
    """Restricts the support to [floor, cap] in the direction-preserving way (module doc)."""
    probs, offset, inf_mass = pld.probs, pld.offset, pld.infinity_mass
    if cap_index is not None and offset + probs.size - 1 > cap_index:
        keep = max(cap_index - offset + 1, 1)
        above = float(probs[keep:].sum())
        probs = probs[:keep].copy()
        if pld.pessimistic:
            inf_mass += above
        else:
            probs[-1] += above
    if floor_index is not None and offset < floor_index:
        cut = min(floor_index - offset, probs.size - 1)
        below = float(probs[:cut].sum())
        probs = probs[cut:].copy()
        offset += cut
        if pld.pessimistic:
            probs[0] += below
    return LatticePld(pld.discretization, offset, probs, min(inf_mass, 1.0), pld.pessimistic,
                      pld.roundoff)


def _clipped(out: np.ndarray) -> Tuple[np.ndarray, float]:
    """FFT output with its round-off clipped at 0, and the δ error that round-off may leave:
    per entry the larger of the largest negative entry (pure round-off) and the FFT's own
    error scale, 2^-52 log2(n) times the largest entry, times the number of entries n.

    The floor is needed where no entry came out negative: at σ = 0.7, 144 Gaussian steps and
    δ = 1e-12 the smallest entry was +3.5e-20, the estimate 0, and ε 266.69050 was reported
    (converged) for an exact 266.69246 (session 23 audit). The floor there is ~8e-20 per
    entry, ~8e-15 in δ, and the same pass in long double gives 266.6952."""
    if not out.size:
        return out, 0.0
    largest = float(np.max(np.abs(out)))
    noise = max(float(-min(np.min(out), 0.0)),
                2.0 ** -52 * math.log2(max(out.size, 2)) * largest)
    if not math.isfinite(noise):
        noise = math.inf
    return np.maximum(out, 0.0), noise * out.size


def _convolve(a: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray, float]:
    return _clipped(signal.fftconvolve(a, b))


def compose(
    first: LatticePld,
    second: LatticePld,
    floor_index: Optional[int] = None,
    cap_index: Optional[int] = None,
) -> LatticePld:
    """PLD of the composition (sum of independent losses), truncated to [floor, cap]."""
    if first.discretization != second.discretization or first.pessimistic != second.pessimistic:
        raise ValueError("PLDs to compose must share `discretization` and `pessimistic`.")
    probs, roundoff = _convolve(first.probs, second.probs)
    inf_mass = 1.0 - (1.0 - first.infinity_mass) * (1.0 - second.infinity_mass)
    out = LatticePld(
        first.discretization, first.offset + second.offset, probs, inf_mass, first.pessimistic,
        first.roundoff + second.roundoff + roundoff,
    )
    return truncate(out, floor_index, cap_index)


def chernoff_window(probs: np.ndarray, num_times: int, tail_mass: float) -> Tuple[int, int]:
    """Index window [lo, hi] holding all but `tail_mass` of the num_times-fold convolution.

    Chernoff bound at a few orders, as in dp-accounting's compute_self_convolve_bounds: for t > 0,
    P(S ≥ b) ≤ exp(n log M(t) - t b); indices relative to num_times * (first index).
    """
    n = probs.size
    upper, lower = (n - 1) * num_times, 0
    support = np.nonzero(probs > 0)[0]
    if support.size == 0:
        return lower, upper
    idx = support.astype(float)
    log_p = np.log(probs[support])
    for order in np.concatenate([np.arange(-20, 0), np.arange(1, 21)]) / n:
        # log Σ p_i e^{t i}, shifted by its largest term (plain numpy: this runs 40 times).
        exponent = idx * order + log_p
        top = float(exponent.max())
        log_mgf = top + math.log(float(np.exp(exponent - top).sum()))
        bound = (num_times * log_mgf + math.log(2.0 / tail_mass)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        else:
            lower = max(lower, math.floor(bound))
    return lower, upper


def self_compose(
    pld: LatticePld,
    num_times: int,
    floor_index: Optional[int] = None,
    cap_index: Optional[int] = None,
    max_window: int = 1 << 22,
) -> LatticePld:
    """`num_times`-fold composition of a PLD with itself.

    Light tails: one FFT power over the Chernoff window (mass outside ≤ 1e-15 is aliased back into
    the window and, for pessimistic PMFs, also counted at +∞ — dp-accounting's approach).
    Heavy tails (window larger than `max_window`, e.g. the JL mechanism with few projections):
    binary exponentiation, truncating each product to [floor, cap].

    Args:
      pld: one-step PLD.
      num_times: n ≥ 1.
      floor_index: lattice floor for heavy-tailed composition (None: none).
      cap_index: lattice cap for heavy-tailed composition (None: none).
      max_window: largest FFT window for the one-shot power.

    Returns:
      The composed PLD.
    """
    if num_times == 1:
        return pld
    probs = pld.probs
    lo, hi = chernoff_window(probs, num_times, TAIL_MASS_TRUNCATION)
    if hi - lo + 1 <= max_window:
        out_len = hi - lo + 1
        fast_len = fft.next_fast_len(max(out_len, probs.size))
        spectrum = fft.rfft(probs, fast_len)
        with np.errstate(over="ignore", invalid="ignore"):
            conv = fft.irfft(spectrum**num_times, fast_len)
        conv, roundoff = _clipped(np.roll(conv, -lo)[:out_len])
        inf_mass = (
            -math.expm1(num_times * math.log1p(-pld.infinity_mass))
            if pld.infinity_mass < 1
            else 1.0
        )
        if pld.pessimistic:
            inf_mass += TAIL_MASS_TRUNCATION
        else:
            # The mass outside the window (at most TAIL_MASS_TRUNCATION) is aliased back
            # into it and may land in the upper tail: an optimistic δ may be that much too
            # high (at δ = 1e-12 it put the optimistic ε above the exact one: σ = 3, 27
            # steps, 13.28601 for 13.28555; session 23 audit).
            roundoff += TAIL_MASS_TRUNCATION
        out = LatticePld(
            pld.discretization,
            pld.offset * num_times + lo,
            conv,
            min(inf_mass, 1.0),
            pld.pessimistic,
            num_times * pld.roundoff + roundoff,
        )
        # Light tails: the window already holds all but 1e-15; no cap (it is for heavy tails).
        return truncate(out, floor_index, None)
    if floor_index is None:
        floor_index = pld.offset * num_times + lo  # Chernoff: the lower tail stays light
    if cap_index is None:
        raise ValueError(
            f"Composition window {hi - lo + 1} exceeds {max_window} and no cap was given."
        )
    result = None
    power = truncate(pld, floor_index, cap_index)
    n = num_times
    while n:
        if n & 1:
            result = power if result is None else compose(result, power, floor_index, cap_index)
        n >>= 1
        if n:
            power = compose(power, power, floor_index, cap_index)
    return result


def _tail_sums(pld: LatticePld) -> Tuple[np.ndarray, np.ndarray]:
    """U_k = Σ_{i ≥ k} p_i and W_k = Σ_{i ≥ k} p_i e^{ℓ_k - ℓ_i} (stable reverse recursions)."""
    rev = pld.probs[::-1]
    upper = np.cumsum(rev)[::-1]
    weighted = signal.lfilter([1.0], [1.0, -math.exp(-pld.discretization)], rev)[::-1]
    return upper, weighted


def delta_for_epsilon(pld: LatticePld, epsilons: Union[float, Sequence[float]]) -> np.ndarray:
    """Hockey-stick divergence (1) at each ε (vectorised, exact for the lattice PMF); for a
    PMF that is not finite, 1 if pessimistic and 0 if optimistic (the trivial bounds)."""
    eps = np.atleast_1d(np.asarray(epsilons, dtype=float))
    if not finite(pld):
        return np.full(eps.shape, 1.0 if pld.pessimistic else 0.0)
    # The FFT round-off estimate (see `roundoff`) widens each side outwards.
    slack = pld.roundoff if pld.pessimistic else -pld.roundoff
    upper, weighted = _tail_sums(pld)
    d = pld.discretization
    # first index k with ℓ_k > ε
    k = np.floor(eps / d).astype(np.float64) + 1 - pld.offset
    k = np.clip(k, 0, pld.size).astype(np.int64)
    out = np.full(eps.shape, pld.infinity_mass)
    inside = k < pld.size
    kk = k[inside]
    loss_k = (pld.offset + kk) * d
    out[inside] += upper[kk] - np.exp(eps[inside] - loss_k) * weighted[kk]
    return np.clip(out + slack, 0.0, 1.0)


def weighted_q_tail(pld: LatticePld, epsilons: np.ndarray) -> np.ndarray:
    """e^ε Q(L > ε) = Σ_{ℓ > ε} p_ℓ e^{ε - ℓ}: minus the slope of δ in x = e^ε, scaled by x."""
    eps = np.atleast_1d(np.asarray(epsilons, dtype=float))
    _, weighted = _tail_sums(pld)
    d = pld.discretization
    k = np.floor(eps / d + 1e-9).astype(np.float64) + 1 - pld.offset
    k = np.clip(k, 0, pld.size).astype(np.int64)
    out = np.zeros(eps.shape)
    inside = k < pld.size
    kk = k[inside]
    out[inside] = weighted[kk] * np.exp(eps[inside] - (pld.offset + kk) * d)
    return out


def coarsen(pld: LatticePld, factor: int) -> LatticePld:
    """The PLD moved to the lattice of step factor·Δ, in its own direction.

    The δ curve of a lattice PLD is known exactly everywhere (1). Pessimistic: connect-the-dots
    through its values at the coarse points (chords of a convex function lie above it).
    Optimistic: `optimistic_pld` from its values and slopes at the coarse points and midpoints
    (tangents lie below it). Either way the result bounds the input's δ in the input's
    direction, hence the true δ. Used after composing a block of steps on a fine lattice: the
    composed PLD is smooth on the coarse scale, so little is lost (two-level composition).
    """
    if factor == 1:
        return pld
    lo = math.floor(pld.offset / factor)
    hi = -((-(pld.offset + pld.size - 1)) // factor) + 1  # one coarse point past the support
    k = np.arange(lo, hi + 1)
    coarse = pld.discretization * factor
    eps = k * coarse
    if pld.pessimistic:
        delta = delta_for_epsilon(pld, eps)
        delta[-1] = pld.infinity_mass
        return dataclasses.replace(pessimistic_pld(k, coarse, delta), roundoff=pld.roundoff)
    mid = 0.5 * (eps[1:] + eps[:-1])
    out = optimistic_pld(
        k,
        coarse,
        delta_for_epsilon(pld, eps),
        weighted_q_tail(pld, eps),
        delta_for_epsilon(pld, mid),
        weighted_q_tail(pld, mid),
        total_mass=float(pld.probs.sum()),
    )
    return dataclasses.replace(out, roundoff=pld.roundoff)


def finite(pld: LatticePld) -> bool:
    """Whether the PMF is a finite array (an FFT power of a spectrum whose modulus exceeds 1,
    from masses that sum to slightly more than 1, overflows to inf and NaN at 10^8 steps)."""
    return bool(np.all(np.isfinite(pld.probs))) and math.isfinite(pld.infinity_mass) and (
        math.isfinite(pld.roundoff))


def epsilon_for_delta(pld: LatticePld, delta: float) -> float:
    """Smallest ε ≥ 0 with δ(ε) ≤ delta for the lattice PMF; +∞ if the mass at +∞ exceeds it.
    For a PMF that is not finite, +∞ if pessimistic and 0 if optimistic (the trivial bounds:
    NaN compared false everywhere and gave 0, session 22 audit)."""
    if not finite(pld):
        return math.inf if pld.pessimistic else 0.0
    if pld.pessimistic and pld.roundoff > 0:
        # The smallest ε at which δ plus the FFT round-off estimate is within `delta`.
        delta -= pld.roundoff
        if delta <= 0:
            return math.inf
    elif pld.roundoff > 0:  # optimistic: δ minus the estimate
        delta += pld.roundoff
    if pld.infinity_mass > delta:
        return math.inf
    upper, weighted = _tail_sums(pld)
    losses = pld.losses
    # On (ℓ_{k-1}, ℓ_k]: δ(ε) = inf + U_k - e^{ε - ℓ_k} W_k. At the lattice points,
    # δ(ℓ_j) = inf + U_{j+1} - e^{-Δ} W_{j+1} (and inf at the last point).
    at_points = np.full(pld.size, pld.infinity_mass)
    at_points[:-1] += upper[1:] - math.exp(-pld.discretization) * weighted[1:]
    below = np.nonzero(at_points <= delta)[0]
    k = int(below[0])
    if weighted[k] <= 0:
        return max(0.0, float(losses[k]))
    excess = pld.infinity_mass + upper[k] - delta
    if excess <= 0:
        return max(0.0, float(losses[k - 1])) if k > 0 else 0.0
    eps = losses[k] + math.log(excess / weighted[k])
    return max(0.0, float(min(eps, losses[k])))
