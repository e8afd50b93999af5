"""The audit examples run end to end (--smoke sizes, subprocesses: slow)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_audit_example_prints_the_bound_next_to_the_accountant():
    out = _run("examples/audit.py", "--noise_multiplier=1.0", "--num_canaries=200",
               "--num_other_examples=100", "--expected_batch_size=10", "--epochs=2")
    assert "audited eps >=" in out and "accountant eps" in out and "VIOLATION" not in out


@pytest.mark.slow
def test_membership_inference_example_writes_the_roc(tmp_path):
    png = tmp_path / "roc.png"
    out = _run("examples/membership_inference.py", "--smoke", f"--output={png}")
    assert "LiRA offline" in out and "LiRA online" in out and png.stat().st_size > 1000


@pytest.mark.slow
def test_membership_inference_example_on_rgp_and_lsg(tmp_path):
    png = tmp_path / "roc.png"
    out = _run("examples/membership_inference.py", "--smoke", "--methods=rgp,lsg",
               f"--output={png}")
    assert "| RGP r=8 eps=8 |" in out and "| LSG r=8 p=0.5 eps=8 |" in out


@pytest.mark.slow
def test_audit_example_with_input_canaries():
    out = _run("examples/audit.py", "--canaries=input", "--noise_multiplier=1.0",
               "--num_canaries=100", "--num_other_examples=100", "--epochs=1")
    assert "input canaries:" in out and "audited eps >=" in out and "-GDP" in out
    assert "VIOLATION" not in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
