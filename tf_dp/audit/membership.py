"""Black-box audits: membership inference and input-space (mislabeled) canaries.

What a user can run on any trained model, without the white-box access of
``tf_dp.audit.canaries``:

* ``membership_report``: ROC AUC, TPR at FPR 0.1% and 1%, and the ε lower bound of the best
  threshold test with Clopper–Pearson intervals (threshold chosen on one half of the
  examples, bounded on the other: ``tf_dp.audit.scores_epsilon_lower_bound``);
  ``plot_roc`` draws the ROC curves on log-log axes (Carlini et al. 2022 argue that the
  low-FPR region is what matters).
* Scores: ``loss_scores`` (the loss-threshold attack of Yeom et al. 2018: minus the
  per-example loss) and ``lira_offline_scores`` (LiRA, Carlini et al., "Membership Inference
  Attacks From First Principles", S&P 2022, offline variant: a Gaussian fitted to each
  example's logit-scaled confidence under shadow models trained *without* it; the score is
  how far the target model's confidence lies above it) and ``lira_online_scores`` (the
  online variant: Gaussians fitted under the shadows trained *with* and *without* each
  example, the score their log-likelihood ratio) with ``confidence_logits``.
* ``input_canary_audit``: the one-run audit (Steinke et al. 2023) with mislabeled canaries
  scored by loss: m examples given a wrong label, each put in the training data with
  probability 1/2, one ``fit`` of the user's private model.

Every function returns numbers; nothing prints.
"""

from __future__ import annotations

import math
import time

import numpy as np

from tf_dp.audit import bounds, fdp

__all__ = [
    "confidence_logits",
    "input_canary_audit",
    "lira_offline_scores",
    "lira_online_scores",
    "loss_scores",
    "membership_report",
    "plot_roc",
]

#: FPRs at which ``membership_report`` gives the TPR.
LOW_FPRS = (0.001, 0.01)


def membership_report(member_scores, nonmember_scores, delta: float = 1e-5,
                      confidence: float = 0.95, rng=None) -> dict:
    """AUC, TPR at FPR 0.1% and 1%, and the ε lower bound of a membership score.

    Args:
      member_scores, nonmember_scores: attack scores (higher = more likely a member) of
        examples that were / were not in the training data.
      delta: the run's δ.
      confidence: of the ε lower bound.
      rng: the auditor's ``numpy.random.Generator`` (the threshold split); None: fresh.

    Returns:
      dict with ``auc``, ``tpr_at_fpr_0.001``, ``tpr_at_fpr_0.01`` and the
      ``epsilon_lower_bound`` with the held-out ``tpr``/``fpr``/``threshold`` it came from.
      With fewer than 1,000 non-members a TPR at FPR 0.1% is the TPR at zero false
      positives.
    """
    report = {"auc": bounds.roc_auc(member_scores, nonmember_scores)}
    for f in LOW_FPRS:
        report[f"tpr_at_fpr_{f:g}"] = bounds.tpr_at_fpr(member_scores, nonmember_scores, f)
    report.update(bounds.scores_epsilon_lower_bound(member_scores, nonmember_scores, delta,
                                                    confidence, rng))
    return report


def plot_roc(curves: dict, path: str, title: str = None) -> str:
    """Writes the ROC curves ``{label: (member_scores, nonmember_scores)}`` on log-log axes
    to ``path`` (PNG) and returns it."""
    if not isinstance(curves, dict) or not curves:
        raise ValueError(f"`curves` must be a non-empty dict label -> (member_scores, "
                         f"nonmember_scores), got {type(curves).__name__}.")
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    floor = 1.0
    for label, (members, nonmembers) in curves.items():
        fpr, tpr, _ = bounds.roc_curve(members, nonmembers)
        auc = bounds.roc_auc(members, nonmembers)
        floor = min(floor, 1.0 / max(len(np.asarray(nonmembers)), 1))
        ax.plot(fpr, tpr, label=f"{label} (AUC {auc:.3f})")
    ax.plot([floor, 1], [floor, 1], "k:", lw=1, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(floor / 2, 1)
    ax.set_ylim(floor / 2, 1)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def loss_scores(model, x, y, loss="sparse_categorical_crossentropy", from_logits=True,
                batch_size: int = 512) -> np.ndarray:
    """Minus the per-example loss of ``model`` on (x, y): the loss-threshold attack's score.

    ``loss`` is a Keras loss name or function returning per-example values.
    """
    import keras  # noqa: PLC0415

    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    preds = model.predict(x, batch_size=batch_size, verbose=0)
    kwargs = {"from_logits": from_logits} if isinstance(loss, str) else {}
    values = keras.ops.convert_to_numpy(fn(np.asarray(y), preds, **kwargs))
    return -np.asarray(values, np.float64).reshape(len(preds), -1).mean(axis=1)


def confidence_logits(model, x, y, from_logits=True, batch_size: int = 512) -> np.ndarray:
    """LiRA's statistic: log(p_y / (1 − p_y)) of the label's probability, computed from
    logits as ``z_y − logsumexp(z_{≠y})`` (stable where p_y rounds to 1)."""
    preds = np.asarray(model.predict(x, batch_size=batch_size, verbose=0), np.float64)
    logits = preds if from_logits else np.log(np.clip(preds, 1e-300, None))
    y = np.asarray(y).reshape(-1).astype(int)
    rows = np.arange(len(y))
    correct = logits[rows, y]
    others = logits.copy()
    others[rows, y] = -np.inf
    top = others.max(axis=1, keepdims=True)
    rest = top[:, 0] + np.log(np.exp(others - top).sum(axis=1))
    return correct - rest


def lira_offline_scores(target_logits, shadow_logits, shadow_in) -> np.ndarray:
    """Offline LiRA scores (Carlini et al. 2022, §VI-C): for each example, a Gaussian
    N(μ_out, σ_out²) fitted to its confidence logits under the shadow models that did *not*
    train on it; the score is the one-sided standardised ``(φ_target − μ_out)/σ_out``
    (monotone in the offline likelihood ratio).

    Args:
      target_logits: (n,) ``confidence_logits`` of the target model.
      shadow_logits: (k, n) the same under k shadow models.
      shadow_in: (k, n) booleans, whether shadow j trained on example i.
    """
    t, s, inside = _shadow_arrays(target_logits, shadow_logits, shadow_in)
    out = ~inside
    counts = out.sum(axis=0)
    if np.any(counts < 2):
        raise ValueError("`shadow_in`: every example needs at least 2 shadow models trained "
                         f"without it, {int(np.sum(counts < 2))} have fewer.")
    mu = np.where(out, s, 0).sum(axis=0) / counts
    var = np.where(out, (s - mu) ** 2, 0).sum(axis=0) / (counts - 1)
    # A global floor keeps an example whose shadows agree exactly from dominating.
    sd = np.sqrt(np.maximum(var, max(float(np.median(var)), 1e-12) * 1e-2))
    return (t - mu) / sd


def _shadow_arrays(target_logits, shadow_logits, shadow_in):
    """(target (n,), shadows (k, n), shadow_in (k, n) bool) as arrays, shapes checked."""
    t = np.asarray(target_logits, np.float64).reshape(-1)
    s = np.asarray(shadow_logits, np.float64)
    inside = np.asarray(shadow_in)
    if s.ndim != 2 or s.shape[1] != t.size:
        raise ValueError(f"`shadow_logits` must have shape (shadows, {t.size}), got "
                         f"{s.shape}.")
    if inside.shape != s.shape or inside.dtype != bool:
        raise ValueError(f"`shadow_in` must be booleans of shape {s.shape}, got "
                         f"{inside.dtype} {inside.shape}.")
    return t, s, inside


def lira_online_scores(target_logits, shadow_logits, shadow_in,
                       global_variance: bool = True) -> np.ndarray:
    """Online LiRA scores (Carlini et al. 2022, Alg. 1): for each example, Gaussians
    N(μ_in, σ_in²) and N(μ_out, σ_out²) fitted to its confidence logits under the shadow models
    that did / did not train on it; the score is the log-likelihood ratio

    ```
    score = log N(φ_target; μ_in, σ_in²) − log N(φ_target; μ_out, σ_out²)
    ```

    Args:
      target_logits: (n,) ``confidence_logits`` of the target model.
      shadow_logits: (k, n) the same under k shadow models.
      shadow_in: (k, n) booleans, whether shadow j trained on example i; every example needs
        at least one IN and one OUT shadow (two of each without ``global_variance``).
      global_variance: one σ_in and one σ_out for all examples (the pooled within-example
        variances), as Carlini et al. recommend with few shadow models (their §VI-B: with
        under ~64 shadows per-example variances are too noisy); False: per example.
    """
    t, s, inside = _shadow_arrays(target_logits, shadow_logits, shadow_in)
    least = 1 if global_variance else 2
    loglik = []
    for mask, name in ((inside, "IN"), (~inside, "OUT")):
        counts = mask.sum(axis=0)
        if np.any(counts < least):
            raise ValueError(f"`shadow_in`: every example needs at least {least} {name} shadow "
                             f"model(s), {int(np.sum(counts < least))} have fewer.")
        mu = np.where(mask, s, 0).sum(axis=0) / counts
        squares = np.where(mask, (s - mu) ** 2, 0).sum(axis=0)
        if global_variance:
            dof = int((counts - 1).sum())
            if dof < 1:
                raise ValueError(f"`shadow_in`: the {name} shadows give no variance estimate "
                                 "(one model per example).")
            var = np.full(t.size, max(squares.sum() / dof, 1e-12))
        else:
            var = np.maximum(squares / (counts - 1), 1e-12)
        loglik.append(-0.5 * np.log(2 * math.pi * var) - 0.5 * (t - mu) ** 2 / var)
    return loglik[0] - loglik[1]


def input_canary_audit(build_model, x, y, num_classes: int, num_canaries: int,
                       canary_x, canary_y=None, fit_kwargs: dict = None, delta: float = 1e-5,
                       confidence: float = 0.95, from_logits: bool = True,
                       rng=None) -> dict:
    """One-run audit with mislabeled input-space canaries, scored by loss (black box).

    ```
    canary j = (canary_x[j], a wrong label),          j = 1..m
    included_j ~ Bernoulli(1/2)                       # the auditor's coins
    model = build_model(); model.fit(x ∪ included canaries, **fit_kwargs)
    score_j = −loss(model(canary_x[j]), wrong label_j); one-run bound over the guesses
    ```

    Args:
      build_model: zero-argument callable returning a compiled private model (its optimizer
        unseeded: the audit is of the mechanism as it runs).
      x, y: the other training data (integer labels).
      num_classes: for drawing wrong labels.
      num_canaries: m (at most ``len(canary_x)``).
      canary_x: inputs the canaries are made from (not in ``x``).
      canary_y: their true labels, if known: each canary then gets a different one;
        otherwise a uniformly random label.
      fit_kwargs: passed to ``fit`` (``batch_size``, ``epochs``, ...; verbose defaults to 0).
      delta, confidence: of the bound.
      from_logits: whether the model outputs logits (for the loss).
      rng: the auditor's ``numpy.random.Generator``; None draws a fresh one.

    Returns:
      dict with ``epsilon_lower_bound`` and the guesses (``one_run_from_scores``),
      ``epsilon`` (the model's accountant), ``gdp`` (the f-DP reading of the guesses,
      ``tf_dp.audit.one_run_gdp_from_scores``: ``mu`` and its ``epsilon``), the canaries'
      ``membership`` report (AUC, TPR at
      low FPR; its ε bound uses only half of them), their ``member_scores`` /
      ``nonmember_scores``, and ``seconds``.
    """
    m = int(num_canaries)
    if isinstance(num_canaries, bool) or m != num_canaries or m < 2:
        raise ValueError(f"`num_canaries` must be an integer >= 2, got {num_canaries!r}.")
    canary_x = np.asarray(canary_x)
    if len(canary_x) < m:
        raise ValueError(f"`canary_x` must hold at least `num_canaries` ({m}) inputs, got "
                         f"{len(canary_x)}.")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"`num_classes` must be an integer >= 2, got {num_classes!r}.")
    start = time.perf_counter()
    rng = np.random.default_rng() if rng is None else rng
    cx = canary_x[:m]
    # A wrong label, uniform among the others: the canary is then an outlier the model can
    # only fit by memorising it. Without true labels, a uniformly random one.
    base = (rng.integers(0, num_classes, m) if canary_y is None
            else np.asarray(canary_y).reshape(-1)[:m].astype(int))
    labels = (base + rng.integers(1, num_classes, m)) % num_classes if canary_y is not None \
        else base
    included = rng.random(m) < 0.5
    y = np.asarray(y).reshape(len(x), *np.asarray(y).shape[1:])
    train_x = np.concatenate([np.asarray(x), cx[included]])
    train_y = np.concatenate([y, labels[included].astype(y.dtype).reshape(-1, *y.shape[1:])])
    model = build_model()
    if not callable(getattr(model, "epsilon", None)):
        # A plain Keras model has no accountant: the audit's lower bound would be compared
        # with nothing (an epsilon of NaN, reported without a word until session 14).
        raise ValueError(
            "`build_model` must return a compiled tf_dp private model (tf_dp.keras."
            f"make_private, DPSequential, ...), got {type(model).__name__}. For a non-private "
            "baseline use a private model with noise_multiplier=0 and l2_norm_clip=inf "
            "(its epsilon is inf).")
    kwargs = {"verbose": 0, **(fit_kwargs or {})}
    model.fit(train_x, train_y, **kwargs)
    scores = loss_scores(model, cx, labels, from_logits=from_logits)
    result = bounds.one_run_from_scores(scores, included, delta, confidence, rng=rng)
    result["gdp"] = fdp.one_run_gdp_from_scores(scores, included, delta, confidence, rng=rng)
    result["epsilon"] = float(model.epsilon())
    result["member_scores"] = scores[included]
    result["nonmember_scores"] = scores[~included]
    result["membership"] = membership_report(scores[included], scores[~included], delta,
                                             confidence, rng)
    result["seconds"] = time.perf_counter() - start
    return result
