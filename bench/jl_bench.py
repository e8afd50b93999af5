r"""JL optimizers vs exact DP-Adam vs non-private Adam: step time, peak memory, max batch.

Bu et al. 2021 (Tables 3-4) measure speed and the largest batch under a fixed memory; this is
that measurement for tf_dp on CPU. Configurations: non-private Adam, DPAdam with
norm_strategy "auto" (ghost norms where a layer formula exists, vectorized for the rest),
DPAdam with "vmap" (vectorized per-example gradients everywhere) and DPAdamJL with
r in {1, 3, 5}. Models: the TF Privacy tutorial CNN on 28x28x1 inputs (26,010 parameters,
batch 256) and the §3.1 BiLSTM (Embedding(8000, 64) -> Bidirectional(LSTM(64)) -> Dense(64)
-> Dense(1), sequence length 150, 598,209 parameters, batch 64). Inputs are random (only
shapes matter for speed and memory).

How each number is measured (every configuration in its OWN subprocess, one at a time):

* step time: the median over ``--steps`` calls of ``tf.function(model.train_step)`` at the
  model's batch size, after two warm-up calls (the first traces; its time is reported as
  "first call"). The function is traced with an unknown batch dimension so that the same
  trace serves the max-batch scan below (no re-tracing per batch size). Ratios are to the
  non-private step of the same run; the non-private configuration is measured first AND
  last for each model and the ratio uses the mean of the two, which shows the drift of this
  shared machine (the load average is printed).
* peak memory: ``ru_maxrss`` of the subprocess (raw; it includes tracing), and "net" = raw
  minus the ``ru_maxrss`` of a baseline subprocess that imports TensorFlow, builds and
  compiles the same model and creates the same batch, but never trains. "step peak" is the
  resident high-water mark (VmHWM, reset through /proc/self/clear_refs after the warm-up and
  a malloc_trim) during the timed steps only, minus the same baseline: the memory a step
  needs once traced.
* max batch under a cap: in the same subprocess, after timing, the batch is doubled from
  ``batch/4`` (one warm-up step, then VmHWM reset, then one measured step per size) until the
  step peak minus baseline exceeds ``--cap_gib``, a step takes longer than ``--scan_step_s``,
  or ``--max_scan_batch`` is reached. A watchdog thread polls VmRSS every 20 ms and ends the
  subprocess as soon as it exceeds baseline + cap (so a configuration that blows the cap
  cannot take the machine's memory). Reported: the largest batch measured under the cap (a
  lower bound), and a linear estimate ``a + b * batch = cap`` through the last two measured
  points (memory per example is constant at large batch for all these methods). RLIMIT_AS is
  not used: TensorFlow reserves far more address space than it touches.

  python bench/jl_bench.py                                  # everything (~1-2 h on 2 cores)
  python bench/jl_bench.py --models=cnn --no_max_batch      # quick
  python bench/jl_bench.py --markdown                       # also print markdown tables
"""

import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn", "bilstm"], "Models to benchmark.")
flags.DEFINE_list("configs", ["nonprivate", "dp_auto", "dp_vmap", "jl1", "jl3", "jl5"],
                  "Configurations (nonprivate is always measured first and last).")
flags.DEFINE_integer("cnn_batch", 256, "Batch size of the CNN.")
flags.DEFINE_integer("bilstm_batch", 64, "Batch size of the BiLSTM.")
flags.DEFINE_integer("steps", 10, "Timed steps per configuration (after 2 warm-up steps).")
flags.DEFINE_bool("max_batch", True, "Also scan for the largest batch under --cap_gib.")
flags.DEFINE_float("cap_gib", 4.0, "Memory cap for the max-batch scan (net of baseline), GiB.")
flags.DEFINE_integer("max_scan_batch", 65536, "Largest batch the scan tries.")
flags.DEFINE_float("scan_step_s", 120.0, "Stop the scan after a step slower than this.")
flags.DEFINE_float("safety_gib", 12.0, "Any worker whose RSS exceeds this is ended.")
flags.DEFINE_bool("markdown", False, "Print markdown tables too.")
flags.DEFINE_string("json_out", "", "Write all results to this JSON file.")
# Worker mode (internal).
flags.DEFINE_string("worker", "", "Internal: run one configuration: '<model>:<config>'.")
flags.DEFINE_integer("batch", 0, "Internal: the worker's batch size.")
flags.DEFINE_float("baseline_mb", 0.0, "Internal: baseline RSS for the cap, MB.")
flags.DEFINE_string("out", "", "Internal: the worker's result file.")

_CONFIG_LABELS = {"nonprivate": "non-private Adam", "dp_auto": "DPAdam auto (ghost)",
                  "dp_vmap": "DPAdam vmap", "jl1": "DPAdamJL r=1", "jl3": "DPAdamJL r=3",
                  "jl5": "DPAdamJL r=5", "baseline": "baseline (no training)"}


# ---------------------------------------------------------------------------- worker side


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm():
    """Releases freed heap to the OS and resets VmHWM to the current RSS (Linux >= 4.0)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _maxrss_mb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _Results:
    """The worker's results, rewritten to the file after every change (survives an abort)."""

    def __init__(self, path, **fields):
        self.path, self.data = path, dict(fields)
        self.flush()

    def set(self, **fields):
        self.data.update(fields)
        self.flush()

    def flush(self):
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)


def _watchdog(limit_mb, results, what):
    """Ends the process when VmRSS exceeds ``limit_mb`` (checked every 20 ms)."""
    import threading

    state = {"limit_mb": limit_mb, "what": what}

    def run():
        while True:
            rss = _status_kb("VmRSS") / 1024.0
            if rss > state["limit_mb"]:
                results.set(aborted=f"{state['what']}: RSS {rss:.0f} MB > {state['limit_mb']:.0f}"
                                    " MB")
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=run, daemon=True).start()
    return state


def _build(model_name, config):
    import keras
    import tensorflow as tf

    import tf_dp

    keras.utils.set_random_seed(0)
    L = keras.layers
    if model_name == "cnn":
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            L.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
            L.MaxPooling2D(2, 1),
            L.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
            L.MaxPooling2D(2, 1),
            L.Flatten(),
            L.Dense(32, activation="tanh"),
            L.Dense(10),
        ])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        x_spec = tf.TensorSpec((None, 28, 28, 1), tf.float32)
        y_spec = tf.TensorSpec((None,), tf.int64)
    else:
        model = keras.Sequential([
            keras.Input((150,), dtype="int32"),
            L.Embedding(8000, 64),
            L.Bidirectional(L.LSTM(64)),
            L.Dense(64, activation="relu"),
            L.Dense(1),
        ])
        loss = keras.losses.BinaryCrossentropy(from_logits=True)
        x_spec = tf.TensorSpec((None, 150), tf.int32)
        y_spec = tf.TensorSpec((None, 1), tf.float32)
    dp = dict(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3)
    if config in ("nonprivate", "baseline"):
        opt = keras.optimizers.Adam(1e-3)
    else:
        model = tf_dp.keras.make_private(model)
        if config.startswith("jl"):
            opt = tf_dp.DPAdamJL(num_projections=int(config[2:]), **dp)
        else:
            opt = tf_dp.DPAdam(norm_strategy=config[3:], **dp)
    model.compile(optimizer=opt, loss=loss, jit_compile=False)
    return model, x_spec, y_spec


def _batch(model_name, n, seed=0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    if model_name == "cnn":
        return (tf.constant(rng.random((n, 28, 28, 1), dtype=np.float32)),
                tf.constant(rng.integers(0, 10, n)))
    return (tf.constant(rng.integers(0, 8000, (n, 150)).astype("int32")),
            tf.constant(rng.integers(0, 2, (n, 1)).astype("float32")))


def _worker(spec):
    import numpy as np
    import tensorflow as tf

    model_name, config = spec.split(":")
    res = _Results(FLAGS.out, model=model_name, config=config, batch=FLAGS.batch)
    safety = _watchdog(FLAGS.safety_gib * 1024, res, "safety limit")
    model, x_spec, y_spec = _build(model_name, config)
    x, y = _batch(model_name, FLAGS.batch)
    if config == "baseline":
        res.set(raw_peak_mb=_maxrss_mb(), rss_mb=_status_kb("VmRSS") / 1024.0)
        return
    if hasattr(model, "check_before_training"):  # what fit() runs before its first step
        model.check_before_training(x, y)
    step = tf.function(lambda a, b: model.train_step((a, b)), input_signature=[x_spec, y_spec])
    t = time.perf_counter()
    float(step(x, y)["loss"])
    res.set(first_call_s=time.perf_counter() - t)
    float(step(x, y)["loss"])
    _reset_hwm()
    times = []
    for _ in range(FLAGS.steps):
        t = time.perf_counter()
        float(step(x, y)["loss"])
        times.append(time.perf_counter() - t)
    res.set(step_s=float(np.median(times)), step_s_all=times,
            step_peak_mb=_status_kb("VmHWM") / 1024.0, raw_peak_mb=_maxrss_mb(),
            load=os.getloadavg()[0])
    if not FLAGS.baseline_mb:
        return
    # Max-batch scan; the watchdog now enforces the cap itself.
    cap_mb = FLAGS.cap_gib * 1024
    safety["limit_mb"] = min(safety["limit_mb"], FLAGS.baseline_mb + cap_mb)
    scan = []
    b = max(FLAGS.batch // 4, 1)
    while b <= FLAGS.max_scan_batch:
        safety["what"] = f"batch {b}"
        res.set(scan=scan, scanning=b)
        xb, yb = _batch(model_name, b, seed=1)
        float(step(xb, yb)["loss"])
        _reset_hwm()
        t = time.perf_counter()
        float(step(xb, yb)["loss"])
        seconds = time.perf_counter() - t
        net = _status_kb("VmHWM") / 1024.0 - FLAGS.baseline_mb
        scan.append({"batch": b, "step_net_mb": net, "step_s": seconds})
        res.set(scan=scan)
        del xb, yb
        if net > cap_mb or seconds > FLAGS.scan_step_s:
            break
        b *= 2
    res.set(scanning=None, scan_done=True)


# ---------------------------------------------------------------------------- driver side


def _run_worker(model_name, config, batch, baseline_mb=0.0):
    fd, path = tempfile.mkstemp(suffix=".json", prefix="jl_bench_")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={model_name}:{config}",
           f"--batch={batch}", f"--out={path}", f"--steps={FLAGS.steps}",
           f"--cap_gib={FLAGS.cap_gib}", f"--max_scan_batch={FLAGS.max_scan_batch}",
           f"--scan_step_s={FLAGS.scan_step_s}", f"--safety_gib={FLAGS.safety_gib}",
           f"--baseline_mb={baseline_mb if FLAGS.max_batch else 0.0}"]
    t = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(path) as f:
        out = json.load(f)
    os.remove(path)
    out["wall_s"] = time.time() - t
    out["returncode"] = proc.returncode
    if proc.returncode not in (0, 3):
        out["error"] = proc.stderr.strip().splitlines()[-1:] or ["?"]
    return out


def _max_batch(r, cap_mb):
    """(largest measured batch under the cap, linear estimate, note)."""
    scan = [s for s in r.get("scan", [])]
    under = [s for s in scan if s["step_net_mb"] <= cap_mb]
    if not scan:
        return None, None, r.get("aborted", "no scan")
    best = max((s["batch"] for s in under), default=None)
    over = r.get("aborted") is not None or any(s["step_net_mb"] > cap_mb for s in scan)
    pts = scan[-2:] if len(scan) >= 2 else scan
    est = None
    if len(pts) == 2 and pts[1]["step_net_mb"] > pts[0]["step_net_mb"]:
        (b0, m0), (b1, m1) = [(p["batch"], p["step_net_mb"]) for p in pts]
        slope = (m1 - m0) / (b1 - b0)
        est = int(b0 + (cap_mb - m0) / slope)
    if r.get("aborted") and r.get("scanning"):
        note = f"batch {r['scanning']} went over the cap (ended by the watchdog)"
    elif over:
        note = "next doubling went over the cap"
    elif scan[-1]["step_s"] > FLAGS.scan_step_s:
        note = f"scan stopped: a step took {scan[-1]['step_s']:.0f} s"
    else:
        note = f"still under the cap at the scan limit {scan[-1]['batch']}"
    return best, est, note


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def main(argv):
    del argv
    if FLAGS.worker:
        _worker(FLAGS.worker)
        return
    import keras
    import tensorflow as tf

    cap_mb = FLAGS.cap_gib * 1024
    print(f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores, "
          f"load {os.getloadavg()[0]:.1f}; {FLAGS.steps} timed steps; cap {FLAGS.cap_gib:g} GiB "
          "net", flush=True)
    results = {}
    for model_name in FLAGS.models:
        batch = FLAGS.cnn_batch if model_name == "cnn" else FLAGS.bilstm_batch
        base = _run_worker(model_name, "baseline", batch)
        base_mb = base["raw_peak_mb"]
        rows = {"baseline": base}
        configs = [c for c in FLAGS.configs if c != "nonprivate"]
        order = ["nonprivate"] + configs + ["nonprivate_again"]
        for config in order:
            # The repeat of the non-private run only re-measures its time (no scan).
            r = _run_worker(model_name, config.replace("_again", ""), batch,
                            0.0 if config.endswith("_again") else base_mb)
            rows[config] = r
            print(f"  {model_name} {config}: step {_fmt(r.get('step_s'), '.4f')} s, "
                  f"raw peak {_fmt(r.get('raw_peak_mb'), '.0f')} MB, first call "
                  f"{_fmt(r.get('first_call_s'), '.1f')} s, wall {r['wall_s']:.0f} s"
                  + (f", ABORTED {r['aborted']}" if r.get("aborted") else "")
                  + (f", ERROR {r['error']}" if r.get("error") else ""), flush=True)
        results[model_name] = rows
        _print_table(model_name, batch, rows, base_mb, cap_mb)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(results, f, indent=1)


def _print_table(model_name, batch, rows, base_mb, cap_mb):
    np1, np2 = rows["nonprivate"], rows["nonprivate_again"]
    np_times = [r["step_s"] for r in (np1, np2) if "step_s" in r]
    np_step = sum(np_times) / len(np_times)
    np_raw = (np1["raw_peak_mb"] + np2["raw_peak_mb"]) / 2
    np_net = np_raw - base_mb
    np_step_net = (np1["step_peak_mb"] + np2["step_peak_mb"]) / 2 - base_mb
    print(f"\n{model_name}, batch {batch}: non-private step {np_times[0] * 1e3:.1f} ms (first) / "
          f"{np_times[-1] * 1e3:.1f} ms (last); baseline RSS {base_mb:.0f} MB")
    head = (f"{'configuration':22s} {'step ms':>9s} {'x np':>6s} {'limit':>6s} {'1st call s':>10s}"
            f" {'raw MB':>7s} {'x np':>6s} {'net MB':>7s} {'x np':>6s} {'step net MB':>11s}"
            f" {'x np':>6s} {'max batch':>10s} {'est.':>8s}")
    print(head)
    md = ["| configuration | step (ms) | × non-private | (1+0.5r) | first call (s) | raw peak (MB)"
          " | × | net peak (MB) | × | step net (MB) | × | max batch measured | linear est. |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for config in ["nonprivate"] + [c for c in rows if c not in ("baseline", "nonprivate",
                                                                  "nonprivate_again")] + [
                                                                      "nonprivate_again"]:
        r = rows[config]
        label = _CONFIG_LABELS.get(config.replace("_again", ""), config)
        if config == "nonprivate_again":
            label += " (again)"
        limit = f"{1 + 0.5 * int(config[2:]):.1f}" if config.startswith("jl") else "-"
        step = r.get("step_s")
        raw = r.get("raw_peak_mb")
        net = raw - base_mb if raw else None
        step_net = r["step_peak_mb"] - base_mb if "step_peak_mb" in r else None
        best, est, note = _max_batch(r, cap_mb) if FLAGS.max_batch else (None, None, "")
        ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
        print(f"{label:22s} {_fmt(step and step * 1e3, '9.1f')} "
              f"{_fmt(ratio(step, np_step), '6.2f')} {limit:>6s} "
              f"{_fmt(r.get('first_call_s'), '10.1f')} {_fmt(raw, '7.0f')} "
              f"{_fmt(ratio(raw, np_raw), '6.2f')} {_fmt(net, '7.0f')} "
              f"{_fmt(ratio(net, np_net), '6.2f')} {_fmt(step_net, '11.0f')} "
              f"{_fmt(ratio(step_net, np_step_net), '6.2f')} {_fmt(best, '10d')} "
              f"{_fmt(est, '8d')}  {note}"
              + (f"  ABORTED: {r['aborted']}" if r.get("aborted") and not r.get("scanning")
                 else ""))
        md.append(f"| {label} | {_fmt(step and step * 1e3, '.1f')} | "
                  f"{_fmt(ratio(step, np_step), '.2f')} | {limit} | "
                  f"{_fmt(r.get('first_call_s'), '.1f')} | {_fmt(raw, '.0f')} | "
                  f"{_fmt(ratio(raw, np_raw), '.2f')} | {_fmt(net, '.0f')} | "
                  f"{_fmt(ratio(net, np_net), '.2f')} | {_fmt(step_net, '.0f')} | "
                  f"{_fmt(ratio(step_net, np_step_net), '.2f')} | {_fmt(best, 'd')} | "
                  f"{_fmt(est, 'd')} |")
    print(f"(load average at the end: {os.getloadavg()[0]:.1f})", flush=True)
    if FLAGS.markdown:
        print("\n" + "\n".join(md) + "\n", flush=True)


if __name__ == "__main__":
    app.run(main)
