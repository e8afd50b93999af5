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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
