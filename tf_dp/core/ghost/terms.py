"""Terms: how a ghost rule describes one use of a weight in factored form.

A rule (``tf_dp.register_ghost_rule``) records, for each weight a layer call uses, a term
from the call's pre-activation output ``z`` and what the per-example gradient is made of
once the backward pass has given ``dz = d(sum of losses)/dz``:

* ``OuterTerm``: ``sum_t a[i, t] (outer) dz[i, t]`` (Dense, convolutions via im2col patches,
  EinsumDense in matmul form, recurrent kernels);
* ``EmbeddingTerm``: rows ``ids[i, t]`` of the table receive ``dz[i, t]``;
* ``DirectTerm``: a small per-example gradient computed directly (biases, normalisation
  scales).

``tf_dp.core.ghost.factors`` turns a weight's terms into its per-example norms, JL
projections and clipped sum.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf


def padded_rows(t, rows, filler=None):
    """``t`` with rows appended up to ``rows`` rows (``t`` has at most that many): copies of
    ``filler`` (one row, (1, ...)), or zeros.

    A concatenation, not ``tf.pad``: Grappler fuses a Pad into the convolution that reads
    it as the convolution's own spatial padding and silently drops the batch axis's (TF
    2.21, oneDNN: the patches of a batch padded from 7 to 64 rows came out with 7)."""
    extra = tf.concat([[rows - tf.shape(t)[0]], tf.shape(t)[1:]], 0)
    if filler is None:
        fill = tf.zeros(extra, t.dtype)
    else:
        fill = tf.tile(filler, tf.concat([extra[:1], tf.ones([t.shape.rank - 1], tf.int32)],
                                         0))
    return tf.concat([t, fill], axis=0)


def rows(t, last=None):
    """Reshapes (B, ..., d) to (B, T, d) with ``last`` = d (default: t's last axis).

    T (and d) stay static whenever t's non-batch shape is, even with an unknown batch (a
    Poisson-sampled batch): the choice between ghost and materialised norms depends on T.
    """
    tail = t.shape[1:]
    if last is None:
        last = tail[-1] if tail.rank and tail[-1] is not None else tf.shape(t)[-1]
    steps = -1
    if isinstance(last, int) and tail.is_fully_defined() and last > 0:
        steps = max(tail.num_elements() // last, 0)
        if steps > 0:  # the batch is the one -1 (fewer graph ops than tf.shape)
            return tf.reshape(t, [-1, steps, last])
    return tf.reshape(t, [tf.shape(t)[0], steps, last])


class Term:
    """One recorded use of a weight: ``z`` is the output whose gradient ``dz`` describes it."""

    def __init__(self, z):
        self.z = z

    def per_example(self, dz):
        """The per-example gradient (B, ...) of this use, materialised; None if too costly."""
        raise NotImplementedError


class OuterTerm(Term):
    """Per-example gradient ``sum_t a_t (outer) dz_t``.

    Args:
      z: the output (pre-activation) the term's gradient flows through.
      a_fn: ``() -> a`` (B, T, d), the inputs (e.g. ``rows(x)``, conv patches).
      dz_fn: ``dz -> g`` (B, T, p); default ``rows(dz)``.
    """

    def __init__(self, z, a_fn: Callable[[], tf.Tensor], dz_fn: Callable = None):
        super().__init__(z)
        self.a_fn = a_fn
        self.dz_fn = dz_fn or rows

    def factors(self, dz):
        g = self.dz_fn(dz)
        # The input factor (for a convolution its im2col patches, kh*kw times its input)
        # depends on the forward pass only: made without a dependency, the executor may form
        # it during the forward pass and keep it alive through the whole backward pass. Under
        # one on its own output gradient it exists from the moment that gradient does (for a
        # first layer, the end of the backward pass) to its use. (Tensors a_fn returns as
        # they are, such as a layer's input, are unaffected: they exist anyway.)
        with tf.control_dependencies([g]):
            a = self.a_fn()
            return tf.cast(a, g.dtype), g

    def per_example(self, dz):
        a, g = self.factors(dz)
        return tf.einsum("btd,btp->bdp", a, g)


class EmbeddingTerm(Term):
    """Rows ``ids[i, t]`` of the table receive ``dz[i, t]``."""

    def __init__(self, z, ids):
        super().__init__(z)
        self.ids = ids

    def factors(self, dz):
        batch = tf.shape(dz)[0]
        ids = tf.reshape(tf.cast(self.ids, tf.int32), [batch, -1])
        return ids, rows(dz)

    def per_example(self, dz):
        return None  # (B, vocabulary, width): left to the vectorized fallback


class DirectTerm(Term):
    """Per-example gradient computed directly from ``dz`` by ``grad_fn`` -> (B, ...)."""

    def __init__(self, z, grad_fn: Callable):
        super().__init__(z)
        self.grad_fn = grad_fn

    def per_example(self, dz):
        return self.grad_fn(dz)


#: patches at most this wide come from a convolution with a one-hot kernel (oneDNN makes it
#: several times faster than tf.image.extract_patches for few input channels); wider ones
#: from extract_patches. Both give the same (kh, kw, cin) ordering.
_EYE_CONV_MAX_WIDTH = 128


def conv_patches(x, kernel_size, strides, dilation_rate, padding):
    """im2col patches (B, L, kh*kw*cin) of a channels-last 4-D input for a 2-D conv."""
    kh, kw = kernel_size
    cin = x.shape[-1]
    width = kh * kw * cin
    if width <= _EYE_CONV_MAX_WIDTH:
        eye = tf.reshape(tf.eye(width, dtype=x.dtype), (kh, kw, cin, width))
        patches = tf.nn.conv2d(x, eye, strides=[1, strides[0], strides[1], 1],
                               padding=padding.upper(), dilations=list(dilation_rate))
    else:
        patches = tf.image.extract_patches(
            x, sizes=[1, kh, kw, 1], strides=[1, strides[0], strides[1], 1],
            rates=[1, dilation_rate[0], dilation_rate[1], 1], padding=padding.upper())
    return rows(patches, width)
