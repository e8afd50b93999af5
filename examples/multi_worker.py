r"""Private training on several machines: tf.distribute.MultiWorkerMirroredStrategy.

The TF Privacy tutorial CNN on Fashion-MNIST, DP-SGD with Poisson sampling, trained by W
worker processes. Every worker loads the same arrays; `fit` (tf_dp) makes each worker sample
only its own shard (rows w, w + W, w + 2W, ...) at q = batch_size / N, so every example is
drawn with probability q once per step over the cluster. The clipped sums are all-reduced,
the noise N(0, σ²C²) is added once per global step (by the cluster's first replica), the sum
is divided by the global expected batch q·N, and every worker's accountant records each step
once: all workers report the same ε (the chief's is the run's).

On this machine (W local workers on localhost ports, started by this script):

  python examples/multi_worker.py --workers=2                 # ~1 min per epoch on 2 cores
  python examples/multi_worker.py --workers=2 --smoke          # seconds

On a real cluster, run on each machine i (same flags everywhere but --task_index; or set
TF_CONFIG yourself and leave --cluster empty):

  python examples/multi_worker.py --cluster=host0:12345,host1:12345 --task_index=0
  python examples/multi_worker.py --cluster=host0:12345,host1:12345 --task_index=1

Faults: with --backup_dir every worker keeps a keras BackupAndRestore in its own
<backup_dir>/worker<i> (Keras 3's has no multi-worker logic), and fit keeps the budget
journal there (the spent budget written ahead of every step). When a worker dies, the
launcher kills the others and restarts the job (--max_restarts); training resumes from the
last backup, with a budget that covers every step applied before the crash, and the chief
says so. --simulate_fault_at=K makes the last worker SIGKILL itself after step K, once:

  python examples/multi_worker.py --workers=2 --smoke --backup_dir=/tmp/mw --save_every=3 \
      --simulate_fault_at=5 --max_restarts=1

Several devices (replicas) per worker: each worker's sample of a step is split over its own
replicas. TensorFlow gives a CPU worker one device; --local_replicas=2 splits each worker's
CPU into 2 logical devices through a private TensorFlow hook (examples/_cpu_replicas.py), to
stand for workers with 2 accelerators (4 replicas in a 2-worker cluster):

  python examples/multi_worker.py --workers=2 --local_replicas=2 --smoke

Noise and sampling come from each worker's fresh OS entropy; --seed seeds the initial
weights only (the same on every worker, as the strategy requires).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 2, "Local worker processes to start (ignored with --task_index).")
flags.DEFINE_string("cluster", None, "Comma-separated host:port of every worker (real clusters).")
flags.DEFINE_integer("task_index", None, "This worker's index in --cluster (set: run as a worker).")
flags.DEFINE_integer("threads", 1, "TensorFlow intra-op threads per worker.")
flags.DEFINE_integer("local_replicas", 1, "Replicas per CPU worker (logical CPUs standing for "
                     "a worker's accelerators; a private TensorFlow hook, for demonstrations).")
flags.DEFINE_integer("batch_size", 1024, "Expected logical batch size over the whole cluster.")
flags.DEFINE_integer("epochs", 3, "Epochs of round(N / batch_size) steps.")
flags.DEFINE_float("noise_multiplier", 1.1, "Noise multiplier σ.")
flags.DEFINE_float("l2_norm_clip", 0.12, "Per-example clipping norm C.")
flags.DEFINE_float("learning_rate", 2.0, "SGD learning rate.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_integer("seed", 0, "Seeds the initial weights only.")
flags.DEFINE_string("result", None, "Write the chief's final numbers here as JSON.")
flags.DEFINE_bool("smoke", False, "A seconds-long run (2,048 examples, 1 epoch).")
flags.DEFINE_string("backup_dir", None, "BackupAndRestore (and budget journal) root; each "
                    "worker uses <backup_dir>/worker<i>.")
flags.DEFINE_integer("save_every", None, "Back up every this many steps (default: each epoch).")
flags.DEFINE_integer("max_restarts", 0, "Launcher: restart the whole job this many times when "
                     "a worker dies.")
flags.DEFINE_integer("simulate_fault_at", None, "The last worker SIGKILLs itself after this "
                     "step, once per --backup_dir (a demonstration of recovery).")


def _free_ports(n):
    with contextlib.ExitStack() as stack:  # all held at once: n distinct ports
        servers = [stack.enter_context(socket.create_server(("localhost", 0)))
                   for _ in range(n)]
        return [server.getsockname()[1] for server in servers]


def launch():
    """Starts --workers local workers and prints the chief's output. When a worker dies, kills
    the others and starts the job again (up to --max_restarts times); fails if that is not
    enough."""
    passthrough = [a for a in sys.argv[1:] if not a.startswith(("--workers", "--task_index",
                                                                "--cluster", "--result"))]
    for attempt in range(FLAGS.max_restarts + 1):
        cluster = ",".join(f"localhost:{p}" for p in _free_ports(FLAGS.workers))
        procs = []
        for i in range(FLAGS.workers):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), f"--cluster={cluster}",
                 f"--task_index={i}", *passthrough,
                 *([f"--result={FLAGS.result}"] if FLAGS.result and i == 0 else [])],
                stdout=None if i == 0 else subprocess.DEVNULL,
                stderr=None if i == 0 else subprocess.PIPE, text=True))
        failed = _wait_for_all_or_first_failure(procs)
        if failed is None:
            return
        i, code = failed
        for p in procs:
            if p.poll() is None:
                p.kill()  # the survivors would wait forever in the next all-reduce
            p.wait()
        err = procs[i].stderr.read()[-3000:] if procs[i].stderr is not None else ""
        if attempt == FLAGS.max_restarts:
            raise SystemExit(f"worker {i} exited with {code}\n{err}")
        print(f"launcher: worker {i} exited with {code}; restarting the job "
              f"({attempt + 1} of {FLAGS.max_restarts})", flush=True)


def _wait_for_all_or_first_failure(procs):
    """None when every worker exited 0, else (index, exit code) of the first that failed."""
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                return i, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.5)


def worker():
    hosts = FLAGS.cluster.split(",") if FLAGS.cluster else None
    if hosts:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                              "task": {"type": "worker",
                                                       "index": FLAGS.task_index}})
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # the strategy logs every collective at INFO
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_dp

    from tf_dp.accounting.functions import epsilon_text
    from _cpu_replicas import use_cpu_replicas  # examples/_cpu_replicas.py
    from _models import tutorial_cnn  # examples/_models.py

    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    use_cpu_replicas(FLAGS.local_replicas)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync // FLAGS.local_replicas
    chief = FLAGS.task_index in (None, 0)
    (x, y), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist")
    if FLAGS.smoke:
        x, y, x_test, y_test = x[:2048], y[:2048], x_test[:512], y_test[:512]
        FLAGS.epochs, FLAGS.batch_size = 1, 256
    x = (x.astype("float32") / 255.0)[..., None]
    x_test = (x_test.astype("float32") / 255.0)[..., None]
    keras.utils.set_random_seed(FLAGS.seed)  # initial weights only: the same on every worker
    with strategy.scope():
        model = tf_dp.keras.make_private(tutorial_cnn("tanh"), delta=FLAGS.delta)
        model.compile(optimizer=tf_dp.DPSGD(l2_norm_clip=FLAGS.l2_norm_clip,
                                            noise_multiplier=FLAGS.noise_multiplier,
                                            learning_rate=FLAGS.learning_rate, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    epoch_seconds = []

    class _FaultOnce(keras.callbacks.Callback):
        """SIGKILLs this worker right after step `at` (no cleanup: a lost machine), once."""

        def __init__(self, at, marker):
            super().__init__()
            self.at, self.marker = at, marker

        def on_train_batch_end(self, batch, logs=None):
            step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if step == self.at and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                print(f"worker {FLAGS.task_index}: simulated fault after step {step}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    class _EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.time()

        def on_epoch_end(self, epoch, logs=None):
            epoch_seconds.append(time.time() - self.start)

    callbacks = [_EpochTimes()]
    if FLAGS.backup_dir:
        # Each worker its own directory; fit keeps the budget journal in it.
        backup = os.path.join(FLAGS.backup_dir, f"worker{FLAGS.task_index or 0}")
        callbacks.insert(0, keras.callbacks.BackupAndRestore(
            backup, save_freq=FLAGS.save_every or "epoch"))
        last = (FLAGS.task_index or 0) == workers - 1
        if FLAGS.simulate_fault_at and last:
            callbacks.append(_FaultOnce(FLAGS.simulate_fault_at,
                                        os.path.join(FLAGS.backup_dir, "fault_simulated")))
    start = time.time()
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
                        verbose=2 if chief else 0, callbacks=callbacks)
    seconds = time.time() - start
    steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    # Evaluation outside the strategy's collectives: every worker holds the same weights.
    logits = model.predict(x_test, batch_size=1024, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == y_test))
    result = {"worker": FLAGS.task_index, "workers": workers,
              "replicas": strategy.num_replicas_in_sync,
              "steps": steps, "seconds": seconds, "epoch_seconds": epoch_seconds,
              "epsilon": model.epsilon(),
              "test_accuracy": accuracy, "loss": history.history["loss"][-1],
              "budget_steps": model.accountant.steps,
              "notes": model.privacy_report()["notes"]}
    if chief:
        print(f"{workers} workers ({strategy.num_replicas_in_sync} replicas), {steps} steps "
              f"in {seconds:.0f} s "
              f"({1000 * seconds / max(steps, 1):.0f} ms/step incl. tracing): test accuracy "
              f"{accuracy:.4f}, epsilon {epsilon_text(result['epsilon'])} at delta {FLAGS.delta:g} "
              f"({result['budget_steps']} steps accounted)", flush=True)
        for note in result["notes"]:
            print(f"note: {note}", flush=True)
    if FLAGS.result:
        with open(FLAGS.result, "w") as f:
            json.dump(result, f)


def main(argv):
    del argv
    if FLAGS.task_index is None and not os.environ.get("TF_CONFIG"):
        launch()
    else:
        worker()


if __name__ == "__main__":
    app.run(main)
