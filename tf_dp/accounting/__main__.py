"""Command line: python -m tf_dp.accounting --dataset_size N --batch_size B --epochs E ...
(or --sampling_probability q --steps T).

Prints ε for the run (or, with --target_epsilon, the calibrated noise multiplier), and with
--plot writes the f-DP trade-off curve next to the Gaussian (exact-clipping) one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional

import numpy as np


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tf_dp.accounting", description=__doc__)
    run = p.add_argument_group(
        "the run", "either --dataset_size, --batch_size and --epochs, or "
        "--sampling_probability and --steps")
    run.add_argument("--dataset_size", type=int, default=None,
                     help="N, the number of training examples")
    run.add_argument("--batch_size", type=int, default=None,
                     help="expected (Poisson) batch size; q = batch_size / dataset_size")
    run.add_argument("--epochs", type=float, default=None,
                     help="epochs; steps = ceil(epochs * max(1, round(1 / q))), as fit takes them")
    run.add_argument("--sampling_probability", type=float, default=None,
                     help="q, instead of --dataset_size and --batch_size")
    run.add_argument("--steps", type=int, default=None, help="number of steps, instead of --epochs")
    p.add_argument("--delta", type=float, required=True, help="δ at which ε is reported")
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("--noise_multiplier", type=float, default=None,
                       help="σ, the noise std in units of the clipping norm (0: no privacy)")
    noise.add_argument("--target_epsilon", type=float, default=None,
                       help="calibrate σ to reach this ε (instead of --noise_multiplier)")
    p.add_argument("--num_projections", type=int, default=None,
                   help="r, for JL norms (Bu et al. 2021); omit for exact clipping")
    p.add_argument("--plot", type=str, default=None,
                   help="output PNG for the trade-off curve (its directory is created)")
    return p


def _run_shape(args):
    """(q, steps) from either form of the run's arguments; SystemExit naming the problem."""
    if args.sampling_probability is not None:
        if args.dataset_size is not None or args.batch_size is not None:
            raise SystemExit("give --sampling_probability or --dataset_size/--batch_size, "
                             "not both.")
        q = args.sampling_probability
        if not 0 < q <= 1:
            raise SystemExit(f"`sampling_probability` must be in (0, 1], got {q}.")
    else:
        if args.dataset_size is None or args.batch_size is None:
            raise SystemExit("give --dataset_size and --batch_size (or --sampling_probability).")
        if args.dataset_size < 1:
            raise SystemExit(f"`dataset_size` must be >= 1, got {args.dataset_size}.")
        if not 1 <= args.batch_size <= args.dataset_size:
            raise SystemExit(f"`batch_size` must be in [1, dataset_size], got {args.batch_size}.")
        q = args.batch_size / args.dataset_size
    if (args.steps is None) == (args.epochs is None):
        raise SystemExit("give exactly one of --epochs and --steps.")
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit(f"`steps` must be >= 1, got {args.steps}.")
        return q, args.steps
    if args.epochs <= 0:
        raise SystemExit(f"`epochs` must be > 0, got {args.epochs}.")
    # As fit, PoissonSampler and for_target_epsilon count them: max(1, round(1/q)) steps per
    # epoch (session 22 audit: ceil(epochs / q) gave 52 steps where fit took 60, N = 1000,
    # B = 385, 20 epochs, and a sigma calibrated here overshot its target in fit).
    return q, int(math.ceil(args.epochs * max(1, round(1.0 / q)) - 1e-9))


def main(argv: Optional[List[str]] = None) -> int:
    from tf_dp import accounting
    from tf_dp.accounting import functions

    args = _parser().parse_args(argv)
    q, steps = _run_shape(args)
    r = args.num_projections
    mech = "DP-SGD (exact clipping)" if r is None else f"JL-DP-SGD (r={r} projections)"
    print(f"mechanism: {mech}, Poisson sampling q={q:.6g}, steps={steps}, delta={args.delta:g}")
    print("unit of privacy: one training example (add/remove); assumes each batch is a Poisson "
          "sample at q (fixed or shuffled batches are outside this guarantee) and noise no one "
          "can regenerate (no seed)")
    print("not covered: hyper-parameter search and earlier runs on the same data; data used "
          "outside training; side channels")
    try:
        if args.target_epsilon is not None:
            sigma = accounting.calibrate_noise_multiplier(
                sampling_probability=q, steps=steps, target_epsilon=args.target_epsilon,
                delta=args.delta, num_projections=r,
            )
            print(
                f"calibrated noise_multiplier: {sigma:.6g} (reaches epsilon <= {args.target_epsilon:g})"
            )
        else:
            if args.noise_multiplier is None:
                raise SystemExit("give --noise_multiplier or --target_epsilon")
            sigma = args.noise_multiplier
        acc = accounting.PrivacyAccountant().step(
            noise_multiplier=sigma, sampling_probability=q, num_projections=r, count=steps
        )
        b = acc.epsilon_bounds(args.delta)
        eps = b.upper
        if math.isinf(eps):
            print(f"epsilon: inf ({b.reason})")
        else:
            print(f"epsilon: {functions.epsilon_text(eps, 6)} (numerical bracket "
                  f"[{b.lower:.6g}, {functions.epsilon_text(b.upper, 6)}]"
                  f"{'' if b.converged else ', not converged: ' + b.reason})")
        if sigma == 0:
            print("RDP epsilon (comparison): inf (no noise)")
            print("CLT mu-GDP: not applicable (no noise)")
        else:
            rdp = acc.rdp_epsilon(args.delta)
            print(
                f"RDP epsilon (comparison): {functions.epsilon_text(rdp, 6)}"
                if math.isfinite(rdp)
                else "RDP epsilon (comparison): inf (RDP is infinite for the JL mechanism)"
            )
            try:
                mu = acc.gdp_mu()
                print(f"CLT mu-GDP (comparison): mu={mu:.6g}, "
                      f"epsilon={accounting.gdp_epsilon(mu=mu, delta=args.delta):.6g}")
            except (accounting.GDPNotApplicableError, OverflowError) as e:
                print(f"CLT mu-GDP: not applicable ({e or 'mu too large'})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot and sigma == 0:
        print("no trade-off curve: without noise the curve is 0 (no privacy)")
    elif args.plot:
        directory = os.path.dirname(os.path.abspath(args.plot))
        os.makedirs(directory, exist_ok=True)
        alphas = np.concatenate([[0.0], np.geomspace(1e-6, 1.0, 240)])
        curves = [(f"{mech}, σ={sigma:.3g}", acc.tradeoff_curve(alphas))]
        if r is not None:
            gauss = accounting.PrivacyAccountant().step(
                noise_multiplier=sigma, sampling_probability=q, count=steps
            )
            curves.append((f"DP-SGD (exact clipping), σ={sigma:.3g}", gauss.tradeoff_curve(alphas)))
        else:
            mu = acc.gdp_mu()
            curves.append((f"CLT μ-GDP, μ={mu:.3g}", accounting.gaussian_tradeoff(mu, alphas)))
        accounting.plot_tradeoff(
            args.plot,
            alphas,
            curves,
            title=f"q={q:.4g}, steps={steps}, ε={functions.epsilon_text(eps)} at δ={args.delta:g}",
            epsilon_delta=(eps, args.delta) if math.isfinite(eps) else None,
        )
        print(f"trade-off curve written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
