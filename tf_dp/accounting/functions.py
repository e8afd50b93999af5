"""Functional API: ε, δ, calibration of σ and of the number of steps, RDP and GDP comparisons.

Every public function takes keyword arguments only, with the same names everywhere:
`noise_multiplier` (σ), `sampling_probability` (q), `steps`, `epsilon` or `target_epsilon`,
`delta`, `num_projections` (r). Several of these are floats of similar size, and a positional
call with two of them swapped would silently report a wrong ε; a positional call raises
`TypeError` instead.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

from scipy import special

from tf_dp import _validation
from tf_dp.accounting import composition
from tf_dp.accounting.accountant import PrivacyAccountant

_keyword_only = _validation.keyword_only("tf_dp.accounting")

_SIGMA_MIN, _SIGMA_MAX = 1e-2, 1e3


def epsilon_text(epsilon: float, digits: int = 4) -> str:
    """``epsilon`` shown with ``digits`` significant digits, rounded UP: a printed ε must never
    be below the accountant's (session 22 audit: ``%.4g`` printed 2.316 for 2.31636).
    Exact decimal arithmetic on the float's own value."""
    import decimal

    if not math.isfinite(epsilon):
        return "inf" if epsilon > 0 else str(epsilon)
    if epsilon <= 0:
        return "0"
    value = decimal.Decimal(epsilon)
    exponent = value.adjusted() - (digits - 1)
    quantum = decimal.Decimal(1).scaleb(exponent)
    rounded = value.quantize(quantum, rounding=decimal.ROUND_CEILING)
    if rounded.adjusted() - (digits - 1) > exponent:  # 9.9995 -> 10.00: keep `digits` digits
        rounded = rounded.quantize(quantum.scaleb(1), rounding=decimal.ROUND_CEILING)
    if -6 <= rounded.adjusted() < 6:
        return format(rounded.normalize(), "f")
    return format(rounded.normalize(), "E").replace("E+", "e+").replace("E-", "e-")


def _accountant(
    noise_multiplier, sampling_probability, steps, num_projections
) -> PrivacyAccountant:
    sigma = _validation.noise_multiplier(noise_multiplier)
    q = _validation.sampling_probability(sampling_probability)
    n = _validation.steps(steps)
    r = _validation.num_projections(num_projections)
    acc = PrivacyAccountant()
    if n > 0:
        acc.step(noise_multiplier=sigma, sampling_probability=q, num_projections=r, count=n)
    return acc


@_keyword_only
def compute_epsilon(
    *,
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    delta: float,
    num_projections: Optional[int] = None,
) -> float:
    """ε of `steps` steps of (JL-)DP-SGD with Poisson sampling, at δ (pessimistic f-DP accounting).

    ```
    compute_epsilon(noise_multiplier=1.1, sampling_probability=256 / 60000, steps=14062,
                    delta=1e-5)   # ≈ 2.38
    ```

    Args (keyword only):
      noise_multiplier: σ ≥ 0; σ = 0 gives ε = ∞.
      sampling_probability: q in (0, 1].
      steps: number of steps ≥ 0.
      delta: δ in (0, 1).
      num_projections: None (exact clipping) or the number r ≥ 1 of JL projections
        (Bu et al. 2021). Small r gives very large ε, or ∞ when no finite ε is certifiable.

    Returns:
      ε (a float, possibly math.inf).
    """
    acc = _accountant(noise_multiplier, sampling_probability, steps, num_projections)
    return acc.epsilon(_validation.delta(delta))


@_keyword_only
def compute_delta(
    *,
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    epsilon: float,
    num_projections: Optional[int] = None,
) -> float:
    """δ at a given ε for `steps` steps of (JL-)DP-SGD (pessimistic f-DP accounting).

    Args (keyword only):
      noise_multiplier, sampling_probability, steps, num_projections: as in `compute_epsilon`.
      epsilon: ε ≥ 0, finite.

    Returns:
      δ in [0, 1].
    """
    acc = _accountant(noise_multiplier, sampling_probability, steps, num_projections)
    return acc.delta(_validation.epsilon(epsilon))


@_keyword_only
def calibrate_noise_multiplier(
    *,
    sampling_probability: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    num_projections: Optional[int] = None,
    relative_tolerance: float = 1e-3,
) -> float:
    """Smallest σ (up to `relative_tolerance`) whose run satisfies (target_epsilon, δ)-DP.

    Bisection in log σ (ε decreases in σ); the returned σ is the upper end of the final bracket,
    verified to reach the target.

    Args (keyword only):
      sampling_probability, steps, delta, num_projections: as in `compute_epsilon`; or
        `sampling_probability` and `steps` as equal-length sequences, the phases of a
        batch-size schedule (`steps[i]` steps at `sampling_probability[i]`, composed).
      target_epsilon: the ε to reach, > 0.
      relative_tolerance: the returned σ is at most (1 + relative_tolerance) times the smallest.

    Returns:
      σ (0.0 when `steps` is 0).

    Raises:
      ValueError: bad arguments, or no σ ≤ 1000 reaches the target.
    """
    target = _validation.positive_epsilon(target_epsilon)
    delta = _validation.delta(delta)
    phases = _phases(sampling_probability, steps)
    r = _validation.num_projections(num_projections)
    if sum(n for _, n in phases) == 0:
        return 0.0

    def eps(sigma: float) -> float:
        acc = PrivacyAccountant()
        for q, n in phases:
            if n > 0:
                acc.step(noise_multiplier=sigma, sampling_probability=q, num_projections=r,
                         count=n)
        return acc.epsilon_bounds(delta).upper

    lo, hi = _SIGMA_MIN, 1.0
    while eps(hi) > target:
        lo, hi = hi, hi * 4.0
        if hi > _SIGMA_MAX:
            raise ValueError(
                f"No `noise_multiplier` <= {_SIGMA_MAX} reaches `target_epsilon`={target} at "
                f"`delta`={delta} (num_projections={r})."
            )
    if hi == 1.0:
        while lo < hi and eps(lo) <= target:
            hi, lo = lo, lo / 4.0
            if lo < 1e-4:
                return hi
    while hi / lo > 1.0 + relative_tolerance:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


@_keyword_only
def compute_max_steps(
    *,
    noise_multiplier: float,
    sampling_probability: float,
    target_epsilon: float,
    delta: float,
    num_projections: Optional[int] = None,
    max_steps: int = 10**7,
) -> int:
    """Largest number of steps whose run satisfies (target_epsilon, δ)-DP (ε increases in steps).

    Args (keyword only):
      noise_multiplier, sampling_probability, delta, num_projections: as in `compute_epsilon`.
      target_epsilon: the ε budget, > 0.
      max_steps: the search stops there.

    Returns:
      0 if even one step exceeds the budget; `max_steps` if that many still fit.
    """
    target = _validation.positive_epsilon(target_epsilon)
    delta = _validation.delta(delta)

    def fits(n: int) -> bool:
        acc = _accountant(noise_multiplier, sampling_probability, n, num_projections)
        return acc.epsilon_bounds(delta).upper <= target

    return largest_fitting(fits, max_steps)


def _phases(sampling_probability, steps):
    """[(q, steps)]: one phase, or the phases of equal-length sequences."""
    if isinstance(sampling_probability, (list, tuple)) or isinstance(steps, (list, tuple)):
        if not (isinstance(sampling_probability, (list, tuple)) and isinstance(steps, (list, tuple))
                and len(sampling_probability) == len(steps) and steps):
            raise ValueError("`sampling_probability` and `steps` must both be numbers or "
                             "both non-empty sequences of the same length (phases), got "
                             f"{sampling_probability!r} and {steps!r}.")
        return [(_validation.sampling_probability(q), _validation.steps(n))
                for q, n in zip(sampling_probability, steps)]
    return [(_validation.sampling_probability(sampling_probability), _validation.steps(steps))]


def largest_fitting(fits, limit: int) -> int:
    """The largest n in [0, limit] with ``fits(n)``, for ``fits`` true up to some n and false
    after (epsilon grows with steps): 0 if not even ``fits(1)``, ``limit`` if ``fits(limit)``.
    Exponential search, then bisection: O(log n) calls."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi >= limit:
            return limit if fits(limit) else _bisect_steps(fits, lo, limit)
    return _bisect_steps(fits, lo, hi)


def _bisect_steps(fits, lo: int, hi: int) -> int:
    """Largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def rdp_epsilon_for_phases(phases: Sequence[composition.Phase], delta: float) -> float:
    """RDP-based ε (Mironov, Talwar, Zhang 2019 via dp-accounting), for comparison only.

    The JL mechanism has infinite Rényi divergence of every order (its privacy loss has a
    power-law tail), so any JL phase gives ∞.
    """
    delta = _validation.delta(delta)
    if any(p.num_projections is not None or p.noise_multiplier == 0 for p in phases):
        return math.inf
    if not phases:
        return 0.0
    import dp_accounting  # local: heavy import, only for this comparison
    from dp_accounting import rdp

    # dp-accounting logs a warning for every fractional order whose series does not converge
    # (it then leaves the order out, which is sound); for a comparison number that is noise.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        acc = rdp.RdpAccountant()
        for p in phases:
            event = dp_accounting.PoissonSampledDpEvent(
                p.sampling_probability, dp_accounting.GaussianDpEvent(p.noise_multiplier)
            )
            acc.compose(event, p.count)
        return float(acc.get_epsilon(delta))
    finally:
        absl_logger.setLevel(level)


@_keyword_only
def compute_rdp_epsilon(
    *,
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    delta: float,
    num_projections: Optional[int] = None,
) -> float:
    """RDP-based ε for comparison (∞ for the JL mechanism: its RDP is infinite at every order).

    Keyword arguments only, as in `compute_epsilon`.
    """
    acc = _accountant(noise_multiplier, sampling_probability, steps, num_projections)
    return rdp_epsilon_for_phases(acc.phases, delta)


class GDPNotApplicableError(ValueError):
    """The central-limit μ-GDP approximation is not valid for this mechanism."""


def gdp_mu_for_phases(phases: Sequence[composition.Phase]) -> float:
    """μ = sqrt(Σ_i T_i q_i² (e^{1/σ_i²} - 1)) (Bu, Dong, Long, Su 2020, Thm. 5 / Dong et al. 2022).

    Raises:
      GDPNotApplicableError: for JL phases. Their privacy loss has a power-law tail (P(μ > m)
        ~ m^{-r}); the CLT misses that tail and would report a far too small ε.
    """
    if any(p.num_projections is not None for p in phases):
        raise GDPNotApplicableError(
            "μ-GDP via the central limit theorem is not valid for the JL mechanism "
            "(`num_projections` set): its random sensitivity sqrt(r/χ²_r) (+ τ) gives the "
            "privacy loss a power-law tail that the CLT ignores. Use the numerical accountant (epsilon/delta)."
        )
    total = 0.0
    for p in phases:
        if p.noise_multiplier == 0:
            return math.inf
        total += p.count * p.sampling_probability**2 * math.expm1(p.noise_multiplier**-2)
    return math.sqrt(total)


@_keyword_only
def compute_gdp_mu(
    *,
    noise_multiplier: float,
    sampling_probability: float,
    steps: int,
    num_projections: Optional[int] = None,
) -> float:
    """CLT μ-GDP parameter of Gaussian DP-SGD; refuses the JL mechanism (see gdp_mu_for_phases).

    Keyword arguments only, as in `compute_epsilon` (no `delta`: μ describes the whole curve).
    """
    acc = _accountant(noise_multiplier, sampling_probability, steps, num_projections)
    return gdp_mu_for_phases(acc.phases)


@_keyword_only
def gdp_delta(*, mu: float, epsilon: float) -> float:
    """δ(ε) of μ-GDP: Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) (Dong, Roth, Su 2022, Cor. 2.13).

    Keyword arguments only (μ and ε are both floats of similar size).
    """
    return _gdp_delta(mu, epsilon)


def _gdp_delta(mu: float, epsilon: float) -> float:
    if mu == 0:
        return 0.0
    return float(
        special.ndtr(-epsilon / mu + mu / 2)
        - math.exp(epsilon) * special.ndtr(-epsilon / mu - mu / 2)
    )


@_keyword_only
def gdp_epsilon(*, mu: float, delta: float) -> float:
    """Smallest ε with gdp_delta(mu=mu, epsilon=ε) ≤ δ (bisection). Keyword arguments only."""
    delta = _validation.delta(delta)
    if _gdp_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _gdp_delta(mu, hi) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _gdp_delta(mu, mid) > delta else (lo, mid)
    return hi
