"""Empirical privacy auditing: statistical lower bounds on the ε a training run spends.

The accountant proves an upper bound for the algorithm on paper; an audit turns a run into a
lower bound that holds with a stated confidence. A lower bound above the reported ε means
the implementation (or its accounting) is broken.

* ``bounds`` (NumPy/SciPy, no TensorFlow): the one-run bound of Steinke, Nasr and Jagielski
  (NeurIPS 2023) from canary guesses, the (TPR, FPR) bound with Clopper–Pearson intervals,
  ROC tools.
* ``fdp`` (NumPy/SciPy): the same guesses read in f-DP (Mahloujifar, Melis, Chaudhuri, ICML
  2025): a lower bound on μ of μ-GDP, tighter than the (ε, δ) reading for Gaussian noise.
* ``canaries`` (TensorFlow, loaded on first access): the white-box one-run audit of a tf_dp
  optimizer with Dirac gradient canaries, trained by tf_dp's own ``fit``.
* ``membership``: membership-inference reports (AUC, TPR at low FPR, ε bound, log-log ROC),
  loss and offline-LiRA scores, and the one-run audit with mislabeled input canaries.

docs/audit.md has the results and the cost.
"""

import importlib

from tf_dp.audit import bounds, fdp
from tf_dp.audit.bounds import (
    clopper_pearson,
    guess_counts,
    membership_epsilon_lower_bound,
    one_run_epsilon_lower_bound,
    one_run_from_scores,
    one_run_p_value,
    roc_auc,
    roc_curve,
    scores_epsilon_lower_bound,
    tpr_at_fpr,
)
from tf_dp.audit.fdp import (
    gdp_blow_up_inverse,
    gdp_delta,
    gdp_epsilon,
    one_run_fdp_mass_needed,
    one_run_fdp_p_value,
    one_run_gdp_from_scores,
    one_run_gdp_lower_bound,
    pure_dp_blow_up_inverse,
)

_LAZY = {
    "AuditResult": "canaries",
    "SCORERS": "canaries",
    "canary_scores": "canaries",
    "gradient_canary_audit": "canaries",
    "confidence_logits": "membership",
    "input_canary_audit": "membership",
    "lira_offline_scores": "membership",
    "lira_online_scores": "membership",
    "loss_scores": "membership",
    "membership_report": "membership",
    "plot_roc": "membership",
}

__all__ = [*bounds.__all__, *fdp.__all__, *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"tf_dp.audit.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'tf_dp.audit' has no attribute {name!r}")
