r"""TensorFlow's normal op against tf_dp's exact-tailed sampler (docs/privacy.md, "The noise is
Gaussian in its tails too").

Three measurements, each optional:

* ``--parts=speed``: ns per draw of ``tf_dp.core.gaussian.normal`` and of
  ``tf.random.stateless_normal``, float64 and float32, on one thread (median of --repeats).
* ``--parts=tail``: ``--tail_draws`` float64 draws of TensorFlow's op: the largest |z| (its
  clamp is sqrt(-2 ln 1e-7) = 5.678) and how many pairs lie exactly on that circle
  (expected 1e-7 per pair), against what an exact Gaussian gives.
* ``--parts=leak``: the probability per step that a shift of C on one noise pair puts the
  release outside the support of TensorFlow's capped noise (a numerical integral over the
  radius law with its atom on the circle), for several sigma; and the same for tf_dp's
  sampler (radius up to 13.3).

  python bench/gaussian_sampler.py                                  # speed and leak
  python bench/gaussian_sampler.py --parts=tail --tail_draws=1000000000
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402
from scipy import integrate, stats  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_dp.core import gaussian  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["speed", "leak"], "What to measure: speed, tail, leak.")
flags.DEFINE_integer("size", 2_000_000, "Draws per timed call.")
flags.DEFINE_integer("repeats", 10, "Timed calls per configuration.")
flags.DEFINE_integer("tail_draws", 200_000_000, "Draws of TensorFlow's op for --parts=tail.")
flags.DEFINE_list("sigmas", ["2", "1", "0.7", "0.5"], "Noise multipliers for --parts=leak.")


def speed():
    seed = tf.constant([1, 2], tf.int64)
    ours = tf.function(lambda dtype: gaussian.normal([FLAGS.size], seed, dtype))
    theirs = tf.function(lambda dtype: tf.random.stateless_normal([FLAGS.size], seed=seed,
                                                                  dtype=dtype))
    print(f"ns per draw, {FLAGS.size} draws per call, median of {FLAGS.repeats} calls, "
          "one thread")
    for dtype in (tf.float64, tf.float32):
        for name, fn in (("tf_dp.core.gaussian.normal", ours),
                         ("tf.random.stateless_normal", theirs)):
            fn(dtype)
            times = []
            for _ in range(FLAGS.repeats):
                t = time.perf_counter()
                fn(dtype).numpy()
                times.append(time.perf_counter() - t)
            print(f"  {name:28s} {dtype.name:8s} {np.median(times) / FLAGS.size * 1e9:6.1f}")


def tail():
    radius2 = gaussian.TF_CLAMPED_RADIUS ** 2
    chunk = 50_000_000

    @tf.function
    def draw(seed):
        z = tf.random.stateless_normal([chunk], seed=seed, dtype=tf.float64)
        r2 = tf.reduce_sum(tf.reshape(z, [-1, 2]) ** 2, 1)
        return (tf.reduce_max(tf.abs(z)),
                tf.reduce_sum(tf.cast(tf.abs(r2 - radius2) < 1e-9, tf.int64)))

    largest, ring, n = 0.0, 0, 0
    for k in range(max(1, FLAGS.tail_draws // chunk)):
        m, c = draw(tf.constant([k, 12345], tf.int64))
        largest, ring, n = max(largest, float(m)), ring + int(c), n + chunk
    print(f"TensorFlow's float64 normal, {n:.1e} draws: largest |z| {largest:.6f} (clamp "
          f"{gaussian.TF_CLAMPED_RADIUS:.6f}; an exact Gaussian puts "
          f"{n * 2 * stats.norm.sf(gaussian.TF_CLAMPED_RADIUS):.1f} draws beyond it); pairs "
          f"on the clamp's circle: {ring} (expected {n // 2 * 1e-7:.0f})")


def outside(radius, atom, shift):
    """P(|n + v| > radius) for |v| = shift and n a pair of draws whose radius is Rayleigh up
    to ``radius``, with the rest of its mass (``atom``) on that circle."""
    def fraction(r):  # of angles that put n + v outside the disc
        c = (radius * radius - r * r - shift * shift) / (2 * r * shift)
        return 0.0 if c >= 1 else (1.0 if c <= -1 else math.acos(c) / math.pi)

    body, _ = integrate.quad(lambda r: r * math.exp(-r * r / 2) * fraction(r),
                             max(radius - shift, 0.0), radius, limit=200)
    return body + atom * fraction(radius)


def leak():
    print("P(release outside the support without the target) per step the target is sampled,"
          " a shift of C on one pair")
    for sigma in (float(s) for s in FLAGS.sigmas):
        capped = outside(gaussian.TF_CLAMPED_RADIUS, 1e-7, 1 / sigma)
        ours = outside(gaussian.MAX_RADIUS, 2.0 ** -128, 1 / sigma)
        print(f"  sigma {sigma:4.2f}: TensorFlow's op {capped:.2e}   tf_dp's sampler {ours:.2e}")


def main(argv):
    del argv
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for part in FLAGS.parts:
        {"speed": speed, "tail": tail, "leak": leak}[part]()


if __name__ == "__main__":
    app.run(main)
