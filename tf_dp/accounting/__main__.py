"""Command line: python -m tf_dp.accounting --dataset_size N --batch_size B --epochs E ...

Prints ε for the run (or, with --target_epsilon, the calibrated noise multiplier), and with
--plot writes the f-DP trade-off curve next to the Gaussian (exact-clipping) one.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, Optional

import numpy as np


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tf_dp.accounting", description=__doc__)
    p.add_argument("--dataset_size", type=int, required=True)
    p.add_argument("--batch_size", type=int, required=True, help="expected (Poisson) batch size")
    p.add_argument("--epochs", type=float, required=True)
    p.add_argument("--noise_multiplier", type=float, default=None)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--num_projections", type=int, default=None)
    p.add_argument("--target_epsilon", type=float, default=None)
    p.add_argument("--plot", type=str, default=None, help="output PNG for the trade-off curve")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from tf_dp import accounting

    args = _parser().parse_args(argv)
    if args.dataset_size < 1:
        raise SystemExit(f"`dataset_size` must be >= 1, got {args.dataset_size}.")
    if not 1 <= args.batch_size <= args.dataset_size:
        raise SystemExit(f"`batch_size` must be in [1, dataset_size], got {args.batch_size}.")
    if args.epochs <= 0:
        raise SystemExit(f"`epochs` must be > 0, got {args.epochs}.")
    q = args.batch_size / args.dataset_size
    steps = int(math.ceil(args.epochs / q))
    r = args.num_projections
    mech = "DP-SGD (exact clipping)" if r is None else f"JL-DP-SGD (r={r} projections)"
    print(f"mechanism: {mech}, Poisson sampling q={q:.6g}, steps={steps}, delta={args.delta:g}")
    try:
        if args.target_epsilon is not None:
            sigma = accounting.calibrate_noise_multiplier(
                args.target_epsilon, args.delta, q, steps, r
            )
            print(
                f"calibrated noise_multiplier: {sigma:.6g} (reaches epsilon <= {args.target_epsilon:g})"
            )
        else:
            if args.noise_multiplier is None:
                raise SystemExit("give --noise_multiplier or --target_epsilon")
            sigma = args.noise_multiplier
        acc = accounting.PrivacyAccountant().step(sigma, q, r, count=steps)
        b = acc.epsilon_bounds(args.delta)
        eps = b.upper
        if math.isinf(eps):
            print(f"epsilon: inf ({b.reason})")
        else:
            print(f"epsilon: {eps:.6g} (numerical bracket [{b.lower:.6g}, {b.upper:.6g}])")
        rdp = acc.rdp_epsilon(args.delta)
        print(
            f"RDP epsilon (comparison): {rdp:.6g}"
            if math.isfinite(rdp)
            else "RDP epsilon (comparison): inf (RDP is infinite for the JL mechanism)"
        )
        try:
            mu = acc.gdp_mu()
            print(
                f"CLT mu-GDP (comparison): mu={mu:.6g}, epsilon={accounting.gdp_epsilon(mu, args.delta):.6g}"
            )
        except accounting.GDPNotApplicableError as e:
            print(f"CLT mu-GDP: not applicable ({e})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        alphas = np.linspace(0.0, 1.0, 201)
        curves = [(f"{mech}, σ={sigma:.3g}", acc.tradeoff_curve(alphas))]
        if r is not None:
            gauss = accounting.PrivacyAccountant().step(sigma, q, None, count=steps)
            curves.append((f"DP-SGD (exact clipping), σ={sigma:.3g}", gauss.tradeoff_curve(alphas)))
        else:
            mu = acc.gdp_mu()
            curves.append((f"CLT μ-GDP, μ={mu:.3g}", accounting.gaussian_tradeoff(mu, alphas)))
        accounting.plot_tradeoff(
            args.plot,
            alphas,
            curves,
            title=f"q={q:.4g}, steps={steps}, ε={eps:.4g} at δ={args.delta:g}",
        )
        print(f"trade-off curve written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
