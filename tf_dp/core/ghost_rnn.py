"""Ghost-norm formulas for Keras LSTM and GRU layers (also inside Bidirectional).

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

A GRU is the same with its three gates, except that its candidate's recurrent part is
multiplied by the reset gate r_t: with ``reset_after`` (the Keras default) the gradient at
``h_{t-1} U + b_rec`` is ``[dz_z, dz_r, r_t * dz_h]``; without it the candidate's block of U
sees ``r_t * h_{t-1}`` instead of ``h_{t-1}``, which is a second outer product (stacked along
the time axis: one term over 2T "steps").

Supported: the plain LSTMCell / GRUCell (any activations, with or without bias), masks (the Keras
semantics: masked steps keep the state; their output is the previous one, or zeros with
``zero_output_for_mask``), ``go_backwards``, ``return_sequences``. Dropout during training,
``initial_state``, ``return_state`` and stateful layers fall back to the vectorized path.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.core import ghost


def _unsupported(layer, initial_state, training, layer_cls, cell_cls):
    cell = layer.cell
    if type(layer).call is not layer_cls.call or type(cell) is not cell_cls:
        return True
    if getattr(layer, "stateful", False) or layer.return_state or initial_state is not None:
        return True
    if training and (cell.dropout > 0 or cell.recurrent_dropout > 0):
        return True
    return ghost._is_unsupported_variant(cell)


def _inputs(layer, rec, sequences, mask):
    x = tf.cast(tf.convert_to_tensor(sequences), layer.cell.compute_dtype)
    if x.shape.rank != 3:
        return None, None
    rec.check_batch(layer, x)
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    if layer.go_backwards:
        x = tf.reverse(x, [1])
        mask = None if mask is None else tf.reverse(mask, [1])
    return x, mask


def _previous(hs):
    """(B, T, H) states after each step -> the states before each step (zeros first)."""
    return tf.concat([tf.zeros_like(hs[:, :1]), hs[:, :-1]], axis=1)


def _output(layer, outs):
    if layer.return_sequences:
        return tf.cast(tf.transpose(outs, [1, 0, 2]), layer.compute_dtype)
    return tf.cast(outs[-1], layer.compute_dtype)


@ghost.register(keras.layers.LSTM)
def _lstm(layer, rec, sequences, initial_state=None, mask=None, training=False):
    if _unsupported(layer, initial_state, training, keras.layers.LSTM, keras.layers.LSTMCell):
        return NotImplemented
    cell = layer.cell
    x, mask = _inputs(layer, rec, sequences, mask)
    if x is None:
        return NotImplemented
    dtype = x.dtype
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

    rec.add(cell.kernel, ghost.OuterTerm(zx, lambda: x))
    rec.add(cell.recurrent_kernel, ghost.OuterTerm(zx, lambda: _previous(hs)))
    if cell.use_bias:
        rec.add(cell.bias, ghost.DirectTerm(zx, lambda dz: tf.reduce_sum(dz, axis=1)))
    return _output(layer, outs)


@ghost.register(keras.layers.GRU)
def _gru(layer, rec, sequences, initial_state=None, mask=None, training=False):
    if _unsupported(layer, initial_state, training, keras.layers.GRU, keras.layers.GRUCell):
        return NotImplemented
    cell = layer.cell
    x, mask = _inputs(layer, rec, sequences, mask)
    if x is None:
        return NotImplemented
    dtype = x.dtype
    units = cell.units
    reset_after = cell.reset_after
    kernel = ghost._alias(cell.kernel, dtype)
    recurrent = ghost._alias(cell.recurrent_kernel, dtype)
    zx = tf.einsum("btd,dp->btp", x, kernel)
    rec_bias = None
    if cell.use_bias:
        bias = ghost._alias(cell.bias, dtype)
        if reset_after:
            zx = zx + bias[0]
            rec_bias = bias[1]
        else:
            zx = zx + bias
    h0 = tf.zeros([tf.shape(x)[0], units], dtype)
    zero_out = bool(getattr(layer, "zero_output_for_mask", False))

    def step(carry, elems):
        h, _, _ = carry
        z_t, m_t = elems
        x_z, x_r, x_h = tf.split(z_t, 3, axis=1)
        if reset_after:
            inner = tf.matmul(h, recurrent)
            if rec_bias is not None:
                inner = inner + rec_bias
            r_z, r_r, r_h = tf.split(inner, 3, axis=1)
        else:
            r_z, r_r = tf.split(tf.matmul(h, recurrent[:, :2 * units]), 2, axis=1)
        zg = cell.recurrent_activation(x_z + r_z)
        rg = cell.recurrent_activation(x_r + r_r)
        if reset_after:
            cand = x_h + rg * r_h
        else:
            cand = x_h + tf.matmul(rg * h, recurrent[:, 2 * units:])
        h_new = zg * h + (1 - zg) * cell.activation(cand)
        if m_t is None:
            return h_new, rg, h_new
        m = m_t[:, None]
        h_kept = tf.where(m, h_new, h)
        out = tf.where(m, h_new, tf.zeros_like(h_new)) if zero_out else h_kept
        return h_kept, rg, out

    zx_tm = tf.transpose(zx, [1, 0, 2])
    init = (h0, h0, h0)
    if mask is None:
        hs, rs, outs = tf.scan(lambda carry, z_t: step(carry, (z_t, None)), zx_tm,
                               initializer=init)
    else:
        m_tm = tf.transpose(tf.cast(mask, tf.bool), [1, 0])
        hs, rs, outs = tf.scan(step, (zx_tm, m_tm), initializer=init)
    hs = tf.transpose(hs, [1, 0, 2])
    rs = tf.transpose(rs, [1, 0, 2])

    def split(dz):
        return tf.split(dz, 3, axis=-1)

    rec.add(cell.kernel, ghost.OuterTerm(zx, lambda: x))
    if reset_after:
        def d_inner(dz):  # gradient at h_{t-1} U + b_rec
            dz_z, dz_r, dz_h = split(dz)
            return tf.concat([dz_z, dz_r, rs * dz_h], axis=-1)

        rec.add(cell.recurrent_kernel, ghost.OuterTerm(zx, lambda: _previous(hs), d_inner))
        if cell.use_bias:
            rec.add(cell.bias, ghost.DirectTerm(zx, lambda dz: tf.stack(
                [tf.reduce_sum(dz, axis=1), tf.reduce_sum(d_inner(dz), axis=1)], axis=1)))
    else:
        def a_two():  # h_{t-1} for the z/r blocks, r_t * h_{t-1} for the candidate's block
            h_prev = _previous(hs)
            return tf.concat([h_prev, rs * h_prev], axis=1)

        def g_two(dz):
            dz_z, dz_r, dz_h = split(dz)
            zeros = tf.zeros_like(dz_h)
            return tf.concat([tf.concat([dz_z, dz_r, zeros], axis=-1),
                              tf.concat([zeros, zeros, dz_h], axis=-1)], axis=1)

        rec.add(cell.recurrent_kernel, ghost.OuterTerm(zx, a_two, g_two))
        if cell.use_bias:
            rec.add(cell.bias, ghost.DirectTerm(zx, lambda dz: tf.reduce_sum(dz, axis=1)))
    return _output(layer, outs)
