"""The two analysis examples run end to end (--smoke) and write their figures.

Slow: each starts TensorFlow in a subprocess and trains a few tiny private models (about
half a minute each on 2 shared cores).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *flags):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--smoke",
                          *flags], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_restricted_lipschitz_smoke(tmp_path):
    figure = tmp_path / "rl.png"
    stdout = _run("restricted_lipschitz.py", f"--output={figure}")
    assert figure.stat().st_size > 10_000
    assert "excess" in stdout and "wrote" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, suffix", [("dpsgd", ""), ("rgp", "_rgp")])
def test_gradient_geometry_smoke(tmp_path, optimizer, suffix):
    stdout = _run("gradient_geometry.py", f"--output_dir={tmp_path}", f"--optimizer={optimizer}")
    for name in (f"stable_rank{suffix}.png", f"historical_alignment{suffix}.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert "test accuracy" in stdout and "epsilon" in stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
