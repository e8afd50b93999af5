"""The weighted sum of a Dense layer's per-example gradients from its factors, three ways.

sum_i w_i sum_t a_it g_it^T over a batch of B examples of T tokens (a: (B, T, d),
g: (B, T, p)):
  float64 products   what the private step does (docs/privacy.md: every sum over examples
                     in float64): one einsum of float64 copies;
  per-example f32    each example's T tokens contracted in float32 (its own rounding only),
                     the B results added in float64: a sound float32 alternative;
  float32 products   one float32 einsum: NOT sound (one example steers the others'
                     rounding), the speed floor.
Medians of --repeats calls, one TensorFlow thread (docs/scaling.md section 1, session 16).

  python bench/sum_products.py [--batch=32] [--steps=64] [--shapes=256x1024,1024x256,256x256]
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 32, "Examples B.")
flags.DEFINE_integer("steps", 64, "Tokens per example T.")
flags.DEFINE_list("shapes", ["256x1024", "1024x256", "256x256"], "Layer shapes d x p.")
flags.DEFINE_integer("repeats", 9, "Timed calls per variant.")


def _variants(b, d, p):
    @tf.function
    def float64_products(a, g, w):
        return tf.einsum("btd,btp->dp", tf.cast(a, tf.float64) * w[:, None, None],
                         tf.cast(g, tf.float64))

    @tf.function
    def per_example_f32(a, g, w):
        per = tf.einsum("btd,btp->bdp", a, g)
        flat = tf.reshape(tf.cast(per, tf.float64), [b, -1])
        return tf.reshape(tf.matmul(tf.reshape(w, [1, -1]), flat), [d, p])

    @tf.function
    def float32_products(a, g, w):
        return tf.einsum("btd,btp->dp", a * tf.cast(w, tf.float32)[:, None, None], g)

    return {"float64 products": float64_products, "per-example f32": per_example_f32,
            "float32 products (unsound)": float32_products}


def main(argv):
    del argv
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    b, t = FLAGS.batch, FLAGS.steps
    rng = np.random.default_rng(0)
    print(f"B = {b}, T = {t}, one TF thread, load {os.getloadavg()[0]:.1f}")
    for shape in FLAGS.shapes:
        d, p = (int(n) for n in shape.split("x"))
        a = tf.constant(rng.normal(size=(b, t, d)).astype("float32"))
        g = tf.constant(rng.normal(size=(b, t, p)).astype("float32"))
        w = tf.constant(rng.random(b))
        fns = _variants(b, d, p)
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn(a, g, w)
        for _ in range(FLAGS.repeats):  # round-robin: the load drifts over all alike
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(a, g, w).numpy()
                times[name].append(time.perf_counter() - start)
        print(f"{d} -> {p}: " + ", ".join(f"{name} {np.median(v) * 1e3:.1f} ms"
                                         for name, v in times.items()), flush=True)


if __name__ == "__main__":
    app.run(main)
