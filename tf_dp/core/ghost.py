"""Exact per-example gradient norms from layer inputs and output gradients ("ghost norms").

During one captured forward pass every registered layer records, for each of its weights,
a *term* describing that weight's per-example gradient in factored form:

* ``OuterTerm``: the per-example gradient is ``sum_t a[i, t] (outer) dz[i, t]`` (Dense,
  Conv via im2col patches, EinsumDense in matmul form). Its squared norm is either
  ``sum((A A^T) * (G G^T))`` (ghost, cost B*T^2) or ``||A^T G||^2`` (materialised, cost
  B*d*p), whichever is cheaper (Goodfellow 2015; Li et al. 2022, "Large language models can
  be strong differentially private learners", Sec. 4).
* ``EmbeddingTerm``: rows ``ids[i, t]`` receive ``dz[i, t]``; norm by token-id equality.
* ``DirectTerm``: the per-example gradient is a small tensor computed directly (biases,
  normalisation scales).

One backward pass gives ``dz`` for every recorded output; the clipped sum
``sum_i w_i g_i`` is then formed from the same factors ("book-keeping", Bu et al. 2022,
"Differentially Private Optimization on Large Model at Small Cost"), so the norm and the
summed gradient always come from the very same tensors, which is what makes each
example's contribution provably bounded by the clipping norm.
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
    return tf.reshape(t, [tf.shape(t)[0], -1])


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


# ---------------------------------------------------------------------------- norms & sums


def _use_ghost(a, g):
    """Ghost (B*T^2) vs materialised (B*d*p) by static shapes; ghost when T is unknown."""
    t, d, p = a.shape[1], a.shape[-1], g.shape[-1]
    if t is None or d is None or p is None:
        return True
    return t * t <= d * p


def _outer_sq_norms(a, g):
    if _use_ghost(a, g):
        aa = tf.einsum("btd,bsd->bts", a, a)
        gg = tf.einsum("btp,bsp->bts", g, g)
        return tf.reduce_sum(aa * gg, axis=[1, 2]), None
    per = tf.einsum("btd,btp->bdp", a, g)
    return tf.reduce_sum(tf.square(per), axis=[1, 2]), per


def _embedding_sq_norms(ids, g):
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
    gg = tf.einsum("btd,bsd->bts", g, g)
    return tf.reduce_sum(same * gg, axis=[1, 2])


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

    With ``exact_norms=False`` (the JL strategy) the exact norms are never formed: only
    ``project`` and ``weighted_sum`` are used.
    """

    def __init__(self, variable, terms, dz_of, exact_norms=True, num_projections=1):
        self.variable = variable
        kinds = {type(t) for t in terms}
        self.kind = None
        self.per = None
        self.sq = None
        if kinds == {OuterTerm}:
            fac = [t.factors(dz_of(t)) for t in terms]
            self.a = tf.concat([f[0] for f in fac], axis=1) if len(fac) > 1 else fac[0][0]
            self.g = tf.concat([f[1] for f in fac], axis=1) if len(fac) > 1 else fac[0][1]
            if exact_norms:
                self.sq, self.per = _outer_sq_norms(self.a, self.g)
            elif _materialise_for_projection(self.a, self.g, num_projections):
                self.per = tf.einsum("btd,btp->bdp", self.a, self.g)
            self.kind = "outer"
        elif kinds == {EmbeddingTerm}:
            fac = [t.factors(dz_of(t)) for t in terms]
            self.ids = tf.concat([f[0] for f in fac], axis=1)
            self.g = tf.concat([f[1] for f in fac], axis=1)
            if exact_norms:
                self.sq = _embedding_sq_norms(self.ids, self.g)
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
                self.sq = tf.reduce_sum(tf.square(per), axis=1)
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
        """``sum_i w_i g_i`` in the variable's shape."""
        shape = self.variable.shape
        if self.per is not None:
            wp = tf.cast(w, self.per.dtype)
            flat = tf.tensordot(wp, tf.reshape(self.per, [tf.shape(self.per)[0], -1]), axes=1)
            return tf.reshape(flat, shape)
        if self.kind == "outer":
            aw = self.a * tf.cast(w, self.a.dtype)[:, None, None]
            return tf.reshape(tf.einsum("btd,btp->dp", aw, self.g), shape)
        if self.kind == "embedding":
            gw = self.g * tf.cast(w, self.g.dtype)[:, None, None]
            return tf.math.unsorted_segment_sum(
                tf.reshape(gw, [-1, shape[-1]]), tf.reshape(self.ids, [-1]), shape[0])
        raise AssertionError(self.kind)


def ghost_norms(rec: Recorder, tape: tf.GradientTape, total_loss, exact_norms=True,
                num_projections=1):
    """Per-variable norm objects for every recorded variable whose output gradient exists.

    ``exact_norms=False`` skips the exact norms (JL projections are taken instead).

    Returns (dict var_id -> _VarNorm, list of variables left uncovered because their
    recorded outputs got no gradient, e.g. used inside a loop the tape cannot see into).
    """
    zs = rec.z_tensors()
    if not zs:
        return {}, []
    dzs = tape.gradient(total_loss, zs, unconnected_gradients=tf.UnconnectedGradients.NONE)
    dz_map = {id(z): dz for z, dz in zip(zs, dzs)}
    out, uncovered = {}, []
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
        out[key] = _VarNorm(var, terms, lambda t: tf.convert_to_tensor(dz_map[id(t.z)]),
                            exact_norms, num_projections)
    return out, uncovered
