"""Problems shared by tests/keras/multi_worker_test.py and its worker processes."""

import keras
import numpy as np
import tensorflow as tf

from tf_dp.optimizers import DPSGD
from tf_dp.schedules import PiecewiseBatchSize

N = 40          # examples of the `declared` problem
Q = 0.25        # its declared sampling probability (expected logical batch 10)
STEPS = 4
FULL_STEPS = 3  # steps of the `full` problem (q = 1)
CLIP, SIGMA, SEED = 1.0, 2.0, 11
NOISE_N, NOISE_BATCH = 32, 8
SCHEDULE_STEPS = 3
SCHEDULE = PiecewiseBatchSize([1], [8, 16])  # q = 1/4 for step 0, then 1/2


def regression():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    return x, y


def batches():
    """Fixed 'Poisson' index batches (realised sizes vary; the divisor is Q * N)."""
    rng = np.random.default_rng(2)
    return [np.flatnonzero(rng.random(N) < Q) for _ in range(STEPS)]


def mlp():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(0.0, 0.7, size=w.shape).astype("float32")
                       for w in model.weights])
    return model


def optimizer(**kwargs):
    # Clipping active (C below most per-example norms), sigma = 0: the result is a function
    # of the batches alone, however they are split over workers.
    return DPSGD(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.1, momentum=0.9,
                 **kwargs)


def full_variant(mode):
    """(optimizer kwargs, fit kwargs) of the q = 1 problems: plain, with accumulation and
    adaptive clipping (its count summed over the cluster), with physical batches of 3."""
    from tf_dp.core.clipping import AdaptiveClipping  # noqa: PLC0415

    if mode == "full_accum":
        # `batch_size` is one micro-batch: the logical batch is 2 x 20, every row (q = 1)
        return dict(gradient_accumulation_steps=2, adaptive_clipping=AdaptiveClipping(
            target_quantile=0.4, learning_rate=0.5)), dict(batch_size=N // 2)
    if mode == "full_physical":
        return {}, dict(batch_size=N, max_physical_batch_size=3)
    return {}, dict(batch_size=N)


def noise_problem():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(NOISE_N, 30)).astype("float32"),
            np.zeros((NOISE_N, 20), np.float32))


def linear():
    return keras.Sequential([keras.Input((30,)), keras.layers.Dense(20)])


def zero_loss(y_true, y_pred):
    return 0.0 * tf.reduce_sum(y_pred, axis=-1)
