"""Dense: ``z = x K + b``; the kernel's per-example gradient is ``sum_t x_t (outer) dz_t``."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import activation, covers
from tf_dp.core.ghost.terms import rows


@register_ghost_rule(keras.layers.Dense)
def _dense(layer, ctx, inputs, training=None):
    if not covers(layer, keras.layers.Dense):
        return NotImplemented
    x = ctx.batch_input(layer, inputs)
    kernel = ctx.read(layer.kernel, x.dtype)
    z = tf.matmul(x, kernel) if x.shape.rank == 2 else tf.tensordot(
        x, kernel, axes=[[x.shape.rank - 1], [0]])
    if layer.bias is not None:
        z = z + ctx.read(layer.bias, x.dtype)
    d = x.shape[-1]
    ctx.outer(layer.kernel, z, lambda: rows(x, d))
    if layer.bias is not None:
        ctx.direct(layer.bias, z, lambda dz: tf.reduce_sum(rows(dz), axis=1))
    return activation(layer, z)
