"""Shared by the RGP examples: per-epoch report and the final line (test accuracy, epsilon)."""

import time

import keras

from tf_dp.accounting.functions import epsilon_text


class EpochReport(keras.callbacks.Callback):
    """Prints train loss, test accuracy, epsilon and seconds after every epoch."""

    def __init__(self, x_test, y_test, private, delta):
        super().__init__()
        self.x_test, self.y_test, self.private, self.delta = x_test, y_test, private, delta
        self.epoch_start = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.time() - self.epoch_start
        _, acc = self.model.evaluate(self.x_test, self.y_test, batch_size=1024, verbose=0)
        logs = logs or {}
        eps = epsilon_text(logs['epsilon']) if self.private else "inf (non-private)"
        print(f"epoch {epoch + 1:3d}  train loss {logs.get('loss', float('nan')):.4f}  "
              f"test accuracy {acc:.4f}  epsilon {eps} (delta={self.delta:g})  "
              f"{seconds:.0f} s", flush=True)


def fit_and_report(model, train, test, batch_size, epochs, private, delta):
    """``model.fit`` with an :class:`EpochReport`, then the final accuracy and epsilon."""
    start = time.time()
    model.fit(*train, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[EpochReport(*test, private, delta)])
    _, acc = model.evaluate(*test, batch_size=1024, verbose=0)
    line = f"final test accuracy {acc:.4f}  {time.time() - start:.0f} s"
    if private:
        line += f"  epsilon {epsilon_text(model.epsilon())} at delta {delta:g}"
    print(line)
