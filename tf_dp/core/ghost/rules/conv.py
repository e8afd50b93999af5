"""Convolutions: the kernel's per-example gradient is ``sum_l patch_l (outer) dz_l`` over
output positions l, with im2col patches of the input (Goodfellow 2015; Rochette et al. 2019,
"Efficient per-example gradient computations in convolutional neural networks").

* Conv1D / Conv2D / Conv3D: one outer-product term on the patches (a general n-D im2col by
  strided slices for Conv3D; the one-hot-kernel fast path of ``terms.conv_patches`` for 1-D
  and 2-D).
* DepthwiseConv1D / DepthwiseConv2D: output channel ``c * multiplier + m`` sees only input
  channel c, so the per-example kernel gradient ``sum_l patch_l[k, c] dz_l[c, m]`` is no
  outer product of the kernel's flattened axes: it is formed directly (B x kernel entries).
* SeparableConv1D / SeparableConv2D: the depthwise step as above, then the pointwise 1x1
  convolution as an outer-product term on the depthwise output.
* Conv1DTranspose / Conv2DTranspose / Conv3DTranspose: a transposed convolution is the
  input gradient of a convolution with the roles swapped, so its kernel's per-example
  gradient is ``sum_l patch(dz)_l (outer) x_l`` (patches of the output gradient, taken as the
  forward convolution would take them, against the input at the same position). Keras stores
  that kernel as (k..., filters, in_channels): the factor from dz is the kernel's leading
  (row) axis, which an outer-product term cannot take (its first factor comes from the
  forward pass), so the per-example gradient is formed directly.

Channels-first layers other than Conv1D/2D/3D run their rule in channels-last and transpose
back. Not covered (left to the exact vectorized fallback): ``groups > 1``, explicit
(list) padding, dilated transposed convolutions (TensorFlow has no CPU kernel for them), LoRA/quantized variants, subclasses overriding ``call``, and spatial shapes
unknown when the layer is called (the n-D patches need them).
"""

from __future__ import annotations

import itertools

import keras
import tensorflow as tf

from tf_dp import _internals
from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import activation, covers
from tf_dp.core.ghost.terms import conv_patches, rows

# ----------------------------------------------------------------------------- patches


def nd_patches(x, kernel_size, strides, dilation_rate, padding, out_spatial=None):
    """im2col patches (B, *out_spatial, prod(kernel_size), C) of a channels-last input with
    any number of spatial axes, by one strided slice per kernel offset (exact: no
    arithmetic). The kernel axis is row-major over ``kernel_size``, as in a Keras kernel.

    ``padding``: "valid" or "same" (TensorFlow's split: the extra pad goes after).
    ``out_spatial``: the number of output positions per axis (default: what a convolution
    of ``x`` gives); a transposed convolution passes its input's spatial shape.
    Returns None when ``x``'s spatial shape is not static.
    """
    spatial = x.shape[1:-1]
    if not spatial.is_fully_defined():
        return None
    pads, outs = [[0, 0]], []
    for i, (n, k, s, d) in enumerate(zip(spatial, kernel_size, strides, dilation_rate)):
        span = (k - 1) * d + 1
        if out_spatial is not None:
            o = out_spatial[i]
        elif padding == "same":
            o = -(-n // s)
        else:
            o = (n - span) // s + 1
        before = max((o - 1) * s + span - n, 0) // 2 if padding == "same" else 0
        after = max((o - 1) * s + span - n - before, 0)
        pads.append([before, after])
        outs.append(o)
    pads.append([0, 0])
    xp = tf.pad(x, pads) if any(p != [0, 0] for p in pads) else x
    slices = []
    for offsets in itertools.product(*[range(k) for k in kernel_size]):
        index = [slice(None)]
        for off, o, s, d in zip(offsets, outs, strides, dilation_rate):
            index.append(slice(off * d, off * d + (o - 1) * s + 1, s))
        slices.append(xp[tuple(index) + (slice(None),)])
    return tf.stack(slices, axis=-2)


def _flat_patches(x, kernel_size, strides, dilation_rate, padding, out_spatial=None):
    """``nd_patches`` as (B, L, prod(kernel_size) * C), or None."""
    p = nd_patches(x, kernel_size, strides, dilation_rate, padding, out_spatial)
    return None if p is None else rows(p, p.shape[-2] * p.shape[-1])


def _patches(layer, x, padding):
    """Patches of a Keras Conv1D/Conv2D/Conv3D input (channels last)."""
    if layer.rank == 1:
        return conv_patches(x[:, None, :, :], (1, layer.kernel_size[0]), (1, layer.strides[0]),
                            (1, layer.dilation_rate[0]), padding)
    if layer.rank == 2:
        return conv_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate, padding)
    return _flat_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate, padding)


def _supported_padding(layer, allowed=("valid", "same")):
    return isinstance(layer.padding, str) and layer.padding in allowed


def _to_last(layer, t):
    """channels_first -> channels_last (identity for channels_last)."""
    if layer.data_format == "channels_last":
        return t
    return tf.transpose(t, [0] + list(range(2, t.shape.rank)) + [1])


def _to_first(layer, t):
    """channels_last -> the layer's data format."""
    if layer.data_format == "channels_last":
        return t
    return tf.transpose(t, [0, t.shape.rank - 1] + list(range(1, t.shape.rank - 1)))


def _add_bias(ctx, layer, z, bias):
    """``z + bias`` (channels last) and the bias's direct term."""
    z = z + ctx.read(bias, z.dtype)
    ctx.direct(bias, z, lambda dz: tf.reduce_sum(rows(dz), axis=1))
    return z


# ------------------------------------------------------------------ Conv1D, Conv2D, Conv3D


@register_ghost_rule(keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
def _conv(layer, ctx, inputs):
    base = next(c for c in (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
                if isinstance(layer, c))
    if not covers(layer, base) or layer.groups != 1 or not _supported_padding(
            layer, ("valid", "same", "causal")):
        return NotImplemented
    x = ctx.batch_input(layer, inputs)
    if layer.rank == 3 and not x.shape[1:].is_fully_defined():
        return NotImplemented
    padding = layer.padding
    if padding == "causal":
        x = tf.pad(x, _internals.causal_padding(layer))
        padding = "valid"
    z = keras.ops.conv(x, ctx.read(layer.kernel, x.dtype), strides=list(layer.strides),
                       padding=padding, dilation_rate=layer.dilation_rate,
                       data_format=layer.data_format)
    channels_last = layer.data_format == "channels_last"
    if layer.use_bias:
        shape = (1,) * (layer.rank + 1) + (layer.filters,) if channels_last else (
            (1, layer.filters) + (1,) * layer.rank)
        z = z + tf.reshape(ctx.read(layer.bias, x.dtype), shape)
    perm = [0] + list(range(2, layer.rank + 2)) + [1]

    def a_fn():
        return _patches(layer, x if channels_last else tf.transpose(x, perm), padding)

    def dz_fn(dz):
        return rows(dz if channels_last else tf.transpose(dz, perm))

    ctx.outer(layer.kernel, z, a_fn, dz_fn)
    if layer.use_bias:
        ctx.direct(layer.bias, z, lambda dz: tf.reduce_sum(dz_fn(dz), axis=1))
    return activation(layer, z)


# ------------------------------------------------------------- depthwise and separable


def _depthwise(ctx, layer, kernel_var, x):
    """The depthwise convolution of a channels-last ``x`` and its kernel's direct term.

    Returns ``u`` (B, *out, C * multiplier), or None when the patches need a static shape
    the input lacks."""
    if not x.shape[1:].is_fully_defined():
        return None
    kernel = ctx.read(kernel_var, x.dtype)
    u = keras.ops.depthwise_conv(x, kernel, strides=layer.strides, padding=layer.padding,
                                 data_format="channels_last",
                                 dilation_rate=layer.dilation_rate)
    cin, mult = kernel_var.shape[-2], kernel_var.shape[-1]
    kernel_shape = tuple(kernel_var.shape)

    def grad_fn(dz):
        # (B, L, K, C) patches against dz (B, L, C, M): each output channel c*M + m sees
        # input channel c only.
        p = nd_patches(tf.cast(x, dz.dtype), layer.kernel_size, layer.strides,
                       layer.dilation_rate, layer.padding)
        batch = tf.shape(p)[0]
        p = tf.reshape(p, [batch, -1, p.shape[-2], cin])
        g = tf.reshape(dz, [batch, -1, cin, mult])
        per = tf.einsum("blkc,blcm->bkcm", p, g)
        return tf.reshape(per, (-1,) + kernel_shape)

    ctx.direct(kernel_var, u, grad_fn)
    return u


def _depthwise_base(layer):
    return next(c for c in (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
                if isinstance(layer, c))


@register_ghost_rule(keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
def _depthwise_conv(layer, ctx, inputs):
    if not covers(layer, _depthwise_base(layer)) or not _supported_padding(layer):
        return NotImplemented
    x = _to_last(layer, ctx.batch_input(layer, inputs))
    z = _depthwise(ctx, layer, layer.kernel, x)
    if z is None:
        return NotImplemented
    if layer.use_bias:
        z = _add_bias(ctx, layer, z, layer.bias)
    return activation(layer, _to_first(layer, z))


@register_ghost_rule(keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
def _separable_conv(layer, ctx, inputs):
    base = next(c for c in (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
                if isinstance(layer, c))
    if not covers(layer, base) or not _supported_padding(layer):
        return NotImplemented
    x = _to_last(layer, ctx.batch_input(layer, inputs))
    u = _depthwise(ctx, layer, layer.depthwise_kernel, x)
    if u is None:
        return NotImplemented
    # The pointwise step: a 1x1 convolution of the depthwise output u, i.e. a Dense on its
    # channels (the kernel (1, ..., 1, C*M, F) is row-major the matrix (C*M, F)).
    width = u.shape[-1]
    pointwise = tf.reshape(ctx.read(layer.pointwise_kernel, x.dtype), [width, layer.filters])
    z = tf.tensordot(u, pointwise, axes=[[u.shape.rank - 1], [0]])
    ctx.outer(layer.pointwise_kernel, z, lambda: rows(u, width))
    if layer.use_bias:
        z = _add_bias(ctx, layer, z, layer.bias)
    return activation(layer, _to_first(layer, z))


# ---------------------------------------------------------------------- transposed convs


@register_ghost_rule(keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                     keras.layers.Conv3DTranspose)
def _conv_transpose(layer, ctx, inputs):
    base = next(c for c in (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                            keras.layers.Conv3DTranspose) if isinstance(layer, c))
    if (not covers(layer, base) or not _supported_padding(layer)
            or max(layer.dilation_rate) > 1):
        # Dilated transposes: no CPU kernel to check a rule against (TensorFlow runs none).
        return NotImplemented
    x = _to_last(layer, ctx.batch_input(layer, inputs))
    if not x.shape[1:].is_fully_defined():
        return NotImplemented
    z = keras.ops.conv_transpose(x, ctx.read(layer.kernel, x.dtype),
                                 strides=list(layer.strides), padding=layer.padding,
                                 output_padding=layer.output_padding,
                                 data_format="channels_last",
                                 dilation_rate=layer.dilation_rate)
    in_spatial = tuple(x.shape[1:-1])
    cin, kernel_shape = x.shape[-1], tuple(layer.kernel.shape)
    if not z.shape[1:].is_fully_defined():
        return NotImplemented

    def grad_fn(dz):
        # dK[k, f, c] = sum_l dz_pad[l*s + k*d, f] x[l, c]: the output gradient's patches,
        # taken as a convolution of z's shape back to x's positions would take them.
        p = _flat_patches(dz, layer.kernel_size, layer.strides, layer.dilation_rate,
                          layer.padding, out_spatial=in_spatial)
        per = tf.einsum("blp,blc->bpc", p, rows(tf.cast(x, dz.dtype), cin))
        return tf.reshape(per, (-1,) + kernel_shape)

    ctx.direct(layer.kernel, z, grad_fn)
    if layer.use_bias:
        z = _add_bias(ctx, layer, z, layer.bias)
    return activation(layer, _to_first(layer, z))
