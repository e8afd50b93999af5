"""Throughput of private multi-worker training: W workers x T threads, same total cores.

Runs examples/multi_worker.py (the tutorial CNN on Fashion-MNIST, DP-SGD, Poisson sampling,
expected batch --batch_size over the cluster) as 1 process x 1 thread, 1 process x 2 threads
and 2 workers x 1 thread (localhost, MultiWorkerMirroredStrategy), one after the other, and
prints the steady-state time per logical step (epochs after the first, which traces) and
the all-reduce volume per step. Results: docs/distributed.md.

  python bench/multi_worker.py                 # ~10 min on 2 cores
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 1024, "Expected logical batch over the cluster.")
flags.DEFINE_integer("epochs", 3, "Epochs per configuration (the first is not timed).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [("1 process x 1 thread", 1, 1), ("1 process x 2 threads", 1, 2),
           ("2 workers x 1 thread", 2, 1)]
PARAMETERS = 26_010  # the tutorial CNN


def run(workers, threads):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multi_worker.py"),
                        f"--workers={workers}", f"--threads={threads}",
                        f"--batch_size={FLAGS.batch_size}", f"--epochs={FLAGS.epochs}",
                        f"--result={out}"], check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        with open(out) as f:
            return json.load(f)


def main(argv):
    del argv
    rows = []
    for name, workers, threads in CONFIGS:
        result = run(workers, threads)
        steps_per_epoch = result["steps"] / FLAGS.epochs
        timed = result["epoch_seconds"][1:]
        ms = 1000 * sum(timed) / (len(timed) * steps_per_epoch)
        rows.append((name, ms, result["test_accuracy"], result["epsilon"]))
        print(f"{name:24s} {ms:7.0f} ms/step  accuracy {result['test_accuracy']:.3f}  "
              f"epsilon {result['epsilon']:.2f}", flush=True)
    base = rows[0][1]
    print("\n| configuration | ms per logical step | speed-up vs 1 x 1 | test accuracy | ε |")
    print("|---|---|---|---|---|")
    for name, ms, acc, eps in rows:
        print(f"| {name} | {ms:.0f} | {base / ms:.2f}x | {acc:.3f} | {eps:.2f} |")
    grads = 4 * PARAMETERS
    print(f"\nAll-reduce per logical step (2 workers): the clipped-and-noised gradient, "
          f"{PARAMETERS:,} float32 = {grads / 1024:.0f} KiB, plus a few scalars (logs, "
          "count); a ring all-reduce sends 2 (W - 1) / W of it per worker.")


if __name__ == "__main__":
    app.run(main)
