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
  python bench/max_batch.py --models=cnn --fixes=late_patches,gram_chunks,jl_no_materialise \
      --time_fixes_batch=256        # step time with and without the prototypes
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
flags.DEFINE_integer("time_fixes_batch", 0, "If > 0: instead, time each configuration with "
                     "and without --fixes round-robin in one process at this batch.")
flags.DEFINE_integer("rounds", 15, "Round-robin rounds of --time_fixes_batch.")
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


def _time_fixes_worker(model):
    """Every configuration traced without, then with, the prototype fixes (they act at
    tracing time), then all timed round-robin."""
    import _memory_fixes

    _scaling.set_threads()
    spec = SPECS[model]
    res = _scaling.Results(FLAGS.out, model=model, batch=FLAGS.time_fixes_batch,
                           fixes=FLAGS.fixes)
    steps = {}
    for patched in (False, True):
        if patched:
            _memory_fixes.apply(FLAGS.fixes)
        for config in FLAGS.configs:
            m = _scaling.compiled_model(spec.build, spec.loss(), config)
            x, y = spec.tensors(FLAGS.time_fixes_batch)
            steps[config + ("+fixes" if patched else "")] = (_scaling.traced_step(m, x, y), x, y)
    load0 = os.getloadavg()
    med, times = _scaling.round_robin(steps, FLAGS.rounds)
    res.set(median_s=med, times=times, load_start=load0, load_end=os.getloadavg())


def main(argv):
    del argv
    if FLAGS.worker.startswith("timefixes:"):
        _time_fixes_worker(FLAGS.worker.split(":")[1])
        return
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
        if FLAGS.time_fixes_batch:
            r = _scaling.run_worker(script, [f"--worker=timefixes:{model}",
                                             f"--configs={','.join(FLAGS.configs)}",
                                             f"--fixes={','.join(FLAGS.fixes)}",
                                             f"--time_fixes_batch={FLAGS.time_fixes_batch}",
                                             f"--rounds={FLAGS.rounds}"], bfc=False)
            med = r.get("median_s", {})
            base = med.get("nonprivate")
            print(f"\n{model}, batch {FLAGS.time_fixes_batch}, median of {FLAGS.rounds} rounds, "
                  f"load average {_scaling.load_text(r.get('load_start'))} -> {_scaling.load_text(r.get('load_end'))}\n"
                  "| configuration | step (ms) | × non-private | with fixes (ms) | × non-private |"
                  " fixes' cost |\n|---|---:|---:|---:|---:|---:|")
            for config in FLAGS.configs:
                a, b = med.get(config), med.get(config + "+fixes")
                print(f"| {_scaling.CONFIG_LABELS.get(config, config)} | "
                      f"{_scaling.fmt(a and a * 1e3, '.1f')} | "
                      f"{_scaling.fmt(_scaling.ratio(a, base), '.2f')} | "
                      f"{_scaling.fmt(b and b * 1e3, '.1f')} | "
                      f"{_scaling.fmt(_scaling.ratio(b, base), '.2f')} | "
                      f"{_scaling.fmt(_scaling.ratio(b, a), '.2f')} |", flush=True)
            if r.get("error"):
                print(f"ERROR {r['error']}")
            results[model] = r
            continue
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
    _scaling.finish(results, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
