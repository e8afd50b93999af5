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


def plot_tradeoff(
    path: str,
    alphas: np.ndarray,
    curves: Sequence[tuple],
    title: Optional[str] = None,
) -> None:
    """Writes a PNG with the trade-off curves [(label, betas), ...] and the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.0), dpi=120)
    ax.plot([0, 1], [1, 0], color="0.7", lw=1, ls=":", label="perfect privacy (β = 1 - α)")
    for label, betas in curves:
        ax.plot(alphas, betas, lw=1.8, label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_aspect("equal")
    ax.set_xlabel("type I error α")
    ax.set_ylabel("type II error β")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
