"""Shared by bench/large_model.py, bench/max_batch.py and bench/xla.py (docs/scaling.md).

Import this module BEFORE TensorFlow: it sets TF_NUM_INTRAOP_THREADS=1 and
TF_NUM_INTEROP_THREADS=1 (unless already set) for this process and the workers it starts,
so that benchmarks sharing a 2-core machine with other jobs do not fight for threads.

What is here:

* ``compiled_model(build_model, loss, config, ...)``: a model compiled for one configuration
  ("nonprivate" = keras Adam; "ghost" = tf_dp.DPAdam(norm_strategy="auto"); "jl<r>" =
  tf_dp.DPAdamJL(num_projections=r); "rgp" = a reparametrized copy of the model with
  DPAdam(norm_strategy="auto")); ``traced_step`` its train step traced with an UNKNOWN
  batch dimension (as Poisson-sampled batches are), optionally under XLA.
* ``round_robin(steps, rounds)``: median step times, one step of each configuration in turn
  (bench/step_time.py's method), so the drift of a shared machine hits all alike.
* Memory, measured from TensorFlow's own allocations: the worker processes run with
  ``TF_CPU_ALLOCATOR_USE_BFC=true``, under which the profiler records every allocation and
  deallocation (op name, shape, requested and allocated bytes) and
  ``tf.config.experimental.get_memory_info`` works on CPU (it raises "Allocator stats not
  available" with the default CPU allocator). ``profiled_step(step, x, y)`` gives the peak,
  during one step, of the sum of the requested sizes of the tensors the step allocated
  (weights, optimizer slots and the input batch, allocated before, are not counted): what
  the step needs, independent of the allocator's rounding and of malloc's caching, which
  blur the resident set size. The BFC allocator's own peak (chunk sizes) is kept as well.
* ``max_batch_search(probe, ...)``: doubling, then bisection, for the largest batch whose
  step peak stays under a cap; ``linear_fit`` gives bytes per example and the fixed part.
* ``peak_breakdown(fn)``: which tensors are alive at that peak (op name, shape, bytes).
* ``run_worker`` / ``Results`` / ``watchdog``: one configuration per subprocess, its results
  written to a JSON file after every change (they survive an abort); the watchdog ends a
  worker whose resident set exceeds a limit, so a runaway configuration cannot take the
  machine's memory.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(_HERE), "examples")

CONFIG_LABELS = {
    "nonprivate": "non-private Adam",
    "ghost": 'DPAdam norm_strategy="auto" (exact ghost)',
    "jl1": "DPAdamJL r=1",
    "jl3": "DPAdamJL r=3",
    "jl5": "DPAdamJL r=5",
    "rgp": "RGP rank 8 + DPAdam auto",
}


def set_threads():
    """Applies the thread counts to TensorFlow too (call after importing it)."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(
            int(os.environ["TF_NUM_INTRAOP_THREADS"]))
        tf.config.threading.set_inter_op_parallelism_threads(
            int(os.environ["TF_NUM_INTEROP_THREADS"]))
    except RuntimeError:
        pass  # already initialised: the environment variables applied


# ----------------------------------------------------------------------------- models


def compiled_model(build_model, loss, config, rgp_layers=None, rank=8, jit_compile=False):
    """(model, optimizer) for one configuration; ``build_model()`` makes the plain model."""
    import keras

    import tf_dp

    keras.utils.set_random_seed(0)  # weight initialisation only; no DP optimizer gets a seed
    model = build_model()
    dp = dict(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3)
    if config == "nonprivate":
        opt = keras.optimizers.Adam(1e-3)
    else:
        if config == "rgp":
            from tf_dp.layers import reparametrize

            names = rgp_layers(model) if rgp_layers is not None else None
            model = reparametrize(model, rank=rank, layers=names)
        model = tf_dp.keras.make_private(model)
        if config.startswith("jl"):
            opt = tf_dp.DPAdamJL(num_projections=int(config[2:]), **dp)
        elif config in ("ghost", "rgp"):
            opt = tf_dp.DPAdam(norm_strategy="auto", **dp)
        else:
            raise ValueError(f"unknown configuration {config!r}")
    model.compile(optimizer=opt, loss=loss, jit_compile=jit_compile)
    return model


def traced_step(model, x, y, jit_compile=False):
    """``model.train_step`` under tf.function with an unknown batch dimension."""
    import tensorflow as tf

    if hasattr(model, "check_before_training"):  # what fit() runs before its first step
        model.check_before_training(x, y)
    spec = [tf.TensorSpec([None, *x.shape[1:]], x.dtype),
            tf.TensorSpec([None, *y.shape[1:]], y.dtype)]
    return tf.function(lambda a, b: model.train_step((a, b)), input_signature=spec,
                       jit_compile=jit_compile)


def run_step(step, x, y):
    """One step, waited for (reading the loss forces the computation)."""
    float(step(x, y)["loss"])


# ----------------------------------------------------------------------------- timing


def round_robin(steps, rounds, warmup=2, log=None):
    """{name: median seconds} over ``rounds`` rounds of one step of each in turn.

    ``steps``: {name: (step, x, y)}, already traced. Returns (medians, all times).
    """
    import numpy as np

    for name, (step, x, y) in steps.items():
        for _ in range(warmup):
            run_step(step, x, y)
    times = {name: [] for name in steps}
    for i in range(rounds):
        for name, (step, x, y) in steps.items():
            t = time.perf_counter()
            run_step(step, x, y)
            times[name].append(time.perf_counter() - t)
        if log:
            log(f"  round {i + 1}/{rounds}: " + ", ".join(
                f"{n} {times[n][-1] * 1e3:.0f} ms" for n in steps))
    return {n: float(np.median(v)) for n, v in times.items()}, times


# ----------------------------------------------------------------------------- memory


def allocator_info():
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("CPU:0")


def step_peak(step, x, y):
    """(peak bytes the step allocates above what was allocated before it, seconds).

    Needs ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the process's environment (set by
    ``run_worker``)."""
    import tensorflow as tf

    tf.config.experimental.reset_memory_stats("CPU:0")
    before = allocator_info()["current"]
    t = time.perf_counter()
    run_step(step, x, y)
    seconds = time.perf_counter() - t
    return allocator_info()["peak"] - before, seconds


def max_batch_search(probe, cap_bytes, start, max_batch, max_step_s, tolerance=0.05,
                     points=None, log=None):
    """The largest batch whose ``probe(batch) -> (bytes, seconds)`` stays under ``cap_bytes``.

    Doubles from ``start`` until a batch goes over the cap (or a step takes longer than
    ``max_step_s``, or ``max_batch`` is reached), then bisects between the largest batch
    under and the smallest over until they are within ``tolerance`` of each other.
    ``points``: measurements already made ({batch: (bytes, seconds)}, e.g. by an earlier
    worker that was ended), reused. Returns (largest under, smallest over or None, points,
    note).
    """
    points = dict(points or {})

    def measure(b):
        if b not in points:
            points[b] = probe(b)
            if log:
                log(f"    batch {b}: {points[b][0] / 2**20:.1f} MiB, {points[b][1]:.2f} s")
        return points[b]

    under = [b for b, v in points.items() if v[0] <= cap_bytes]
    over = [b for b, v in points.items() if v[0] > cap_bytes]
    lo = max(under, default=None)
    hi = min(over, default=None)
    note = "bisected"
    if hi is None:
        b = start if lo is None else lo * 2
        while True:
            if b > max_batch:
                return lo, None, points, f"still under the cap at the scan limit {max_batch}"
            mem, sec = measure(b)[:2]
            if mem > cap_bytes:
                hi = b
                break
            lo = b
            if sec > max_step_s:
                return lo, None, points, f"scan stopped: a step took {sec:.0f} s"
            b *= 2
    if lo is None:
        return None, hi, points, f"over the cap at the first batch {hi}"
    while hi - lo > max(1, tolerance * lo):
        mid = (lo + hi) // 2
        mem = measure(mid)[0]
        if mem > cap_bytes:
            hi = mid
        else:
            lo = mid
    return lo, hi, points, note


def linear_fit(points):
    """(fixed bytes, bytes per example) by least squares over {batch: (bytes, s)}."""
    import numpy as np

    if len(points) < 2:
        return None, None
    b = np.array(sorted(points), dtype=float)
    m = np.array([points[int(k)][0] for k in b], dtype=float)
    slope, intercept = np.polyfit(b, m, 1)
    return float(intercept), float(slope)


def peak_breakdown(fn, logdir=None, top=25):
    """Tensors alive at the peak of ``fn()``, from the TensorFlow profiler's memory events.

    Only allocations made during ``fn()`` count (what was allocated before, such as weights,
    slots and the input batch, is not tracked). Returns a dict: ``requested`` (the peak of
    the sum of live tensors' requested sizes: what the step needs, independent of the
    allocator), ``allocated`` (the peak of the BFC allocator's chunk sizes, which add its
    rounding and unsplit chunks), ``rows`` [(requested bytes, op name, shape, count)] alive
    at the requested peak, grouped by op and shape, largest first. Needs the BFC CPU
    allocator (``run_worker`` sets it)."""
    import shutil

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    own = logdir is None
    logdir = logdir or tempfile.mkdtemp(prefix="tfdp_prof_")
    tf.profiler.experimental.start(
        logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=2))
    try:
        fn()
    finally:
        tf.profiler.experimental.stop()
    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    if own:
        shutil.rmtree(logdir, ignore_errors=True)
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for e in line.events:
                kind = names.get(e.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for s in e.stats:
                    key = stat_names.get(s.metadata_id)
                    if s.HasField("ref_value"):
                        stats[key] = stat_names.get(s.ref_value)
                    elif s.HasField("str_value"):
                        stats[key] = s.str_value
                    elif s.HasField("int64_value"):
                        stats[key] = s.int64_value
                    elif s.HasField("uint64_value"):
                        stats[key] = s.uint64_value
                t = line.timestamp_ns * 1000 + e.offset_ps
                events.append((t, kind == "MemoryAllocation", stats))
    events.sort(key=lambda ev: ev[0])
    live, at_peak = {}, {}
    req = alloc = peak_req = peak_alloc = 0
    for _, is_alloc, s in events:
        addr = s.get("addr")
        if is_alloc:
            entry = (int(s.get("requested_bytes") or 0), int(s.get("allocation_bytes") or 0),
                     s.get("tf_op") or "?", s.get("shape") or "?")
            live[addr] = entry
            req += entry[0]
            alloc += entry[1]
        else:
            entry = live.pop(addr, None)
            if entry is not None:
                req -= entry[0]
                alloc -= entry[1]
        peak_alloc = max(peak_alloc, alloc)
        if req > peak_req:
            peak_req, at_peak = req, dict(live)
    groups = collections.defaultdict(lambda: [0, 0])
    for nbytes, _, op, shape in at_peak.values():
        groups[(op, shape)][0] += nbytes
        groups[(op, shape)][1] += 1
    rows = sorted(((v[0], op, shape, v[1]) for (op, shape), v in groups.items()), reverse=True)
    return {"requested": peak_req, "allocated": peak_alloc, "rows": rows[:top]}


def profiled_step(step, x, y):
    """One step under the profiler: (requested peak bytes, allocator peak bytes, seconds,
    rows alive at the peak) -- see ``peak_breakdown``."""
    t = time.perf_counter()
    out = peak_breakdown(lambda: run_step(step, x, y))
    return out["requested"], out["allocated"], time.perf_counter() - t, out["rows"]


# ----------------------------------------------------------------------------- processes


def status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Results:
    """A worker's results, rewritten to ``path`` after every change (survive an abort)."""

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


def watchdog(limit_mb, results):
    """Ends the process (exit code 3) when its resident set exceeds ``limit_mb``."""
    state = {"limit_mb": limit_mb, "what": "setup"}

    def run():
        while True:
            rss = status_kb("VmRSS") / 1024.0
            if rss > state["limit_mb"]:
                results.set(aborted=f"{state['what']}: RSS {rss:.0f} MB > "
                                    f"{state['limit_mb']:.0f} MB")
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=run, daemon=True).start()
    return state


def run_worker(script, args, bfc=True, timeout=None):
    """Runs ``script --worker ... --out=<file> args`` in a fresh process; its JSON results.

    ``bfc``: the BFC CPU allocator (allocator statistics); off for timing runs."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="tfdp_scaling_")
    os.close(fd)
    env = dict(os.environ)
    if bfc:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    cmd = [sys.executable, script, f"--out={path}", *args]
    t = time.time()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=timeout)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(
            e.stderr, bytes) else (e.stderr or "")
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError):
        out = {}
    for p in (path, path + ".tmp"):
        if os.path.exists(p):
            os.remove(p)
    out["wall_s"] = time.time() - t
    out["returncode"] = code
    if code not in (0, 3):
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        out["error"] = lines[-3:] or ["?"]
    return out


def machine():
    """One line: TF/Keras versions, cores, threads, load, free memory."""
    import keras
    import tensorflow as tf

    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable"))
    return (f"TF {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} cores, "
            f"TF_NUM_INTRAOP_THREADS={os.environ.get('TF_NUM_INTRAOP_THREADS')} "
            f"TF_NUM_INTEROP_THREADS={os.environ.get('TF_NUM_INTEROP_THREADS')}, load "
            f"{'/'.join(f'{v:.1f}' for v in os.getloadavg())}, MemAvailable "
            f"{avail / 2**20:.1f} GiB")


def load_text(v):
    """A list of load averages as "1.0/2.0/3.0" ("?" when not recorded)."""
    return "/".join(f"{x:.1f}" for x in v) if v else "?"


def finish(results, json_out):
    """End of a driver run: the machine's state, and the results as JSON if asked."""
    import json

    print(machine(), flush=True)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(results, f, indent=1)


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


# ----------------------------------------------------------------------------- memory runs


class ModelSpec:
    """What the memory and timing runs need of a model: ``build() -> keras.Model``, its loss,
    ``batch(n, seed) -> (x, y)`` numpy arrays, and (for "rgp") ``rgp_layers(model) ->
    names``."""

    def __init__(self, name, build, loss, batch, rgp_layers=None, describe=""):
        self.name, self.build, self.loss, self.batch = name, build, loss, batch
        self.rgp_layers, self.describe = rgp_layers, describe

    def tensors(self, n, seed=0):
        import tensorflow as tf

        x, y = self.batch(n, seed)
        return tf.constant(x), tf.constant(y)


# ------------------------------------------- the models of bench/step_time.py


def _cnn():
    sys.path.insert(0, EXAMPLES)
    import _models  # examples/_models.py

    return _models.tutorial_cnn()


def _bilstm():
    import keras

    return keras.Sequential([
        keras.Input((150,), dtype="int32"),
        keras.layers.Embedding(8000, 64),
        keras.layers.Bidirectional(keras.layers.LSTM(64)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1),
    ])


def _cnn_batch(n, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n)


def _bilstm_batch(n, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.integers(0, 8000, (n, 150)).astype("int32"),
            rng.integers(0, 2, (n, 1)).astype("float32"))


def _sparse_ce():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _bce():
    import keras

    return keras.losses.BinaryCrossentropy(from_logits=True)


TUTORIAL_SPECS = {
    "cnn": ModelSpec("cnn", _cnn, _sparse_ce, _cnn_batch,
                              describe="TF Privacy tutorial CNN, 26,010 parameters"),
    "bilstm": ModelSpec("bilstm", _bilstm, _bce, _bilstm_batch,
                                 describe="BiLSTM, 598,209 parameters, sequence 150"),
}



def memory_worker(spec, config, out, cap_mib, start_batch, max_scan_batch, scan_step_s,
                  safety_mib, known=None, breakdown_batch=0, rank=8, fixes=()):
    """One configuration's memory run in this process (BFC allocator): its fixed footprint,
    the max-batch search and, with ``breakdown_batch``, what is alive at a step's peak."""
    import tensorflow as tf

    set_threads()
    if fixes:
        import _memory_fixes  # bench/_memory_fixes.py: prototypes, by monkeypatching

        _memory_fixes.apply(fixes)
    res = Results(out, model=spec.name, config=config, fixes=list(fixes))
    dog = watchdog(safety_mib, res)
    model = compiled_model(spec.build, spec.loss(), config, spec.rgp_layers, rank)
    x, y = spec.tensors(8)
    step = traced_step(model, x, y)
    t = time.perf_counter()
    run_step(step, x, y)
    res.set(first_call_s=time.perf_counter() - t)
    run_step(step, x, y)
    params = int(sum(int(tf.size(v)) for v in model.trainable_variables))
    res.set(params=params, footprint_mib=allocator_info()["current"] / 2**20,
            rss_mib=status_kb("VmRSS") / 1024.0)
    del x, y
    if breakdown_batch:
        xb, yb = spec.tensors(breakdown_batch, seed=1)
        run_step(step, xb, yb)
        mem, _ = step_peak(step, xb, yb)
        req, alloc, _, top = profiled_step(step, xb, yb)
        res.set(breakdown_batch=breakdown_batch, breakdown_step_peak=mem,
                breakdown_requested=req, breakdown_allocated=alloc,
                breakdown=[[b, op, shape, n] for b, op, shape, n in top])
        return
    known = known or {}
    points = {int(k): tuple(v) for k, v in known.items() if v != "retry"}
    retry = sorted(int(k) for k, v in known.items() if v == "retry")
    cap = cap_mib * 2**20
    # From here the watchdog also bounds the search: a batch far over the cap is ended. The
    # margin is wide because the BFC allocator keeps (and fragments) the regions of earlier,
    # smaller batches: the resident set grows faster than any one step's peak.
    dog["limit_mb"] = min(safety_mib, status_kb("VmRSS") / 1024.0 + 2.5 * cap_mib + 1024)

    def probe(b):
        dog["what"] = f"batch {b}"
        res.set(scanning=b)
        xb, yb = spec.tensors(b, seed=1)
        req, alloc, seconds, top = profiled_step(step, xb, yb)
        del xb, yb
        result = (req, seconds, alloc)
        res.set(points={**res.data.get("points", {}), str(b): list(result)},
                tops={**res.data.get("tops", {}), str(b): [list(r) for r in top[:8]]},
                scanning=None)
        return result

    for b in retry:  # ended by the watchdog in an earlier process: measured afresh first
        points[b] = probe(b)
    lo, hi, points, note = max_batch_search(probe, cap, start_batch, max_scan_batch,
                                            scan_step_s, points=points,
                                            log=lambda s: print(s, flush=True))
    res.set(points={str(k): list(v) for k, v in points.items()}, max_batch=lo, over=hi,
            note=note, load=os.getloadavg()[0])


def memory_driver(script, spec, configs, forwarded, cap_mib, attempts=4, log=print):
    """Every configuration in its own worker (restarted, with what it measured, when the
    watchdog ends it); returns {config: results}."""
    rows = {}
    for config in configs:
        known, result = {}, {}
        for _ in range(attempts):
            result = run_worker(script, [f"--worker={spec.name}:{config}",
                                         f"--known={json.dumps(known)}", *forwarded])
            known.update(result.get("points", {}))
            if result.get("returncode") == 3 and result.get("scanning"):
                # Ended by the watchdog during this batch: measured again first in a fresh
                # process (whose allocator holds no earlier batches' regions); ended twice,
                # it counts as over the cap.
                b = str(result["scanning"])
                again = known.get(b) == "retry"
                known[b] = [float("inf"), 0.0] if again else "retry"
                log(f"  {spec.name} {config}: batch {b} ended by the watchdog"
                    + (" again (over the cap)" if again else "; measuring it afresh")
                    + ", restarting with what was measured")
                continue
            break
        result["points"] = known
        pts = {int(k): tuple(v) for k, v in known.items()
               if v != "retry" and v[0] != float("inf")}
        under = [b for b, v in pts.items() if v[0] <= cap_mib * 2**20]
        result.setdefault("max_batch", max(under, default=None))
        result["fixed_bytes"], result["bytes_per_example"] = linear_fit(pts)
        rows[config] = result
        log(f"  {spec.name} {config}: max batch {result.get('max_batch')} "
            f"({result.get('note', '')}), {fmt(result['bytes_per_example'] and result['bytes_per_example'] / 1024, '.1f')} KiB/example, "
            f"fixed {fmt(result['fixed_bytes'] and result['fixed_bytes'] / 2**20, '.1f')} MiB, "
            f"wall {result['wall_s']:.0f} s"
            + (f", ERROR {result['error']}" if result.get("error") else ""))
    return rows


def memory_table(spec, rows, cap_mib, same_batch):
    """Markdown table of a memory run: ratios to non-private."""
    base = rows.get("nonprivate", {})
    base_max = base.get("max_batch")
    base_slope = base.get("bytes_per_example")

    def at(r, b):
        if r.get("bytes_per_example") is None:
            return None
        return r["fixed_bytes"] + r["bytes_per_example"] * b

    base_at = at(base, same_batch)
    lines = [f"{spec.name}: {spec.describe}; cap {cap_mib:g} MiB on the step's peak (live "
             "tensors the step allocates; weights, slots and the batch excluded)",
             f"| configuration | largest batch under the cap | × non-private | bytes/example "
             f"(KiB) | × | step peak at batch {same_batch} (MiB) | × | batch-independent part "
             "(MiB) | footprint (MiB) | search |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for config, r in rows.items():
        slope = r.get("bytes_per_example")
        lines.append(
            f"| {CONFIG_LABELS.get(config, config)} | {fmt(r.get('max_batch'), 'd')} | "
            f"{fmt(ratio(r.get('max_batch'), base_max), '.2f')} | "
            f"{fmt(slope and slope / 1024, '.1f')} | {fmt(ratio(slope, base_slope), '.2f')} | "
            f"{fmt(at(r, same_batch) and at(r, same_batch) / 2**20, '.0f')} | "
            f"{fmt(ratio(at(r, same_batch), base_at), '.2f')} | "
            f"{fmt(r.get('fixed_bytes') and r['fixed_bytes'] / 2**20, '.0f')} | "
            f"{fmt(r.get('footprint_mib'), '.0f')} | {r.get('note', r.get('error', ''))} |")
    return "\n".join(lines)


def breakdown_table(rows, label, top=12):
    lines = [f"{label}: tensors alive at the step's peak (sum of requested sizes "
             f"{rows.get('breakdown_requested', 0) / 2**20:.1f} MiB; BFC allocator peak "
             f"{rows.get('breakdown_step_peak', 0) / 2**20:.1f} MiB)",
             "| MiB | op | shape | count |", "|---:|---|---|---:|"]
    for b, op, shape, n in rows.get("breakdown", [])[:top]:
        lines.append(f"| {b / 2**20:.1f} | `{op}` | {shape} | {n} |")
    return "\n".join(lines)
