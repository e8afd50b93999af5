"""Recurrent layers: Keras LSTM, GRU and SimpleRNN (also inside Bidirectional).

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

A SimpleRNN step is ``h_t = activation(x_t K + b + h_{t-1} U)``: the LSTM's terms with one
gate.

Supported: the plain LSTMCell / GRUCell / SimpleRNNCell (any activations, with or without bias), masks (the Keras
semantics: masked steps keep the state; their output is the previous one, or zeros with
``zero_output_for_mask``), ``go_backwards``, ``return_sequences``. Dropout during training,
``initial_state``, ``return_state`` and stateful layers fall back to the vectorized path.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import is_variant
from tf_dp.core.ghost.terms import DirectTerm, OuterTerm


def _prepare(layer, ctx, sequences, mask, initial_state, training, layer_cls, cell_cls):
    """(x, mask, kernel, recurrent kernel) for a supported layer call, or None."""
    cell = layer.cell
    if type(layer).call is not layer_cls.call or type(cell) is not cell_cls:
        return None
    if getattr(layer, "stateful", False) or layer.return_state or initial_state is not None:
        return None
    if training and (cell.dropout > 0 or cell.recurrent_dropout > 0):
        return None
    if is_variant(cell):
        return None
    x = tf.cast(tf.convert_to_tensor(sequences), cell.compute_dtype)
    if x.shape.rank != 3:
        return None
    ctx.check_batch(layer, x)
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    if layer.go_backwards:
        x = tf.reverse(x, [1])
        mask = None if mask is None else tf.reverse(mask, [1])
    return (x, mask, ctx.read(cell.kernel, x.dtype),
            ctx.read(cell.recurrent_kernel, x.dtype))


def _recurrent_rule(layer_cls, cell_cls):
    """Registers ``body(layer, ctx, x, mask, kernel, recurrent_kernel) -> output`` as the
    rule of ``layer_cls`` for the calls ``_prepare`` supports (the others decline)."""

    def deco(body):
        def rule(layer, ctx, sequences, initial_state=None, mask=None, training=False):
            prep = _prepare(layer, ctx, sequences, mask, initial_state, training, layer_cls,
                            cell_cls)
            return NotImplemented if prep is None else body(layer, ctx, *prep)

        register_ghost_rule(layer_cls)(rule)
        return rule

    return deco


def _run(layer, zx, mask, num_states, cell_step):
    """Runs ``cell_step(states, z_t) -> (new_states, extra)`` over time (``tf.scan``).

    States start at zeros, the first is the output h. Keras's masking semantics: a masked
    step keeps the states; its output is the previous one, or zeros with
    ``zero_output_for_mask``. Returns (h after each step (B, T, H), the per-step ``extra``
    (B, T, H), the layer's output).
    """
    zero_out = bool(getattr(layer, "zero_output_for_mask", False))
    h0 = tf.zeros([tf.shape(zx)[0], layer.cell.units], zx.dtype)

    def step(carry, elems):
        states = carry[0]
        z_t, m_t = elems
        new_states, extra = cell_step(states, z_t)
        h_new = new_states[0]
        if m_t is None:
            return new_states, extra, h_new
        m = m_t[:, None]
        kept = tuple(tf.where(m, n, o) for n, o in zip(new_states, states))
        out = tf.where(m, h_new, tf.zeros_like(h_new)) if zero_out else kept[0]
        return kept, extra, out

    zx_tm = tf.transpose(zx, [1, 0, 2])
    init = ((h0,) * num_states, h0, h0)
    if mask is None:
        states, extra, outs = tf.scan(lambda carry, z_t: step(carry, (z_t, None)), zx_tm,
                                      initializer=init)
    else:
        m_tm = tf.transpose(tf.cast(mask, tf.bool), [1, 0])
        states, extra, outs = tf.scan(step, (zx_tm, m_tm), initializer=init)
    if layer.return_sequences:
        output = tf.transpose(outs, [1, 0, 2])
    else:
        output = outs[-1]
    return (tf.transpose(states[0], [1, 0, 2]), tf.transpose(extra, [1, 0, 2]),
            tf.cast(output, layer.compute_dtype))


def _previous(hs):
    """(B, T, H) states after each step -> the states before each step (zeros first)."""
    return tf.concat([tf.zeros_like(hs[:, :1]), hs[:, :-1]], axis=1)


def _projected(layer, ctx, x, kernel, with_bias=True):
    """``zx = x K (+ b)``: every step's input projection, formed before the recurrence."""
    zx = tf.einsum("btd,dp->btp", x, kernel)
    if with_bias and layer.cell.use_bias:
        zx = zx + ctx.read(layer.cell.bias, x.dtype)
    return zx


def _record_plain(ctx, cell, x, zx, hs):
    """K: sum_t x_t (outer) dz_t; U: sum_t h_{t-1} (outer) dz_t; b: sum_t dz_t."""
    ctx.add(cell.kernel, OuterTerm(zx, lambda: x))
    ctx.add(cell.recurrent_kernel, OuterTerm(zx, lambda: _previous(hs)))
    if cell.use_bias:
        ctx.add(cell.bias, DirectTerm(zx, lambda dz: tf.reduce_sum(dz, axis=1)))


@_recurrent_rule(keras.layers.LSTM, keras.layers.LSTMCell)
def _lstm(layer, ctx, x, mask, kernel, recurrent):
    cell = layer.cell
    zx = _projected(layer, ctx, x, kernel)

    def cell_step(states, z_t):
        h, c = states
        zi, zf, zc, zo = tf.split(z_t + tf.matmul(h, recurrent), 4, axis=1)
        c_new = (cell.recurrent_activation(zf) * c
                 + cell.recurrent_activation(zi) * cell.activation(zc))
        h_new = cell.recurrent_activation(zo) * cell.activation(c_new)
        return (h_new, c_new), h_new

    hs, _, output = _run(layer, zx, mask, 2, cell_step)
    _record_plain(ctx, cell, x, zx, hs)
    return output


@_recurrent_rule(keras.layers.GRU, keras.layers.GRUCell)
def _gru(layer, ctx, x, mask, kernel, recurrent):
    cell = layer.cell
    units, reset_after = cell.units, cell.reset_after
    zx = tf.einsum("btd,dp->btp", x, kernel)
    rec_bias = None
    if cell.use_bias:
        bias = ctx.read(cell.bias, x.dtype)
        if reset_after:
            zx, rec_bias = zx + bias[0], bias[1]
        else:
            zx = zx + bias

    def cell_step(states, z_t):
        (h,) = states
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
        return (zg * h + (1 - zg) * cell.activation(cand),), rg

    hs, rs, output = _run(layer, zx, mask, 1, cell_step)

    def split(dz):
        return tf.split(dz, 3, axis=-1)

    ctx.add(cell.kernel, OuterTerm(zx, lambda: x))
    if reset_after:
        def d_inner(dz):  # gradient at h_{t-1} U + b_rec
            dz_z, dz_r, dz_h = split(dz)
            # dz arrives in float32 also under mixed precision (see tf_dp.core.ghost.backward).
            return tf.concat([dz_z, dz_r, tf.cast(rs, dz.dtype) * dz_h], axis=-1)

        ctx.add(cell.recurrent_kernel, OuterTerm(zx, lambda: _previous(hs), d_inner))
        if cell.use_bias:
            ctx.add(cell.bias, DirectTerm(zx, lambda dz: tf.stack(
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

        ctx.add(cell.recurrent_kernel, OuterTerm(zx, a_two, g_two))
        if cell.use_bias:
            ctx.add(cell.bias, DirectTerm(zx, lambda dz: tf.reduce_sum(dz, axis=1)))
    return output


@_recurrent_rule(keras.layers.SimpleRNN, keras.layers.SimpleRNNCell)
def _simple_rnn(layer, ctx, x, mask, kernel, recurrent):
    cell = layer.cell
    zx = _projected(layer, ctx, x, kernel)

    def cell_step(states, z_t):
        (h,) = states
        h_new = z_t + tf.matmul(h, recurrent)
        if cell.activation is not None:
            h_new = cell.activation(h_new)
        return (h_new,), h_new

    hs, _, output = _run(layer, zx, mask, 1, cell_step)
    _record_plain(ctx, cell, x, zx, hs)
    return output
