"""Accounting benchmark: tf_dp.accounting next to dp-accounting's PLD and prv-accountant.

Run: python bench/accounting_bench.py [--jl r1,r2,...]
Prints one table: our ε (with its numerical bracket), dp-accounting's PLD ε at a fine and at an
equal-time discretisation, PRV bounds (eps_error=0.01), and times. Single process, light.
"""

import argparse
import math
import time

Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 14062, 1e-5


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jl", default="1000000,100,30,10,5", help="comma-separated r values")
    args = parser.parse_args()

    from dp_accounting.pld import privacy_loss_distribution as dpl
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    from tf_dp import accounting

    rows = []
    acc = accounting.PrivacyAccountant().step(SIGMA, Q, count=STEPS)
    ours, t_ours = _timed(lambda: acc.epsilon_bounds(DELTA))
    rows.append(("ours (exact clipping)", f"{ours.upper:.5f}", f"[{ours.lower:.5f}, {ours.upper:.5f}]", f"{t_ours:.2f}"))
    for vdi in (1e-3, 1e-4, 3e-5):
        e, t = _timed(
            lambda: dpl.from_gaussian_mechanism(SIGMA, sampling_prob=Q, value_discretization_interval=vdi)
            .self_compose(STEPS)
            .get_epsilon_for_delta(DELTA)
        )
        rows.append((f"dp-accounting PLD Δ={vdi:g}", f"{e:.5f}", "upper only", f"{t:.2f}"))
    prv = PRVAccountant(
        prvs=PoissonSubsampledGaussianMechanism(noise_multiplier=SIGMA, sampling_probability=Q),
        max_self_compositions=STEPS, eps_error=0.01, delta_error=1e-10,
    )
    (lo, est, up), t = _timed(lambda: prv.compute_epsilon(delta=DELTA, num_self_compositions=STEPS))
    rows.append(("prv-accountant (eps_error 0.01)", f"{est:.5f}", f"[{lo:.5f}, {up:.5f}]", f"{t:.2f}"))
    rows.append(("RDP (dp-accounting)", f"{acc.rdp_epsilon(DELTA):.5f}", "upper only", "-"))
    mu = acc.gdp_mu()
    rows.append(("CLT mu-GDP (approximation)", f"{accounting.gdp_epsilon(mu, DELTA):.5f}", "not a bound", "-"))
    for r in [int(x) for x in args.jl.split(",") if x]:
        jl = accounting.PrivacyAccountant().step(SIGMA, Q, num_projections=r, count=STEPS)
        b, t = _timed(lambda: jl.epsilon_bounds(DELTA))
        flag = "" if b.converged else " (not converged)"
        rows.append((f"ours JL r={r}", f"{b.upper:.5g}", f"[{b.lower:.5g}, {b.upper:.5g}]{flag}", f"{t:.2f}"))

    print(f"q={Q:.6g} sigma={SIGMA} steps={STEPS} delta={DELTA:g}")
    print(f"{'method':36s} {'epsilon':>12s} {'bracket':>34s} {'time s':>8s}")
    for name, e, br, t in rows:
        print(f"{name:36s} {e:>12s} {br:>34s} {t:>8s}")


if __name__ == "__main__":
    main()
