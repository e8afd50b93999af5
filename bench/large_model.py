r"""A >= 10M-parameter Transformer encoder: step time and largest batch vs non-private.

Issue 14 part 2, measured as ratios to non-private Adam in the same run (docs/scaling.md).

Model (examples/_transformer.py's builder, functional attention so that RGP reaches the
attention projections): token Embedding(--vocab, --d_model) + positional Embedding ->
--blocks x [4-head self-attention (EinsumDense q, k, v, output) -> Add -> LayerNorm ->
Dense(--ff, relu) -> Dense(--d_model) -> Add -> LayerNorm] -> masked mean pooling ->
Dense(2). Defaults: vocab 32,000, d_model 256, 4 blocks, ff 1024, sequence 64: 11.4M
parameters (8.2M in the token embedding). Random token ids in [1, vocab) (no padding) and
random binary labels: only shapes matter for speed and memory.

Configurations (bench/_scaling.py): non-private keras Adam; DPAdam norm_strategy="auto"
(exact ghost norms, clipped sum from the same factors); DPAdamJL r=1 and r=5; RGP:
tf_dp.layers.reparametrize(model, rank=--rank) on every EinsumDense and feed-forward Dense
(as examples/rgp_transformer.py does), then DPAdam auto. C = 1, sigma = 1, no seed given to
any DP optimizer.

Step time (--parts=timing): every configuration built and traced (unknown batch dimension)
in one process, then timed round-robin for --rounds rounds at --batch_size (one step of each
in turn, as bench/step_time.py), default CPU allocator. Ratios to non-private's median.

Largest batch (--parts=memory): each configuration in its own process (BFC CPU allocator,
whose profiler events give the step's peak of live tensors it allocates; weights, optimizer
slots and the input batch excluded); doubling from --start_batch then bisection to 5 % for
the largest batch under --cap_mib; bytes per example from a line through all measured
batches. --breakdown_batch=N lists the tensors alive at one step's peak instead.

TF_NUM_INTRAOP_THREADS=1 and TF_NUM_INTEROP_THREADS=1 (set by bench/_scaling.py).

  python bench/large_model.py                                 # timing, then memory
  python bench/large_model.py --parts=timing --rounds=8 --batch_size=32
  python bench/large_model.py --parts=memory --cap_mib=1024
  python bench/large_model.py --breakdown_batch=64 --configs=nonprivate,ghost,jl5
  python bench/large_model.py --parts=memory --configs=ghost,jl5 --fixes=gram_chunks,jl_no_materialise
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _scaling  # noqa: E402  (sets the thread counts before TensorFlow is imported)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["timing", "memory"], "What to measure: timing, memory.")
flags.DEFINE_list("configs", ["nonprivate", "ghost", "jl1", "jl5", "rgp"], "Configurations.")
flags.DEFINE_integer("vocab", 32000, "Vocabulary (token embedding rows).")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("d_model", 256, "Model width.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("ff", 1024, "Feed-forward hidden units.")
flags.DEFINE_integer("blocks", 4, "Encoder blocks.")
flags.DEFINE_integer("rank", 8, "RGP carrier rank.")
flags.DEFINE_integer("batch_size", 32, "Batch of the timed steps.")
flags.DEFINE_integer("rounds", 8, "Timed round-robin rounds (after 2 warm-up steps each).")
flags.DEFINE_float("cap_mib", 1024, "Cap on the step's peak of live tensors (MiB).")
flags.DEFINE_integer("start_batch", 16, "First batch of the max-batch search.")
flags.DEFINE_integer("max_scan_batch", 4096, "Largest batch the search tries.")
flags.DEFINE_float("scan_step_s", 90.0, "Stop doubling after a step slower than this.")
flags.DEFINE_float("safety_mib", 7000, "Any worker whose RSS exceeds this is ended.")
flags.DEFINE_integer("breakdown_batch", 0, "If > 0: tensors alive at the peak at this batch.")
flags.DEFINE_integer("same_batch", 64, "Batch at which the memory table compares peaks.")
flags.DEFINE_list("fixes", [], "Prototype memory fixes (bench/_memory_fixes.py), measurement "
                  "only: gram_chunks, late_patches, jl_no_materialise.")
flags.DEFINE_string("json_out", "", "Write all results to this JSON file.")
flags.DEFINE_string("worker", "", "Internal: 'timing' or 'transformer:<config>'.")
flags.DEFINE_string("out", "", "Internal: the worker's result file.")
flags.DEFINE_string("known", "{}", "Internal: batches already measured (JSON).")


def _build():
    sys.path.insert(0, _scaling.EXAMPLES)
    import _transformer  # examples/_transformer.py

    return _transformer.transformer_classifier(
        FLAGS.vocab, FLAGS.seq, FLAGS.d_model, FLAGS.heads, FLAGS.ff, FLAGS.blocks,
        attention="functional", num_classes=2)


def _batch(n, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(1, FLAGS.vocab, (n, FLAGS.seq)), rng.integers(0, 2, n)


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _rgp_layers(model):
    """Every EinsumDense and feed-forward Dense (examples/rgp_transformer.py's choice)."""
    import keras

    return [layer.name for layer in model.layers
            if type(layer) is keras.layers.EinsumDense
            or (type(layer) is keras.layers.Dense and "_ff" in layer.name)]


def _spec():
    return _scaling.ModelSpec(
        "transformer", _build, _loss, _batch, _rgp_layers,
        describe=(f"Transformer encoder, vocab {FLAGS.vocab}, d_model {FLAGS.d_model}, "
                  f"{FLAGS.blocks} blocks, ff {FLAGS.ff}, sequence {FLAGS.seq}"))


def _timing_worker():
    import time

    import numpy as np

    _scaling.set_threads()
    res = _scaling.Results(FLAGS.out, batch=FLAGS.batch_size)
    spec = _spec()
    steps, info = {}, {}
    for config in FLAGS.configs:
        model = _scaling.compiled_model(spec.build, spec.loss(), config, spec.rgp_layers,
                                        FLAGS.rank)
        x, y = spec.tensors(FLAGS.batch_size)
        step = _scaling.traced_step(model, x, y)
        t = time.perf_counter()
        _scaling.run_step(step, x, y)
        info[config] = {
            "first_call_s": time.perf_counter() - t,
            "params": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        }
        steps[config] = (step, x, y)
        print(f"  traced {config}: {info[config]}", flush=True)
        res.set(info=info)
    load0 = os.getloadavg()
    med, times = _scaling.round_robin(steps, FLAGS.rounds,
                                      log=lambda s: print(s, flush=True))
    res.set(info=info, median_s=med, times=times, load_start=load0, load_end=os.getloadavg())


def _forwarded():
    names = ("vocab", "seq", "d_model", "heads", "ff", "blocks", "rank", "cap_mib",
             "start_batch", "max_scan_batch", "scan_step_s", "safety_mib", "breakdown_batch")
    return [f"--{n}={FLAGS[n].value}" for n in names] + [f"--fixes={','.join(FLAGS.fixes)}"]


def _timing_table(r):
    med, info = r.get("median_s", {}), r.get("info", {})
    base = med.get("nonprivate")
    lines = [f"step time, batch {FLAGS.batch_size}, median of {FLAGS.rounds} round-robin "
             f"rounds (load average {_scaling.load_text(r.get('load_start'))} -> {_scaling.load_text(r.get('load_end'))})",
             "| configuration | trainable params | step (ms) | × non-private | first call (s) |",
             "|---|---:|---:|---:|---:|"]
    for config in FLAGS.configs:
        m = med.get(config)
        lines.append(f"| {_scaling.CONFIG_LABELS.get(config, config)} | "
                     f"{info.get(config, {}).get('params', 0):,} | "
                     f"{_scaling.fmt(m and m * 1e3, '.0f')} | "
                     f"{_scaling.fmt(_scaling.ratio(m, base), '.2f')} | "
                     f"{_scaling.fmt(info.get(config, {}).get('first_call_s'), '.1f')} |")
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.worker == "timing":
        _timing_worker()
        return
    if FLAGS.worker:
        _, config = FLAGS.worker.split(":")
        _scaling.memory_worker(_spec(), config, FLAGS.out, FLAGS.cap_mib, FLAGS.start_batch,
                               FLAGS.max_scan_batch, FLAGS.scan_step_s, FLAGS.safety_mib,
                               json.loads(FLAGS.known), FLAGS.breakdown_batch, FLAGS.rank,
                               fixes=FLAGS.fixes)
        return
    print(_scaling.machine(), flush=True)
    spec = _spec()
    print(spec.describe, flush=True)
    if FLAGS.fixes:
        print(f"PROTOTYPE FIXES (monkeypatched, bench/_memory_fixes.py): {FLAGS.fixes}")
    script = os.path.abspath(__file__)
    results = {}
    if FLAGS.breakdown_batch:
        for config in FLAGS.configs:
            r = _scaling.run_worker(script, [f"--worker=transformer:{config}", *_forwarded()])
            results[config] = r
            print("\n" + _scaling.breakdown_table(
                r, f"transformer {config}, batch {FLAGS.breakdown_batch}")
                + (f"\nERROR {r['error']}" if r.get("error") else ""), flush=True)
    else:
        if "timing" in FLAGS.parts:
            r = _scaling.run_worker(script, ["--worker=timing",
                                             f"--configs={','.join(FLAGS.configs)}",
                                             f"--batch_size={FLAGS.batch_size}",
                                             f"--rounds={FLAGS.rounds}", *_forwarded()],
                                    bfc=False)
            results["timing"] = r
            print("\n" + _timing_table(r) + "\n"
                  + (f"ERROR {r['error']}\n" if r.get("error") else ""), flush=True)
        if "memory" in FLAGS.parts:
            rows = _scaling.memory_driver(script, spec, FLAGS.configs, _forwarded(),
                                          FLAGS.cap_mib)
            results["memory"] = rows
            print("\n" + _scaling.memory_table(spec, rows, FLAGS.cap_mib, FLAGS.same_batch)
                  + "\n", flush=True)
    _scaling.finish(results, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
