r"""Largest batch under a memory cap, and where the memory goes: tutorial CNN and BiLSTM.

Issue 14's goal: exact ghost clipping and JL fit >= 0.75x non-private's largest batch.
Configurations (bench/_scaling.py): non-private Adam, DPAdam norm_strategy="auto" (exact
ghost), DPAdamJL r=1 and r=5. Models as in bench/step_time.py: the TF Privacy tutorial CNN
(28x28x1, 26,010 parameters) and the BiLSTM (Embedding(8000, 64) -> Bidirectional(LSTM(64))
-> Dense(64) -> Dense(1), sequence 150, 598,209 parameters). Random inputs.

Each configuration runs in its own process with TensorFlow's BFC CPU allocator, whose
statistics give the step's exact peak above what was allocated before it (weights, optimizer
slots and the input batch excluded); the largest batch whose step peak stays under --cap_mib
is found by doubling from --start_batch and bisecting to 5 %. Bytes per example and the
batch-independent part come from a least-squares line through every measured batch.
TF_NUM_INTRAOP_THREADS=1, TF_NUM_INTEROP_THREADS=1 (bench/_scaling.py).

--breakdown_batch=N instead lists, for each configuration, the tensors alive at the peak of
one step at batch N (TensorFlow profiler memory events: op name, shape, bytes).

  python bench/max_batch.py                                   # both models, cap 1024 MiB
  python bench/max_batch.py --models=cnn --configs=nonprivate,ghost
  python bench/max_batch.py --models=cnn --breakdown_batch=1024
  python bench/max_batch.py --models=cnn --fixes=late_patches,gram_chunks   # prototypes
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _scaling  # noqa: E402  (sets the thread counts before TensorFlow is imported)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn", "bilstm"], "Models: cnn, bilstm.")
flags.DEFINE_list("configs", ["nonprivate", "ghost", "jl1", "jl5"], "Configurations.")
flags.DEFINE_float("cap_mib", 1024, "Cap on the step's allocator peak above the footprint.")
flags.DEFINE_integer("cnn_start", 512, "First batch of the CNN's search.")
flags.DEFINE_integer("bilstm_start", 64, "First batch of the BiLSTM's search.")
flags.DEFINE_integer("max_scan_batch", 1 << 17, "Largest batch the search tries.")
flags.DEFINE_float("scan_step_s", 120.0, "Stop doubling after a step slower than this.")
flags.DEFINE_float("safety_mib", 7000, "Any worker whose RSS exceeds this is ended.")
flags.DEFINE_integer("breakdown_batch", 0, "If > 0: tensors alive at the peak at this batch.")
flags.DEFINE_integer("same_batch", 1024, "Batch at which the table compares step peaks.")
flags.DEFINE_list("fixes", [], "Prototype fixes to apply (bench/_memory_fixes.py): "
                  "gram_chunks, late_patches, jl_no_materialise. Measurement only.")
flags.DEFINE_string("json_out", "", "Write all results to this JSON file.")
flags.DEFINE_string("worker", "", "Internal: '<model>:<config>'.")
flags.DEFINE_string("out", "", "Internal: the worker's result file.")
flags.DEFINE_string("known", "{}", "Internal: batches already measured (JSON).")


SPECS = _scaling.TUTORIAL_SPECS


def _forwarded(model):
    start = FLAGS.cnn_start if model == "cnn" else FLAGS.bilstm_start
    return [f"--cap_mib={FLAGS.cap_mib}", f"--max_scan_batch={FLAGS.max_scan_batch}",
            f"--scan_step_s={FLAGS.scan_step_s}", f"--safety_mib={FLAGS.safety_mib}",
            f"--breakdown_batch={FLAGS.breakdown_batch}", f"--cnn_start={start}",
            f"--bilstm_start={start}", f"--fixes={','.join(FLAGS.fixes)}"]


def main(argv):
    del argv
    if FLAGS.worker:
        model, config = FLAGS.worker.split(":")
        start = FLAGS.cnn_start if model == "cnn" else FLAGS.bilstm_start
        _scaling.memory_worker(SPECS[model], config, FLAGS.out, FLAGS.cap_mib, start,
                               FLAGS.max_scan_batch, FLAGS.scan_step_s, FLAGS.safety_mib,
                               json.loads(FLAGS.known), FLAGS.breakdown_batch,
                               fixes=FLAGS.fixes)
        return
    print(_scaling.machine(), flush=True)
    if FLAGS.fixes:
        print(f"PROTOTYPE FIXES (monkeypatched, bench/_memory_fixes.py): {FLAGS.fixes}")
    script = os.path.abspath(__file__)
    results = {}
    for model in FLAGS.models:
        spec = SPECS[model]
        if FLAGS.breakdown_batch:
            rows = {}
            for config in FLAGS.configs:
                rows[config] = _scaling.run_worker(
                    script, [f"--worker={model}:{config}", *_forwarded(model)])
                print("\n" + _scaling.breakdown_table(
                    rows[config], f"{model} {config}, batch {FLAGS.breakdown_batch}")
                    + (f"\nERROR {rows[config]['error']}" if rows[config].get("error") else ""),
                    flush=True)
        else:
            rows = _scaling.memory_driver(script, spec, FLAGS.configs, _forwarded(model),
                                          FLAGS.cap_mib)
            print("\n" + _scaling.memory_table(spec, rows, FLAGS.cap_mib, FLAGS.same_batch)
                  + "\n", flush=True)
        results[model] = rows
    print(_scaling.machine(), flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
