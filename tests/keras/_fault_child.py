"""One process of a crash-and-restart run (tests/keras/fault_test.py).

    python _fault_child.py <index> <ports or -> <backup root> <kill at step or 0> <attempt> <out>

Zero loss, so every update is the step's noise alone (DPSGD, lr 1): the weights after each
step are written to ``<out dir>/w<index>_<attempt>_<step>.npy`` as they are applied, the
budget the model holds when training begins and at the end to
``<out dir>/r<index>_<attempt>.json``. ``BackupAndRestore(save_freq=3)`` in ``<backup root>/worker<index>`` (each worker its
own directory). With ``kill at step`` > 0 the process SIGKILLs itself right after that step
(no Python cleanup, no finally: what a lost machine looks like). ``ports`` "-" runs one
process without a cluster.
"""

import json
import os
import signal
import sys

index, ports, backup_root, kill_at, attempt, out = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
if ports != "-":
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports.split(",")]},
        "task": {"type": "worker", "index": index}})
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.keras import _multi_worker_data as data  # noqa: E402
from tf_dp.keras import make_private  # noqa: E402
from tf_dp.optimizers import DPSGD  # noqa: E402

N, BATCH = 40, 4          # q = 0.1: 10 steps per epoch
SAVE_EVERY = 3


class Record(keras.callbacks.Callback):
    """Writes the weights after every step, the budget at the start; kills on cue."""

    def __init__(self, attempt):
        super().__init__()
        self.attempt = attempt

    def _path(self, name):
        return os.path.join(out, name)

    def on_train_begin(self, logs=None):
        # Listed after BackupAndRestore: runs once it has restored (and fit, before that,
        # has adopted the budget journal).
        np.save(self._path(f"w{index}_{self.attempt}_start.npy"), self._flat())
        self.start = {"steps": self.model.accountant.steps,
                      "iterations": int(keras.ops.convert_to_numpy(
                          self.model.optimizer.iterations))}

    def on_train_batch_end(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        np.save(self._path(f"w{index}_{self.attempt}_{step}.npy"), self._flat())
        if kill_at and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def _flat(self):
        return np.concatenate([np.ravel(w) for w in self.model.get_weights()])


def main():
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if ports != "-"
                else tf.distribute.get_strategy())
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 30)).astype("float32")
    y = np.zeros((N, 20), np.float32)
    with strategy.scope():
        model = make_private(data.linear())
        model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
        model.compile(optimizer=DPSGD(data.CLIP, data.SIGMA, learning_rate=1.0),
                      loss=data.zero_loss)
    record = Record(attempt)
    backup = keras.callbacks.BackupAndRestore(os.path.join(backup_root, f"worker{index}"),
                                              save_freq=SAVE_EVERY)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[backup, record])
    with open(os.path.join(out, f"r{index}_{attempt}.json"), "w") as f:
        json.dump({"start": record.start, "steps": model.accountant.steps,
                   "phases": [(p.noise_multiplier, p.sampling_probability, p.count)
                              for p in model.accountant.phases],
                   "notes": model.privacy_report()["notes"],
                   "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))},
                  f)


if __name__ == "__main__":
    main()
