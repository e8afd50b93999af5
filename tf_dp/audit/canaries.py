"""White-box one-run audit of a tf_dp optimizer with Dirac gradient canaries.

The audit (Steinke, Nasr and Jagielski, NeurIPS 2023, §6 "white-box"): m canaries, each
put in the training data independently with probability 1/2 by the auditor; one run of
tf_dp's own private ``fit`` (Poisson sampling, clipping, noise, accounting); a score per
canary from the released per-step updates; guesses on the most (and least) confident
canaries; the ε lower bound of ``tf_dp.audit.bounds``.

Canary i is the id i fed to a scalar ``Embedding`` (one row per canary) with target s ≥ C
and the loss ``−target·output``: its per-example gradient is ``−s·e_i``, a Dirac direction
in embedding row i of norm s, the same at every step (the one-hot-input ``Dense`` of the
paper, without an N × m input). Clipping cuts it to C, so a step that samples canary i
moves row i by ``lr·C/E`` plus that row's noise ``lr·σC·ξ/E``, and nothing else does: each canary coordinate is its own Poisson-subsampled
Gaussian mechanism, and the audit measures what the implementation actually does to one
example (clipping, noise scale, fresh noise every step, q and the step count). Other
examples (``num_other_examples``) have target 0 (zero gradient): they change N and so q,
not the canaries' coordinates.

Scorers (higher = more likely included), functions of the released updates only:

* ``"sum"``: the total update of the canary's coordinate (what the final model shows).
* ``"likelihood_ratio"``: ``Σ_t log(1 − q + q·exp((y_t − 1/2)/σ̂²))``, the per-step
  likelihood ratio of "sampled with probability q" against "absent" for the normalised
  update ``y_t`` (1 = one clipped canary) with σ̂ the noise std *estimated from the released
  updates* (a robust scale of all canary coordinates): whatever σ the code really used,
  this is close to the most powerful test, so a too-small noise shows.
* ``"repeated_noise"``: minus the number of consecutive steps whose updates of the
  coordinate agree to within ``1e-4`` of a clipped canary. Fresh noise agrees only by rare
  accident, so for a correct optimizer the scores (almost) tie, ties broken at random;
  noise replayed at step t makes an absent canary's two updates agree exactly, while an
  included canary sampled in only one of the two breaks the agreement.

The guesses are chosen after seeing the scores, so a Bonferroni correction is applied over
every (scorer, number of guesses) pair tried. The same guesses are also read in f-DP
(``tf_dp.audit.fdp``): a lower bound on μ of μ-GDP and the ε(δ) of that Gaussian mechanism.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from tf_dp.accounting.functions import epsilon_text as _epsilon_text
from tf_dp.audit import bounds, fdp

__all__ = ["AuditResult", "SCORERS", "gradient_canary_audit", "canary_scores"]

#: Scorers ``gradient_canary_audit`` knows by name (see the module docstring).
SCORERS = ("sum", "likelihood_ratio", "repeated_noise")

_REPEAT_TOLERANCE = 1e-4  # float32 rounding of the rows is ~1e-6 of a canary


@dataclasses.dataclass
class AuditResult:
    """What one audit run found.

    Attributes:
      epsilon_lower_bound: the audited ε lower bound at ``delta`` (with ``confidence``).
      epsilon: the accountant's ε for the same run (``model.epsilon()``).
      epsilon_exact_clipping: what exact clipping would cost at the same σ, q and steps
        (differs from ``epsilon`` for JL norms only).
      delta, confidence: of the bound and of ``epsilon``.
      num_canaries, num_included: m and how many the auditor put in.
      steps, sampling_probability, noise_multiplier, l2_norm_clip: of the run, as accounted.
      scorer, num_guesses, num_correct: of the best (scorer, guesses) pair.
      per_scorer: the best bound of each scorer (each already Bonferroni-corrected for all
        pairs tried).
      seconds: wall time of the audit (training and scoring).
      gdp_mu: the f-DP reading of the same guesses (``tf_dp.audit.fdp``, same Bonferroni
        correction): "the run is not μ-GDP" for this μ, at ``confidence``.
      gdp_epsilon: ε(δ) of a ``gdp_mu``-GDP mechanism: an ε lower bound within the Gaussian
        family, not against every (ε, δ) claim (DP-SGD's own trade-off curve is not
        Gaussian), so ``violation`` uses ``epsilon_lower_bound`` only.
      claim_p_value: p-value of the accountant's own claim — the run is (ε, δ(ε))-DP for
        its pessimistic δ(ε) at every ε of a grid (``tf_dp.audit.profile_blow_up_inverse``)
        — from the same guesses, Bonferroni-corrected (the smallest p-value times the pairs
        tried, capped at 1). Below 1 − confidence: ``claim_rejected``.
    """

    epsilon_lower_bound: float
    epsilon: float
    epsilon_exact_clipping: float
    delta: float
    confidence: float
    num_canaries: int
    num_included: int
    steps: int
    sampling_probability: float
    noise_multiplier: float
    l2_norm_clip: float
    scorer: str
    num_guesses: int
    num_correct: int
    per_scorer: dict
    seconds: float
    gdp_mu: float = math.nan
    gdp_epsilon: float = math.nan
    claim_p_value: float = math.nan

    @property
    def claim_rejected(self) -> bool:
        """True if the guesses reject the accountant's whole privacy profile (f-DP reading,
        ``claim_p_value`` < 1 − confidence): a broken run, found with more power than
        ``violation``."""
        return self.claim_p_value < 1.0 - self.confidence

    @property
    def violation(self) -> bool:
        """True if the audited lower bound exceeds the accountant's ε (a broken run)."""
        return self.epsilon_lower_bound > self.epsilon

    def __str__(self):
        return (f"audited epsilon >= {self.epsilon_lower_bound:.3f} (confidence "
                f"{self.confidence:g}, {self.scorer}: {self.num_correct}/{self.num_guesses} "
                f"right guesses of {self.num_canaries} canaries) vs accountant epsilon "
                f"{_epsilon_text(self.epsilon)} at delta {self.delta:g}; f-DP reading: not "
                f"{self.gdp_mu:.3f}-GDP (its epsilon {self.gdp_epsilon:.3f}); p-value of the "
                f"accountant's profile {self.claim_p_value:.3g}"
                + (" -- VIOLATION: the implementation spends more than it reports"
                   if self.violation or self.claim_rejected else ""))


def canary_scores(updates, sampling_probability: float, scorer: str) -> np.ndarray:
    """Scores of m canaries from their normalised per-step updates.

    Args:
      updates: (steps, m) array; entry (t, i) is step t's update of canary i's coordinate
        in units of one clipped canary (1 = the canary's clipped gradient, no noise).
      sampling_probability: q of the run.
      scorer: one of ``SCORERS``.
    """
    y = np.asarray(updates, dtype=np.float64)
    if y.ndim != 2 or y.shape[0] == 0:
        raise ValueError(f"`updates` must be a (steps, canaries) array with steps > 0, got "
                         f"shape {y.shape}.")
    if scorer == "sum":
        return y.sum(axis=0)
    if scorer == "likelihood_ratio":
        q = float(sampling_probability)
        if not 0 < q <= 1:
            raise ValueError(f"`sampling_probability` must be in (0, 1], got {q!r}.")
        # Robust noise scale: the median absolute deviation ignores the rare sampled steps.
        sigma = max(1.4826 * float(np.median(np.abs(y - np.median(y)))), 1e-6)
        a = (y - 0.5) / sigma**2
        if q == 1.0:
            return a.sum(axis=0)
        return np.logaddexp(math.log1p(-q), math.log(q) + a).sum(axis=0)
    if scorer == "repeated_noise":
        if y.shape[0] < 2:
            return np.zeros(y.shape[1])
        repeats = np.abs(np.diff(y, axis=0)) < _REPEAT_TOLERANCE
        return -repeats.sum(axis=0).astype(np.float64)
    raise ValueError(f"`scorer` must be one of {SCORERS}, got {scorer!r}.")


def _check_optimizer(optimizer):
    import keras  # noqa: PLC0415 (TensorFlow only when an audit runs)

    from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin  # noqa: PLC0415

    if callable(optimizer) and not isinstance(optimizer, keras.optimizers.Optimizer):
        optimizer = optimizer()
    if not isinstance(optimizer, DPOptimizerMixin) or not isinstance(
            optimizer, keras.optimizers.SGD):
        raise ValueError("`optimizer` must be a tf_dp DPSGD (or a callable returning one): "
                         "the scores read the noised gradient off plain SGD updates; got "
                         f"{type(optimizer).__name__}.")
    if float(optimizer.momentum) != 0.0 or optimizer.nesterov:
        raise ValueError(f"`optimizer` must have momentum 0 (each step's update is then the "
                         f"noised gradient times the learning rate), got momentum "
                         f"{optimizer.momentum!r}.")
    if optimizer.weight_decay:
        raise ValueError(f"`optimizer` must have no weight_decay, got "
                         f"{optimizer.weight_decay!r}.")
    if not isinstance(optimizer.get_config().get("learning_rate"), (float, int)):
        raise ValueError("`optimizer` must have a constant learning rate (a schedule changes "
                         "the unit of the scores).")
    if optimizer.iterations.numpy() != 0:
        raise ValueError("`optimizer` must be fresh (one audit is one training run); got one "
                         f"that has taken {int(optimizer.iterations.numpy())} steps.")
    if optimizer.accumulation_steps != 1:
        raise ValueError("`optimizer` must have gradient_accumulation_steps=1 for the audit, "
                         f"got {optimizer.accumulation_steps}.")
    return optimizer


def gradient_canary_audit(optimizer, num_canaries: int = 1000, expected_batch_size: int = 10,
                          epochs: int = 4, num_other_examples: int = 0, delta: float = 1e-5,
                          confidence: float = 0.95, scorers=("likelihood_ratio",),
                          guesses=None, canary_gradient_norm: float = None,
                          rng=None) -> AuditResult:
    """One-run white-box audit of a tf_dp DPSGD optimizer with Dirac gradient canaries.

    ```
    included_i ~ Bernoulli(1/2), i = 1..m          # the auditor's coins (``rng``)
    data = {(i, s) : included_i} ∪ {(m, 0)}^other  # canary i: gradient −s·e_i, ‖·‖ = s ≥ C
    fit(data, batch_size=E, epochs)                 # tf_dp: Poisson q = E/N, clip, noise
    y[t, i] = Δrow_i[t] · E / (lr · C)            # step t's update of canary i
    score_i = scorer(y[:, i]);  guesses on the top k_in / bottom k_out scores
    ε_lb = one-run bound (Steinke et al. 2023), Bonferroni over (scorer, k_in, k_out)
    ```

    Args:
      optimizer: a fresh ``tf_dp.DPSGD`` (any norm strategy, momentum 0, constant learning
        rate) or a zero-argument callable returning one. It is used for this one run.
      num_canaries: m.
      expected_batch_size: E of Poisson sampling (q = E/N, N the realised dataset size).
      epochs: passes of ``fit``; steps = epochs · ceil(N/E) as ``fit`` takes them.
      num_other_examples: examples with zero gradient added to the data (lower q at a given
        E without touching the canaries' coordinates).
      delta: δ of the accountant's ε and of the bound.
      confidence: of the bound (e.g. 0.95).
      scorers: names from ``SCORERS``; the bound is the best over them, corrected.
      guesses: (k_in, k_out) pairs for ``tf_dp.audit.one_run_from_scores``; default its own.
      canary_gradient_norm: s, the canary gradients' norm before clipping (default
        10^4 · C, or 1 without clipping).
      rng: the auditor's ``numpy.random.Generator`` (inclusion coins, tie-breaking); None
        draws a fresh one from OS entropy. It is never the optimizer's randomness.

    Returns:
      ``AuditResult``: the audited bound next to the accountant's ε.
    """
    m = _positive_int(num_canaries, "num_canaries")
    batch = _positive_int(expected_batch_size, "expected_batch_size")
    epochs = _positive_int(epochs, "epochs")
    if isinstance(num_other_examples, bool) or not isinstance(num_other_examples, int) or \
            num_other_examples < 0:
        raise ValueError(f"`num_other_examples` must be an integer >= 0, got "
                         f"{num_other_examples!r}.")
    scorers = (scorers,) if isinstance(scorers, str) else tuple(scorers)
    if not scorers or any(s not in SCORERS for s in scorers):
        raise ValueError(f"`scorers` must be names from {SCORERS}, got {scorers!r}.")
    start = time.perf_counter()

    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from tf_dp.keras import make_private  # noqa: PLC0415

    optimizer = _check_optimizer(optimizer)
    clip = optimizer.l2_norm_clip
    norm = (canary_gradient_norm if canary_gradient_norm is not None
            else (1e4 * clip if math.isfinite(clip) else 1.0))
    if not norm > 0 or not math.isfinite(norm):
        raise ValueError(f"`canary_gradient_norm` must be a finite number > 0, got {norm!r}.")
    if norm < clip and math.isfinite(clip):
        raise ValueError(f"`canary_gradient_norm` must be >= `l2_norm_clip` ({clip:g}) so "
                         f"that canaries are clipped, got {norm!r}.")
    rng = np.random.default_rng() if rng is None else rng
    included = rng.random(m) < 0.5
    ids = np.flatnonzero(included)
    n = len(ids) + num_other_examples
    if n < batch:
        raise ValueError(f"`expected_batch_size` ({batch}) must be at most the dataset size "
                         f"({n}: included canaries plus `num_other_examples`).")
    # Canary i is id i with target s; the other examples are id m with target 0 (their
    # gradient is 0). An embedding row per canary keeps the data O(N), not O(N·m).
    x = np.full((n, 1), m, np.int32)
    x[: len(ids), 0] = ids
    y = np.zeros((n, 1), np.float32)
    y[: len(ids), 0] = norm

    inputs = keras.Input((1,), dtype="int32")
    rows = keras.layers.Embedding(m + 1, 1, embeddings_initializer="zeros",
                                  name="canary_coordinates")
    model = make_private(keras.Model(inputs, keras.layers.Flatten()(rows(inputs))), delta=delta)

    def negative_output(y_true, y_pred):  # per-example loss −y·output: gradient −y·e_id
        return -tf.reduce_sum(y_true * y_pred, axis=-1)

    model.compile(optimizer=optimizer, loss=negative_output)
    kernels = [np.zeros(m)]

    class _Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            kernels.append(rows.embeddings.numpy()[:m, 0].astype(np.float64))

    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[_Record()])
    q = batch / n
    lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    unit = lr * min(clip, norm) / batch
    updates = np.diff(np.stack(kernels), axis=0) / unit
    steps = updates.shape[0]

    counts = {name: bounds.guess_counts(canary_scores(updates, q, name), included, guesses, rng)
              for name in scorers}
    # Bonferroni over every (scorer, guesses) pair tried, for both readings of the guesses.
    level = 1.0 - (1.0 - confidence) / sum(len(c) for c in counts.values())
    tried, gdp = {}, {"mu": 0.0, "epsilon": 0.0}
    for name, pairs in counts.items():
        for k_in, k_out, correct in pairs:
            eps = bounds.one_run_epsilon_lower_bound(m, k_in + k_out, correct, delta, level)
            if name not in tried or eps > tried[name]["epsilon_lower_bound"]:
                tried[name] = {"epsilon_lower_bound": eps, "num_guesses": k_in + k_out,
                               "num_correct": correct}
            g = fdp.one_run_gdp_lower_bound(m, k_in + k_out, correct, delta, level)
            if g["mu"] > gdp["mu"]:
                gdp = g
    best_name = max(tried, key=lambda k: tried[k]["epsilon_lower_bound"])
    best = tried[best_name]
    epsilon = float(model.epsilon())
    claim = _profile_inverse(model.accountant, epsilon)
    pairs_tried = sum(len(c) for c in counts.values())
    claim_p = min(1.0, pairs_tried * min(
        fdp.one_run_fdp_p_value(m, k_in + k_out, correct, claim, tolerance=1e-6)
        for pairs in counts.values() for k_in, k_out, correct in pairs))
    return AuditResult(
        epsilon_lower_bound=best["epsilon_lower_bound"],
        epsilon=epsilon,
        epsilon_exact_clipping=(float(model.epsilon(exact_clipping=True))
                                if optimizer.num_projections else epsilon),
        delta=delta, confidence=confidence, num_canaries=m, num_included=int(included.sum()),
        steps=steps, sampling_probability=q, noise_multiplier=float(optimizer.mechanism(q)[0]),
        l2_norm_clip=clip, scorer=best_name, num_guesses=best["num_guesses"],
        num_correct=best["num_correct"],
        per_scorer={k: v["epsilon_lower_bound"] for k, v in tried.items()},
        seconds=time.perf_counter() - start, gdp_mu=gdp["mu"], gdp_epsilon=gdp["epsilon"],
        claim_p_value=claim_p)


def _profile_inverse(accountant, epsilon):
    """b⁻¹ of the accountant's claim: its pessimistic δ(ε) (both adjacency directions) on a
    grid of ε up to 3× the run's ε at its δ (any grid is a valid, if weaker, claim; this one
    avoids the accountant's search for ε at δ = 1e-10, which takes a minute for JL). σ = 0
    claims nothing."""
    if not math.isfinite(epsilon) or any(p.noise_multiplier == 0 for p in accountant.phases):
        return lambda y: 0.0
    top = max(3.0 * epsilon, 1e-2)
    grid = np.unique(np.concatenate([np.linspace(0.0, top, 60), np.geomspace(1e-4, top, 60)]))
    return fdp.profile_blow_up_inverse(grid, accountant.privacy_profile(grid))


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
    return int(value)
