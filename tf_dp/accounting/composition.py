"""Numerical composition of heterogeneous DP-SGD / JL-DP-SGD phases with two-sided error bounds.

A phase is `count` identical steps of the (JL-)Poisson-subsampled Gaussian mechanism. For each
adjacency direction, the one-step PLD is discretised pessimistically and optimistically
(`pld.py`), self-composed `count` times by FFT, and the phases are convolved. The discretisation
interval Δ is refined until the two bounds agree to the requested tolerance.

Tails. The per-step PLD is cut at a loss level ε_hi chosen so that `count · δ_step(ε_hi)` is a
small fraction of the δ of interest; the mass beyond goes to +∞ (it is counted in δ). For the
JL mechanism with few projections the privacy loss has a power-law tail (Bu et al. 2021, Sec. 4)
and that ε_hi can be in the thousands or more. But mass sent to +∞ from a loss level c ≥ ε only
raises δ(ε) by e^{ε - c} times its Q-mass: going from loss ℓ > c to +∞ changes
(1 - e^{ε - ℓ - R})_+ by at most e^{ε - ℓ - R}, and E_P[e^{-R}] ≤ 1 for the rest R of the
composition. So once a first pass has given an upper bound ε_u, every loss above the horizon
c = ε_u + log((steps + 64) / (1e-4 δ)) can go to +∞ (pessimistic) or down to c (optimistic), at
a cost below 1e-4 δ: the lattice then spans [floor, c] instead of [floor, 2 ε_hi].

Two levels. A subsampled step's losses bend at the scale q near 0, and the optimistic
discretisation needs Δ below that scale (with Δ ≫ q it must push P-mass down by ~Δ per step, a
drift of thousands of Δ over a run). When the single-level composed lattice would be large (JL
tails up to the horizon), each phase is composed in blocks of `_BLOCK_STEPS` steps on the fine
lattice, each block PLD is moved to a coarser lattice (`pld.coarsen`, direction-preserving), and
the blocks are composed there: the block's loss distribution is smooth on the coarse scale.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tf_dp.accounting import mechanisms, pld

# Largest per-step loss level we discretise. Beyond it, losses count as +∞ (pessimistic).
MAX_LOSS = 1e9
# Largest composed lattice we are willing to build.
MAX_WINDOW = 1 << 22
# Relative growth of the sparse support points above the dense lattice part.
_GEOMETRIC_RATIO = 1.002
# Dense lattice points of one step around 0 (the rest is geometric). Beyond 1024 Δ the 0.2%
# geometric spacing is coarser than Δ; measured: ε moves by < 1e-5 relative, the one-step
# profile costs 20x fewer mixture evaluations for the JL mechanism.
_MAX_DENSE_POINTS = 1 << 11
# Steps composed on the fine lattice before moving a block to the coarse one.
_BLOCK_STEPS = 64
# A phase whose single-level composed lattice would exceed this many points uses two levels.
_MAX_FINE_POINTS = 1 << 19
# Points aimed at for the coarse lattice of two-level composition.
_COARSE_POINTS = 1 << 17
# Tail floors tried below the requested one (the first pass's cap must stay cheap).
_TIGHT_FLOOR_FACTOR = 1e-6


@dataclasses.dataclass(frozen=True)
class Phase:
    """`count` steps of the mechanism with these parameters (num_projections=None: exact)."""

    noise_multiplier: float
    sampling_probability: float
    num_projections: Optional[int]
    count: int


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A numerical result bracketed by an optimistic and a pessimistic computation.

    Attributes:
      lower: value from the optimistic PLD (the true value is not below it).
      upper: value from the pessimistic PLD (the true value is not above it).
      discretization: the lattice step Δ used.
      converged: whether upper - lower met the requested tolerance.
    """

    lower: float
    upper: float
    discretization: float
    converged: bool

    @property
    def error(self) -> float:
        return self.upper - self.lower


def directions(sampling_probability: float) -> Tuple[str, ...]:
    # Without subsampling the Gaussian pair is symmetric: one direction suffices.
    return ("remove",) if sampling_probability == 1.0 else ("remove", "add")


def _law(noise_multiplier: float, num_projections: Optional[int], mu_saturation: float):
    if num_projections is None:
        return mechanisms.gaussian_mu_law(noise_multiplier)
    return mechanisms.jl_mu_law(noise_multiplier, num_projections, mu_saturation)


@functools.lru_cache(maxsize=128)
def _probe(
    noise_multiplier: float, sampling_probability: float, num_projections: Optional[int]
) -> Tuple[np.ndarray, np.ndarray]:
    """Upper bounds of the one-step remove-direction δ on a geometric grid of loss levels."""
    eps = np.geomspace(1e-2, MAX_LOSS, 400)
    mu_sat = mechanisms.jl_saturation_mu(MAX_LOSS, sampling_probability)
    law = _law(noise_multiplier, num_projections, mu_sat)
    prof = mechanisms.step_profile(law, eps, sampling_probability, "remove")
    return eps, np.maximum.accumulate(prof.delta_upper[::-1])[::-1]


def tail_cap(phase: Phase, delta_floor: float) -> float:
    """Smallest probed loss level ε_hi with count · δ_step(ε_hi) ≤ delta_floor (≤ MAX_LOSS)."""
    eps, delta = _probe(phase.noise_multiplier, phase.sampling_probability, phase.num_projections)
    ok = np.nonzero(phase.count * delta <= delta_floor)[0]
    return float(eps[ok[0]]) if ok.size else MAX_LOSS


def horizon_margin(total_steps: int, delta: float) -> float:
    """Loss margin c - ε beyond which sending mass to +∞ costs < 1e-4 δ at ε (module doc)."""
    return math.log((total_steps + 64) / (1e-4 * delta))


def _phase_caps(phases: Sequence[Phase], delta_floor: float) -> Tuple[List[float], List[float]]:
    """Per-phase tail caps: (for the first pass, tight).

    The tight cap (floor 1e-6 × delta_floor) makes the mass at +∞ negligible; it is used from
    the start when it costs little (light tails: the Gaussian's grows like sqrt(log)), and
    otherwise only below the horizon found by the first pass.
    """
    first, tight = [], []
    for p in phases:
        loose = tail_cap(p, delta_floor / len(phases))
        strict = tail_cap(p, _TIGHT_FLOOR_FACTOR * delta_floor / len(phases))
        first.append(strict if strict <= 2.0 * loose + 4.0 else loose)
        tight.append(strict)
    return first, tight


def _support_indices(
    k_lo: int, k_hi: int, discretization: float, bulk: Tuple[float, float]
) -> np.ndarray:
    """Support points of one step's PMF.

    The dense lattice covers the bulk (levels between which all but ~1e-13 of the P-mass lies),
    clipped to [-D, D] with D = max(1, 2^16 Δ); outside it, lattice points with relative spacing
    0.2% (connect-the-dots stays pessimistic there, only slightly looser).
    """
    half = max(1.0, _MAX_DENSE_POINTS / 2 * discretization)
    d_lo = max(k_lo, math.floor(max(-half, bulk[0]) / discretization))
    d_hi = min(k_hi, math.ceil(min(half, bulk[1]) / discretization))
    parts = [np.arange(d_lo, max(d_hi, d_lo) + 1), np.array([k_lo, k_hi])]
    for sign, k_edge, k_end in ((1, d_hi, k_hi), (-1, d_lo, k_lo)):
        start = max(abs(k_edge) * discretization, 16 * discretization)
        end = abs(k_end) * discretization
        if sign * k_end > sign * k_edge and end > start:
            n = int(math.ceil(math.log(end / start) / math.log(_GEOMETRIC_RATIO)))
            levels = start * _GEOMETRIC_RATIO ** np.arange(1, n + 1) / discretization
            parts.append(sign * np.ceil(levels).astype(np.int64))
            # the gap between the dense edge and the first geometric level, densely
            parts.append(np.arange(min(k_edge, sign * 16), max(k_edge, sign * 16) + 1))
    k = np.unique(np.concatenate(parts).astype(np.int64))
    return k[(k >= k_lo) & (k <= k_hi)]


def _bulk(law, sampling_probability: float, direction: str, lowest: float, top: float):
    """Loss levels (a, b) with P(L ≤ a) and P(L > b) below ~1e-13, from a coarse probe."""
    grid = np.geomspace(1e-6, 100.0, 160)
    probe = np.concatenate([-grid[::-1], [0.0], grid])
    probe = probe[(probe >= lowest) & (probe <= top)]
    if probe.size == 0:
        return lowest, top
    prof = mechanisms.step_profile(law, probe, sampling_probability, direction)
    above = prof.delta_lower + prof.weighted_q_tail * np.exp(0.0)  # P(L > ε) = δ + e^ε Q(L > ε)
    low_ok = np.nonzero(1.0 - above <= 1e-13)[0]
    high_ok = np.nonzero(above <= 1e-13)[0]
    a = float(probe[low_ok[-1]]) if low_ok.size else lowest
    b = float(probe[high_ok[0]]) if high_ok.size else top
    return a, b


@functools.lru_cache(maxsize=64)
def step_plds(
    noise_multiplier: float,
    sampling_probability: float,
    num_projections: Optional[int],
    direction: str,
    discretization: float,
    eps_hi: float,
) -> Tuple[pld.LatticePld, pld.LatticePld]:
    """(pessimistic, optimistic) one-step lattice PLDs in one direction."""
    q = sampling_probability
    mu_sat = mechanisms.jl_saturation_mu(eps_hi, q)
    law = _law(noise_multiplier, num_projections, mu_sat)
    lowest, highest = mechanisms.loss_support(law, q, direction)
    top = eps_hi if highest is None else min(eps_hi, highest)
    k_lo = math.floor(lowest / discretization)
    k_hi = max(math.ceil(top / discretization), k_lo + 2)
    bulk = _bulk(law, q, direction, lowest, top)
    k = _support_indices(k_lo, k_hi, discretization, bulk)
    eps = k * discretization
    prof = mechanisms.step_profile(law, eps, q, direction)
    mid = mechanisms.step_profile(law, 0.5 * (eps[1:] + eps[:-1]), q, direction)
    upper = pld.pessimistic_pld(k, discretization, prof.delta_upper)
    lower = pld.optimistic_pld(
        k, discretization, prof.delta_lower, prof.weighted_q_tail, mid.delta_lower, mid.weighted_q_tail
    )
    return upper, lower


def _compose_steps(step: pld.LatticePld, count: int, factor: int, limit: float) -> pld.LatticePld:
    """`count`-fold composition of a one-step PLD, returned on the lattice factor·Δ.

    factor > 1: blocks of `_BLOCK_STEPS` steps on the fine lattice, coarsened, then composed on
    the coarse lattice (module doc). Products are truncated at the loss level `limit`.
    """
    fine_cap = math.ceil(limit / step.discretization)
    if factor == 1 or count < 2 * _BLOCK_STEPS:
        return pld.coarsen(pld.self_compose(step, count, cap_index=fine_cap), factor)
    coarse_cap = math.ceil(limit / (step.discretization * factor))
    blocks, rest = divmod(count, _BLOCK_STEPS)
    block = pld.coarsen(pld.self_compose(step, _BLOCK_STEPS, cap_index=fine_cap), factor)
    out = pld.self_compose(block, blocks, cap_index=coarse_cap)
    if rest:
        tail = pld.coarsen(pld.self_compose(step, rest, cap_index=fine_cap), factor)
        out = pld.compose(out, tail, cap_index=coarse_cap)
    return out


def _single_level_points(step: pld.LatticePld, count: int, limit: float) -> int:
    """Size of the `count`-fold composed lattice on the step's own lattice (Chernoff window,
    cut at `limit`)."""
    lo, hi = pld.chernoff_window(step.probs, count, pld.TAIL_MASS_TRUNCATION)
    top = min(step.offset * count + hi, math.ceil(limit / step.discretization))
    return max(1, top - (step.offset * count + lo) + 1)


def composed_plds(
    phases: Sequence[Phase],
    discretization: float,
    caps: Sequence[float],
    limit: Optional[float] = None,
) -> Dict[str, Tuple[pld.LatticePld, pld.LatticePld]]:
    """Composed (pessimistic, optimistic) PLDs of all phases, per direction.

    Args:
      phases: the phases.
      discretization: Δ of the one-step PLDs.
      caps: per-phase tail caps ε_hi (one-step losses above go to +∞).
      limit: loss horizon: composed and one-step losses above it go to +∞ (pessimistic) or
        down to it (optimistic). None: 2 ε_hi per phase (no horizon known yet).

    Returns:
      {direction: (pessimistic, optimistic)}, all on one lattice (Δ or a multiple of it).
    """
    all_dirs = sorted({d for p in phases for d in directions(p.sampling_probability)})
    steps, limits = {}, []
    for phase, cap in zip(phases, caps):
        phase_limit = 2.0 * cap if limit is None else limit
        limits.append(phase_limit)
        for direction in all_dirs:
            # A q = 1 phase is symmetric: its remove PLD is its add PLD.
            d = direction if direction in directions(phase.sampling_probability) else "remove"
            steps[phase, direction] = step_plds(
                phase.noise_multiplier,
                phase.sampling_probability,
                phase.num_projections,
                d,
                discretization,
                min(cap, phase_limit),
            )
    # One coarse lattice for all phases, fine enough for the largest composed phase.
    factor = 1
    for (phase, _), (upper, _) in steps.items():
        points = _single_level_points(upper, phase.count, limits[phases.index(phase)])
        if points > _MAX_FINE_POINTS and phase.count >= 2 * _BLOCK_STEPS:
            factor = max(factor, -(-points // _COARSE_POINTS))
    coarse = discretization * factor
    total_cap = math.ceil(max(limits) / coarse) if limit is not None else None
    result = {}
    for direction in all_dirs:
        acc = [None, None]
        for phase, phase_limit in zip(phases, limits):
            for i in range(2):
                composed = _compose_steps(steps[phase, direction][i], phase.count, factor, phase_limit)
                acc[i] = (
                    composed if acc[i] is None else pld.compose(acc[i], composed, cap_index=total_cap)
                )
        result[direction] = (acc[0], acc[1])
    return result


def _estimated_size(
    phases: Sequence[Phase], discretization: float, caps: Sequence[float], limit: Optional[float]
) -> int:
    """Rough size of the fine lattice (heavy phases are bounded by the horizon or 2 ε_hi)."""
    top = math.inf if limit is None else limit + 10.0
    return int(
        sum(min(2 * c, 10 + 4 * math.sqrt(p.count) * c, top) for p, c in zip(phases, caps))
        / discretization
    )


def _initial_discretization(caps: Sequence[float]) -> float:
    return max(1e-3, 2.0 * max(caps) / (1 << 15))


def refine(
    phases: Sequence[Phase],
    delta_floor: float,
    query: Callable[[pld.LatticePld], float],
    combine: Callable[[Sequence[float]], float],
    tolerance: Callable[[float], float],
    discretization: Optional[float] = None,
    horizon: Optional[Callable[[float], float]] = None,
) -> Bounds:
    """Computes a query on the composed PLDs, refining Δ until the bounds are within tolerance.

    Args:
      phases: the mechanism's phases (non-empty, all counts ≥ 1).
      delta_floor: δ level below which the per-step tail may be counted at +∞.
      query: function of a composed PLD (e.g. ε for a δ).
      combine: how directions combine (max for ε and δ).
      tolerance: allowed upper - lower as a function of upper.
      discretization: fixed Δ (no refinement) if given.
      horizon: loss level beyond which mass may go to +∞ at negligible cost, as a function of
        the upper result of a pass (module doc); None: no horizon (lattice up to 2 ε_hi).

    Returns:
      `Bounds`.
    """
    caps, tight_caps = _phase_caps(phases, delta_floor)
    delta_step = discretization or _initial_discretization(caps)
    limit = None
    while True:
        plds = composed_plds(phases, delta_step, caps, limit)
        upper = combine([query(u) for u, _ in plds.values()])
        lower = combine([query(l) for _, l in plds.values()])
        lower = min(lower, upper)
        done = upper == lower or (math.isinf(upper) and math.isinf(lower))
        if done or upper - lower <= tolerance(upper):
            return Bounds(lower, upper, delta_step, True)
        finer = delta_step / 3.0
        if horizon is not None and math.isfinite(upper):
            new_limit = horizon(upper)
            if limit is None or new_limit < limit:
                limit = new_limit
                caps = [min(c, limit) for c in tight_caps]
                # A much shorter lattice: start the refinement over from its own initial step.
                finer = min(finer, _initial_discretization(caps))
        too_big = _estimated_size(phases, finer, caps, limit) > MAX_WINDOW
        if discretization is not None or too_big:
            return Bounds(lower, upper, delta_step, False)
        delta_step = finer
