"""LayerNormalization and GroupNormalization: ``out = xhat * gamma + beta`` with ``xhat``
normalised within each example, so gamma's and beta's per-example gradients are direct."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp import _internals
from tf_dp.core.ghost.registry import register_ghost_rule


def _affine(layer, ctx, x, xhat, axes):
    """Records gamma/beta terms of ``out = xhat * gamma + beta`` and returns ``out``."""
    rank = x.shape.rank
    bshape = [1] * rank
    for a in axes:
        bshape[a] = x.shape[a]
    out = xhat
    gamma = getattr(layer, "gamma", None)
    beta = getattr(layer, "beta", None)
    if gamma is not None:
        out = out * tf.reshape(ctx.read(gamma, xhat.dtype), bshape)
    if beta is not None:
        out = out + tf.reshape(ctx.read(beta, xhat.dtype), bshape)
    reduce_axes = [i for i in range(1, rank) if i not in axes]

    def per_example(t):
        return tf.reduce_sum(t, axis=reduce_axes) if reduce_axes else t

    if gamma is not None:
        ctx.direct(gamma, out, lambda dz: per_example(dz * xhat))
    if beta is not None:
        ctx.direct(beta, out, per_example)
    return out


def _float32(x):
    return tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x


@register_ghost_rule(keras.layers.LayerNormalization)
def _layer_norm(layer, ctx, inputs):
    if getattr(layer, "rms_scaling", False) or type(layer).call is not (
            keras.layers.LayerNormalization.call):
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    ctx.check_batch(layer, x)
    rank = x.shape.rank
    axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
    axes = sorted(a % rank for a in axes)
    if 0 in axes:
        return NotImplemented
    xc = _float32(x)
    mean, var = tf.nn.moments(xc, axes=axes, keepdims=True)
    xhat = (xc - mean) * tf.math.rsqrt(var + layer.epsilon)
    return tf.cast(_affine(layer, ctx, xc, xhat, axes), layer.compute_dtype)


@register_ghost_rule(keras.layers.GroupNormalization)
def _group_norm(layer, ctx, inputs):
    if type(layer).call is not keras.layers.GroupNormalization.call:
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    ctx.check_batch(layer, x)
    rank = x.shape.rank
    axis = layer.axis % rank
    if axis == 0 or x.shape[axis] is None:
        return NotImplemented
    xc = _float32(x)
    grouped = _internals.reshape_into_groups(layer, xc)
    red = list(range(1, grouped.shape.rank))
    red.remove(axis)  # the groups axis sits at `axis`, channels-per-group just after it
    mean, var = tf.nn.moments(grouped, axes=red, keepdims=True)
    xhat = tf.reshape((grouped - mean) * tf.math.rsqrt(var + layer.epsilon), tf.shape(xc))
    return tf.cast(_affine(layer, ctx, xc, xhat, [axis]), layer.compute_dtype)
