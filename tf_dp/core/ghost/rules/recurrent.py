"""Recurrent layers: Keras LSTM, GRU and SimpleRNN (also inside Bidirectional).

An LSTM step computes the gate pre-activations ``z_t = x_t K + h_{t-1} U + b``. Write
``zx`` (B, T, 4H) for the input projections ``x_t K + b`` of all steps: the gradient of the
loss with respect to ``zx[:, t]`` equals its gradient with respect to ``z_t``, and one
backward pass to ``zx`` gives every factor:

    per-example grad of K = sum_t x_t (outer) dz_t
    per-example grad of U = sum_t h_{t-1} (outer) dz_t
    per-example grad of b = sum_t dz_t

two outer-product terms and a direct one, exactly the forms the ghost machinery handles
for Dense layers. The recurrence runs in a ``tf.while_loop`` with its own gradient
(``_recurrence``: no unrolling, no per-example copies, no (B, T, 4H) transposes or zero
fills; ``zx`` is formed a step at a time inside the loop, and its gradient reaches the
factors through a probe tensor), so an LSTM costs about what it costs without privacy, and JL projections of
its gradients come from the same factors.

A GRU is the same with its three gates, except that its candidate's recurrent part is
multiplied by the reset gate r_t: with ``reset_after`` (the Keras default) the gradient at
``h_{t-1} U + b_rec`` is ``[dz_z, dz_r, r_t * dz_h]``; without it the candidate's block of U
sees ``r_t * h_{t-1}`` instead of ``h_{t-1}``, which is a second outer product (stacked along
the time axis: one term over 2T "steps").

A SimpleRNN step is ``h_t = activation(x_t K + b + h_{t-1} U)``: the LSTM's terms with one
gate.

Supported: the plain LSTMCell / GRUCell / SimpleRNNCell (any activations, with or without
bias), masks (the Keras semantics: masked steps keep the state; their output is the
previous one, or zeros with ``zero_output_for_mask``), ``go_backwards``,
``return_sequences``. Dropout during training, ``initial_state``, ``return_state`` and
stateful layers fall back to the vectorized path.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import is_variant
from tf_dp.core.ghost.terms import DirectTerm, OuterTerm


def _prepare(layer, ctx, sequences, mask, initial_state, training, layer_cls, cell_cls):
    """(x (B, T, d), mask (B, T) or None, kernel, recurrent kernel) for a supported layer
    call, or None. Both stay in the order of time (``go_backwards`` is the loop's order)."""
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


class _Cell:
    """One recurrent cell as ``_recurrence`` runs it.

    Each step forms ``r_t = h_{t-1} rec (+ rec_bias)`` (the recurrent matrix product), then
    ``pre_t = pre(zx_t, r_t)`` and ``(new states, extra_t) = step(states, pre_t)``, which must
    not multiply by ``rec`` again (its product is in ``pre_t``, saved for the backward
    loop); ``pre_t`` is (B, pre_width). ``split(d pre_t) -> (d zx_t, d r_t)``. ``extra``:
    whether ``step`` returns a per-step (B, H) tensor the factors need (else None).

    ``fast``: optionally a cell with a hand-written step backward (``_LSTMBackward``): its
    ``forward(states, pre_t) -> (new states, extra_t, kept_t)`` replaces ``step`` in the
    forward loop and keeps the tensors ``kept_t`` (widths ``fast.widths``) for its
    ``backward(kept_t, states before, d new states) -> (d pre_t, d states before)``, where a
    state the step reads only through ``pre_t`` may get None. Without it the backward loop
    differentiates ``step`` with a tape from the saved ``pre_t``.
    """

    def __init__(self, num_states, rec, rec_bias, pre_width, pre, step, split, extra=False,
                 fast=None):
        self.num_states, self.rec, self.rec_bias = num_states, rec, rec_bias
        self.pre_width = pre_width
        self.pre, self.step, self.split, self.extra = pre, step, split, extra
        self.fast = fast


class _LSTMBackward:
    """The LSTM step with sigmoid gates and tanh activations (the Keras defaults) and its
    backward written out, so the backward loop neither recomputes the step nor runs a tape
    (whose element-wise gradients, with an unknown batch, each carry broadcast reductions).

    Forward: ``i, f, o = sigmoid(z_i, z_f, z_o)``, ``g = tanh(z_c)``, ``c' = f c + i g``,
    ``h' = o tanh(c')``; kept per step: ``i, f, g, o`` and ``tanh(c')`` (each (B, H), kept
    apart: a TensorArray write keeps a reference, a concatenation would copy). Backward,
    from ``dh'`` and ``dc'``: ``dc* = dc' + dh' o (1 - tanh(c')^2)``,
    ``d[i, f, g, o] = [dc* g, dc* c, dc* i, dh' tanh(c')]``, each times its activation's
    derivative (``SigmoidGrad`` / ``TanhGrad``: ``a (1 - a)`` / ``1 - a^2`` from the kept
    activation), ``dc = dc* f``; h enters the step only through ``z`` (its gradient is the
    recurrent product's, formed by ``_recurrence``).
    """

    def __init__(self, units):
        self.widths = (units,) * 5

    @staticmethod
    def applies(cell):
        return (cell.recurrent_activation is keras.activations.sigmoid
                and cell.activation is keras.activations.tanh)

    def forward(self, states, z):
        _, c = states
        zi, zf, zc, zo = tf.split(z, 4, axis=1)
        i, f, o = tf.sigmoid(zi), tf.sigmoid(zf), tf.sigmoid(zo)
        g = tf.tanh(zc)
        c_new = f * c + i * g
        tc = tf.tanh(c_new)
        return (o * tc, c_new), None, (i, f, g, o, tc)

    def backward(self, kept, prev, d_new):
        i, f, g, o, tc = kept
        _, c = prev
        dh, dc = d_new
        dc_all = dc + tf.raw_ops.TanhGrad(y=tc, dy=dh * o)
        sig = tf.raw_ops.SigmoidGrad
        dz = tf.concat([sig(y=i, dy=dc_all * g), sig(y=f, dy=dc_all * c),
                        tf.raw_ops.TanhGrad(y=g, dy=dc_all * i), sig(y=o, dy=dh * tc)], axis=1)
        return dz, [None, dc_all * f]


#: sequences at most this long are gathered from a loop's TensorArray straight into (B, T, ...)
#: (one copy, T graph ops); longer or unknown ones are stacked (T, B, ...) and transposed.
_UNSTACKED_MAX_STEPS = 1024


class _Projection:
    """The input projections ``zx_t = x_t K (+ b)`` (B, P) of a layer's input x (B, T, d),
    formed inside the loop one step at a time, as Keras's own loop does: the whole (B, T, P)
    product is never written (at batch 2048 it was 315 MB per LSTM direction and its one
    large matrix product, bound by memory, took twice the time of the per-step ones)."""

    def __init__(self, x, kernel, bias=None):
        self.x, self.kernel, self.bias = x, kernel, bias

    def at(self, t):
        z = tf.matmul(tf.gather(self.x, t, axis=1), self.kernel)
        return z if self.bias is None else z + self.bias


def _recurrence(layer, ctx, inputs: _Projection, mask, cell: _Cell):
    """Runs ``cell`` over the input projections ``zx`` (B, T, P) of ``inputs``.

    States start at zeros, the first is the output h; steps run from t = 0 up, or from
    T - 1 down with ``go_backwards``. Keras's masking semantics: a masked step keeps the
    states; its output is the previous one, or zeros with ``zero_output_for_mask``.

    The loop has its own gradient (``tf.custom_gradient``): the forward loop keeps each
    step's ``pre_t`` (or what a ``fast`` cell keeps) and the states before it in
    TensorArrays, and the backward loop differentiates one step at a time from them (a
    tape over the cell's element-wise part, or the ``fast`` cell's own backward; the
    product with ``rec`` is transposed by hand) and writes each ``d zx_t`` into a
    TensorArray: no zero-filled lists, no recomputed matrix products. Steps read their
    slices of the batch-major x, mask and output gradient directly, and what leaves the
    loops is gathered into (B, T, ...) in one copy, so nothing (B, T, P) is transposed.

    ``zx`` itself is never formed (``_Projection``). Its gradient ``dz`` (B, T, P), which the
    factors need, is the gradient at a **probe**: an input of the loop with the static
    shape (None, T, P) of ``zx`` but no rows (nothing is stored), watched by the capture's
    tape, to which the loop's gradient returns ``dz``. The gradient at x is ``dz K^T``.

    Returns (the probe, to record terms on; states h before each step (B, T, H) in time
    order; the per-step ``extra`` (B, T, H) or None; the layer's output: (B, T, H) in the
    loop's order with ``return_sequences``, else (B, H)). Only the output carries a
    gradient.
    """
    units = layer.cell.units
    x = inputs.x
    dtype = x.dtype
    width = inputs.kernel.shape[-1]
    # A static T keeps the factors' shapes static (the choice between Gram and materialised
    # norms depends on it).
    steps = x.shape[1] if x.shape[1] is not None else tf.shape(x)[1]
    batch = tf.shape(x)[0]
    probe = tf.compat.v1.placeholder_with_default(
        tf.zeros([0, steps, width], dtype),
        shape=[None, steps if isinstance(steps, int) else None, width])
    ctx.watch(probe)
    backwards = bool(layer.go_backwards)
    zero_out = bool(getattr(layer, "zero_output_for_mask", False))
    sequences = bool(layer.return_sequences)
    mask = None if mask is None else tf.cast(mask, tf.bool)
    side = {}

    def time_of(k):
        return steps - 1 - k if backwards else k

    def array(width):
        return tf.TensorArray(dtype, size=steps, element_shape=tf.TensorShape([None, width]),
                              clear_after_read=False)  # (read twice when executing eagerly)

    def batch_major(ta):
        if isinstance(steps, int) and steps <= _UNSTACKED_MAX_STEPS:
            if steps == 0:
                return tf.zeros([batch, 0, ta.element_shape[-1]], dtype)
            return tf.stack([ta.read(t) for t in range(steps)], axis=1)
        return tf.transpose(ta.stack(), [1, 0, 2])

    def recurrent_product(h):
        r = tf.matmul(h, cell.rec)
        return r if cell.rec_bias is None else r + cell.rec_bias

    @tf.custom_gradient
    def run(x, probe):
        del probe  # (only its gradient is used)
        zeros = tf.zeros([batch, units], dtype)

        def body(k, states, last, keeps, prevs, extras, outs):
            t = time_of(k)
            pre = cell.pre(inputs.at(t), recurrent_product(states[0]))
            if cell.fast is None:
                (new, extra), saved = cell.step(states, pre), (pre,)
            else:
                new, extra, saved = cell.fast.forward(states, pre)
            keeps = tuple(ta.write(t, v) for ta, v in zip(keeps, saved))
            prevs = tuple(ta.write(t, s) for ta, s in zip(prevs, states))
            if cell.extra:
                extras = extras.write(t, extra)
            if mask is None:
                kept, out = new, new[0]
            else:
                m = tf.gather(mask, t, axis=1)[:, None]
                kept = tuple(tf.where(m, n, o) for n, o in zip(new, states))
                out = tf.where(m, new[0], zeros) if zero_out else kept[0]
            if sequences:
                outs = outs.write(k, out)
            return k + 1, kept, out, keeps, prevs, extras, outs

        widths = (cell.pre_width,) if cell.fast is None else cell.fast.widths
        init = (tf.constant(0), (zeros,) * cell.num_states, zeros,
                tuple(array(w) for w in widths),
                tuple(array(units) for _ in range(cell.num_states)),
                array(units) if cell.extra else tf.constant(0),
                array(units) if sequences else tf.constant(0))
        _, _, last, keeps, prevs, extras, outs = tf.while_loop(
            lambda k, *_: k < steps, body, init)
        side["prev"] = batch_major(prevs[0])
        side["extra"] = batch_major(extras) if cell.extra else None
        output = batch_major(outs) if sequences else last

        def grad(d_output):
            d_output = tf.convert_to_tensor(d_output)

            def back(j, d_states, d_last, dzs):
                k = steps - 1 - j
                t = time_of(k)
                saved = tuple(ta.read(t) for ta in keeps)
                prev = tuple(ta.read(t) for ta in prevs)
                d_out = tf.gather(d_output, k, axis=1) if sequences else d_last
                d_kept = list(d_states)
                if mask is None:
                    d_kept[0] = d_kept[0] + d_out
                    d_new, d_pass = d_kept, None
                else:
                    # The step's new states reach only the examples that are not masked;
                    # the others pass their gradient on to the previous states.
                    m = tf.gather(mask, t, axis=1)[:, None]
                    if not zero_out:  # the output is the kept state
                        d_kept[0] = d_kept[0] + d_out
                    d_new = [tf.where(m, d, zeros) for d in d_kept]
                    if zero_out:  # the output is the new state or zeros
                        d_new[0] = tf.where(m, d_kept[0] + d_out, zeros)
                    d_pass = [tf.where(m, zeros, d) for d in d_kept]
                if cell.fast is None:
                    with tf.GradientTape() as tape:
                        tape.watch(saved[0])
                        tape.watch(prev)
                        new, _ = cell.step(prev, saved[0])
                    d_pre, *d_prev = tape.gradient(list(new), [saved[0], *prev],
                                                   output_gradients=d_new)
                else:
                    d_pre, d_prev = cell.fast.backward(saved, prev, d_new)
                d_zx, d_r = cell.split(d_pre)
                d_h = tf.matmul(d_r, cell.rec, transpose_b=True)
                d_prev = [zeros if g is None else g for g in d_prev]
                d_prev[0] = d_h if d_prev[0] is zeros else d_prev[0] + d_h
                if d_pass is not None:
                    d_prev = [a + b for a, b in zip(d_prev, d_pass)]
                return j + 1, tuple(d_prev), zeros, dzs.write(t, d_zx)

            d_last = zeros if sequences else tf.cast(d_output, dtype)
            init = (tf.constant(0), (zeros,) * cell.num_states, d_last, array(width))
            *_, dzs = tf.while_loop(lambda j, *_: j < steps, back, init)
            dz = batch_major(dzs)
            return tf.einsum("btp,dp->btd", dz, inputs.kernel), dz

        return output, grad

    output = run(x, probe)
    return probe, side["prev"], side["extra"], tf.cast(output, layer.compute_dtype)


def _time_sum(dz):
    return tf.reduce_sum(dz, axis=1)


def _record_plain(ctx, cell, x, zx, prev_h):
    """K: sum_t x_t (outer) dz_t; U: sum_t h_{t-1} (outer) dz_t; b: sum_t dz_t."""
    ctx.add(cell.kernel, OuterTerm(zx, lambda: x))
    ctx.add(cell.recurrent_kernel, OuterTerm(zx, lambda: prev_h))
    if cell.use_bias:
        ctx.add(cell.bias, DirectTerm(zx, _time_sum))


def _add(zx_t, r_t):
    return zx_t + r_t


def _same(d):
    return d, d


@_recurrent_rule(keras.layers.LSTM, keras.layers.LSTMCell)
def _lstm(layer, ctx, x, mask, kernel, recurrent):
    cell = layer.cell
    bias = ctx.read(cell.bias, x.dtype) if cell.use_bias else None
    def step(states, z):
        _, c = states
        zi, zf, zc, zo = tf.split(z, 4, axis=1)
        c_new = (cell.recurrent_activation(zf) * c
                 + cell.recurrent_activation(zi) * cell.activation(zc))
        h_new = cell.recurrent_activation(zo) * cell.activation(c_new)
        return (h_new, c_new), None

    fast = _LSTMBackward(cell.units) if _LSTMBackward.applies(cell) else None
    zx, prev_h, _, output = _recurrence(
        layer, ctx, _Projection(x, kernel, bias), mask,
        _Cell(2, recurrent, None, 4 * cell.units, _add, step, _same, fast=fast))
    _record_plain(ctx, cell, x, zx, prev_h)
    return output


@_recurrent_rule(keras.layers.GRU, keras.layers.GRUCell)
def _gru(layer, ctx, x, mask, kernel, recurrent):
    cell = layer.cell
    units, reset_after = cell.units, cell.reset_after
    bias = ctx.read(cell.bias, x.dtype) if cell.use_bias else None
    if reset_after:
        inputs = _Projection(x, kernel, None if bias is None else bias[0])

        def pre(zx_t, r_t):  # [x_z + r_z, x_r + r_r, x_h, r_h]
            return tf.concat([zx_t[:, :2 * units] + r_t[:, :2 * units], zx_t[:, 2 * units:],
                              r_t[:, 2 * units:]], axis=1)

        def step(states, p):
            (h,) = states
            s_z, s_r, x_h, r_h = tf.split(p, 4, axis=1)
            zg = cell.recurrent_activation(s_z)
            rg = cell.recurrent_activation(s_r)
            return (zg * h + (1 - zg) * cell.activation(x_h + rg * r_h),), rg

        def split(d):
            return d[:, :3 * units], tf.concat([d[:, :2 * units], d[:, 3 * units:]], axis=1)

        spec = _Cell(1, recurrent, None if bias is None else bias[1], 4 * units, pre, step,
                     split, True)
    else:
        inputs = _Projection(x, kernel, bias)
        rec_h = recurrent[:, 2 * units:]

        def pre(zx_t, r_t):  # [x_z + r_z, x_r + r_r, x_h]
            return tf.concat([zx_t[:, :2 * units] + r_t, zx_t[:, 2 * units:]], axis=1)

        def step(states, p):
            (h,) = states
            s_z, s_r, x_h = tf.split(p, 3, axis=1)
            zg = cell.recurrent_activation(s_z)
            rg = cell.recurrent_activation(s_r)
            return (zg * h + (1 - zg) * cell.activation(x_h + tf.matmul(rg * h, rec_h)),), rg

        spec = _Cell(1, recurrent[:, :2 * units], None, 3 * units, pre, step,
                     lambda d: (d, d[:, :2 * units]), True)

    zx, prev_h, rs, output = _recurrence(layer, ctx, inputs, mask, spec)

    def split_t(dz):
        return tf.split(dz, 3, axis=-1)

    ctx.add(cell.kernel, OuterTerm(zx, lambda: x))
    if reset_after:
        def d_inner(dz):  # gradient at h_{t-1} U + b_rec
            dz_z, dz_r, dz_h = split_t(dz)
            # dz arrives in float32 also under mixed precision (see tf_dp.core.ghost.backward).
            return tf.concat([dz_z, dz_r, tf.cast(rs, dz.dtype) * dz_h], axis=-1)

        ctx.add(cell.recurrent_kernel, OuterTerm(zx, lambda: prev_h, d_inner))
        if cell.use_bias:
            ctx.add(cell.bias, DirectTerm(zx, lambda dz: tf.stack(
                [_time_sum(dz), _time_sum(d_inner(dz))], axis=1)))
    else:
        def a_two():  # h_{t-1} for the z/r blocks, r_t * h_{t-1} for the candidate's block
            return tf.concat([prev_h, rs * prev_h], axis=1)

        def g_two(dz):
            dz_z, dz_r, dz_h = split_t(dz)
            zeros = tf.zeros_like(dz_h)
            return tf.concat([tf.concat([dz_z, dz_r, zeros], axis=-1),
                              tf.concat([zeros, zeros, dz_h], axis=-1)], axis=1)

        ctx.add(cell.recurrent_kernel, OuterTerm(zx, a_two, g_two))
        if cell.use_bias:
            ctx.add(cell.bias, DirectTerm(zx, _time_sum))
    return output


@_recurrent_rule(keras.layers.SimpleRNN, keras.layers.SimpleRNNCell)
def _simple_rnn(layer, ctx, x, mask, kernel, recurrent):
    cell = layer.cell
    bias = ctx.read(cell.bias, x.dtype) if cell.use_bias else None
    def step(states, z):
        return ((z if cell.activation is None else cell.activation(z)),), None

    zx, prev_h, _, output = _recurrence(
        layer, ctx, _Projection(x, kernel, bias), mask,
        _Cell(1, recurrent, None, cell.units, _add, step, _same))
    _record_plain(ctx, cell, x, zx, prev_h)
    return output
