"""f-DP trade-off curves (Dong, Roth, Su 2022) from privacy profiles, and plotting."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from scipy import special


def tradeoff_from_profile(
    epsilons: np.ndarray, deltas: np.ndarray, alphas: np.ndarray
) -> np.ndarray:
    """β(α) = sup_ε max(0, 1 - δ(ε) - e^ε α, e^{-ε}(1 - δ(ε) - α)) (Dong et al. 2022, Prop. 2.12).

    With upper bounds on δ(ε) and a subset of ε the result is a lower bound on the true curve.
    """
    eps = np.asarray(epsilons, float)[None, :]
    d = np.asarray(deltas, float)[None, :]
    a = np.asarray(alphas, float)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        first = 1.0 - d - np.exp(eps) * a
        second = np.exp(-eps) * (1.0 - d - a)
    out = np.nanmax(np.maximum(first, second), axis=1)
    return np.clip(out, 0.0, 1.0)


def gaussian_tradeoff(mu: float, alphas: Sequence[float]) -> np.ndarray:
    """G_μ(α) = Φ(Φ^{-1}(1 - α) - μ), the μ-GDP curve (Dong et al. 2022, Def. 2.7)."""
    a = np.asarray(alphas, float)
    return special.ndtr(special.ndtri(1.0 - a) - mu)


def epsilon_grid(accountant, num: int = 600, delta_floor: float = 1e-10) -> np.ndarray:
    """ε values from 0 to where δ(ε) is below delta_floor (dense near 0)."""
    try:
        top = accountant.epsilon_bounds(delta_floor).upper
    except ValueError:
        top = 50.0
    if not np.isfinite(top):
        top = 1e4
    top = max(top, 1e-2)
    return np.unique(np.concatenate([np.linspace(0.0, top, num), np.geomspace(1e-4, top, num)]))


def dp_tradeoff(epsilon: float, delta: float, alphas: Sequence[float]) -> np.ndarray:
    """f_{ε,δ}(α) = max(0, 1 - δ - e^ε α, e^{-ε}(1 - δ - α)): the trade-off curve of
    (ε, δ)-DP (Dong et al. 2022, Prop. 2.4); a mechanism is (ε, δ)-DP iff its curve lies on
    or above it."""
    return tradeoff_from_profile(np.array([epsilon]), np.array([delta]), np.asarray(alphas))


def plot_tradeoff(
    path: str,
    alphas: np.ndarray,
    curves: Sequence[tuple],
    title: Optional[str] = None,
    epsilon_delta: Optional[tuple] = None,
) -> None:
    """Writes a PNG of the trade-off curves [(label, betas), ...] in two panels.

    Left: β against α on a log α axis (where DP-SGD's curves part: at small α), with the
    (ε, δ)-DP curve of ``epsilon_delta`` (if given) as a dashed line and the region it
    rules out shaded. Right: the privacy gap 1 - α - β (0 is perfect privacy; the largest
    value is the best test's advantage), which separates curves that nearly coincide.
    Curves get distinct line styles and markers, so they stay apart in print.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    alphas = np.asarray(alphas, float)
    shown = alphas > 0
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "D", "v"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.6), dpi=130)
    left.plot(alphas[shown], 1.0 - alphas[shown], color="0.6", lw=1, ls=":",
              label="perfect privacy (β = 1 − α)")
    if epsilon_delta is not None:
        eps, delta = epsilon_delta
        from tf_dp.accounting.functions import epsilon_text  # local: no import cycle

        bound = dp_tradeoff(eps, delta, alphas)
        left.plot(alphas[shown], bound[shown], color="black", lw=1.2, ls="--",
                  label=f"({epsilon_text(eps, 3)}, {delta:g})-DP bound")
        left.fill_between(alphas[shown], 0, bound[shown], color="0.85", alpha=0.6, lw=0,
                          label="excluded by (ε, δ)-DP")
    every = max(1, int(shown.sum()) // 8)
    for i, (label, betas) in enumerate(curves):
        betas = np.asarray(betas, float)
        kw = dict(lw=1.8, ls=styles[i % len(styles)], marker=markers[i % len(markers)],
                  markevery=every, markersize=4, label=label)
        left.plot(alphas[shown], betas[shown], **kw)
        right.plot(alphas[shown], (1.0 - alphas - betas)[shown], **kw)
    left.set_xscale("log")
    left.set_xlim(alphas[shown].min(), 1)
    left.set_ylim(0, 1.02)
    left.set_xlabel("type I error α (log scale)")
    left.set_ylabel("type II error β")
    left.legend(fontsize=7, loc="lower left")
    right.set_xscale("log")
    right.set_xlim(alphas[shown].min(), 1)
    right.set_ylim(bottom=0)
    right.set_xlabel("type I error α (log scale)")
    right.set_ylabel("privacy gap 1 − α − β")
    right.legend(fontsize=7, loc="upper left")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def epsilon_over_steps(accountant, delta: float, num: int = 25):
    """(steps, ε) after each of ``num`` evenly spaced prefixes of the accountant's steps."""
    from tf_dp.accounting.accountant import PrivacyAccountant

    total = accountant.steps
    marks = sorted({int(round(t)) for t in np.linspace(0, total, num + 1)[1:]} - {0})
    out = []
    for mark in marks:
        acc, left = PrivacyAccountant(), mark
        for p in accountant.phases:
            take = min(p.count, left)
            if take:
                acc.step(noise_multiplier=p.noise_multiplier,
                         sampling_probability=p.sampling_probability,
                         num_projections=p.num_projections, count=take)
            left -= take
        out.append(acc.epsilon(delta))
    return np.array(marks), np.array(out)


def plot_epsilon(path: str, steps, epsilons, delta: float, title: Optional[str] = None) -> None:
    """Writes a PNG of ε (at ``delta``) against training steps, e.g. from
    ``epsilon_over_steps(model.accountant, delta)`` or a History's "epsilon" per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.0), dpi=130)
    ax.plot(steps, epsilons, marker="o", markersize=3, lw=1.6)
    ax.set_xlabel("step")
    ax.set_ylabel(f"ε at δ = {delta:g}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
