"""examples/mlm_megabatch.py runs end to end (--smoke): the table, both figures.

Slow: it starts TensorFlow in a subprocess and traces a private Transformer step (about a
minute per private configuration on 2 shared cores).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_mlm_megabatch_smoke(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "mlm_megabatch.py"),
                          "--smoke", f"--output_dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    stdout = out.stdout
    assert "| configuration | sigma |" in stdout
    assert "| schedule 32 -> 64 -> 96 -> 128 |" in stdout
    assert "| non-private AdamW, batch 128 |" in stdout
    assert "inf (non-private)" in stdout
    for name in ("mlm_snr.png", "mlm_accuracy.png"):
        assert (tmp_path / name).stat().st_size > 10_000


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
