"""Ghost-norm formula for Keras LSTM layers (also inside Bidirectional).

An LSTM step computes the gate pre-activations ``z_t = x_t K + h_{t-1} U + b``. All input
projections ``x_t K + b`` are formed for every step at once *before* the recurrence, as one
tensor ``zx`` (B, T, 4H); the recurrence then adds ``h_{t-1} U``. The gradient of the loss
with respect to ``zx[:, t]`` therefore equals its gradient with respect to ``z_t``, and one
backward pass to ``zx`` gives every factor:

    per-example grad of K = sum_t x_t (outer) dz_t
    per-example grad of U = sum_t h_{t-1} (outer) dz_t
    per-example grad of b = sum_t dz_t

two outer-product terms and a direct one, exactly the forms the ghost machinery handles
for Dense layers. The recurrence runs in ``tf.scan`` (no unrolling, no per-example
copies), so an LSTM costs about what it costs without privacy, and JL projections of its
gradients come from the same factors.

Supported: the plain LSTMCell (any activations, with or without bias), masks (the Keras
semantics: masked steps keep the state; their output is the previous one, or zeros with
``zero_output_for_mask``), ``go_backwards``, ``return_sequences``. Dropout during training,
``initial_state``, ``return_state`` and stateful layers fall back to the vectorized path.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.core import ghost


def _unsupported(layer, initial_state, training):
    cell = layer.cell
    if type(layer).call is not keras.layers.LSTM.call or type(cell) is not keras.layers.LSTMCell:
        return True
    if getattr(layer, "stateful", False) or layer.return_state or initial_state is not None:
        return True
    if training and (cell.dropout > 0 or cell.recurrent_dropout > 0):
        return True
    return ghost._is_unsupported_variant(cell)


@ghost.register(keras.layers.LSTM)
def _lstm(layer, rec, sequences, initial_state=None, mask=None, training=False):
    if _unsupported(layer, initial_state, training):
        return NotImplemented
    cell = layer.cell
    dtype = cell.compute_dtype
    x = tf.cast(tf.convert_to_tensor(sequences), dtype)
    if x.shape.rank != 3:
        return NotImplemented
    rec.check_batch(layer, x)
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    if layer.go_backwards:
        x = tf.reverse(x, [1])
        mask = None if mask is None else tf.reverse(mask, [1])
    units = cell.units
    kernel = ghost._alias(cell.kernel, dtype)
    recurrent = ghost._alias(cell.recurrent_kernel, dtype)
    zx = tf.einsum("btd,dp->btp", x, kernel)
    if cell.use_bias:
        zx = zx + ghost._alias(cell.bias, dtype)
    batch = tf.shape(x)[0]
    h0 = tf.zeros([batch, units], dtype)
    zero_out = bool(getattr(layer, "zero_output_for_mask", False))

    def step(carry, elems):
        h, c, _ = carry
        z_t, m_t = elems
        z = z_t + tf.matmul(h, recurrent)
        zi, zf, zc, zo = tf.split(z, 4, axis=1)
        i = cell.recurrent_activation(zi)
        f = cell.recurrent_activation(zf)
        c_new = f * c + i * cell.activation(zc)
        o = cell.recurrent_activation(zo)
        h_new = o * cell.activation(c_new)
        if m_t is None:
            return h_new, c_new, h_new
        m = m_t[:, None]
        h_kept = tf.where(m, h_new, h)
        out = tf.where(m, h_new, tf.zeros_like(h_new)) if zero_out else h_kept
        return h_kept, tf.where(m, c_new, c), out

    zx_tm = tf.transpose(zx, [1, 0, 2])
    if mask is None:
        hs, _, outs = tf.scan(lambda carry, z_t: step(carry, (z_t, None)), zx_tm,
                              initializer=(h0, h0, h0))
    else:
        m_tm = tf.transpose(tf.cast(mask, tf.bool), [1, 0])
        hs, _, outs = tf.scan(step, (zx_tm, m_tm), initializer=(h0, h0, h0))
    hs = tf.transpose(hs, [1, 0, 2])  # (B, T, H): state after each step

    def h_prev():
        return tf.concat([tf.zeros_like(hs[:, :1]), hs[:, :-1]], axis=1)

    rec.add(cell.kernel, ghost.OuterTerm(zx, lambda: x))
    rec.add(cell.recurrent_kernel, ghost.OuterTerm(zx, h_prev))
    if cell.use_bias:
        rec.add(cell.bias, ghost.DirectTerm(zx, lambda dz: tf.reduce_sum(dz, axis=1)))
    if layer.return_sequences:
        return tf.cast(tf.transpose(outs, [1, 0, 2]), layer.compute_dtype)
    return tf.cast(outs[-1], layer.compute_dtype)
