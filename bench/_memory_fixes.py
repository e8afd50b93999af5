"""Prototypes of memory fixes for the private step, applied by monkeypatching (bench only).

These existed to MEASURE what a change to tf_dp/core would save (bench/max_batch.py
--fixes=...), not to be used for training. All three are now superseded by the library's
own versions (docs/scaling.md section 7): applied to the current library they replace its
(chunked, bounded, selective) code with these prototypes. They are kept only to reproduce
sections 2 and 5 of docs/scaling.md on the snapshots named there (e.g. 4d9788f):

* ``gram_chunks``: ``tf_dp.core.ghost.precision.gram_norms`` casts the whole factors a (B, T, d)
  and g (B, T, p) to float64 and squares the float64 copy for l1: three B*T*d*8-byte tensors
  alive at once. Here the same function runs on chunks of 64 examples (``tf.map_fn``), so
  the float64 copies exist for one chunk at a time. Same numbers.
* ``late_patches``: an outer-product term's input factor ``a = a_fn()`` (for convolutions,
  the im2col patches, B*T*kh*kw*cin floats: 16x the first conv layer's input in the
  tutorial CNN) depends only on the forward pass, so TensorFlow's executor may compute it
  during the forward pass and keep it alive through the whole backward pass. Here it is
  created under a control dependency on its output gradient (``tf_dp.core.ghost.terms.
  OuterTerm.factors``), so it exists only from the end of the backward pass to its use.
* ``jl_no_materialise``: JL projections of an outer-product term materialise the per-example
  gradient (B, d, p) whenever that saves flops and d*p <= max(65,536, r*T*min(d, p))
  (``tf_dp.core.ghost.factors._materialise_for_projection``), and keep it until the weighted
  sum; here never (the factors are projected one direction at a time, so one (B, T,
  min(d, p)) tensor at a time: the r in that bound overstates their memory r-fold).
"""

from __future__ import annotations


def apply(names):
    """Applies the named prototypes (a list of the names above) to the imported tf_dp."""
    for name in names:
        if name:
            _FIXES[name]()


def _gram_chunks(chunk=64):
    import tensorflow as tf

    from tf_dp.core.ghost import precision

    original = precision.gram_norms

    def gram_norms(a, g):
        t, d, p = a.shape[1], a.shape[2], g.shape[2]
        if t is None or d is None or p is None:
            return original(a, g)
        b = tf.shape(a)[0]
        pad = (-b) % chunk
        ar = tf.reshape(tf.pad(a, [[0, pad], [0, 0], [0, 0]]), [-1, chunk, t, d])
        gr = tf.reshape(tf.pad(g, [[0, pad], [0, 0], [0, 0]]), [-1, chunk, t, p])
        out = tf.map_fn(lambda args: original(*args), (ar, gr),
                        fn_output_signature=(tf.float64, tf.float64, tf.float64),
                        parallel_iterations=1)
        return tuple(tf.reshape(o, [-1])[:b] for o in out)

    precision.gram_norms = gram_norms


def _late_patches():
    import tensorflow as tf

    from tf_dp.core.ghost import terms

    def factors(self, dz):
        g = self.dz_fn(dz)
        with tf.control_dependencies([g]):
            a = self.a_fn()
        return tf.cast(a, g.dtype), g

    terms.OuterTerm.factors = factors


def _jl_no_materialise():
    from tf_dp.core.ghost import factors

    factors._materialise_for_projection = lambda a, g, num_projections: False


_FIXES = {"gram_chunks": _gram_chunks, "late_patches": _late_patches,
          "jl_no_materialise": _jl_no_materialise}
