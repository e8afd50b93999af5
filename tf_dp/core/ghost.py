"""Exact per-example gradient norms from layer inputs and output gradients ("ghost norms").

During one captured forward pass every registered layer records, for each of its weights,
a *term* describing that weight's per-example gradient in factored form:

* ``OuterTerm``: the per-example gradient is ``sum_t a[i, t] (outer) dz[i, t]`` (Dense,
  Conv via im2col patches, EinsumDense in matmul form). Its squared norm is either
  ``sum((A A^T) * (G G^T))`` (ghost, cost B*T^2) or ``||A^T G||^2`` (materialised, cost
  B*d*p), whichever is cheaper (Goodfellow 2015; Li et al. 2022, "Large language models can
  be strong differentially private learners", Sec. 4).
* ``EmbeddingTerm``: rows ``ids[i, t]`` receive ``dz[i, t]``; norm from the row sums of
  equal token ids.
* ``DirectTerm``: the per-example gradient is a small tensor computed directly (biases,
  normalisation scales).

One backward pass gives ``dz`` for every recorded output; the clipped sum
``sum_i w_i g_i`` is then formed from the same factors ("book-keeping", Bu et al. 2022,
"Differentially Private Optimization on Large Model at Small Cost"). The norm and the sum
are still different computations (the Gram form above is not the contraction that sums),
so every norm comes with an upper bound of what the sum adds for the example, rounding
included, and the clip factor is formed from that bound (see "precision" below): each
example's contribution is then bounded by the clipping norm for any input.
"""

from __future__ import annotations

import contextlib
import string
import threading
from typing import Callable

import keras
import tensorflow as tf

# ---------------------------------------------------------------------------- terms


class OuterTerm:
    """Per-example gradient ``sum_t a_t (outer) dz_t``; ``a`` (B, T, d), ``dz`` -> (B, T, p)."""

    def __init__(self, z, a_fn: Callable[[], tf.Tensor], dz_fn: Callable = None):
        self.z = z
        self.a_fn = a_fn
        self.dz_fn = dz_fn or _to_btp

    def factors(self, dz):
        a = self.a_fn()
        g = self.dz_fn(dz)
        return tf.cast(a, g.dtype), g


class EmbeddingTerm:
    """Rows ``ids[i, t]`` of the table receive ``dz[i, t]``."""

    def __init__(self, z, ids):
        self.z = z
        self.ids = ids

    def factors(self, dz):
        batch = tf.shape(dz)[0]
        ids = tf.reshape(tf.cast(self.ids, tf.int32), [batch, -1])
        g = rows(dz)
        return ids, g


class DirectTerm:
    """Per-example gradient computed directly from ``dz`` by ``grad_fn`` -> (B, ...)."""

    def __init__(self, z, grad_fn: Callable):
        self.z = z
        self.grad_fn = grad_fn


def rows(t, last=None):
    """Reshapes (B, ..., d) to (B, T, d) with ``last`` = d (default: t's last axis).

    T (and d) stay static whenever t's non-batch shape is, even with an unknown batch (a
    Poisson-sampled batch): the choice between ghost and materialised norms depends on T.
    """
    tail = t.shape[1:]
    if last is None:
        last = tail[-1] if tail.rank and tail[-1] is not None else tf.shape(t)[-1]
    steps = -1
    if isinstance(last, int) and tail.is_fully_defined() and last > 0:
        steps = max(tail.num_elements() // last, 0)
    return tf.reshape(t, [tf.shape(t)[0], steps, last])


def _to_btp(dz):
    return rows(dz)


def _flat_per_example(t):
    """(B, ...) -> (B, n), with n static whenever t's non-batch shape is (a -1 would lose it
    when the batch is unknown)."""
    n = t.shape[1:].num_elements() if t.shape.rank is not None else None
    return tf.reshape(t, [tf.shape(t)[0], -1 if n is None else n])


# ---------------------------------------------------------------------------- recorder


class Recorder:
    """Collects terms per variable during a captured forward pass."""

    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.terms: dict[int, list] = {}
        self.variables: dict[int, object] = {}
        self.layers_called: list = []
        self.depth = 0  # > 0 while a registered layer's rule runs
        self.outside_reads: set[int] = set()  # variables read anywhere else

    def add(self, variable, term):
        key = id(variable)
        self.variables[key] = variable
        self.terms.setdefault(key, []).append(term)

    def check_batch(self, layer, x):
        """Asserts that ``x``'s leading axis is the batch (per-example structure intact)."""
        static = x.shape[0] if x.shape.rank else None
        if isinstance(self.batch_size, int) and static is not None:
            if static != self.batch_size:
                raise ValueError(_batch_msg(layer, static, self.batch_size))
            return
        tf.debugging.assert_equal(
            tf.shape(x)[0], tf.cast(self.batch_size, tf.int32),
            message=_batch_msg(layer, "?", "the batch size"))

    def z_tensors(self):
        seen, out = set(), []
        for terms in self.terms.values():
            for t in terms:
                if id(t.z) not in seen:
                    seen.add(id(t.z))
                    out.append(t.z)
        return out


def _batch_msg(layer, got, want):
    return (f"Layer {layer.name!r} was called on a tensor whose leading axis ({got}) is not the "
            f"batch ({want}); per-example norms by layer formulas need the batch axis first. "
            "Compile the DP optimizer with norm_strategy='vmap' for this model.")


# ---------------------------------------------------------------------------- registry

_REGISTRY: dict[type, Callable] = {}


def register(layer_cls):
    """Registers ``fn(layer, recorder, inputs, *args, **kwargs) -> outputs`` for a layer class.

    ``fn`` must reproduce ``layer.call`` and record a term for every trainable weight it
    uses, or return ``NotImplemented`` to leave the layer to the vectorized fallback.
    """

    def deco(fn):
        _REGISTRY[layer_cls] = fn
        return fn

    return deco


def registered_fn(layer):
    for cls in type(layer).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    return None


def _alias(var, dtype):
    return tf.cast(tf.identity(var), dtype) if var.dtype != dtype else tf.identity(var)


def _is_unsupported_variant(layer):
    return bool(getattr(layer, "lora_enabled", False)) or getattr(layer, "quantization_mode",
                                                                 None) is not None


@register(keras.layers.Dense)
def _dense(layer, rec, inputs, training=None):
    if _is_unsupported_variant(layer) or type(layer).call is not keras.layers.Dense.call:
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    dtype = layer.compute_dtype
    x = tf.cast(x, dtype)
    rec.check_batch(layer, x)
    z = tf.matmul(x, _alias(layer.kernel, dtype)) if x.shape.rank == 2 else tf.tensordot(
        x, _alias(layer.kernel, dtype), axes=[[x.shape.rank - 1], [0]])
    if layer.bias is not None:
        z = z + _alias(layer.bias, dtype)
    d = x.shape[-1]
    rec.add(layer.kernel, OuterTerm(z, lambda: rows(x, d)))
    if layer.bias is not None:
        rec.add(layer.bias, DirectTerm(z, lambda dz: tf.reduce_sum(_to_btp(dz), axis=1)))
    return layer.activation(z) if layer.activation is not None else z


@register(keras.layers.Embedding)
def _embedding(layer, rec, inputs):
    if _is_unsupported_variant(layer) or type(layer).call is not keras.layers.Embedding.call:
        return NotImplemented
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    rec.check_batch(layer, ids)
    z = tf.gather(_alias(layer.embeddings, layer.embeddings.dtype), ids)
    rec.add(layer.embeddings, EmbeddingTerm(z, ids))
    return tf.cast(z, layer.compute_dtype)


#: patches at most this wide come from a convolution with a one-hot kernel (oneDNN makes it
#: several times faster than tf.image.extract_patches for few input channels); wider ones
#: from extract_patches. Both give the same (kh, kw, cin) ordering.
_EYE_CONV_MAX_WIDTH = 128


def conv_patches(x, kernel_size, strides, dilation_rate, padding):
    """im2col patches (B, L, kh*kw*cin) of a channels-last 4-D input for a 2-D conv."""
    kh, kw = kernel_size
    cin = x.shape[-1]
    width = kh * kw * cin
    if width <= _EYE_CONV_MAX_WIDTH:
        eye = tf.reshape(tf.eye(width, dtype=x.dtype), (kh, kw, cin, width))
        patches = tf.nn.conv2d(x, eye, strides=[1, strides[0], strides[1], 1],
                               padding=padding.upper(), dilations=list(dilation_rate))
    else:
        patches = tf.image.extract_patches(
            x, sizes=[1, kh, kw, 1], strides=[1, strides[0], strides[1], 1],
            rates=[1, dilation_rate[0], dilation_rate[1], 1], padding=padding.upper())
    return rows(patches, width)


def _conv_patches(layer, x, padding):
    """Patches of a Keras Conv1D/Conv2D input (channels last)."""
    if layer.rank == 1:
        return conv_patches(x[:, None, :, :], (1, layer.kernel_size[0]), (1, layer.strides[0]),
                            (1, layer.dilation_rate[0]), padding)
    return conv_patches(x, layer.kernel_size, layer.strides, layer.dilation_rate, padding)


@register(keras.layers.Conv1D)
@register(keras.layers.Conv2D)
def _conv(layer, rec, inputs):
    base = keras.layers.Conv1D if isinstance(layer, keras.layers.Conv1D) else keras.layers.Conv2D
    if _is_unsupported_variant(layer) or layer.groups != 1 or type(layer).call is not base.call:
        return NotImplemented
    dtype = layer.compute_dtype
    x = tf.cast(tf.convert_to_tensor(inputs), dtype)
    rec.check_batch(layer, x)
    padding = layer.padding
    if padding == "causal":
        x = tf.pad(x, layer._compute_causal_padding())
        padding = "valid"
    z = keras.ops.conv(x, _alias(layer.kernel, dtype), strides=list(layer.strides),
                       padding=padding, dilation_rate=layer.dilation_rate,
                       data_format=layer.data_format)
    channels_last = layer.data_format == "channels_last"
    if layer.use_bias:
        shape = (1,) * (layer.rank + 1) + (layer.filters,) if channels_last else (
            (1, layer.filters) + (1,) * layer.rank)
        z = z + tf.reshape(_alias(layer.bias, dtype), shape)
    perm = [0] + list(range(2, layer.rank + 2)) + [1]

    def a_fn():
        return _conv_patches(layer, x if channels_last else tf.transpose(x, perm), padding)

    def dz_fn(dz):
        return _to_btp(dz if channels_last else tf.transpose(dz, perm))

    rec.add(layer.kernel, OuterTerm(z, a_fn, dz_fn))
    if layer.use_bias:
        rec.add(layer.bias, DirectTerm(z, lambda dz: tf.reduce_sum(dz_fn(dz), axis=1)))
    return layer.activation(z) if layer.activation is not None else z


def _norm_affine(layer, rec, x, xhat, axes):
    """Records gamma/beta terms of ``out = xhat * gamma + beta`` and returns ``out``."""
    rank = x.shape.rank
    bshape = [1] * rank
    for a in axes:
        bshape[a] = x.shape[a]
    out = xhat
    gamma = getattr(layer, "gamma", None)
    beta = getattr(layer, "beta", None)
    if gamma is not None:
        out = out * tf.reshape(_alias(gamma, xhat.dtype), bshape)
    if beta is not None:
        out = out + tf.reshape(_alias(beta, xhat.dtype), bshape)
    reduce_axes = [i for i in range(1, rank) if i not in axes]

    def per_example(t):
        t = tf.reduce_sum(t, axis=reduce_axes) if reduce_axes else t
        return t

    if gamma is not None:
        rec.add(gamma, DirectTerm(out, lambda dz: per_example(dz * xhat)))
    if beta is not None:
        rec.add(beta, DirectTerm(out, per_example))
    return out


@register(keras.layers.LayerNormalization)
def _layer_norm(layer, rec, inputs):
    if getattr(layer, "rms_scaling", False) or type(layer).call is not (
            keras.layers.LayerNormalization.call):
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    rec.check_batch(layer, x)
    rank = x.shape.rank
    axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
    axes = sorted(a % rank for a in axes)
    if 0 in axes:
        return NotImplemented
    xc = tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x
    mean, var = tf.nn.moments(xc, axes=axes, keepdims=True)
    xhat = (xc - mean) * tf.math.rsqrt(var + layer.epsilon)
    out = _norm_affine(layer, rec, xc, xhat, axes)
    return tf.cast(out, layer.compute_dtype)


@register(keras.layers.GroupNormalization)
def _group_norm(layer, rec, inputs):
    if type(layer).call is not keras.layers.GroupNormalization.call:
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    rec.check_batch(layer, x)
    rank = x.shape.rank
    axis = layer.axis % rank
    if axis == 0 or x.shape[axis] is None:
        return NotImplemented
    xc = tf.cast(x, tf.float32) if x.dtype in (tf.float16, tf.bfloat16) else x
    grouped = layer._reshape_into_groups(xc)
    red = list(range(1, grouped.shape.rank))
    red.remove(axis)  # the groups axis sits at `axis`, channels-per-group just after it
    mean, var = tf.nn.moments(grouped, axes=red, keepdims=True)
    xhat = tf.reshape((grouped - mean) * tf.math.rsqrt(var + layer.epsilon), tf.shape(xc))
    out = _norm_affine(layer, rec, xc, xhat, [axis])
    return tf.cast(out, layer.compute_dtype)


@register(keras.layers.EinsumDense)
def _einsum_dense(layer, rec, inputs, training=None):
    if _is_unsupported_variant(layer) or type(layer).call is not keras.layers.EinsumDense.call:
        return NotImplemented
    x = tf.cast(tf.convert_to_tensor(inputs), layer.compute_dtype)
    spec = _parse_einsum(layer.equation, x.shape.rank)
    if spec is None:
        return NotImplemented
    in_s, ker_s, out_s = spec
    rec.check_batch(layer, x)
    eq = f"{in_s},{ker_s}->{out_s}"
    z = tf.einsum(eq, x, _alias(layer.kernel, layer.compute_dtype))
    if layer.bias is not None:
        z = z + _alias(layer.bias, layer.compute_dtype)
    rec.add(layer.kernel, _einsum_term(z, x, in_s, ker_s, out_s))
    if layer.bias is not None:
        bias_axes = layer.bias_axes or ""
        red = [i for i, c in enumerate(out_s) if i > 0 and c not in bias_axes]
        rec.add(layer.bias, DirectTerm(z, lambda dz: tf.reduce_sum(dz, axis=red) if red else dz))
    return layer.activation(z) if layer.activation is not None else z


def _parse_einsum(equation, x_rank):
    """Returns (input, kernel, output) subscripts with '...' expanded, or None."""
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


def _einsum_term(z, x, in_s, ker_s, out_s):
    b = in_s[0]
    shared = [c for c in in_s[1:] if c in out_s and c not in ker_s]
    contract = [c for c in in_s[1:] if c in ker_s and c not in out_s]
    kout = [c for c in out_s[1:] if c in ker_s and c not in in_s]
    summed = [c for c in in_s[1:] if c not in out_s and c not in ker_s]
    matmul_form = (sorted(contract + kout) == sorted(ker_s) and not summed
                   and all(c in shared or c in kout for c in out_s[1:]))
    if not matmul_form:
        # Per-example kernel gradient directly: einsum(x, dz) keeping the batch index.
        def grad_fn(dz):
            return tf.einsum(f"{in_s},{out_s}->{b}{ker_s}", tf.cast(x, dz.dtype), dz)
        return DirectTerm(z, grad_fn)

    def a_fn():
        perm = [in_s.index(c) for c in [b] + shared + contract]
        xt = tf.transpose(x, perm)
        return rows(xt, _prod(x.shape, [in_s.index(c) for c in contract]))

    def dz_fn(dz):
        perm = [out_s.index(c) for c in [b] + shared + kout]
        gt = tf.transpose(dz, perm)
        return rows(gt, _prod(z.shape, [out_s.index(c) for c in kout]))

    return OuterTerm(z, a_fn, dz_fn)


def _prod(shape, idx):
    p = 1
    for i in idx:
        p *= shape[i]
    return p


# ---------------------------------------------------------------------------- capture

_OPAQUE_PARENTS = (keras.layers.RNN, keras.layers.Bidirectional, keras.layers.TimeDistributed,
                   keras.layers.Wrapper)


def capturable_layers(model):
    """Registered layers reachable without passing through a batch-reshaping wrapper."""
    out = []

    def visit(layer, top):
        if not top and registered_fn(layer) is not None:
            out.append(layer)
            return
        if isinstance(layer, keras.layers.Bidirectional):
            # Calls its two RNNs on the batch-first input: both can be captured.
            visit(layer.forward_layer, False)
            visit(layer.backward_layer, False)
            return
        if not top and isinstance(layer, _OPAQUE_PARENTS):
            return
        for sub in getattr(layer, "_layers", []) or []:
            visit(sub, False)

    visit(model, True)
    # A layer may be reachable twice (shared); keep one entry each.
    uniq, seen = [], set()
    for layer in out:
        if id(layer) not in seen:
            seen.add(id(layer))
            uniq.append(layer)
    return uniq


# ------------------------------------------------------------------ variable reads
#
# A weight read outside its layer's rule (a tied embedding used as the output projection,
# a custom layer reading another layer's kernel) has gradient contributions no recorded
# term describes. Reads are tracked while a capture is active (the property that every
# Keras variable read goes through is wrapped, per thread, only then); such variables are
# left to the exact fallback instead of getting a partial gradient.

_TRACK = threading.local()
_TRACK_LOCK = threading.Lock()
_TRACK_STATE = {"users": 0, "owner": None, "original": None}


def _variable_value_owner():
    return next(c for c in keras.Variable.__mro__ if "value" in c.__dict__)


def _tracked_value(self):
    recs = getattr(_TRACK, "recorders", None)
    if recs and recs[-1].depth == 0:
        recs[-1].outside_reads.add(id(self))
    return _TRACK_STATE["original"].fget(self)


@contextlib.contextmanager
def _tracking_reads(rec):
    with _TRACK_LOCK:
        if _TRACK_STATE["users"] == 0:
            owner = _variable_value_owner()
            _TRACK_STATE["owner"], _TRACK_STATE["original"] = owner, owner.__dict__["value"]
            owner.value = property(_tracked_value, doc=_TRACK_STATE["original"].__doc__)
        _TRACK_STATE["users"] += 1
    stack = getattr(_TRACK, "recorders", None)
    if stack is None:
        stack = _TRACK.recorders = []
    stack.append(rec)
    try:
        yield
    finally:
        stack.pop()
        with _TRACK_LOCK:
            _TRACK_STATE["users"] -= 1
            if _TRACK_STATE["users"] == 0:
                _TRACK_STATE["owner"].value = _TRACK_STATE["original"]


@contextlib.contextmanager
def capture(layers, batch_size):
    """Within the context, calls of ``layers`` record terms in the yielded ``Recorder``."""
    rec = Recorder(batch_size)
    patched = []
    with _tracking_reads(rec), _patched_calls(layers, rec, patched):
        yield rec


@contextlib.contextmanager
def _patched_calls(layers, rec, patched):
    try:
        for layer in layers:
            fn = registered_fn(layer)
            original = layer.__dict__.get("call")
            bound = layer.call

            def call(*args, _layer=layer, _fn=fn, _bound=bound, **kwargs):
                rec.depth += 1
                try:
                    out = _fn(_layer, rec, *args, **kwargs)
                finally:
                    rec.depth -= 1
                if out is NotImplemented:
                    return _bound(*args, **kwargs)
                rec.layers_called.append(_layer)
                return out

            layer.call = call
            patched.append((layer, original))
        yield
    finally:
        for layer, original in patched:
            if original is None:
                del layer.call
            else:
                layer.call = original


# ---------------------------------------------------------------------------- precision
#
# What bounds an example's contribution is w_i times the norm of its gradient *as the weighted
# sum forms it*. So the factors are brought to float32 (float64 for float64 models) before any
# norm or sum: float16 Gram entries overflow at 65504 and bfloat16 keeps 8 bits. Every norm
# comes with an upper bound that accounts for the rounding of its own computation and of the
# sum it describes, from the classical bound for a sum of n terms computed in any order: off
# by at most gamma_{n-1} times the sum of their absolute values, gamma_n = n u / (1 - n u)
# (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed. 2002, Sec. 3.1 and 4.2).
# The Gram form sum((A A^T) * (G G^T)) squares the conditioning of sum_t a_t g_t^T: with
# kappa = sum_t ||a_t|| ||g_t|| / ||A^T G||, float32 loses kappa^2 u32 of the squared norm (it
# even goes negative), so Gram matrices are formed in float64. The fused float32 weighted sum
# is off by up to gamma_{T+1} kappa of the norm: the rare examples for which that exceeds
# _FLOAT32_SUM_MAX_SLACK (kappa above ~50 for T = 32) have their sum formed in float64 and
# their norm from their own float64 matrix, one example at a time, so that neither bound
# lowers their clip factor by more than that.

_UNIT_ROUNDOFF = {tf.float16: 2.0**-11, tf.bfloat16: 2.0**-8, tf.float32: 2.0**-24,
                  tf.float64: 2.0**-53}

#: float32 squares are summed in blocks of at most this many (relative error at most
#: gamma_32 = 1.9e-6 of the squared norm), the block sums in float64: a rigorous bound
#: without casting the per-example gradients, often the largest tensors of the step, to
#: float64 (which took 3x as long as this on CPU).
_SQUARES_BLOCK = 32

#: float32 flushes results below its smallest normal number to zero on CPUs.
_FLUSH_FLOAT32 = 2.0**-126


def accumulation_dtype(dtype):
    """The dtype of norms' inputs and weighted sums: float64 for float64, else float32."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def computes_in_float16(model) -> bool:
    """Whether a layer of ``model`` computes in float16 (its own policy counts: a wrapper
    made by ``make_private`` outside the policy scope keeps float32 at the model level)."""
    return any(getattr(layer, "compute_dtype", None) == "float16"
               for layer in model._flatten_layers(include_self=True, recursive=True))


def unit_roundoff(dtype) -> float:
    """u = 2^-p of a float dtype with p significand bits (round to nearest)."""
    return _UNIT_ROUNDOFF[tf.as_dtype(dtype)]


def _gamma(n, dtype):
    """gamma_n = n u / (1 - n u) as float64 (n may be a tensor); inf when n u >= 1/2."""
    nu = tf.cast(n, tf.float64) * unit_roundoff(dtype)
    return tf.where(nu < 0.5, nu / (1.0 - nu), tf.constant(float("inf"), tf.float64))


def _block_size(n):
    """The largest divisor of n that is at most _SQUARES_BLOCK."""
    return next(k for k in range(min(n, _SQUARES_BLOCK), 0, -1) if n % k == 0)


def squared_norms(t):
    """Squared norms of the rows of ``t`` (B, ...) and upper bounds of their exact values.

    Returns (estimate, upper bound), both (B,) float64. float32 rows are summed in float32
    blocks (see ``_SQUARES_BLOCK``); when a square overflows float32 (entries above 1.8e19),
    rows are rescaled by their largest entry first. Rows that hold inf or NaN give inf/NaN.
    """
    flat = _flat_per_example(t)
    n = flat.shape[1]
    if flat.dtype == tf.float64 or n is None or n == 0:
        flat = tf.cast(flat, tf.float64)
        sq = tf.reduce_sum(tf.square(flat), axis=1)
        size = tf.cast(tf.shape(flat)[1], tf.float64)
        return sq, sq * (1.0 + _gamma(size + 1, tf.float64)) + size * 2.0**-1022
    flat = tf.cast(flat, tf.float32)
    k = _block_size(n)

    def block_sums(x):
        return tf.reduce_sum(tf.square(tf.reshape(x, [-1, n // k, k])), axis=-1)

    def rescaled():
        top = tf.reduce_max(tf.abs(flat), axis=1)
        top = tf.where((top > 0) & tf.math.is_finite(top), top, tf.ones_like(top))
        q = tf.cast(block_sums(flat / top[:, None]), tf.float64)
        # A division, a square and k-1 additions in float32 per block sum; flushed squares
        # lose less than 2^-126 of top^2 each.
        rel = _gamma(k + 1, tf.float32) + n * _FLUSH_FLOAT32
        return q * tf.square(tf.cast(top, tf.float64))[:, None], rel

    q = block_sums(flat)
    # A square and k-1 additions in float32 per block sum.
    q, rel = tf.cond(tf.reduce_all(tf.math.is_finite(q)),
                     lambda: (tf.cast(q, tf.float64), _gamma(k, tf.float32)), rescaled)
    sq = tf.reduce_sum(q, axis=1)
    # n/k block sums in float64; each flushed square loses less than 2^-126.
    rel = rel + _gamma(n // k + 1, tf.float64)
    return sq, sq * (1.0 + rel) + n * _FLUSH_FLOAT32


def _gram_norms(a, g):
    """``||sum_t a_t g_t^T||^2`` from float64 Gram matrices, with a bound, per example.

    Returns (estimate clamped to [0, l1^2], upper bound, l1), all (B,) float64, where
    ``l1 = sum_t ||a_t|| ||g_t||`` bounds both the norm and the size of every rounding error.
    """
    a64, g64 = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    aa = tf.einsum("btd,bsd->bts", a64, a64)
    gg = tf.einsum("btp,bsp->bts", g64, g64)
    s = tf.reduce_sum(aa * gg, axis=[1, 2])
    l1 = tf.reduce_sum(tf.sqrt(tf.reduce_sum(tf.square(a64), -1))
                       * tf.sqrt(tf.reduce_sum(tf.square(g64), -1)), axis=1)
    l1_sq = tf.square(l1)
    steps = tf.shape(a)[1]
    # Each Gram entry is off by gamma_d (gamma_p) times ||a_t|| ||a_s|| (||g_t|| ||g_s||), the
    # T^2 products are summed: the error is at most gamma_{d+p+T^2+2} sum_ts ||a_t|| ||a_s||
    # ||g_t|| ||g_s|| = gamma l1^2; l1 itself is computed with a relative error below gamma.
    rel = _gamma(tf.shape(a)[2] + tf.shape(g)[2] + steps * steps + steps + 8, tf.float64)
    sq = tf.clip_by_value(s, tf.zeros_like(s), l1_sq)
    upper = tf.minimum(tf.maximum(s, 0.0) + 2.0 * rel * l1_sq, (1.0 + 3.0 * rel) * l1_sq)
    return sq, upper, l1


def _exact_outer_norms(a, g, l1):
    """Squared norms of ``sum_t a_t g_t^T`` from the float64 matrices, one example at a time
    (d x p memory, not B of them), and upper bounds of the exact norms, (n,) float64.

    The matrix is off by at most gamma_T l1 (float64), its sum of squares by gamma_{dp}.
    """
    def one(args):
        a_i, g_i = args
        per = tf.matmul(tf.cast(a_i, tf.float64), tf.cast(g_i, tf.float64), transpose_a=True)
        return tf.reduce_sum(tf.square(per))

    sq = tf.map_fn(one, (a, g), fn_output_signature=tf.float64, parallel_iterations=1)
    size = tf.shape(a)[2] * tf.shape(g)[2]
    bound = (tf.sqrt(sq) * (1.0 + _gamma(size + 2, tf.float64))
             + _gamma(tf.shape(a)[1], tf.float64) * l1)
    return sq, bound


#: An example whose float32 weighted sum could be off by more than this fraction of its norm
#: (an ill-conditioned gradient: terms far larger than their sum) has its sums formed in
#: float64 instead; in float32 its factor would have to be lowered by that much to stay sound.
_FLOAT32_SUM_MAX_SLACK = 1e-4


def _ill_conditioned(norm_bound, slack):
    """(B,) bool: the float32 ``slack`` is above ``_FLOAT32_SUM_MAX_SLACK`` of the norm."""
    return slack > _FLOAT32_SUM_MAX_SLACK * norm_bound


def _row_sums(ids, g):
    """``R_t = sum_s [id_s = id_t] g_s``: the row of the per-example gradient token t feeds,
    and how many tokens feed it."""
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
    return tf.einsum("bts,bsd->btd", same, g), tf.reduce_sum(same, axis=2), same


def _width(t):
    """t's last axis for a reshape, static when known (squared_norms needs a static width)."""
    return t.shape[-1] if t.shape[-1] is not None else -1


def _rows_norm(row_sums, count):
    """(estimate, upper bound) of ``sqrt(sum_t ||R_t||^2 / count_t)``, each row counted once."""
    batch, steps = tf.shape(row_sums)[0], tf.shape(row_sums)[1]
    r_sq, r_upper = squared_norms(tf.reshape(row_sums, [batch * steps, _width(row_sums)]))
    count = tf.cast(count, tf.float64)
    return (tf.reduce_sum(tf.reshape(r_sq, [batch, steps]) / count, axis=1),
            tf.sqrt(tf.reduce_sum(tf.reshape(r_upper, [batch, steps]) / count, axis=1)))


def _embedding_norms(ids, g):
    """Norms of the per-example embedding gradients (rows ``ids[i, t]`` receive ``g[i, t]``).

    Every token's row sum ``R_t`` is formed (B*T^2*D, like the Gram form), and
    ``||grad||^2 = sum_t ||R_t||^2 / count_t``: a sum of squares, which cannot cancel.

    Returns (squared norm, upper bound of the norm of what ``weighted_sum`` adds per unit
    weight, (B,) bool of the examples whose sums are formed in float64 (None for float64 g)).
    """
    row_sums, count, same = _row_sums(ids, g)
    sq, upper = _rows_norm(row_sums, count)
    batch, steps = tf.shape(g)[0], tf.shape(g)[1]
    # R_t (here) and the segment sum of w_i g_s (in weighted_sum) each add up the g_s of one
    # row: each is off by at most gamma_{T+1} sum_{s in row} ||g_s||, whose norm over rows is
    # `spread` (itself summed in g's dtype, hence the extra gamma).
    _, g_sq = squared_norms(tf.reshape(g, [batch * steps, _width(g)]))
    g_norms = tf.cast(tf.reshape(tf.sqrt(g_sq), [batch, steps]), g.dtype)
    near = tf.cast(tf.einsum("bts,bs->bt", same, g_norms), tf.float64)
    spread = tf.sqrt(tf.reduce_sum(tf.square(near) / tf.cast(count, tf.float64), axis=1))
    slack = 2.0 * _gamma(steps + 1, g.dtype) * spread * (1.0 + _gamma(steps + 4, g.dtype))
    if g.dtype == tf.float64:
        return sq, upper + slack, None
    wide = _ill_conditioned(upper, slack)
    # Ill-conditioned examples: row sums again in float64, for them only.
    idx = tf.where(wide)
    sums64, count64, _ = _row_sums(tf.gather_nd(ids, idx),
                                   tf.cast(tf.gather_nd(g, idx), tf.float64))
    sq64, upper64 = _rows_norm(sums64, count64)
    sq = tf.tensor_scatter_nd_update(sq, idx, sq64)
    upper = tf.tensor_scatter_nd_update(upper, idx, upper64)
    # ... in float64 then, and rounded once to float32.
    slack = tf.where(wide, 2.0 * _gamma(steps + 1, tf.float64) * spread, slack)
    return sq, upper + slack, wide


def _materialised_norms(per):
    """(squared norm, norm bound) of materialised per-example gradients ``per`` (B, ...).

    The weighted sum adds ``w_i * per_i`` itself: the bound is that of the norm's own
    rounding (the products ``w_i per_i`` are the final products, see ``clip_factors``).
    """
    sq, upper = squared_norms(per)
    return sq, tf.sqrt(upper)


def combined_norms(norm_objs, per_example_grads, like):
    """Per-example norms and their bounds over several variables.

    ``norm_objs``: ``_VarNorm``s computed with exact norms; ``per_example_grads``: (B, ...)
    materialised per-example gradients of other variables (the vectorized fallback); ``like``:
    a (B,) tensor (zeros come out when there is no variable).
    Returns (norms, bounds), (B,) float64: ``bounds[i]`` bounds the norm of everything the
    weighted sums add for example i per unit weight (``sqrt(sum_v bound_v^2)``, the norm of a
    concatenation of parts each bounded by ``bound_v``).
    """
    sq, bound_sq = None, None
    parts = [(o.sq, o.bound) for o in norm_objs]
    parts += [_materialised_norms(g) for g in per_example_grads]
    for s, b in parts:
        sq = s if sq is None else sq + s
        bound_sq = tf.square(b) if bound_sq is None else bound_sq + tf.square(b)
    if sq is None:
        zeros = tf.zeros_like(tf.cast(like, tf.float64))
        return zeros, zeros
    # sqrt(sum of V squares) in float64: relative error far below float32's.
    return tf.sqrt(sq), tf.sqrt(bound_sq) * (1.0 + _gamma(len(parts) + 4, tf.float64))


def _drop(x, w):
    """``x`` with the examples of weight 0 zeroed, even where ``x`` is inf or NaN."""
    keep = tf.reshape(w > 0, [-1] + [1] * (x.shape.rank - 1))
    return tf.where(keep, x, tf.zeros_like(x))


def weighted_per_example_sum(w, per, drop_non_finite=False):
    """``sum_i w_i per_i`` of materialised per-example gradients ``per`` (B, ...).

    Formed in float32 (float64 for float64 ``per``). ``drop_non_finite``: examples of weight
    0 add nothing even if their gradient is inf or NaN (0 * inf would be NaN).
    """
    acc = accumulation_dtype(per.dtype)
    per = tf.cast(per, acc)
    if drop_non_finite:
        per = _drop(per, w)
    return tf.tensordot(tf.cast(w, acc), per, axes=1)


# ---------------------------------------------------------------------------- norms & sums


def _use_ghost(a, g):
    """Ghost (B*T^2) vs materialised (B*d*p) by static shapes; ghost when T is unknown."""
    t, d, p = a.shape[1], a.shape[-1], g.shape[-1]
    if t is None or d is None or p is None:
        return True
    return t * t <= d * p


#: per-example gradients of at most this many entries per example may be materialised for
#: JL projections even when the projected factors would take less memory.
_MATERIALISE_MAX_ENTRIES = 1 << 16


def _materialise_for_projection(a, g, num_projections):
    """JL projections of an outer-product term: materialise the per-example gradient
    (B, d, p) only when that takes fewer flops (B*T*d*p + r*B*d*p against r*B*T*d*p for
    projecting the factors, i.e. (r - 1)(T - 1) > 1) and its memory is small, or no larger
    than one projected factor (B, T, min(d, p)) per direction."""
    t, d, p = a.shape[1], a.shape[-1], g.shape[-1]
    if t is None or d is None or p is None:
        return False
    r = num_projections
    if (r - 1) * (t - 1) <= 1:
        return False
    return d * p <= max(_MATERIALISE_MAX_ENTRIES, r * t * min(d, p))


class _VarNorm:
    """How one variable's per-example squared norms, JL projections and weighted sum are
    computed from its recorded factors.

    Factors are in float32 (float64 for float64 models). With ``exact_norms`` it holds
    ``sq`` (B,) float64, the squared norms, and ``bound`` (B,) float64, an upper bound of the
    norm of what ``weighted_sum`` adds for example i per unit of ``w_i`` (rounding included).
    With ``exact_norms=False`` (the JL strategy) they are never formed: only ``project`` and
    ``weighted_sum`` are used. ``drop_non_finite``: ``weighted_sum`` ignores the factors of
    examples of weight 0, even inf or NaN ones (float16 backward passes can overflow).
    """

    def __init__(self, variable, terms, dz_of, exact_norms=True, num_projections=1,
                 drop_non_finite=False):
        self.variable = variable
        self.drop_non_finite = drop_non_finite
        kinds = {type(t) for t in terms}
        self.kind = None
        self.per = None
        self.sq = None
        self.bound = None
        self.wide = None  # (B,) bool: examples whose weighted sum is formed in float64
        if kinds == {OuterTerm}:
            fac = [t.factors(dz_of(t)) for t in terms]
            self.a = tf.concat([f[0] for f in fac], axis=1) if len(fac) > 1 else fac[0][0]
            self.g = tf.concat([f[1] for f in fac], axis=1) if len(fac) > 1 else fac[0][1]
            if exact_norms and _use_ghost(self.a, self.g):
                self.sq, upper, l1 = _gram_norms(self.a, self.g)
                # The weighted sum contracts over t in one product: its rounding for example
                # i is at most gamma_{T+1} w_i l1_i (products w_i a_t and (w_i a_t) g_t, T-1
                # additions), of which 2u w_i ||g_i|| is the final products' share.
                norm, steps = tf.sqrt(upper), tf.shape(self.a)[1] + 1
                u = unit_roundoff(self.a.dtype)
                slack = tf.maximum(_gamma(steps, self.a.dtype) * l1 - 2.0 * u * norm, 0.0)
                if self.a.dtype != tf.float64:
                    self.wide = _ill_conditioned(norm, slack)
                    # ... in float64 then (rounded once to float32: the products' share), and
                    # their norms exactly, without the Gram form's kappa^2.
                    wide = tf.where(self.wide)
                    sq_w, norm_w = _exact_outer_norms(tf.gather_nd(self.a, wide),
                                                      tf.gather_nd(self.g, wide),
                                                      tf.gather_nd(l1, wide))
                    self.sq = tf.tensor_scatter_nd_update(self.sq, wide, sq_w)
                    norm = tf.tensor_scatter_nd_update(norm, wide, norm_w)
                    slack = tf.where(self.wide, _gamma(steps, tf.float64) * l1, slack)
                self.bound = norm + slack
            elif exact_norms or _materialise_for_projection(self.a, self.g, num_projections):
                self.per = tf.einsum("btd,btp->bdp", self.a, self.g)
                if exact_norms:
                    self.sq, self.bound = _materialised_norms(self.per)
            self.kind = "outer"
        elif kinds == {EmbeddingTerm}:
            fac = [t.factors(dz_of(t)) for t in terms]
            self.ids = tf.concat([f[0] for f in fac], axis=1)
            self.g = tf.concat([f[1] for f in fac], axis=1)
            if exact_norms:
                self.sq, self.bound, self.wide = _embedding_norms(self.ids, self.g)
            self.kind = "embedding"
        else:
            per = None
            for t in terms:
                if isinstance(t, DirectTerm):
                    p = t.grad_fn(dz_of(t))
                elif isinstance(t, OuterTerm):
                    a, g = t.factors(dz_of(t))
                    p = tf.einsum("btd,btp->bdp", a, g)
                else:
                    raise NotImplementedError(
                        f"Variable {variable.path} is used by an Embedding and another layer.")
                p = _flat_per_example(p)
                per = p if per is None else per + p
            self.per = per
            if exact_norms:
                self.sq, self.bound = _materialised_norms(per)
            self.kind = "direct"

    def project(self, directions):
        """``P[j, i] = <g_i, v_j>`` for directions (r, *variable.shape) -> (r, B)."""
        r = directions.shape[0]
        if self.per is not None:
            v = tf.reshape(tf.cast(directions, self.per.dtype), [r, -1])
            return tf.matmul(v, tf.reshape(self.per, [tf.shape(self.per)[0], -1]),
                             transpose_b=True)
        # One direction at a time: the peak is one projected factor, not r of them.
        if self.kind == "outer":
            d, p = self.a.shape[-1], self.g.shape[-1]
            v = tf.reshape(tf.cast(directions, self.a.dtype), [r, d, p])
            if p <= d:
                return tf.stack([tf.einsum("btp,btp->b", tf.einsum("btd,dp->btp", self.a, v[j]),
                                           self.g) for j in range(r)])
            return tf.stack([tf.einsum("btd,btd->b", tf.einsum("btp,dp->btd", self.g, v[j]),
                                       self.a) for j in range(r)])
        if self.kind == "embedding":
            v = tf.cast(directions, self.g.dtype)
            return tf.stack([tf.einsum("btd,btd->b", tf.gather(v[j], self.ids), self.g)
                             for j in range(r)])
        raise AssertionError(self.kind)

    def weighted_sum(self, w):
        """``sum_i w_i g_i`` in the variable's shape, in the factors' (float32) dtype.

        ``w`` is cast to that dtype, never to a lower-precision compute dtype: a factor
        rounded up would let a clipped example exceed the clipping norm.
        """
        shape = self.variable.shape
        if self.per is not None:
            flat = weighted_per_example_sum(
                w, tf.reshape(self.per, [tf.shape(self.per)[0], -1]), self.drop_non_finite)
            return tf.reshape(flat, shape)
        g = _drop(self.g, w) if self.drop_non_finite else self.g
        wf = tf.cast(w, g.dtype)
        if self.wide is not None:
            # Ill-conditioned examples are summed in float64 below, the others here.
            wide = tf.where(self.wide)
            w64 = tf.cast(tf.gather_nd(w, wide), tf.float64)[:, None, None]
            wf = tf.where(self.wide, tf.zeros_like(wf), wf)
        if self.kind == "outer":
            a = _drop(self.a, w) if self.drop_non_finite else self.a
            out = tf.einsum("btd,btp->dp", a * wf[:, None, None], g)
            if self.wide is not None:
                out += tf.cast(tf.einsum("btd,btp->dp",
                                         tf.cast(tf.gather_nd(a, wide), tf.float64) * w64,
                                         tf.cast(tf.gather_nd(g, wide), tf.float64)), out.dtype)
            return tf.reshape(out, shape)
        if self.kind == "embedding":
            rows_out, width = shape[0], shape[-1]
            out = tf.math.unsorted_segment_sum(tf.reshape(g * wf[:, None, None], [-1, width]),
                                               tf.reshape(self.ids, [-1]), rows_out)
            if self.wide is not None:
                ids, pos = tf.unique(tf.reshape(tf.gather_nd(self.ids, wide), [-1]))
                part = tf.math.unsorted_segment_sum(
                    tf.reshape(tf.cast(tf.gather_nd(g, wide), tf.float64) * w64, [-1, width]),
                    pos, tf.shape(ids)[0])
                out = tf.tensor_scatter_nd_add(out, ids[:, None], tf.cast(part, out.dtype))
            return out
        raise AssertionError(self.kind)


def ghost_norms(rec: Recorder, tape: tf.GradientTape, total_loss, exact_norms=True,
                num_projections=1, drop_non_finite=False):
    """Per-variable norm objects for every recorded variable whose output gradient exists.

    ``exact_norms=False`` skips the exact norms (JL projections are taken instead). Output
    gradients reach the rules in float32 (float64 for float64 models) whatever the compute
    dtype. ``drop_non_finite``: see ``_VarNorm``.

    Returns (dict var_id -> _VarNorm, list of variables left uncovered because their
    recorded outputs got no gradient, e.g. used inside a loop the tape cannot see into).
    """
    zs = rec.z_tensors()
    if not zs:
        return {}, []
    dzs = tape.gradient(total_loss, zs, unconnected_gradients=tf.UnconnectedGradients.NONE)
    dz_map = {id(z): dz for z, dz in zip(zs, dzs)}
    out, uncovered = {}, []

    def dz_of(t):
        dz = tf.convert_to_tensor(dz_map[id(t.z)])
        return tf.cast(dz, accumulation_dtype(dz.dtype))

    for key, terms in rec.terms.items():
        var = rec.variables[key]
        if key in rec.outside_reads:
            # Also used outside its layer's rule (tied weights): no term covers that use.
            uncovered.append(var)
            continue
        if any(dz_map[id(t.z)] is None for t in terms):
            # No gradient through a recorded output: either unused, or used where the tape
            # cannot see (a loop body). Leave it to the exact vectorized fallback.
            uncovered.append(var)
            continue
        out[key] = _VarNorm(var, terms, dz_of, exact_norms, num_projections, drop_non_finite)
    return out, uncovered
