"""Accounting benchmark: tf_dp.accounting next to dp-accounting's PLD and prv-accountant.

Run: python bench/accounting_bench.py [--jl r1,r2,...] [--repeats N] [--skip_equal_time]
     [--skip_tightness] [--skip_cost]

Prints five tables, the first three for the issue's setting (q = 256/60000, σ = 1.1, 14,062
steps, δ = 1e-5):

1. The default query next to dp-accounting's PLD, prv-accountant, RDP and the CLT.
2. Equal-time comparison (Gaussian): both PLD engines at a range of fixed discretisations Δ,
   each point's error against a fine reference (our certified bracket at Δ = 1e-5), then, for a
   series of time budgets, the smallest error each engine reached within the budget.
3. JL queries over r: ε, its certified bracket, time.
4. Tightness: the default Gaussian query next to prv-accountant's certified bracket at
   eps_error = 1e-3 over the regimes of tests/accounting/tight_test.py (ε from 0.04 to 36).
5. Cost of the default Gaussian query where it refines most (long runs, small q or σ) and at
   large ε: ε, certified bracket, final Δ, time.

Times are CPU seconds of this process (time.process_time, best of --repeats runs): the machine
is shared, and wall time there measures the neighbours as much as the code. Caches of both
engines are cleared before every timed run. Single process.
"""

import argparse
import math
import pathlib
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 14062, 1e-5
# Discretisations measured for the equal-time table (both engines).
GRID = (2e-3, 1e-3, 5e-4, 3e-4, 2e-4, 1e-4, 7e-5, 5e-5, 3e-5, 2e-5, 1.5e-5)
REFERENCE_DISCRETIZATION = 1e-5
BUDGETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
def _tight_regimes():
    """(σ, q, steps) of the tightness table: the fast regimes of
    tests/accounting/tight_test.py, read from that file so the bench and the test cannot
    drift apart."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[1] / "tests" / "accounting" / "tight_test.py"
    spec = importlib.util.spec_from_file_location("_tight_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.REGIMES)


PRV_EPS_ERROR = 1e-3
# (σ, q, steps) of the cost table: the issue's setting, then long runs and large ε.
COST_REGIMES = (
    (SIGMA, Q, STEPS),
    (0.6, 0.001, 10000),
    (0.6, 0.02, 10000),
    (3.0, 0.02, 10000),
    (0.5, 0.1, 1000),
    (0.5, 0.2, 2000),
)


def _clear_caches():
    from tf_dp.accounting import composition, mechanisms

    composition.step_plds.cache_clear()
    composition._probe.cache_clear()
    mechanisms.jl_mu_law.cache_clear()
    mechanisms.split_jl_mu_law.cache_clear()


def _timed(fn, repeats=1):
    """(result, best CPU seconds, wall seconds of that run)."""
    best = None
    for _ in range(repeats):
        _clear_caches()
        t, w = time.process_time(), time.perf_counter()
        out = fn()
        cpu, wall = time.process_time() - t, time.perf_counter() - w
        if best is None or cpu < best[1]:
            best = (out, cpu, wall)
    return best


def _dp_accounting(discretization):
    from dp_accounting.pld import privacy_loss_distribution as dpl

    pld = dpl.from_gaussian_mechanism(
        SIGMA, sampling_prob=Q, value_discretization_interval=discretization
    )
    return pld.self_compose(STEPS).get_epsilon_for_delta(DELTA)


def _ours(discretization):
    """Our engine at a fixed Δ (one pass, both bounds, both directions)."""
    from tf_dp.accounting import composition, pld

    phases = [composition.Phase(SIGMA, Q, None, STEPS)]
    return composition.refine(
        phases,
        1e-2 * DELTA,
        lambda p: pld.epsilon_for_delta(p, DELTA),
        max,
        lambda u: math.inf,
        discretization=discretization,
    )


def _best_within(points, budget):
    """Smallest error among (time, error) points with time ≤ budget (None if none)."""
    errors = [e for t, e in points if t <= budget]
    return min(errors) if errors else None


def _fmt(x, spec=".2e"):
    return "-" if x is None else format(x, spec)


def default_table(repeats):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    from tf_dp import accounting

    rows = []
    acc = accounting.PrivacyAccountant().step(
        noise_multiplier=SIGMA, sampling_probability=Q, count=STEPS
    )
    ours, cpu, wall = _timed(lambda: acc.epsilon_bounds(DELTA), repeats)
    rows.append(
        ("ours, default query", ours.upper, f"[{ours.lower:.5f}, {ours.upper:.5f}]", cpu, wall)
    )
    for vdi in (1e-3, 1e-4, 3e-5):
        e, cpu, wall = _timed(lambda: _dp_accounting(vdi), repeats)
        rows.append((f"dp-accounting PLD Δ={vdi:g}", e, "upper only", cpu, wall))
    prv = PRVAccountant(
        prvs=PoissonSubsampledGaussianMechanism(noise_multiplier=SIGMA, sampling_probability=Q),
        max_self_compositions=STEPS,
        eps_error=0.01,
        delta_error=1e-10,
    )
    (lo, est, up), cpu, wall = _timed(
        lambda: prv.compute_epsilon(delta=DELTA, num_self_compositions=STEPS)
    )
    rows.append(("prv-accountant (eps_error 0.01)", est, f"[{lo:.5f}, {up:.5f}]", cpu, wall))
    rows.append(("RDP (dp-accounting)", acc.rdp_epsilon(DELTA), "upper only", None, None))
    mu = acc.gdp_mu()
    rows.append(
        (
            "CLT mu-GDP (approximation)",
            accounting.gdp_epsilon(mu=mu, delta=DELTA),
            "not a bound",
            None,
            None,
        )
    )
    print(f"\n== 1. Default query: q={Q:.6g} sigma={SIGMA} steps={STEPS} delta={DELTA:g}")
    print(f"{'method':34s} {'epsilon':>10s} {'bracket':>24s} {'cpu s':>7s} {'wall s':>7s}")
    for name, e, br, cpu, wall in rows:
        print(f"{name:34s} {e:>10.5f} {br:>24s} {_fmt(cpu, '.3f'):>7s} {_fmt(wall, '.3f'):>7s}")
    return ours


def equal_time_table(repeats, default):
    ref, cpu_ref, _ = _timed(lambda: _ours(REFERENCE_DISCRETIZATION))
    truth = 0.5 * (ref.lower + ref.upper)
    print(
        f"\n== 2. Equal time (Gaussian). Reference: our certified bracket at Δ="
        f"{REFERENCE_DISCRETIZATION:g}: [{ref.lower:.7f}, {ref.upper:.7f}] ({cpu_ref:.2f} s);"
        f" error = value - {truth:.7f}"
    )
    print(
        f"{'Δ':>8s} | {'ours ε (upper)':>14s} {'ours lower':>11s} {'error':>9s} {'cpu s':>7s}"
        f" | {'dp-acc ε':>10s} {'error':>9s} {'cpu s':>7s}"
    )
    ours_pts, theirs_pts = [], []
    for d in GRID:
        b, t_ours, _ = _timed(lambda: _ours(d), repeats)
        e, t_theirs, _ = _timed(lambda: _dp_accounting(d), repeats)
        ours_pts.append((t_ours, b.upper - truth))
        theirs_pts.append((t_theirs, e - truth))
        print(
            f"{d:>8.1e} | {b.upper:>14.7f} {b.lower:>11.7f} {b.upper - truth:>9.2e} {t_ours:>7.3f}"
            f" | {e:>10.7f} {e - truth:>9.2e} {t_theirs:>7.3f}"
        )
    print(
        f"default query (adaptive Δ={default.discretization:.3g}): ε={default.upper:.7f},"
        f" error {default.upper - truth:.2e}"
    )
    print("\nSmallest error reached within a CPU-time budget (over the Δ grid above):")
    print(f"{'budget s':>9s} {'ours':>10s} {'dp-accounting':>14s} {'ours closer':>12s}")
    for budget in BUDGETS:
        a, b = _best_within(ours_pts, budget), _best_within(theirs_pts, budget)
        closer = "-" if a is None else ("yes" if b is None or a < b else "NO")
        print(f"{budget:>9.2f} {_fmt(a):>10s} {_fmt(b):>14s} {closer:>12s}")


def jl_table(rs):
    from tf_dp import accounting

    print(f"\n== 3. JL (Bu et al. 2021): q={Q:.6g} sigma={SIGMA} steps={STEPS} delta={DELTA:g}")
    print(f"{'r':>8s} {'epsilon':>12s} {'bracket':>30s} {'cpu s':>7s} {'wall s':>7s}")
    for r in rs:
        acc = accounting.PrivacyAccountant().step(
            noise_multiplier=SIGMA, sampling_probability=Q, num_projections=r, count=STEPS
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            b, cpu, wall = _timed(lambda: acc.epsilon_bounds(DELTA))
        flag = "" if b.converged else " (not converged)"
        print(
            f"{r:>8d} {b.upper:>12.6g} {f'[{b.lower:.6g}, {b.upper:.6g}]' + flag:>30s}"
            f" {cpu:>7.2f} {wall:>7.2f}"
        )
        if b.reason:
            print(f"{'':>8s} {b.reason}")


def tightness_table(repeats):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    from tf_dp import accounting

    print(
        f"\n== 4. Tightness: default query against prv-accountant (eps_error {PRV_EPS_ERROR:g},"
        f" delta_error 1e-10), delta={DELTA:g}; slack = epsilon - PRV estimate"
    )
    print(
        f"{'sigma':>5s} {'q':>9s} {'steps':>6s} {'epsilon':>10s} {'bracket':>22s} {'cpu s':>6s}"
        f" | {'PRV lower':>10s} {'PRV upper':>10s} {'slack':>9s} {'inside':>6s}"
    )
    for sigma, q, steps in _tight_regimes():
        acc = accounting.PrivacyAccountant().step(
            noise_multiplier=sigma, sampling_probability=q, count=steps
        )
        b, cpu, _ = _timed(lambda: acc.epsilon_bounds(DELTA), repeats)
        prv = PRVAccountant(
            prvs=PoissonSubsampledGaussianMechanism(
                noise_multiplier=sigma, sampling_probability=q
            ),
            max_self_compositions=steps,
            eps_error=PRV_EPS_ERROR,
            delta_error=1e-10,
        )
        lo, est, up = prv.compute_epsilon(delta=DELTA, num_self_compositions=steps)
        inside = "yes" if lo <= b.upper <= up else "NO"
        print(
            f"{sigma:>5g} {q:>9.6g} {steps:>6d} {b.upper:>10.6f}"
            f" {f'[{b.lower:.6f}, {b.upper:.6f}]':>22s} {cpu:>6.3f}"
            f" | {lo:>10.6f} {up:>10.6f} {b.upper - est:>9.2e} {inside:>6s}"
        )


def cost_table(repeats):
    from tf_dp import accounting

    print(f"\n== 5. Cost of the default query (Gaussian), delta={DELTA:g}")
    print(
        f"{'sigma':>5s} {'q':>9s} {'steps':>6s} {'epsilon':>11s} {'bracket':>26s}"
        f" {'delta':>8s} {'cpu s':>6s}"
    )
    for sigma, q, steps in COST_REGIMES:
        acc = accounting.PrivacyAccountant().step(
            noise_multiplier=sigma, sampling_probability=q, count=steps
        )
        b, cpu, _ = _timed(lambda: acc.epsilon_bounds(DELTA), repeats)
        print(
            f"{sigma:>5g} {q:>9.6g} {steps:>6d} {b.upper:>11.6f}"
            f" {f'[{b.lower:.6f}, {b.upper:.6f}]':>26s} {b.discretization:>8.2g} {cpu:>6.3f}"
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jl", default="1000000,100,30,10,5,3,2,1", help="comma-separated r")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (best kept)")
    parser.add_argument("--skip_equal_time", action="store_true")
    parser.add_argument("--skip_tightness", action="store_true")
    parser.add_argument("--skip_cost", action="store_true")
    args = parser.parse_args()
    default = default_table(args.repeats)
    if not args.skip_equal_time:
        equal_time_table(args.repeats, default)
    jl_table([int(x) for x in args.jl.split(",") if x])
    if not args.skip_tightness:
        tightness_table(args.repeats)
    if not args.skip_cost:
        cost_table(args.repeats)


if __name__ == "__main__":
    main()
