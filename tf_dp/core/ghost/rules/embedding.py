"""Embedding: rows ``ids[i, t]`` of the table receive ``dz[i, t]``."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import covers


@register_ghost_rule(keras.layers.Embedding)
def _embedding(layer, ctx, inputs):
    if not covers(layer, keras.layers.Embedding):
        return NotImplemented
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    ctx.check_batch(layer, ids)
    z = tf.gather(ctx.read(layer.embeddings), ids)
    ctx.embedding(layer.embeddings, z, ids)
    return tf.cast(z, layer.compute_dtype)
