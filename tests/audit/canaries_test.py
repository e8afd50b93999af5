"""White-box one-run audit through tf_dp's own fit: the correct DPSGD is never flagged, two
deliberately broken mechanisms (defined here only) and non-private training are.

Sizing (docs/audit.md): 500 canaries, 250 other examples, expected batch 10, 4 epochs
(~200 steps at q ≈ 0.02), σ = 1, C = 1 → accountant ε ≈ 1.85 at δ = 1e-5. Over 12 runs
each: the correct optimizer's bound was 0–0.47; σ/4 gave 2.65–3.37 and replayed noise
2.65–3.66 (12/12 caught each); σ = 0 gave 2.65–3.09.

Seeded (test only): each audit is one run, and a run of the correct optimizer may be flagged
by chance (the bound holds at 95 % confidence; in 40 unseeded runs its bound reached 0.8 of
ε ≈ 1.85 and the claim's p-value 0.34), as a broken one may pass, with probabilities no
affordable number of runs pins below 1e-6. With ``SEED`` the optimizer's noise, fit's
Poisson sampling and the auditor's coins are fixed, so each test checks one typical run
deterministically (its outcome is printed by ``str(result)`` when an assertion fails).
"""

import sys
import warnings

import numpy as np
import pytest

import tf_dp
from tf_dp.audit import canaries
from tf_dp.core import randomness

SIGMA = 1.0
SEED = 0  # debugging seed of the optimizer (noise, fit's sampling) and the auditor's coins
AUDIT = dict(num_canaries=500, expected_batch_size=10, epochs=4, num_other_examples=250,
             scorers=("likelihood_ratio", "repeated_noise"))


# ---------------------------------------------------------- deliberately broken mechanisms
class QuarterNoiseDPSGD(tf_dp.DPSGD):
    """BROKEN ON PURPOSE (test only): adds noise σ/4 while its ledger reports σ."""

    def __init__(self, l2_norm_clip, noise_multiplier, **kwargs):
        super().__init__(l2_norm_clip, noise_multiplier / 4, **kwargs)
        object.__setattr__(self, "_reported_sigma", float(noise_multiplier))

    def mechanism(self, sampling_probability):
        return (self._reported_sigma, float(sampling_probability), self.num_projections)


class _ReplayingStream(randomness.SecretStream):
    """BROKEN ON PURPOSE (test only): every second seed repeats the previous one."""

    def next_seed(self):
        c = self._counter.assign_add(1, read_value=True) - 1
        return self._seed_at(c // 2)


class ReplayedNoiseDPSGD(tf_dp.DPSGD):
    """BROKEN ON PURPOSE (test only): the noise of step 2k+1 is the noise of step 2k."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_dp_noise", _ReplayingStream("noise", kwargs.get("seed")))


def _audit(cls, sigma=SIGMA, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0 and the seed warn that the run is not private
        return canaries.gradient_canary_audit(
            lambda: cls(l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=1.0, seed=SEED),
            rng=np.random.default_rng(SEED), **{**AUDIT, **kwargs})


# ---------------------------------------------------------- the four audits
def test_correct_dpsgd_audited_bound_stays_below_the_accountants_epsilon():
    result = _audit(tf_dp.DPSGD)
    assert 1.5 < result.epsilon < 2.3  # the sizing above
    assert result.noise_multiplier == SIGMA and result.steps > 150
    assert 0.0 <= result.epsilon_lower_bound <= result.epsilon, str(result)
    assert not result.violation
    assert result.claim_p_value >= 0.05 and not result.claim_rejected, str(result)


def test_noise_a_quarter_of_the_reported_sigma_is_caught():
    result = _audit(QuarterNoiseDPSGD)
    assert result.noise_multiplier == SIGMA  # what the accountant was told
    assert result.gdp_epsilon > result.epsilon_lower_bound, str(result)
    assert result.claim_rejected and result.claim_p_value < 1e-3, str(result)
    assert result.epsilon_lower_bound > result.epsilon, str(result)
    assert result.violation and "VIOLATION" in str(result)


def test_noise_replayed_every_second_step_is_caught():
    result = _audit(ReplayedNoiseDPSGD)
    assert result.epsilon_lower_bound > result.epsilon, str(result)
    assert result.scorer == "repeated_noise"
    assert result.claim_rejected, str(result)


def test_non_private_training_gives_a_large_audited_epsilon():
    result = _audit(tf_dp.DPSGD, sigma=0.0)
    assert result.epsilon == float("inf")
    assert result.epsilon_lower_bound > 2.0, str(result)  # 500 canaries cap it near 3.7
    # the f-DP reading of the same (near-perfect) guesses goes further than the (ε, δ) one
    assert result.gdp_epsilon > result.epsilon_lower_bound + 1.0, str(result)


# ---------------------------------------------------------- scorers on synthetic updates
def test_scorers_on_synthetic_updates():
    rng = np.random.default_rng(0)
    steps, m, q, sigma = 200, 400, 0.05, 0.5
    included = rng.random(m) < 0.5
    y = (rng.random((steps, m)) < q) * included + sigma * rng.normal(size=(steps, m))
    for name in ("sum", "likelihood_ratio"):
        s = canaries.canary_scores(y, q, name)
        assert s[included].mean() > s[~included].mean()
    # replayed noise: absent canaries' consecutive updates agree exactly, present ones not
    y_rep = y.copy()
    y_rep[1::2] = y_rep[0::2] - (y[0::2] - y[1::2]) * included  # noise of step 2k reused
    s = canaries.canary_scores(y_rep, q, "repeated_noise")
    assert s[~included].max() <= s[included].min() or s[included].mean() > s[~included].mean()
    # fresh noise: consecutive updates agree (within 1e-4) only by rare accident
    assert canaries.canary_scores(y, q, "repeated_noise").mean() > -0.1


def test_bad_arguments_name_the_argument():
    good = lambda: tf_dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1.0)
    for kwargs, message in [
        (dict(num_canaries=0), "`num_canaries` must be an integer >= 1"),
        (dict(epochs=1.5), "`epochs` must be an integer >= 1"),
        (dict(num_other_examples=-1), "`num_other_examples` must be an integer >= 0"),
        (dict(scorers=("loss",)), "`scorers` must be names from"),
        (dict(canary_gradient_norm=0.5), "`canary_gradient_norm` must be >= `l2_norm_clip`"),
        (dict(num_canaries=10, expected_batch_size=50), "`expected_batch_size` \\(50\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            canaries.gradient_canary_audit(good, **kwargs)
    with pytest.raises(ValueError, match="`optimizer` must be a tf_dp DPSGD"):
        canaries.gradient_canary_audit(lambda: tf_dp.DPAdam(1.0, 1.0))
    with pytest.raises(ValueError, match="`optimizer` must have momentum 0"):
        canaries.gradient_canary_audit(tf_dp.DPSGD(1.0, 1.0, momentum=0.9))
    with pytest.raises(ValueError, match="`scorer` must be one of"):
        canaries.canary_scores(np.zeros((3, 2)), 0.1, "max")
    with pytest.raises(ValueError, match="`updates` must be a \\(steps, canaries\\) array"):
        canaries.canary_scores(np.zeros(3), 0.1, "sum")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
