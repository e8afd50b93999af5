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
# μ at which heavy-tailed JL phases are split into bulk and tail (a per-step loss scale of μ²/2 = 32).
_MU_SPLIT = 8.0
# Binomial tail mass of the number of tail steps neglected by the optimistic split composition.
_SPLIT_TAIL_MASS = 1e-18
# Past its tolerance, `refine` pursues a target only while each pass shrinks the bracket this much.
_PAYING_SHRINK = 3.0


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
      reason: why the result is infinite or unconverged, in words ("" otherwise).
    """

    lower: float
    upper: float
    discretization: float
    converged: bool
    reason: str = ""

    @property
    def error(self) -> float:
        return self.upper - self.lower


def directions(sampling_probability: float) -> Tuple[str, ...]:
    # Without subsampling the Gaussian pair is symmetric: one direction suffices.
    return ("remove",) if sampling_probability == 1.0 else ("remove", "add")


def _law(
    noise_multiplier: float,
    num_projections: Optional[int],
    mu_saturation: float,
    part: Optional[str] = None,
):
    """Law of μ; part "bulk"/"tail": conditional on μ ≤ / > `_MU_SPLIT` (`split_phase`)."""
    if num_projections is None:
        return mechanisms.gaussian_mu_law(noise_multiplier)
    if part is None:
        return mechanisms.jl_mu_law(noise_multiplier, num_projections, mu_saturation)
    split = mechanisms.split_jl_mu_law(noise_multiplier, num_projections, mu_saturation, _MU_SPLIT)
    return split[1] if part == "bulk" else split[2]


def _bulk_cap(sampling_probability: float) -> float:
    """Loss level above which a step with μ ≤ `_MU_SPLIT` has P-mass < q Φ(-9): the q-component's
    output y ≤ μ + 9 gives L ≤ log(1 - q + q e^{μ²/2 + 9μ})."""
    mu = _MU_SPLIT
    return (
        math.log1p(
            -sampling_probability + sampling_probability * math.exp(0.5 * mu * mu + 9.0 * mu)
        )
        + 1.0
    )


def split_phase(phase: Phase, cap: float) -> Optional[float]:
    """P(μ > `_MU_SPLIT`) when the phase's remove direction is composed as bulk ⊛ tail, else None.

    Split when the one-step tail reaches far beyond what μ ≤ `_MU_SPLIT` can produce (JL with
    few projections): the bulk then needs a fine lattice over a short range only, the rare large-μ
    steps a coarse one over the long range (`_compose_split`).
    """
    if phase.num_projections is None or cap <= 2.0 * _bulk_cap(phase.sampling_probability):
        return None
    mu_sat = mechanisms.jl_saturation_mu(cap, phase.sampling_probability)
    split = mechanisms.split_jl_mu_law(
        phase.noise_multiplier, phase.num_projections, mu_sat, _MU_SPLIT
    )
    return None if split is None else split[0]


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
    clipped to [-D, D] with D = max(1, _MAX_DENSE_POINTS/2 · Δ) = max(1, 2^10 Δ); outside it,
    lattice points with relative spacing 0.2% (`_GEOMETRIC_RATIO`; connect-the-dots stays
    pessimistic there, only slightly looser).
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
    part: Optional[str] = None,
    mu_saturation: Optional[float] = None,
) -> Tuple[pld.LatticePld, pld.LatticePld]:
    """(pessimistic, optimistic) one-step lattice PLDs in one direction (of the conditional
    mechanism given μ ≤ or > `_MU_SPLIT` for part "bulk" / "tail")."""
    q = sampling_probability
    mu_sat = mechanisms.jl_saturation_mu(eps_hi, q) if mu_saturation is None else mu_saturation
    law = _law(noise_multiplier, num_projections, mu_sat, part)
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
        k,
        discretization,
        prof.delta_lower,
        prof.weighted_q_tail,
        mid.delta_lower,
        mid.weighted_q_tail,
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


def _binomial_quantile_bound(n: int, p: float, tail: float) -> int:
    """A j with P(Binomial(n, p) > j) ≤ tail, from the Chernoff bound P(J ≥ j) ≤ e^{-τ} (eτ/j)^j,
    τ = np: scipy's isf does not reach tails like 1e-18."""
    tau = n * p
    j = max(1, math.ceil(tau))
    while j < n and j * math.log(math.e * tau / j) - tau > math.log(tail):
        j += 1 + j // 64
    return min(j, n)


def _compose_split(
    bulk_step: pld.LatticePld,
    tail_step: pld.LatticePld,
    p_tail: float,
    count: int,
    factor: int,
    limit: float,
) -> pld.LatticePld:
    """`count` steps that are each, with μ revealed, a bulk step (prob. 1 - p) or a tail step (p).

    With J ~ Binomial(count, p) tail steps, the composition is the J-mixture of
    B^{count - J} ⊛ T^J. Pessimistic: B^{count - J} ≤ B^count (more steps, more loss), so it is
    bounded by B^count ⊛ Z^count with Z = (1 - p)·{0} + p·T (a tail step or nothing), whose
    count-fold power is exactly the J-mixture of T^J. Optimistic: B^{count - J} ≥ B^{count - j_max}
    for J ≤ j_max, with P(J > j_max) < `_SPLIT_TAIL_MASS` dropped. B lives on the fine lattice
    (short range, light tail), Z on the coarse one (`tail_step`'s), up to `limit`.
    """
    coarse_cap = math.ceil(limit / tail_step.discretization)
    nulls = pld.self_compose(pld.with_null_outcome(tail_step, p_tail), count, cap_index=coarse_cap)
    bulk_count = count
    if not bulk_step.pessimistic:
        bulk_count = count - min(_binomial_quantile_bound(count, p_tail, _SPLIT_TAIL_MASS), count)
    if bulk_count == 0:
        return nulls
    bulk = _compose_steps(bulk_step, bulk_count, factor, limit)
    return pld.compose(bulk, nulls, cap_index=coarse_cap)


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
    steps, limits, splits = {}, [], []
    for phase, cap in zip(phases, caps):
        phase_limit = 2.0 * cap if limit is None else limit
        limits.append(phase_limit)
        splits.append(split_phase(phase, cap))
        for direction in all_dirs:
            # A q = 1 phase is symmetric: its remove PLD is its add PLD.
            d = direction if direction in directions(phase.sampling_probability) else "remove"
            part, step_cap = None, min(cap, phase_limit)
            if splits[-1] is not None and d == "remove":
                part, step_cap = "bulk", min(_bulk_cap(phase.sampling_probability), phase_limit)
            steps[phase, direction] = step_plds(
                phase.noise_multiplier,
                phase.sampling_probability,
                phase.num_projections,
                d,
                discretization,
                step_cap,
                part,
            )
    # One coarse lattice for all phases, fine enough for the largest composed phase; a split
    # phase's tail spans its whole horizon on it.
    factor = 1
    for i, phase in enumerate(phases):
        for direction in all_dirs:
            upper = steps[phase, direction][0]
            points = _single_level_points(upper, phase.count, limits[i])
            if points > _MAX_FINE_POINTS and phase.count >= 2 * _BLOCK_STEPS:
                factor = max(factor, -(-points // _COARSE_POINTS))
        if splits[i] is not None:
            factor = max(factor, -(-math.ceil(limits[i] / discretization) // _COARSE_POINTS))
    coarse = discretization * factor
    total_cap = math.ceil(max(limits) / coarse) if limit is not None else None
    result = {}
    for direction in all_dirs:
        acc = [None, None]
        for i, phase in enumerate(phases):
            d = direction if direction in directions(phase.sampling_probability) else "remove"
            tails = None
            if splits[i] is not None and d == "remove":
                mu_sat = mechanisms.jl_saturation_mu(caps[i], phase.sampling_probability)
                tails = step_plds(
                    phase.noise_multiplier,
                    phase.sampling_probability,
                    phase.num_projections,
                    d,
                    coarse,
                    min(caps[i], limits[i]),
                    "tail",
                    mu_sat,
                )
            for j in range(2):
                step = steps[phase, direction][j]
                if tails is None:
                    composed = _compose_steps(step, phase.count, factor, limits[i])
                else:
                    composed = _compose_split(
                        step, tails[j], splits[i], phase.count, factor, limits[i]
                    )
                acc[j] = (
                    composed
                    if acc[j] is None
                    else pld.compose(acc[j], composed, cap_index=total_cap)
                )
        result[direction] = (acc[0], acc[1])
    return result


def _estimated_size(
    phases: Sequence[Phase], discretization: float, caps: Sequence[float], limit: Optional[float]
) -> int:
    """Rough size of the fine lattice (heavy phases are bounded by the horizon or 2 ε_hi)."""
    top = math.inf if limit is None else limit + 10.0
    size = 0.0
    for p, c in zip(phases, caps):
        if split_phase(p, c) is not None:  # fine lattice: the bulk only
            c = _bulk_cap(p.sampling_probability)
        size += min(2 * c, 10 + 4 * math.sqrt(p.count) * c, top)
    return int(size / discretization)


def _initial_discretization(caps: Sequence[float], phases: Sequence[Phase] = ()) -> float:
    """First Δ: the phases' one-step lattices (a split phase's bulk) of about 2^14 points."""
    reach = [
        _bulk_cap(p.sampling_probability) if split_phase(p, c) is not None else c
        for p, c in zip(phases, caps)
    ] or list(caps)
    return max(1e-3, 2.0 * max(reach) / (1 << 15))


def numerical_failure(plds, lower: float, upper: float, delta_floor: float,
                      crossing: float = 0.0) -> str:
    """Why a pass's composed PLDs cannot be trusted, in words ("" if they can): a PMF that is
    not finite, a pessimistic FFT round-off estimate above ``delta_floor`` (half the δ of an
    ε query), or an optimistic answer above the pessimistic one by more than ``crossing``
    (``refine`` passes its tolerance: a smaller crossing is round-off, and the pass then
    bounds from above by the larger of the two, and not from below)."""
    for u, l in plds.values():
        if not (pld.finite(u) and pld.finite(l)):
            return "the composed distribution overflowed (not finite)"
        # The pessimistic side's queries carry its round-off estimate (`pld.LatticePld`):
        # past `delta_floor` the answer would be mostly that estimate.
        if u.roundoff > delta_floor:
            return (f"the composition's FFT round-off (about {u.roundoff:.2g} in δ) is not "
                    f"below the δ resolved ({delta_floor:.2g})")
    if math.isfinite(upper) and lower > upper + crossing:
        return (f"the optimistic result {lower:.6g} exceeds the pessimistic {upper:.6g} "
                "(numerical error)")
    return ""


def refine(
    phases: Sequence[Phase],
    delta_floor: float,
    query: Callable[[pld.LatticePld], float],
    combine: Callable[[Sequence[float]], float],
    tolerance: Callable[[float], float],
    discretization: Optional[float] = None,
    horizon: Optional[Callable[[float], float]] = None,
    target: Optional[Callable[[float], float]] = None,
    roundoff_limit: Optional[Callable[[float], float]] = None,
) -> Bounds:
    """Computes a query on the composed PLDs, refining Δ until the bounds are within tolerance.

    Args:
      phases: the mechanism's phases (non-empty, all counts ≥ 1).
      delta_floor: δ level below which the per-step tail may be counted at +∞.
      query: function of a composed PLD (e.g. ε for a δ).
      combine: how directions combine (max for ε and δ).
      tolerance: allowed upper - lower as a function of upper (`converged` once within it).
      discretization: fixed Δ (no refinement) if given.
      horizon: loss level beyond which mass may go to +∞ at negligible cost, as a function of
        the upper result of a pass (module doc); None: no horizon (lattice up to 2 ε_hi).
      target: a smaller upper - lower (function of upper) that refinement keeps pursuing past
        `tolerance` while passes pay: the last one shrank the bracket at least `_PAYING_SHRINK`
        times (discretisation error falls like Δ², 9x per pass; a bracket that shrinks less is
        held up by something else, e.g. round-off at large ε) and no phase is split (the split's
        optimistic side drops up to j_max bulk steps, a gap no lattice closes: JL r = 5 at the
        issue's setting keeps a 2.5e-4 relative bracket from Δ = 2e-3 down to 7.5e-5). None: stop
        at `tolerance`.
      roundoff_limit: the largest FFT round-off, in δ, a pass may carry, as a function of its
        upper result (None: `delta_floor`); a pass beyond it, or not finite, or whose bounds
        cross by more than the tolerance, ends the refinement without being used
        (`numerical_failure`).

    Returns:
      `Bounds`.
    """
    caps, tight_caps = _phase_caps(phases, delta_floor)
    delta_step = discretization or _initial_discretization(caps, phases)
    limit = None
    upper, lower = math.inf, -math.inf
    width = math.inf
    while True:
        plds = composed_plds(phases, delta_step, caps, limit)
        pass_upper = combine([query(u) for u, _ in plds.values()])
        pass_lower = combine([query(l) for _, l in plds.values()])
        resolution = (roundoff_limit(pass_upper) if roundoff_limit is not None
                      else delta_floor)
        # Bounds that cross by less than the tolerance are round-off (either side's): the
        # pass's upper bound is the larger answer, and it gives no lower bound. Discarding
        # the pass reported RDP's looser ε and made ε fall as steps grew (σ = 3, δ = 1e-12:
        # 13.77 at 27 steps, 13.56 at 28; session 23 audit).
        crossing = tolerance(pass_upper) if math.isfinite(pass_upper) else 0.0
        failure = numerical_failure(plds, pass_lower, pass_upper, resolution, crossing)
        if not failure and pass_lower > pass_upper:
            pass_upper, pass_lower = pass_lower, -math.inf
        if failure:
            # A pass whose arithmetic failed bounds nothing: it must not lower the upper bound
            # (session 22 audit: NaN PMFs at 1e8 steps gave ε = 0, "converged"; FFT round-off
            # at δ = 1e-12 gave an ε 0.8 below the exact one). Finer lattices only make it
            # worse: stop with what the sound passes gave (if any).
            reason = (f"{failure} at Δ = {delta_step:.3g}" if math.isinf(upper)
                      else f"refinement stopped: {failure} at Δ = {delta_step:.3g}")
            within = math.isfinite(upper) and upper - lower <= tolerance(upper)
            return Bounds(lower, upper, delta_step, within, reason)
        # Every sound pass gives valid bounds: keep the tightest of all passes.
        upper = min(upper, pass_upper)
        lower = max(lower, pass_lower)
        lower = min(lower, upper)
        reason = ""
        if math.isinf(upper):
            top = limit if limit is not None else max(2.0 * c for c in caps)
            unbounded = max(u.infinity_mass for u, _ in plds.values())
            top = min(top, MAX_LOSS)
            reason = (
                f"no ε ≤ {top:.3g} can be certified: with probability {unbounded:.3g} the "
                f"privacy loss exceeds {top:.3g}, and losses beyond that are counted as unbounded"
            )
        done = upper == lower or (math.isinf(upper) and math.isinf(lower))
        previous_width, width = width, upper - lower
        within = done or width <= tolerance(upper)
        if within and (
            done
            or target is None
            or width <= target(upper)
            or width * _PAYING_SHRINK > previous_width
            or any(split_phase(p, c) is not None for p, c in zip(phases, caps))
        ):
            return Bounds(lower, upper, delta_step, True, reason)
        finer = delta_step / 3.0
        if horizon is not None and math.isfinite(upper):
            new_limit = horizon(upper)
            if limit is None:
                # The first horizon may move the phases to other lattices (two levels, a
                # coarser one): the pass without it is no yardstick for the next.
                width = math.inf
            if limit is None or new_limit < limit:
                limit = new_limit
                caps = [min(c, limit) for c in tight_caps]
                # A much shorter lattice: start the refinement over from its own initial step.
                finer = min(finer, _initial_discretization(caps, phases))
        too_big = _estimated_size(phases, finer, caps, limit) > MAX_WINDOW
        if discretization is not None or too_big:
            if not within:
                reason = reason or f"the lattice cannot be refined below Δ = {delta_step:.3g}"
            return Bounds(lower, upper, delta_step, within, reason)
        delta_step = finer
