"""Ghost-norm formulas for the RGP / LSG reparametrized layers (tf_dp.layers).

A reparametrized Dense computes h = x L_eff, z = h R_eff + x sg(W - L R) + b (as
z = x sg(W) + (h R_eff - sg(h R_eff)) + b with h = sg(x) L_eff: same value and gradients,
no m x n residual; the rules below reproduce the layer's call exactly), so its
carriers are two stacked linear maps: the per-example gradient of L is sum_t x_t (outer)
dh_t and that of R is sum_t h_t (outer) dz_t (Yu et al. 2021, Theorem 2.1), both outer
products the ghost machinery handles, with LSG's frozen rows/columns zeroed in the factors
(exactly what the masked carriers' autodiff gradients are). ReparamConv2D is the same with
im2col patches for L (a conv of the original size) and a 1x1 conv for R.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp.core import ghost
from tf_dp.layers import ReparamConv2D, ReparamDense


def _masked_factor(t, mask, axis_size):
    if mask is None:
        return t
    return t * tf.reshape(tf.cast(mask, t.dtype), [axis_size])


def _inputs_and_carriers(layer, rec, inputs):
    dtype = layer.compute_dtype
    x = tf.cast(tf.convert_to_tensor(inputs), dtype)
    rec.check_batch(layer, x)
    left, right = layer._forward_carriers()
    return x, tf.cast(left, dtype), tf.cast(right, dtype)


def _masks(layer):
    if not layer.sparsity:
        return None, None
    return layer.left_mask, layer.right_mask


@ghost.register(ReparamDense)
def _reparam_dense(layer, rec, inputs, training=None):
    if type(layer).call is not ReparamDense.call:
        return NotImplemented
    x, left, right = _inputs_and_carriers(layer, rec, inputs)
    dtype = x.dtype
    h = tf.tensordot(tf.stop_gradient(x), left, axes=[[x.shape.rank - 1], [0]])
    z = tf.tensordot(x, tf.cast(layer._frozen_kernel(), dtype), axes=[[x.shape.rank - 1], [0]])
    z = z + layer._carrier_term(tf.tensordot(h, right, axes=[[h.shape.rank - 1], [0]]))
    if layer.bias is not None:
        z = z + tf.cast(layer.bias, dtype)
    m_in, m_out = _masks(layer)
    d, r, n = x.shape[-1], layer.rank, layer.units
    rec.add(layer.left_carrier, ghost.OuterTerm(
        h, lambda: _masked_factor(ghost.rows(x, d), m_in, d)))
    rec.add(layer.right_carrier, ghost.OuterTerm(
        z, lambda: ghost.rows(h, r),
        lambda dz: _masked_factor(ghost._to_btp(dz), m_out, n)))
    if layer.bias is not None:
        rec.add(layer.bias, ghost.DirectTerm(z, lambda dz: tf.reduce_sum(ghost._to_btp(dz), 1)))
    return layer.activation(z) if layer.activation is not None else z


@ghost.register(ReparamConv2D)
def _reparam_conv2d(layer, rec, inputs):
    if type(layer).call is not ReparamConv2D.call:
        return NotImplemented
    x, left, right = _inputs_and_carriers(layer, rec, inputs)
    dtype = x.dtype
    hidden = layer._convolve(tf.stop_gradient(x), left)
    low_rank = tf.nn.conv2d(hidden, right, strides=1, padding="VALID",
                            data_format="NHWC" if layer.data_format == "channels_last" else "NCHW")
    z = layer._convolve(x, tf.cast(layer._frozen_kernel(), dtype)) + layer._carrier_term(low_rank)
    channels_last = layer.data_format == "channels_last"
    if layer.use_bias:
        shape = (1, 1, 1, layer.filters) if channels_last else (1, layer.filters, 1, 1)
        z = z + tf.reshape(tf.cast(layer.bias, dtype), shape)
    perm = [0, 2, 3, 1]
    to_last = (lambda t: t) if channels_last else (lambda t: tf.transpose(t, perm))
    m_in, m_out = _masks(layer)
    cin = x.shape[-1] if channels_last else x.shape[1]

    def left_a():
        xl = to_last(x)
        if m_in is not None:
            xl = xl * tf.reshape(tf.cast(m_in, xl.dtype), [1, 1, 1, cin])
        return ghost.conv_patches(xl, layer.kernel_size, layer.strides, layer.dilation_rate,
                                  layer.padding)

    rec.add(layer.left_carrier, ghost.OuterTerm(hidden, left_a,
                                                lambda dz: ghost._to_btp(to_last(dz))))
    rec.add(layer.right_carrier, ghost.OuterTerm(
        z, lambda: ghost._to_btp(to_last(hidden)),
        lambda dz: _masked_factor(ghost._to_btp(to_last(dz)), m_out, layer.filters)))
    if layer.use_bias:
        rec.add(layer.bias, ghost.DirectTerm(
            z, lambda dz: tf.reduce_sum(ghost._to_btp(to_last(dz)), 1)))
    return layer.activation(z) if layer.activation is not None else z
