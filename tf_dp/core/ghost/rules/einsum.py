"""EinsumDense (and the projections of MultiHeadAttention, which are EinsumDense layers).

An equation in "matmul form" (every kernel axis either contracted with the input or carried
to the output, no input axis summed away) has an outer-product per-example gradient over
the shared axes; any other equation gets its per-example kernel gradient directly, as
``einsum(x, dz)`` keeping the batch index.
"""

from __future__ import annotations

import string

import keras
import tensorflow as tf

from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import activation, covers
from tf_dp.core.ghost.terms import DirectTerm, OuterTerm, rows


@register_ghost_rule(keras.layers.EinsumDense)
def _einsum_dense(layer, ctx, inputs, training=None):
    if not covers(layer, keras.layers.EinsumDense):
        return NotImplemented
    x = ctx.batch_input(layer, inputs)
    spec = parse_einsum(layer.equation, x.shape.rank)
    if spec is None:
        return NotImplemented
    in_s, ker_s, out_s = spec
    z = tf.einsum(f"{in_s},{ker_s}->{out_s}", x, ctx.read(layer.kernel, x.dtype))
    if layer.bias is not None:
        z = z + ctx.read(layer.bias, x.dtype)
    ctx.add(layer.kernel, einsum_term(z, x, in_s, ker_s, out_s))
    if layer.bias is not None:
        ctx.direct(layer.bias, z, bias_grad_fn(out_s, layer.bias_axes))
    return activation(layer, z)


def bias_grad_fn(out_s, bias_axes):
    """Per-example gradient of an einsum bias broadcast over the other output axes."""
    red = [i for i, c in enumerate(out_s) if i > 0 and c not in (bias_axes or "")]
    return lambda dz: tf.reduce_sum(dz, axis=red) if red else dz


def parse_einsum(equation, x_rank):
    """Returns (input, kernel, output) subscripts with '...' expanded, or None when the
    equation has no leading batch axis of its own (the rule does not apply)."""
    eq = equation.replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out_s = eq.split("->")
    in_s, ker_s = lhs.split(",")
    if "..." in ker_s:
        return None
    if "..." in in_s:
        free = [c for c in string.ascii_letters if c not in eq]
        n = x_rank - (len(in_s) - 3)
        fill = "".join(free[:n])
        in_s = in_s.replace("...", fill)
        out_s = out_s.replace("...", fill)
    if len(in_s) != x_rank or not in_s or not out_s or in_s[0] != out_s[0] or in_s[0] in ker_s:
        return None
    return in_s, ker_s, out_s


def einsum_term(z, x, in_s, ker_s, out_s, a_mask=None, g_mask=None):
    """The term of ``z = einsum(in_s, ker_s -> out_s)(x, kernel)`` for the kernel.

    ``a_mask`` / ``g_mask``: optional 0/1 vectors over the flattened contracted input axes /
    kernel output axes, multiplied into the factors (LSG's frozen rows and columns).
    """
    b = in_s[0]
    shared = [c for c in in_s[1:] if c in out_s and c not in ker_s]
    # In kernel order: the factors' flattened axes must be laid out as the kernel is
    # (row-major), whatever order the input and output list them in.
    contract = [c for c in ker_s if c in in_s and c not in out_s]
    kout = [c for c in ker_s if c in out_s and c not in in_s]
    summed = [c for c in in_s[1:] if c not in out_s and c not in ker_s]
    matmul_form = (list(ker_s) == contract + kout and not summed
                   and all(c in shared or c in kout for c in out_s[1:]))
    if not matmul_form:
        if a_mask is not None or g_mask is not None:
            raise NotImplementedError("masked factors need an equation in matmul form")

        def grad_fn(dz):
            return tf.einsum(f"{in_s},{out_s}->{b}{ker_s}", tf.cast(x, dz.dtype), dz)
        return DirectTerm(z, grad_fn)

    def a_fn():
        perm = [in_s.index(c) for c in [b] + shared + contract]
        a = rows(tf.transpose(x, perm), _prod(x.shape, [in_s.index(c) for c in contract]))
        return a if a_mask is None else a * tf.cast(a_mask, a.dtype)

    def dz_fn(dz):
        perm = [out_s.index(c) for c in [b] + shared + kout]
        g = rows(tf.transpose(dz, perm), _prod(z.shape, [out_s.index(c) for c in kout]))
        return g if g_mask is None else g * tf.cast(g_mask, g.dtype)

    return OuterTerm(z, a_fn, dz_fn)


def _prod(shape, idx):
    p = 1
    for i in idx:
        p *= shape[i]
    return p
