"""tf_dp.accounting: f-DP numerical privacy accounting for DP-SGD and JL-DP-SGD.

Importing this package does not import TensorFlow.
"""

from tf_dp.accounting.accountant import AccuracyError, PrivacyAccountant
from tf_dp.accounting.composition import Bounds, Phase
from tf_dp.accounting.functions import (
    GDPNotApplicableError,
    calibrate_noise_multiplier,
    compute_delta,
    compute_epsilon,
    compute_gdp_mu,
    compute_max_steps,
    compute_rdp_epsilon,
    gdp_delta,
    gdp_epsilon,
)
from tf_dp.accounting.tradeoff import (dp_tradeoff, epsilon_over_steps, gaussian_tradeoff,
                                      plot_epsilon, plot_tradeoff)

__all__ = [
    "AccuracyError",
    "Bounds",
    "GDPNotApplicableError",
    "Phase",
    "PrivacyAccountant",
    "calibrate_noise_multiplier",
    "compute_delta",
    "compute_epsilon",
    "compute_gdp_mu",
    "compute_max_steps",
    "compute_rdp_epsilon",
    "dp_tradeoff",
    "epsilon_over_steps",
    "gaussian_tradeoff",
    "gdp_delta",
    "gdp_epsilon",
    "plot_epsilon",
    "plot_tradeoff",
]
