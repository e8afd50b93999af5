"""One worker of a two-process MultiWorkerMirroredStrategy run (tests/keras/multi_worker_test.py).

    python _multi_worker_child.py <task index> <port,port> <result.json> [replicas per worker]

Runs the problems one after the other, in one cluster (starting the workers is most of
the cost):
  declared  each worker feeds, through distribute_datasets_from_function, the rows of a
            fixed list of logical batches that belong to its shard (row i -> worker i % 2);
            sigma = 0, so the weights must be those of one process on the whole batches.
  noise     zero loss, seeded noise (test only), array inputs sampled by fit on each
            worker's shard: the update is exactly -z / (q N) with z the step's noise, added
            once for the cluster.
  validation  array inputs with validation_split: the history's validation metrics must be
            those of the final weights on the held-out rows, on every worker.
  schedule  the noise problem with a batch-size schedule: step t's update is exactly
            -z_t / (q_t N), q_t of its phase, and each phase is accounted at its own q.
  full      arrays sampled by fit at q = 1 (every row in every step: the batches are known
            without reading the samplers), sigma = 0, clipping active: the weights must be
            those of one process.
  full_accum, full_physical  the same with gradient accumulation (2 micro-batches) and
            adaptive clipping, or with physical batches of at most 3 rows.
With more than one replica per worker (examples/_cpu_replicas.py: logical CPUs standing in
for a worker's accelerators) `declared` is not run: a distributed dataset is refused there,
and the result says with which error.
The result file gets the final weights and the worker's accountant record.
"""

import json
import os
import sys

index, ports, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
local_replicas = int(sys.argv[4]) if len(sys.argv) > 4 else 1
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"localhost:{p}" for p in ports]},
    "task": {"type": "worker", "index": index}})
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "examples"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from _cpu_replicas import use_cpu_replicas  # noqa: E402  (examples/)
from tests.keras import _multi_worker_data as data  # noqa: E402
from tf_dp.keras import make_private  # noqa: E402
from tf_dp.optimizers import DPSGD  # noqa: E402


def run(strategy, mode):
    if mode == "declared":
        x, y = data.regression()
        with strategy.scope():
            model = make_private(data.mlp())
            model.compile(optimizer=data.optimizer(), loss="mse")
        shard = [b[b % len(ports) == index] for b in data.batches()]
        ragged = tf.ragged.constant([s.tolist() for s in shard], dtype=tf.int64)
        local = tf.data.Dataset.from_tensor_slices(ragged).map(
            lambda idx: (tf.gather(x, idx), tf.gather(y, idx)))
        dataset = strategy.distribute_datasets_from_function(lambda context: local)
        model.fit(dataset, epochs=1, steps_per_epoch=len(shard), verbose=0,
                  dataset_size=len(x), sampling_probability=data.Q)
    elif mode == "declared_refused":
        x, y = data.regression()
        with strategy.scope():
            model = make_private(data.mlp())
            model.compile(optimizer=data.optimizer(), loss="mse")
        local = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        dataset = strategy.distribute_datasets_from_function(lambda context: local)
        try:
            model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0, dataset_size=len(x),
                      sampling_probability=data.Q)
        except ValueError as e:
            return {"error": str(e)}
        return {"error": None}
    elif mode.startswith("full"):
        x, y = data.regression()
        opt_kwargs, fit_kwargs = data.full_variant(mode)
        with strategy.scope():
            model = make_private(data.mlp())
            model.compile(optimizer=data.optimizer(**opt_kwargs), loss="mse")
        model.fit(x, y, epochs=data.FULL_STEPS, verbose=0, **fit_kwargs)
        phases = [(p.noise_multiplier, p.sampling_probability, p.count)
                  for p in model.accountant.phases]
        return {"weights": [w.tolist() for w in model.get_weights()], "phases": phases,
                "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
                "clip": float(keras.ops.convert_to_numpy(model.optimizer.current_clip()))}
    elif mode == "validation":
        # arrays sampled by fit on each worker's shard, the last quarter held out: every
        # worker evaluates all of it after each epoch
        x, y = data.regression()
        with strategy.scope():
            model = make_private(data.mlp())
            model.compile(optimizer=data.optimizer(), loss="mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_split=0.25,
                            validation_batch_size=3)
        phases = [(p.noise_multiplier, p.sampling_probability, p.count)
                  for p in model.accountant.phases]
        return {"weights": [w.tolist() for w in model.get_weights()], "phases": phases,
                "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}
    else:
        x, y = data.noise_problem()
        with strategy.scope():
            model = make_private(data.linear())
            model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
            model.compile(optimizer=DPSGD(data.CLIP, data.SIGMA, learning_rate=1.0,
                                          seed=data.SEED), loss=data.zero_loss)
        if mode == "schedule":
            model.fit(x, y, batch_size=data.SCHEDULE, epochs=1,
                      steps_per_epoch=data.SCHEDULE_STEPS, verbose=0)
        else:
            model.fit(x, y, batch_size=data.NOISE_BATCH, epochs=1, steps_per_epoch=1,
                      verbose=0)
    phases = [(p.noise_multiplier, p.sampling_probability, p.count)
              for p in model.accountant.phases]
    return {"weights": [w.tolist() for w in model.get_weights()], "phases": phases,
            "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}


def main():
    use_cpu_replicas(local_replicas)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == len(ports) * local_replicas, (
        strategy.num_replicas_in_sync)
    first = "declared" if local_replicas == 1 else "declared_refused"
    results = {mode: run(strategy, mode)
               for mode in (first, "noise", "validation", "schedule", "full", "full_accum",
                            "full_physical")}
    results["num_replicas_in_sync"] = strategy.num_replicas_in_sync
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
