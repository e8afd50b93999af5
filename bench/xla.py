r"""Step time with and without XLA (jit_compile=True), private and non-private.

For each model, one process builds every configuration twice, compiled with
``jit_compile=False`` and ``jit_compile=True``, traces ``model.train_step`` under
``tf.function(jit_compile=...)`` (what Keras' train function does with compile's
``jit_compile``) with an unknown batch dimension, and times all of them round-robin (one step
of each in turn, bench/step_time.py's method). Configurations: non-private keras Adam,
DPAdam norm_strategy="auto" (exact ghost), DPAdamJL r=5 (bench/_scaling.py). Ratios are to
non-private WITHOUT XLA of the same run; "XLA speed-up" is a configuration's time without
XLA over its time with it. The optimizer is built (``model.optimizer.build``) before the XLA
step is traced: DPAdam's first XLA call otherwise fails to create its slot variables, and so
does ``fit(..., jit_compile=True)`` (a library bug, docs/scaling.md). Models as bench/step_time.py (built by bench/_scaling.py).
The first call (tracing + XLA compilation) is reported as well. Each model runs in its own
worker with a --timeout_s limit (the BiLSTM's XLA compilation can take long).

TF_NUM_INTRAOP_THREADS=1 and TF_NUM_INTEROP_THREADS=1 (set by bench/_scaling.py).

  python bench/xla.py                                   # CNN (batch 256), BiLSTM (batch 64)
  python bench/xla.py --models=cnn --rounds=20
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _scaling  # noqa: E402  (sets the thread counts before TensorFlow is imported)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn", "bilstm"], "Models: cnn, bilstm.")
flags.DEFINE_list("configs", ["nonprivate", "ghost", "jl5"], "Configurations.")
flags.DEFINE_integer("cnn_batch", 256, "Batch of the CNN.")
flags.DEFINE_integer("bilstm_batch", 64, "Batch of the BiLSTM.")
flags.DEFINE_integer("rounds", 15, "Timed round-robin rounds (after 2 warm-up steps each).")
flags.DEFINE_float("timeout_s", 1800, "Limit on one model's worker.")
flags.DEFINE_string("worker", "", "Internal: the model to measure in this process.")
flags.DEFINE_string("out", "", "Internal: the worker's result file.")


def _worker(model_name):
    import time

    _scaling.set_threads()
    spec = _scaling.TUTORIAL_SPECS[model_name]
    batch = FLAGS.cnn_batch if model_name == "cnn" else FLAGS.bilstm_batch
    res = _scaling.Results(FLAGS.out, model=model_name, batch=batch)
    steps, first = {}, {}
    for config in FLAGS.configs:
        for jit in (False, True):
            name = f"{config}{'+xla' if jit else ''}"
            model = _scaling.compiled_model(spec.build, spec.loss(), config, jit_compile=jit)
            if jit:
                # The optimizer's variables must exist before the XLA function is traced: a
                # DP optimizer with slots (DPAdam, DPAdamJL, DPSGD with momentum) otherwise
                # fails with "We failed to lift variable creations out of this tf.function"
                # (so does fit(jit_compile=True) itself; docs/scaling.md, "Bugs").
                model.optimizer.build(model.trainable_variables)
            x, y = spec.tensors(batch)
            step = _scaling.traced_step(model, x, y, jit_compile=jit)
            t = time.perf_counter()
            try:
                _scaling.run_step(step, x, y)
            except Exception as err:  # noqa: BLE001 - reported, the others still run
                first[name] = f"{type(err).__name__}: {str(err)[:300]}"
                res.set(first_call_s=first)
                print(f"  {name}: FAILED {first[name]}", flush=True)
                continue
            first[name] = time.perf_counter() - t
            steps[name] = (step, x, y)
            res.set(first_call_s=first)
            print(f"  traced {name}: first call {first[name]:.1f} s", flush=True)
    load0 = os.getloadavg()
    med, times = _scaling.round_robin(steps, FLAGS.rounds)
    res.set(median_s=med, times=times, load_start=load0, load_end=os.getloadavg())


def _table(model_name, r):
    med, first = r.get("median_s", {}), r.get("first_call_s", {})
    base = med.get("nonprivate")
    batch = r.get("batch")
    lines = [f"{model_name}, batch {batch}, median of {FLAGS.rounds} round-robin rounds "
             f"(load average {_scaling.load_text(r.get('load_start'))} -> {_scaling.load_text(r.get('load_end'))})",
             "| configuration | no XLA (ms) | × non-private | XLA (ms) | × non-private (no XLA) "
             "| × non-private XLA | XLA speed-up | first call no XLA / XLA (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    base_xla = med.get("nonprivate+xla")
    for config in FLAGS.configs:
        a, b = med.get(config), med.get(config + "+xla")
        f0, f1 = first.get(config), first.get(config + "+xla")
        lines.append(
            f"| {_scaling.CONFIG_LABELS.get(config, config)} | {_scaling.fmt(a and a * 1e3, '.1f')}"
            f" | {_scaling.fmt(_scaling.ratio(a, base), '.2f')} | "
            f"{_scaling.fmt(b and b * 1e3, '.1f')} | {_scaling.fmt(_scaling.ratio(b, base), '.2f')}"
            f" | {_scaling.fmt(_scaling.ratio(b, base_xla), '.2f')} | "
            f"{_scaling.fmt(_scaling.ratio(a, b), '.2f')} | "
            f"{_scaling.fmt(f0, '.1f')} / {_scaling.fmt(f1, '.1f') if not isinstance(f1, str) else f1} |")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.worker:
        _worker(FLAGS.worker)
        return
    print(_scaling.machine(), flush=True)
    script = os.path.abspath(__file__)
    for model_name in FLAGS.models:
        r = _scaling.run_worker(script, [f"--worker={model_name}",
                                         f"--configs={','.join(FLAGS.configs)}",
                                         f"--cnn_batch={FLAGS.cnn_batch}",
                                         f"--bilstm_batch={FLAGS.bilstm_batch}",
                                         f"--rounds={FLAGS.rounds}"],
                                bfc=False, timeout=FLAGS.timeout_s)
        print("\n" + _table(model_name, r) + "\n"
              + (f"ERROR ({r['returncode']}): {r.get('error')}\n" if r.get("error") else ""),
              flush=True)
    print(_scaling.machine(), flush=True)


if __name__ == "__main__":
    app.run(main)
