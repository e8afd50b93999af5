"""Statistical lower bounds on ε from an attack's outcome (NumPy and SciPy only).

Two ways to turn what an attacker got right into an ε that a run provably exceeds (with the
stated confidence, over the randomness of the run and of the auditor):

* ``one_run_epsilon_lower_bound``: Steinke, Nasr and Jagielski, "Privacy Auditing with One
  (1) Training Run" (NeurIPS 2023). m canaries, each included independently with
  probability 1/2; the auditor guesses in/out for r of them and v guesses are right. Under
  (ε, δ)-DP the number of correct guesses is stochastically dominated by Binomial(r,
  e^ε/(1+e^ε)) up to a δ-term (their Theorem 3 and the p-value of their Algorithm 2):

  ```
  q     = e^ε / (1 + e^ε)
  β(ε)  = P[Binomial(r, q) ≥ v]
  α(ε)  = max_{1≤i≤v} P[v−i ≤ Binomial(r, q) < v] / i
  p(ε)  = min(1, β(ε) + α(ε) · 2 m δ)
  ```

  and the lower bound is the largest ε whose p-value is below 1 − confidence.
* ``membership_epsilon_lower_bound``: a membership-inference test with true- and
  false-positive rates (TPR, FPR) on independent members and non-members gives
  ε ≥ log((TPR − δ)/FPR) and ε ≥ log((1 − FPR − δ)/(1 − TPR)) (the hypothesis-testing
  view of (ε, δ)-DP; Kairouz et al. 2015); with Clopper–Pearson intervals for the rates
  (Jagielski et al. 2020, Nasr et al. 2021) the bound holds with the stated confidence.

Plus the ROC tools of a membership-inference evaluation (``roc_curve``, ``roc_auc``,
``tpr_at_fpr``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

__all__ = [
    "clopper_pearson",
    "guess_counts",
    "membership_epsilon_lower_bound",
    "one_run_epsilon_lower_bound",
    "one_run_from_scores",
    "one_run_p_value",
    "roc_auc",
    "roc_curve",
    "scores_epsilon_lower_bound",
    "tpr_at_fpr",
]


# -- argument checks (each names the argument) -------------------------------------------


def _count(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be a non-negative integer, got {value!r}.")
    return int(value)


def _delta(delta) -> float:
    d = float(delta)
    if not 0.0 <= d < 1.0 or math.isnan(d):
        raise ValueError(f"`delta` must be in [0, 1), got {delta!r}.")
    return d


def _confidence(confidence) -> float:
    c = float(confidence)
    if not 0.0 < c < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}.")
    return c


# -- one-run audit (Steinke, Nasr, Jagielski 2023) ---------------------------------------


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, epsilon: float,
                    delta: float = 0.0) -> float:
    """P-value of ``num_correct`` right guesses out of ``num_guesses`` under (ε, δ)-DP.

    An upper bound on the probability, for any (ε, δ)-DP mechanism and any guessing rule,
    of at least ``num_correct`` correct guesses when each of ``num_canaries`` canaries is
    included independently with probability 1/2 (Steinke et al. 2023, Theorem 3 and
    Algorithm 2). Small values reject "the run is (ε, δ)-DP".
    """
    m = _count(num_canaries, "num_canaries")
    r = _count(num_guesses, "num_guesses")
    v = _count(num_correct, "num_correct")
    if r > m:
        raise ValueError(f"`num_guesses` must be at most `num_canaries` ({m}), got {r}.")
    if v > r:
        raise ValueError(f"`num_correct` must be at most `num_guesses` ({r}), got {v}.")
    eps = float(epsilon)
    if not eps >= 0.0:
        raise ValueError(f"`epsilon` must be >= 0, got {epsilon!r}.")
    d = _delta(delta)
    if v == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-eps)) if eps < 700 else 1.0
    beta = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if d == 0.0:
        return min(beta, 1.0)
    # α = max_i P[v - i <= B < v] / i, with P[v - i <= B < v] = sf(v - i - 1) - sf(v - 1).
    i = np.arange(1, v + 1)
    window = stats.binom.sf(v - i - 1, r, q) - beta
    alpha = float(np.max(window / i))
    return min(beta + alpha * 2.0 * m * d, 1.0)


def one_run_epsilon_lower_bound(num_canaries: int, num_guesses: int, num_correct: int,
                                delta: float = 0.0, confidence: float = 0.95,
                                tolerance: float = 1e-6) -> float:
    """The ε a run exceeds with probability ``confidence``: the largest ε whose p-value
    (``one_run_p_value``) is below 1 − confidence, found by bisection (the p-value grows
    with ε). 0 when even ε = 0 is not rejected.

    Args:
      num_canaries: m, canaries each included with probability 1/2 (all of them count,
        including those the auditor abstained on).
      num_guesses: r, the canaries guessed (in or out).
      num_correct: v, the right guesses.
      delta: δ of the claim being tested (the run's δ).
      confidence: e.g. 0.95 (p-value threshold 0.05).
      tolerance: absolute precision of the returned ε (it is rounded down).

    Reference: Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run",
    NeurIPS 2023 (Theorem 3; Algorithm 2 computes the bound the same way).
    """
    conf = _confidence(confidence)
    if not tolerance > 0:
        raise ValueError(f"`tolerance` must be > 0, got {tolerance!r}.")
    threshold = 1.0 - conf

    def rejected(eps):
        return one_run_p_value(num_canaries, num_guesses, num_correct, eps, delta) < threshold

    if not rejected(0.0):
        return 0.0
    # 1e4: no finite claim survives (e.g. perfect guesses with δ = 0 and huge r).
    return _largest_rejected(rejected, tolerance, cap=1e4)


def _largest_rejected(rejected, tolerance: float, cap: float) -> float:
    """The largest x (rounded down to ``tolerance``) with ``rejected(x)`` true, for a
    ``rejected`` that holds at 0 and is monotone (true up to a point, false beyond):
    doubling, then bisection; ``inf`` if it still holds beyond ``cap``."""
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2.0 * hi
        if hi > cap:
            return math.inf
    while hi - lo > tolerance:
        mid = 0.5 * (lo + hi)
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return lo


# -- membership inference: (TPR, FPR) with Clopper–Pearson --------------------------------


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple:
    """Two-sided Clopper–Pearson interval (lo, hi) for a binomial proportion: each side
    fails with probability at most (1 − confidence)/2."""
    k = _count(successes, "successes")
    n = _count(trials, "trials")
    if n == 0:
        raise ValueError("`trials` must be > 0, got 0.")
    if k > n:
        raise ValueError(f"`successes` must be at most `trials` ({n}), got {k}.")
    tail = (1.0 - _confidence(confidence)) / 2.0
    lo = 0.0 if k == 0 else float(stats.beta.ppf(tail, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1.0 - tail, k + 1, n - k))
    return lo, hi


def membership_epsilon_lower_bound(true_positives: int, num_members: int,
                                   false_positives: int, num_nonmembers: int,
                                   delta: float = 0.0, confidence: float = 0.95) -> float:
    """ε lower bound from one membership test's counts, with Clopper–Pearson intervals.

    TPR is bounded below and FPR above, each one-sided at (1 − confidence)/2 (so both hold
    together with probability ``confidence``); then

    ```
    ε ≥ max(log((TPR_lo − δ) / FPR_hi), log((1 − FPR_hi − δ) / (1 − TPR_lo)), 0)
    ```

    (an (ε, δ)-DP mechanism has TPR ≤ e^ε FPR + δ and 1 − FPR ≤ e^ε (1 − TPR) + δ for every
    test). The test (its threshold) must not have been chosen on these same counts; see
    ``scores_epsilon_lower_bound``.
    """
    if _count(num_members, "num_members") == 0:
        raise ValueError("`num_members` must be > 0, got 0.")
    if _count(num_nonmembers, "num_nonmembers") == 0:
        raise ValueError("`num_nonmembers` must be > 0, got 0.")
    clopper_pearson(true_positives, num_members, confidence)  # checks the counts
    clopper_pearson(false_positives, num_nonmembers, confidence)
    return float(_membership_epsilon(np.asarray([true_positives]), num_members,
                                     np.asarray([false_positives]), num_nonmembers,
                                     _delta(delta), _confidence(confidence))[0])


def _membership_epsilon(tp, n_pos, fp, n_neg, delta, confidence):
    """``membership_epsilon_lower_bound`` for arrays of counts (checked by the caller)."""
    tail = (1.0 - confidence) / 2.0
    tp, fp = np.asarray(tp, np.float64), np.asarray(fp, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpr_lo = np.where(tp > 0, stats.beta.ppf(tail, tp, n_pos - tp + 1), 0.0)
        fpr_hi = np.where(fp < n_neg, stats.beta.ppf(1.0 - tail, fp + 1, n_neg - fp), 1.0)
        first = np.where((tpr_lo - delta > 0) & (fpr_hi > 0),
                         np.log(np.maximum(tpr_lo - delta, 1e-300) / fpr_hi), 0.0)
        second = np.where((1.0 - fpr_hi - delta > 0) & (1.0 - tpr_lo > 0),
                          np.log(np.maximum(1.0 - fpr_hi - delta, 1e-300)
                                 / np.maximum(1.0 - tpr_lo, 1e-300)), 0.0)
    return np.maximum(np.maximum(first, second), 0.0)


# -- ROC ---------------------------------------------------------------------------------


def _scores(values, name: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError(f"`{name}` must hold at least one score, got none.")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"`{name}` must be finite, got {int(np.sum(~np.isfinite(a)))} "
                         "non-finite value(s).")
    return a


def roc_curve(member_scores, nonmember_scores) -> tuple:
    """(fpr, tpr, thresholds) of the test "member if score ≥ threshold" at every distinct
    score (higher score = more likely a member), from (0, 0) to (1, 1)."""
    pos = _scores(member_scores, "member_scores")
    neg = _scores(nonmember_scores, "nonmember_scores")
    thresholds = np.unique(np.concatenate([pos, neg]))[::-1]
    tp = len(pos) - np.searchsorted(np.sort(pos), thresholds, side="left")
    fp = len(neg) - np.searchsorted(np.sort(neg), thresholds, side="left")
    tpr = np.concatenate([[0.0], tp / len(pos)])
    fpr = np.concatenate([[0.0], fp / len(neg)])
    return fpr, tpr, np.concatenate([[np.inf], thresholds])


def roc_auc(member_scores, nonmember_scores) -> float:
    """Area under the ROC curve: P[member score > non-member score] + P[tie]/2."""
    pos = _scores(member_scores, "member_scores")
    neg = _scores(nonmember_scores, "nonmember_scores")
    ranks = stats.rankdata(np.concatenate([pos, neg]))
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2)
                 / (len(pos) * len(neg)))


def tpr_at_fpr(member_scores, nonmember_scores, fpr: float) -> float:
    """The largest TPR of a threshold test whose FPR is at most ``fpr`` (no interpolation:
    at FPR 0.1% with 1,000 non-members this is the TPR at one false positive)."""
    f = float(fpr)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"`fpr` must be in [0, 1], got {fpr!r}.")
    fprs, tprs, _ = roc_curve(member_scores, nonmember_scores)
    return float(np.max(tprs[fprs <= f + 1e-12]))


def scores_epsilon_lower_bound(member_scores, nonmember_scores, delta: float = 0.0,
                               confidence: float = 0.95, rng=None) -> dict:
    """ε lower bound of a score-threshold membership test, the threshold chosen honestly.

    The members and non-members are split at random in two halves (``rng``: the auditor's
    ``numpy.random.Generator``; None draws a fresh one). The threshold (and which of the two
    ε forms) that gives the best Clopper–Pearson bound on the first half is applied to the
    second half, whose counts give the bound: choosing the threshold on the counts that are
    then bounded would make the confidence level false.

    Returns:
      dict with ``epsilon_lower_bound``, the ``threshold``, and the held-out ``tpr``,
      ``fpr``, ``num_members``, ``num_nonmembers`` it came from.
    """
    pos = _scores(member_scores, "member_scores")
    neg = _scores(nonmember_scores, "nonmember_scores")
    if len(pos) < 2 or len(neg) < 2:
        raise ValueError("`member_scores` and `nonmember_scores` need at least 2 scores each "
                         f"(split in halves), got {len(pos)} and {len(neg)}.")
    rng = np.random.default_rng() if rng is None else rng
    pos, neg = rng.permutation(pos), rng.permutation(neg)
    pos_a, pos_b = pos[: len(pos) // 2], pos[len(pos) // 2:]
    neg_a, neg_b = neg[: len(neg) // 2], neg[len(neg) // 2:]

    def counts(p, n, t):
        t = np.atleast_1d(t)
        return (len(p) - np.searchsorted(np.sort(p), t, side="left"),
                len(n) - np.searchsorted(np.sort(n), t, side="left"))

    d, conf = _delta(delta), _confidence(confidence)
    candidates = np.unique(np.concatenate([pos_a, neg_a]))
    tp_a, fp_a = counts(pos_a, neg_a, candidates)
    eps_a = _membership_epsilon(tp_a, len(pos_a), fp_a, len(neg_a), d, conf)
    best_t = candidates[int(np.argmax(eps_a))]
    tp, fp = (int(c[0]) for c in counts(pos_b, neg_b, best_t))
    return {
        "epsilon_lower_bound": membership_epsilon_lower_bound(
            tp, len(pos_b), fp, len(neg_b), delta, confidence),
        "threshold": float(best_t),
        "tpr": tp / len(pos_b),
        "fpr": fp / len(neg_b),
        "num_members": len(pos_b),
        "num_nonmembers": len(neg_b),
    }


# -- one-run audit from canary scores ----------------------------------------------------

#: Fractions of the canaries guessed "in" (top scores) tried by ``one_run_from_scores``; for
#: each, the same number is also tried with as many "out" guesses on the lowest scores.
DEFAULT_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def one_run_from_scores(scores, included, delta: float = 0.0, confidence: float = 0.95,
                        guesses=None, rng=None) -> dict:
    """The one-run ε lower bound from canary scores (higher = more likely included).

    For each (k_in, k_out) in ``guesses`` the auditor guesses "in" for the k_in highest and
    "out" for the k_out lowest scores (ties broken at random with ``rng``, the auditor's
    generator) and counts its right guesses; the best bound is reported with a Bonferroni
    correction over the pairs tried (each is evaluated at confidence
    1 − (1 − confidence)/len(guesses)), so picking the best pair after the fact keeps the
    stated confidence.

    Args:
      scores: one score per canary (m of them).
      included: booleans, whether each canary was in the training data (drawn by the
        auditor with probability 1/2 each, before the run).
      delta: δ of the claim tested.
      confidence: overall confidence of the returned bound.
      guesses: sequence of (k_in, k_out); default from ``DEFAULT_GUESS_FRACTIONS``.
      rng: ``numpy.random.Generator`` for the tie-breaking; None draws a fresh one.

    Returns:
      dict: ``epsilon_lower_bound``, ``num_guesses``, ``num_correct``, ``k_in``, ``k_out``
      of the best pair, ``num_canaries`` and ``pairs_tried``.
    """
    counts = guess_counts(scores, included, guesses, rng)
    conf = 1.0 - (1.0 - _confidence(confidence)) / len(counts)
    m = _scores(scores, "scores").size
    best = None
    for k_in, k_out, correct in counts:
        eps = one_run_epsilon_lower_bound(m, k_in + k_out, correct, delta, conf)
        if best is None or eps > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": eps, "num_guesses": k_in + k_out,
                    "num_correct": correct, "k_in": k_in, "k_out": k_out}
    best.update(num_canaries=m, pairs_tried=len(counts))
    return best


def guess_counts(scores, included, guesses=None, rng=None) -> list:
    """The right guesses of each (k_in, k_out) pair: "in" for the k_in highest scores, "out"
    for the k_out lowest (ties broken at random with ``rng``).

    Args:
      scores: one score per canary (m of them; higher = more likely included).
      included: booleans, whether each canary was in the training data.
      guesses: sequence of (k_in, k_out); default: for each f in
        ``DEFAULT_GUESS_FRACTIONS``, k = round(f·m) as (k, 0) and (k, k).
      rng: ``numpy.random.Generator``; None draws a fresh one.

    Returns:
      list of (k_in, k_out, num_correct), one per pair, in order.
    """
    s = _scores(scores, "scores")
    inc = np.asarray(included).reshape(-1)
    if inc.dtype != bool:
        raise ValueError(f"`included` must be booleans, got dtype {inc.dtype}.")
    if inc.shape != s.shape:
        raise ValueError(f"`included` must have one entry per score ({s.size}), got "
                         f"{inc.size}.")
    m = s.size
    if guesses is None:
        guesses = []
        for f in DEFAULT_GUESS_FRACTIONS:
            k = max(1, int(round(f * m)))
            for pair in ((k, 0), (k, k)):
                if sum(pair) <= m and pair not in guesses:
                    guesses.append(pair)
    guesses = [(_count(a, "guesses"), _count(b, "guesses")) for a, b in guesses]
    if not guesses or any(a + b > m or a + b == 0 for a, b in guesses):
        raise ValueError(f"`guesses` must be non-empty (k_in, k_out) pairs with "
                         f"0 < k_in + k_out <= {m}, got {guesses!r}.")
    rng = np.random.default_rng() if rng is None else rng
    order = np.lexsort((rng.random(m), s))[::-1]  # descending score, random among ties
    return [(k_in, k_out,
             int(inc[order[:k_in]].sum()) + (int((~inc[order[m - k_out:]]).sum()) if k_out
                                             else 0))
            for k_in, k_out in guesses]
