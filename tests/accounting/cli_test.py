"""Command line: prints ε, calibrates σ, writes the trade-off PNG."""

import sys

import pytest

from tf_dp.accounting import __main__ as cli


def test_cli_prints_epsilon_and_writes_plot(tmp_path, capsys):
    out = tmp_path / "curve.png"
    args = "--dataset_size 60000 --batch_size 256 --epochs 60 --noise_multiplier 1.1 --delta 1e-5"
    assert cli.main(args.split() + ["--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "epsilon: 2.3" in text and "RDP epsilon" in text
    assert "unit of privacy: one training example" in text and "Poisson sample" in text
    assert "not covered:" in text
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_cli_calibrates_noise(capsys):
    args = "--dataset_size 1000 --batch_size 10 --epochs 2 --delta 1e-5 --target_epsilon 3"
    assert cli.main(args.split()) == 0
    assert "calibrated noise_multiplier" in capsys.readouterr().out


def test_cli_refuses_gdp_for_jl(capsys):
    args = "--dataset_size 1000 --batch_size 10 --epochs 1 --noise_multiplier 1 --delta 1e-5"
    assert cli.main(args.split() + ["--num_projections", "100"]) == 0
    assert "not applicable" in capsys.readouterr().out


def test_cli_says_why_epsilon_is_infinite(capsys):
    args = "--dataset_size 1000 --batch_size 10 --epochs 10 --noise_multiplier 1 --delta 1e-5"
    assert cli.main(args.split() + ["--num_projections", "1"]) == 0
    assert "epsilon: inf (no ε ≤ 1e+09 can be certified" in capsys.readouterr().out



def test_cli_without_noise_reports_infinite_epsilon_and_why(capsys):
    args = "--dataset_size 1000 --batch_size 100 --epochs 1 --noise_multiplier 0 --delta 1e-5"
    assert cli.main(args.split()) == 0
    text = capsys.readouterr().out
    assert "epsilon: inf (" in text and "no noise" in text


def test_cli_steps_and_sampling_probability_are_the_same_run(capsys):
    base = "--noise_multiplier 1.1 --delta 1e-5"
    assert cli.main(f"--dataset_size 1000 --batch_size 10 --epochs 2 {base}".split()) == 0
    by_size = capsys.readouterr().out.splitlines()
    assert cli.main(f"--sampling_probability 0.01 --steps 200 {base}".split()) == 0
    by_q = capsys.readouterr().out.splitlines()
    assert [l for l in by_size if l.startswith("epsilon")] == [
        l for l in by_q if l.startswith("epsilon")]


@pytest.mark.parametrize("args", [
    "--dataset_size 1000 --batch_size 10 --epochs 1 --noise_multiplier 1 --target_epsilon 2",
    "--dataset_size 1000 --batch_size 10 --epochs 1 --steps 5 --noise_multiplier 1",
    "--sampling_probability 0.1 --dataset_size 1000 --steps 5 --noise_multiplier 1",
    "--batch_size 10 --epochs 1 --noise_multiplier 1",
])
def test_cli_refuses_contradictory_or_missing_arguments(args):
    with pytest.raises(SystemExit) as err:
        cli.main(args.split() + ["--delta", "1e-5"])
    assert err.value.code != 0


def test_cli_creates_the_plot_directory_and_documents_every_flag(tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "curve.png"
    args = "--sampling_probability 0.01 --steps 100 --noise_multiplier 1.0 --delta 1e-5"
    assert cli.main(args.split() + ["--plot", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    for action in cli._parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_epsilon_over_steps_and_the_dp_region_of_the_plots(tmp_path):
    import numpy as np

    from tf_dp import accounting

    acc = accounting.PrivacyAccountant()
    acc.step(noise_multiplier=1.1, sampling_probability=0.01, count=300)
    acc.step(noise_multiplier=2.0, sampling_probability=0.02, count=200)
    steps, eps = accounting.epsilon_over_steps(acc, 1e-5, num=10)
    assert steps[-1] == 500 and len(steps) == 10
    assert np.all(np.diff(eps) > 0) and eps[-1] == pytest.approx(acc.epsilon(1e-5))
    # Each prefix is the accountant of those steps only (the first 100 are all at sigma 1.1).
    assert eps[1] == pytest.approx(accounting.compute_epsilon(
        noise_multiplier=1.1, sampling_probability=0.01, steps=100, delta=1e-5))
    # A mechanism satisfying (eps, delta)-DP lies on or above the (eps, delta) curve.
    alphas = np.concatenate([[0.0], np.geomspace(1e-6, 1.0, 200)])
    mu = 1.0
    eps_mu = accounting.gdp_epsilon(mu=mu, delta=1e-5)
    assert np.all(accounting.gaussian_tradeoff(mu, alphas)
                  >= accounting.dp_tradeoff(eps_mu, 1e-5, alphas) - 1e-9)
    assert not np.all(accounting.gaussian_tradeoff(mu, alphas)
                      >= accounting.dp_tradeoff(0.5 * eps_mu, 1e-5, alphas) - 1e-9)
    out = tmp_path / "eps.png"
    accounting.plot_epsilon(str(out), steps, eps, 1e-5, title="a run")
    assert out.read_bytes()[:4] == b"\x89PNG"

@pytest.mark.parametrize("n, b, epochs", [(1000, 385, 20), (60000, 256, 3), (1000, 10, 2),
                                           (100, 40, 5)])
def test_cli_epochs_are_the_steps_fit_takes(n, b, epochs, capsys):
    # Session 22 audit: ceil(epochs / q) gave 52 steps where fit takes 20 * round(1000/385)
    # = 60; a noise multiplier calibrated by the CLI then overshot its target in fit.
    from tf_dp.data import PoissonSampler

    import numpy as np

    per_epoch = PoissonSampler(np.zeros((n, 1), "float32"), expected_batch_size=b).steps_per_epoch
    assert cli.main(f"--dataset_size {n} --batch_size {b} --epochs {epochs} "
                    "--noise_multiplier 1.2 --delta 1e-5".split()) == 0
    assert f"steps={epochs * per_epoch}," in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
