r"""Private training of the TF Privacy tutorial CNN (26,010 parameters) on Fashion-MNIST.

Prints test accuracy and epsilon (delta = 1e-5 by default) after every epoch. The default
hyper-parameters follow Papernot et al. 2020 ("Tempered Sigmoid Activations for Deep
Learning with Differential Privacy"): tanh activations, batch 2048, sigma 2.15, clip 0.12,
SGD with learning rate 4 and momentum 0.9, 40 epochs, epsilon about 2.4 at delta 1e-5.

  python examples/fashion_mnist.py --epochs=40
  python examples/fashion_mnist.py --optimizer=dpadam --learning_rate=1e-3 --l2_norm_clip=1 \
      --noise_multiplier=1.1 --batch_size=256 --epochs=15
  python examples/fashion_mnist.py --optimizer=dpsgd_jl --num_projections=5
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.accounting.functions import epsilon_text  # noqa: E402
from _models import tutorial_cnn  # noqa: E402  (examples/_models.py)

FLAGS = flags.FLAGS
flags.DEFINE_enum("optimizer", "dpsgd", ["dpsgd", "dpadam", "dpadamw", "dpsgd_jl", "dpadam_jl",
                                         "sgd", "adam"],
                  "Private optimizer, or sgd/adam for a non-private baseline.")
flags.DEFINE_float("learning_rate", 4.0, "Learning rate.")
flags.DEFINE_float("momentum", 0.9, "Momentum (SGD optimizers).")
flags.DEFINE_float("noise_multiplier", 2.15, "Noise multiplier sigma.")
flags.DEFINE_float("l2_norm_clip", 0.12, "Per-example clipping norm C.")
flags.DEFINE_integer("batch_size", 2048, "Expected batch size (Poisson sampling).")
flags.DEFINE_integer("epochs", 40, "Epochs.")
flags.DEFINE_integer("num_projections", 5, "JL projections r (JL optimizers only).")
flags.DEFINE_enum("activation", "tanh", ["tanh", "relu"], "Hidden activation.")
flags.DEFINE_enum("norm_strategy", "auto", ["auto", "ghost", "vmap"], "Per-example norm path.")
flags.DEFINE_float("delta", 1e-5, "Target delta.")
flags.DEFINE_integer("seed", 0, "Seed for weight initialisation only. Noise and Poisson sampling always "
                     "come from fresh OS entropy (a seeded DP optimizer would void epsilon).")
flags.DEFINE_string("dataset", "fashion_mnist", "fashion_mnist or mnist.")


def make_optimizer():
    dp = dict(l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=FLAGS.noise_multiplier,
              learning_rate=FLAGS.learning_rate)
    name = FLAGS.optimizer
    if name == "sgd":
        return keras.optimizers.SGD(FLAGS.learning_rate, momentum=FLAGS.momentum)
    if name == "adam":
        return keras.optimizers.Adam(FLAGS.learning_rate)
    if name == "dpsgd":
        return tf_dp.DPSGD(momentum=FLAGS.momentum, norm_strategy=FLAGS.norm_strategy, **dp)
    if name == "dpadam":
        return tf_dp.DPAdam(norm_strategy=FLAGS.norm_strategy, **dp)
    if name == "dpadamw":
        return tf_dp.DPAdamW(norm_strategy=FLAGS.norm_strategy, **dp)
    if name == "dpsgd_jl":
        return tf_dp.DPSGDJL(momentum=FLAGS.momentum, num_projections=FLAGS.num_projections, **dp)
    if name == "dpadam_jl":
        return tf_dp.DPAdamJL(num_projections=FLAGS.num_projections, **dp)
    raise ValueError(name)


class _Report(keras.callbacks.Callback):
    """Prints test accuracy, epsilon and seconds per epoch."""

    def __init__(self, x_test, y_test, private):
        super().__init__()
        self.x_test, self.y_test, self.private = x_test, y_test, private

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.time()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.time() - self.start
        _, acc = self.model.evaluate(self.x_test, self.y_test, batch_size=2048, verbose=0)
        eps = (logs or {}).get("epsilon", float("inf") if self.private else None)
        eps_text = epsilon_text(eps) if eps is not None else "n/a (non-private)"
        if "epsilon_exact_clipping" in (logs or {}):
            eps_text += f" (exact clipping would give {epsilon_text(logs['epsilon_exact_clipping'])})"
        print(f"epoch {epoch + 1:3d}  test accuracy {acc:.4f}  epsilon {eps_text} "
              f"(delta={FLAGS.delta:g})  {seconds:.1f} s", flush=True)


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    (x_train, y_train), (x_test, y_test) = tf_dp.datasets.load(FLAGS.dataset)
    x_train = (x_train.astype("float32") / 255.0)[..., None]
    x_test = (x_test.astype("float32") / 255.0)[..., None]
    model = tutorial_cnn(FLAGS.activation)
    private = FLAGS.optimizer not in ("sgd", "adam")
    if private:
        model = tf_dp.keras.make_private(model, delta=FLAGS.delta)
    model.compile(optimizer=make_optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    print(f"{FLAGS.dataset}: {len(x_train)} train / {len(x_test)} test; model "
          f"{model.count_params()} parameters; optimizer {FLAGS.optimizer}")
    model.fit(x_train, y_train, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=[_Report(x_test, y_test, private)])
    _, acc = model.evaluate(x_test, y_test, batch_size=2048, verbose=0)
    line = f"final test accuracy {acc:.4f}"
    if private:
        line += f"  epsilon {epsilon_text(model.epsilon())} at delta {FLAGS.delta:g}"
    print(line)


if __name__ == "__main__":
    app.run(main)
