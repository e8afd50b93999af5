"""`PrivacyAccountant`: a stateful f-DP numerical accountant for (JL-)DP-SGD training runs."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from tf_dp import _validation
from tf_dp.accounting import composition, pld

# Default accuracy of ε: the bracket is refined to upper - lower ≤ EPSILON_ABS_TOLERANCE (up to
# ε = 50) while refinement pays (`composition.refine`'s target), and counts as converged within
# max(abs, rel · upper). 5e-4 keeps the reported ε below prv-accountant's certified upper bound
# at eps_error = 1e-3 up to ε = 50 (tests/accounting/tight_test.py); the former 5e-3 let it sit
# 1.5% above the true ε at ε = 0.115. The relative part is for what refinement cannot close:
# round-off at large ε, the bulk/tail split of heavy JL tails.
EPSILON_ABS_TOLERANCE = 5e-4
EPSILON_REL_TOLERANCE = 5e-3
# Beyond ε = 50 the target grows as 1e-5 ε: there round-off floors the bracket near 2e-6 ε
# (measured at ε = 494 and 877), which passes past the tolerance would approach at 3x the cost each.
_EPSILON_TARGET_REL = 1e-5
# Above this ε, epsilon_bounds also compares the numerical composition with RDP's ε.
_CROSS_CHECK_ABOVE = 100.0
DELTA_REL_TOLERANCE = 1e-2
DELTA_ABS_TOLERANCE = 1e-12


_NOISELESS = "a step has noise_multiplier 0 (no noise), so its output reveals the data"


class AccuracyError(ArithmeticError):
    """A privacy quantity could not be computed to the requested accuracy.

    Attributes:
      lower: the optimistic bound reached (the true value is not below it).
      upper: the pessimistic bound reached (a valid guarantee, but looser than requested).
    """

    def __init__(self, message: str, lower: float, upper: float):
        super().__init__(message)
        self.lower = lower
        self.upper = upper


class PrivacyAccountant:
    """Tracks the privacy spent by a (JL-)DP-SGD run and reports ε, δ and the trade-off curve.

    Each `step` records steps of the Poisson-subsampled Gaussian mechanism (add/remove
    adjacency) with noise multiplier σ and sampling probability q; with `num_projections=r` the
    step is the JL mechanism of Bu et al. (2021), whose sensitivity sqrt(r/χ²_r) is random but
    revealed (tf_dp composes sqrt(r/χ²_r) + τ, τ = 2^-20 covering the rounding of the summed
    gradients, `mechanisms.JL_ROUNDING_SLACK`). Queries compose all recorded steps
    numerically (privacy loss distributions, FFT) and return a pessimistic value whose
    numerical error is below the tolerance.

    ```
    accountant = PrivacyAccountant()
    accountant.step(noise_multiplier=1.1, sampling_probability=256 / 60000, count=14062)
    accountant.epsilon(delta=1e-5)   # ≈ 2.38
    ```

    Args:
      epsilon_tolerance: absolute tolerance on ε (upper minus lower bound), which refinement
        pursues while each pass still shrinks the bracket.
      epsilon_relative_tolerance: relative tolerance on ε: a bracket within
        max(epsilon_tolerance, epsilon_relative_tolerance · ε) is accepted when refinement stops
        paying (large ε, heavy JL tails).

    References:
      Koskela, Jälkö, Honkela (2020), "Computing tight differential privacy guarantees using FFT".
      Doroshenko et al. (2022), "Connect the dots: tighter discrete approximations of PLDs".
      Bu, Gopi, Kulkarni, Lee, Shen, Tantipongpipat (2021), "Fast and memory efficient
      differentially private-SGD via JL projections", Theorem 4.1.
      Dong, Roth, Su (2022), "Gaussian differential privacy" (trade-off functions).
    """

    def __init__(
        self,
        epsilon_tolerance: float = EPSILON_ABS_TOLERANCE,
        epsilon_relative_tolerance: float = EPSILON_REL_TOLERANCE,
    ):
        if not epsilon_tolerance > 0:
            raise ValueError(f"`epsilon_tolerance` must be > 0, got {epsilon_tolerance!r}.")
        if not epsilon_relative_tolerance >= 0:
            raise ValueError(
                f"`epsilon_relative_tolerance` must be >= 0, got {epsilon_relative_tolerance!r}."
            )
        self._phases: List[composition.Phase] = []
        self._epsilon_tolerance = float(epsilon_tolerance)
        self._epsilon_relative_tolerance = float(epsilon_relative_tolerance)

    # -- recording ---------------------------------------------------------------------------

    @_validation.keyword_only("tf_dp.accounting")
    def step(
        self,
        *,
        noise_multiplier: float,
        sampling_probability: float,
        num_projections: Optional[int] = None,
        count: int = 1,
    ) -> "PrivacyAccountant":
        """Records `count` steps; consecutive identical steps are merged into one phase.

        Keyword arguments only: σ and q are both floats, and swapped they would record a
        different mechanism without any error.

        Args:
          noise_multiplier: σ ≥ 0 (σ = 0 means no noise and ε = ∞).
          sampling_probability: Poisson sampling rate q in (0, 1].
          num_projections: None for exact clipping, or the number r ≥ 1 of JL projections.
          count: number of steps, ≥ 1.

        Returns:
          self.
        """
        sigma = _validation.noise_multiplier(noise_multiplier)
        q = _validation.sampling_probability(sampling_probability)
        r = _validation.num_projections(num_projections)
        n = _validation.count(count)
        if self._phases:
            last = self._phases[-1]
            if (last.noise_multiplier, last.sampling_probability, last.num_projections) == (
                sigma,
                q,
                r,
            ):
                self._phases[-1] = composition.Phase(sigma, q, r, last.count + n)
                return self
        self._phases.append(composition.Phase(sigma, q, r, n))
        return self

    @property
    def phases(self) -> List[composition.Phase]:
        return list(self._phases)

    @property
    def steps(self) -> int:
        return sum(p.count for p in self._phases)

    def _has_noiseless_step(self) -> bool:
        return any(p.noise_multiplier == 0 for p in self._phases)

    # -- queries -----------------------------------------------------------------------------

    def epsilon_bounds(self, delta: float) -> composition.Bounds:
        """Two-sided bounds on the smallest ε for which the run is (ε, δ)-DP (never raises for
        accuracy; `converged` says whether the tolerance was met)."""
        delta = _validation.delta(delta)
        if not self._phases:
            return composition.Bounds(0.0, 0.0, 0.0, True)
        if self._has_noiseless_step():
            return composition.Bounds(math.inf, math.inf, 0.0, True, _NOISELESS)
        margin = composition.horizon_margin(self.steps, delta)
        b = composition.refine(
            self._phases,
            delta_floor=1e-2 * delta,
            query=lambda p: pld.epsilon_for_delta(p, delta),
            combine=max,
            tolerance=lambda u: max(self._epsilon_tolerance, self._epsilon_relative_tolerance * u),
            target=lambda u: max(self._epsilon_tolerance, _EPSILON_TARGET_REL * u),
            # Heavy (JL) tails put mass just above ε: leave room for it (P(L > 1.25 ε) < δ).
            horizon=lambda u: u + max(margin, 0.25 * u),
            # ε is read where δ plus the round-off estimate is within δ; past δ / 2 the
            # answer would be mostly that estimate.
            roundoff_limit=lambda u: 0.5 * delta,
        )
        if not b.converged or b.upper > _CROSS_CHECK_ABOVE or b.reason:
            # Where the numerical composition could not certify the tolerance (or failed: FFT
            # round-off at tiny δ, overflow at 1e8 steps), RDP's ε is also a valid upper
            # bound for Gaussian steps: the smaller of the two is reported. Past ε = 100 it is
            # a cross-check too: a lattice too short for the composed loss gives T times the
            # one-step cap, "converged" at both ends (949400 for an exact 51348, session 22
            # audit), whose lower end is then no bound at all. And wherever a failed pass
            # stopped the refinement (b.reason): at 1e5 steps and δ = 1e-13 the sound passes
            # left 83.94 for an exact 65.82, RDP 67.68 (session 23 review).
            from tf_dp.accounting import functions

            rdp = functions.rdp_epsilon_for_phases(self._phases, delta)
            if rdp < b.upper:
                lower = b.lower if math.isfinite(b.lower) and b.lower <= rdp else 0.0
                return composition.Bounds(
                    max(lower, 0.0), rdp, b.discretization, False,
                    (b.reason + "; " if b.reason else "") + f"reported: RDP's ε {rdp:.6g}")
        return b

    def epsilon(self, delta: float) -> float:
        """Smallest ε (pessimistic, within tolerance) such that the run is (ε, δ)-DP.

        Returns math.inf when no finite ε can be certified at this δ: σ = 0, or (JL with one
        projection) the probability that the privacy loss exceeds 1e9, where losses are
        counted as unbounded, is above δ. A `RuntimeWarning` then says which.

        Raises:
          ValueError: `delta` outside (0, 1).
          AccuracyError: the bounds could not be brought within tolerance (its `upper` is still
            a valid, looser, ε).
        """
        b = self.epsilon_bounds(delta)
        if not b.converged and math.isfinite(b.upper):
            raise AccuracyError(
                f"ε at δ={delta} could only be bracketed in [{b.lower:.6g}, {b.upper:.6g}] "
                f"(tolerance {max(self._epsilon_tolerance, self._epsilon_relative_tolerance * b.upper):.3g}); "
                f"{b.upper:.6g} is a valid but loose ε.",
                b.lower,
                b.upper,
            )
        if math.isinf(b.upper):
            warnings.warn(f"ε = inf at δ = {delta:g}: {b.reason}.", RuntimeWarning, stacklevel=2)
        return b.upper

    def delta_bounds(self, epsilon: float) -> composition.Bounds:
        """Two-sided bounds on the smallest δ for which the run is (ε, δ)-DP."""
        epsilon = _validation.epsilon(epsilon)
        if not self._phases:
            return composition.Bounds(0.0, 0.0, 0.0, True)
        if self._has_noiseless_step():
            return composition.Bounds(1.0, 1.0, 0.0, True, _NOISELESS)
        tol = lambda u: max(DELTA_ABS_TOLERANCE, DELTA_REL_TOLERANCE * u)  # noqa: E731
        query = lambda p: float(pld.delta_for_epsilon(p, epsilon)[0])  # noqa: E731
        steps = self.steps
        horizon = lambda u: epsilon + max(  # noqa: E731
            composition.horizon_margin(steps, max(u, 1e-12)), 0.25 * epsilon
        )
        # The pessimistic δ carries its FFT round-off estimate: never a reason to fail.
        limit = lambda u: math.inf  # noqa: E731
        b = composition.refine(self._phases, 1e-12, query, max, tol, horizon=horizon,
                               roundoff_limit=limit)
        if b.lower > 1e-9:  # the tail can be cut closer to the answer: finer lattice
            b2 = composition.refine(self._phases, 1e-3 * b.lower, query, max, tol, horizon=horizon,
                                    roundoff_limit=limit)
            if b2.upper <= b.upper:
                b = b2
        if b.upper > 1.0:  # a failed pass bounds nothing: δ ≤ 1 is the trivial bound
            b = composition.Bounds(max(b.lower, 0.0), 1.0, b.discretization, False, b.reason)
        return b

    def delta(self, epsilon: float) -> float:
        """Smallest δ (pessimistic, within tolerance) such that the run is (ε, δ)-DP."""
        b = self.delta_bounds(epsilon)
        if not b.converged:
            raise AccuracyError(
                f"δ at ε={epsilon} could only be bracketed in [{b.lower:.6g}, {b.upper:.6g}]; "
                f"{b.upper:.6g} is a valid but loose δ.",
                b.lower,
                b.upper,
            )
        return b.upper

    def privacy_profile(self, epsilons: Sequence[float], delta_floor: float = 1e-12) -> np.ndarray:
        """Pessimistic δ(ε) at many ε ≥ 0 at once (max over both adjacency directions)."""
        eps = np.asarray(epsilons, dtype=float)
        if np.any(eps < 0) or not np.all(np.isfinite(eps)):
            raise ValueError(f"`epsilons` must be finite and >= 0, got {epsilons!r}.")
        if not self._phases:
            return np.zeros_like(eps)
        if self._has_noiseless_step():
            return np.ones_like(eps)
        caps = [composition.tail_cap(p, delta_floor / len(self._phases)) for p in self._phases]
        dstep = composition._initial_discretization(caps) / 3.0
        plds = composition.composed_plds(self._phases, dstep, caps)
        return np.max([pld.delta_for_epsilon(u, eps) for u, _ in plds.values()], axis=0)

    def tradeoff_curve(self, alphas: Sequence[float]) -> np.ndarray:
        """f-DP trade-off curve β(α) of the run (a pessimistic lower bound on type-II error).

        β(α) = sup_{ε ≥ 0} max(0, 1 - δ(ε) - e^ε α, e^{-ε}(1 - δ(ε) - α)) (Dong, Roth, Su 2022,
        Prop. 2.12), over a grid of ε; a sup over fewer ε is smaller, so still valid.
        """
        from tf_dp.accounting import tradeoff  # local: keeps the module light

        alphas = np.asarray(alphas, dtype=float)
        if np.any((alphas < 0) | (alphas > 1)):
            raise ValueError(f"`alphas` must lie in [0, 1], got {alphas!r}.")
        eps = tradeoff.epsilon_grid(self)
        return tradeoff.tradeoff_from_profile(eps, self.privacy_profile(eps), alphas)

    def rdp_epsilon(self, delta: float) -> float:
        """ε from Rényi DP (Mironov et al. 2019), for comparison; ∞ for the JL mechanism."""
        from tf_dp.accounting import functions  # local import

        return functions.rdp_epsilon_for_phases(self._phases, delta)

    def gdp_mu(self) -> float:
        """μ of the CLT μ-GDP approximation (Bu, Dong, Long, Su 2020); refuses the JL mechanism."""
        from tf_dp.accounting import functions

        return functions.gdp_mu_for_phases(self._phases)

    # -- serialization -----------------------------------------------------------------------

    def get_config(self) -> Dict[str, Any]:
        """Everything needed to restore the spent budget (JSON-serialisable)."""
        return {
            "epsilon_tolerance": self._epsilon_tolerance,
            "epsilon_relative_tolerance": self._epsilon_relative_tolerance,
            "phases": [
                {
                    "noise_multiplier": p.noise_multiplier,
                    "sampling_probability": p.sampling_probability,
                    "num_projections": p.num_projections,
                    "count": p.count,
                }
                for p in self._phases
            ],
        }

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "PrivacyAccountant":
        acc = cls(
            epsilon_tolerance=config.get("epsilon_tolerance", EPSILON_ABS_TOLERANCE),
            epsilon_relative_tolerance=config.get(
                "epsilon_relative_tolerance", EPSILON_REL_TOLERANCE
            ),
        )
        for p in config.get("phases", []):
            acc.step(
                noise_multiplier=p["noise_multiplier"],
                sampling_probability=p["sampling_probability"],
                num_projections=p["num_projections"],
                count=p["count"],
            )
        return acc

    def __repr__(self) -> str:
        return f"PrivacyAccountant(steps={self.steps}, phases={len(self._phases)})"
