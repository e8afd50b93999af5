"""Convolutions: the kernel's per-example gradient is ``sum_l patch_l (outer) dz_l`` over
output positions l, with im2col patches of the input (Goodfellow 2015; Rochette et al. 2019,
"Efficient per-example gradient computations in convolutional neural networks").

* Conv1D / Conv2D / Conv3D: one outer-product term on the patches (a general n-D im2col by
  strided slices for Conv3D; the one-hot-kernel fast path of ``terms.conv_patches`` for 1-D
  and 2-D). A Conv1D/Conv2D kernel whose per-example gradient the factors would
  materialise anyway (few input channels: T^2 > d*p) gets it directly instead, formed a
  chunk of examples at a time, so the whole batch's patches never exist
  (``_direct_kernel_gradient``; docs/scaling.md section 3 (b)): one grouped filter
  gradient per chunk (the examples as the groups) where a probe finds that kernel exact
  (oneDNN), the chunk's patches and a batched product otherwise.
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
import logging

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _internals
from tf_dp.core.ghost.factors import _use_ghost
from tf_dp.core.ghost.registry import register_ghost_rule
from tf_dp.core.ghost.rules._common import activation, covers
from tf_dp.core.ghost.terms import _EYE_CONV_MAX_WIDTH, conv_patches, padded_rows, rows

_LOG = logging.getLogger("tf_dp")

# ----------------------------------------------------------------------------- patches


def nd_patches(x, kernel_size, strides, dilation_rate, padding, out_spatial=None):
    """im2col patches (B, *out_spatial, prod(kernel_size), C) of a channels-last input with
    any number of spatial axes, by one strided slice per kernel offset (exact: no
    arithmetic). The kernel axis is row-major over ``kernel_size``, as in a Keras kernel.

    ``padding``: "valid" or "same" (TensorFlow's split: the extra pad goes after).
    ``out_spatial``: the number of output positions per axis (default: what a convolution
    of ``x`` gives); a transposed convolution passes its input's spatial shape. Spatial
    sizes unknown while tracing (images or sequences of varying size) are read from the
    tensors: the same slices, with bounds computed in the graph.
    """
    spatial = x.shape[1:-1]
    static = spatial.is_fully_defined() and (
        out_spatial is None or all(isinstance(o, int) for o in out_spatial))
    dims = tf.shape(x) if not static else None
    pads, outs = [[0, 0]], []
    for i, (n, k, s, d) in enumerate(zip(spatial, kernel_size, strides, dilation_rate)):
        if n is None:
            n = dims[i + 1]
        span = (k - 1) * d + 1
        if out_spatial is not None:
            o = out_spatial[i]
        elif padding == "same":
            o = -(-n // s)
        else:
            o = (n - span) // s + 1
        before = _at_least_0((o - 1) * s + span - n) // 2 if padding == "same" else 0
        after = _at_least_0((o - 1) * s + span - n - before)
        pads.append([before, after])
        outs.append(o)
    pads.append([0, 0])
    if not static:
        xp = tf.pad(x, pads)
    else:
        xp = tf.pad(x, pads) if any(p != [0, 0] for p in pads) else x
    slices = []
    for offsets in itertools.product(*[range(k) for k in kernel_size]):
        index = [slice(None)]
        for off, o, s, d in zip(offsets, outs, strides, dilation_rate):
            index.append(slice(off * d, off * d + (o - 1) * s + 1, s))
        slices.append(xp[tuple(index) + (slice(None),)])
    return tf.stack(slices, axis=-2)


def _at_least_0(v):
    return max(v, 0) if isinstance(v, int) else tf.maximum(v, 0)


def _spatial_sizes(t):
    """The spatial sizes of a channels-last ``t``: ints where static, scalars otherwise."""
    dims = None if t.shape[1:-1].is_fully_defined() else tf.shape(t)
    return tuple(n if n is not None else dims[i + 1] for i, n in enumerate(t.shape[1:-1]))


def _flat_patches(x, kernel_size, strides, dilation_rate, padding, out_spatial=None):
    """``nd_patches`` as (B, L, prod(kernel_size) * C)."""
    p = nd_patches(x, kernel_size, strides, dilation_rate, padding, out_spatial)
    return rows(p, p.shape[-2] * p.shape[-1])


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

    if _direct_kernel_gradient(layer, x, z):
        ctx.direct(layer.kernel, z, _chunked_kernel_gradient(
            layer, x if channels_last else tf.transpose(x, perm), padding, dz_fn,
            out_spatial=z.shape[1:-1] if channels_last else z.shape[2:]))
    else:
        ctx.outer(layer.kernel, z, a_fn, dz_fn)
    if layer.use_bias:
        ctx.direct(layer.bias, z, lambda dz: tf.reduce_sum(dz_fn(dz), axis=1))
    return activation(layer, z)


# ------------------------------------- per-example kernel gradients without full patches

#: the patches of one chunk of examples take at most about this many bytes
_CHUNK_BYTES = 4 << 20


def _direct_kernel_gradient(layer, x, z) -> bool:
    """Whether a Conv1D/Conv2D kernel's per-example gradient is formed outright, a chunk of
    examples at a time (patches and product per chunk), instead of recorded as an
    outer-product term on the im2col patches (B, T, d): T output positions,
    d = prod(kernel_size) * in_channels, p = filters.

    Chosen when the factors would materialise it anyway for exact norms
    (``factors._use_ghost``: always when T^2 > d*p) and it is not much larger than the
    factors: p <= T when T^2 > d*p (a tutorial CNN's first convolution, 28x28x1 input,
    8x8 kernel, 16 filters: T = 196, d = 64, p = 16), else d*p <= 2T(d + p) (its second,
    T = 25, d = 256, p = 32). Then the patches, kh*kw times the layer's input, exist for one
    chunk of examples at a time only, and the per-example gradients (B, d, p) take their
    place; chunks that fit in cache also make the products faster (docs/step_time.md). JL
    projections then project the per-example gradients: B*T*d*p + r*B*d*p multiply-adds
    against r*B*T*d*p for projecting the factors, at most twice their memory for r = 1.
    """
    if layer.rank not in (1, 2) or not z.shape[1:].is_fully_defined():
        return False
    if not x.shape[1:].is_fully_defined():
        return False
    p = layer.filters
    steps = z.shape[1:].num_elements() // p
    width = int(np.prod(layer.kernel_size)) * layer.kernel.shape[-2]
    if steps * steps > width * p:
        return p <= steps
    if _use_ghost(tf.TensorSpec([None, steps, width]), tf.TensorSpec([None, steps, p])):
        return False
    return width * p <= 2 * steps * (width + p)


def _s2d_patches(x, kernel_size, strides, padding):
    """Patches of a strided convolution of a channels-last 4-D ``x`` as those of a stride-1
    one (space-to-depth: ``x[s*i + r]`` becomes channel r of row i), which oneDNN forms
    faster. Needs dilation 1 and every kernel size a multiple of its stride.

    Returns (patches (B, T, d), columns (d,)): ``columns[j]`` is the patch column of entry j
    of the kernel's (kh, kw, cin) row-major order (a permutation: same entries, another
    order).
    """
    cin = x.shape[-1]
    pads, sizes, blocks = [[0, 0]], [], []
    for n, k, s in zip(x.shape[1:3], kernel_size, strides):
        if padding == "same":
            o = -(-n // s)
            before = max((o - 1) * s + k - n, 0) // 2
        else:
            o, before = (n - k) // s + 1, 0
        size = (o - 1) * s + k  # the rows the convolution reads, a multiple of s
        pads.append([before, max(size - n - before, 0)])
        sizes.append(size)
        blocks.append(k // s)
    pads.append([0, 0])
    xp = tf.pad(x, pads) if any(p != [0, 0] for p in pads) else x
    xp = xp[:, :sizes[0], :sizes[1], :]
    (sh, sw), (qh, qw) = strides, blocks
    y = tf.reshape(xp, [-1, sizes[0] // sh, sh, sizes[1] // sw, sw, cin])
    y = tf.reshape(tf.transpose(y, [0, 1, 3, 2, 4, 5]),
                   [-1, sizes[0] // sh, sizes[1] // sw, sh * sw * cin])
    patches = conv_patches(y, (qh, qw), (1, 1), (1, 1), "valid")
    columns = [((ki // sh * qw + kj // sw) * sh * sw + ki % sh * sw + kj % sw) * cin + c
               for ki in range(kernel_size[0]) for kj in range(kernel_size[1])
               for c in range(cin)]
    return patches, columns


def _chunked_kernel_gradient(layer, x, padding, dz_fn, out_spatial=None):
    """``dz -> `` the per-example kernel gradients (B, *kernel.shape) of a Conv1D/Conv2D on
    the channels-last input ``x``, formed a chunk of examples at a time, so that only one
    chunk's intermediates exist at once, into one buffer (``_in_chunks``).

    Two ways to form a chunk's gradients, the same numbers up to float rounding:

    * grouped (``_grouped_gradient``): ONE filter gradient of a grouped convolution whose
      groups are the chunk's examples. Used when the layer is undilated, its output spatial
      shape ``out_spatial`` is given, the step is not compiled by XLA (which takes no
      dynamic number of groups) and ``_grouped_gradient_works`` for the dtype (oneDNN's
      float32 and bfloat16 kernels on CPU; Eigen's CPU kernel refuses groups). Measured on
      an AVX-512 CPU (docs/step_time.md, session 11): 1.0-3x faster than the patches for
      every shape tried, chunks of ``_GROUPED_CHUNK_BYTES``.
    * patches (im2col) and one batched product per chunk, otherwise.
    """
    kernel_shape = tuple(layer.kernel.shape)
    if layer.rank == 1:
        kernel_size, strides = (1, layer.kernel_size[0]), (1, layer.strides[0])
        dilation = (1, layer.dilation_rate[0])
        if out_spatial is not None:
            out_spatial = (1,) + tuple(out_spatial)
    else:
        kernel_size, strides = tuple(layer.kernel_size), tuple(layer.strides)
        dilation = tuple(layer.dilation_rate)
    # Space-to-depth only where the patches then come from the one-hot convolution (few
    # channels; measured 2x faster for the tutorial CNN's first layer), not where both come
    # from extract_patches (its second layer: slower, by the columns' gather).
    s2d = (max(strides) > 1 and max(dilation) == 1
           and all(k % s == 0 for k, s in zip(kernel_size, strides))
           and int(np.prod(kernel_size)) * x.shape[-1] <= _EYE_CONV_MAX_WIDTH)
    width = int(np.prod(kernel_shape[:-1]))

    def patches_chunk(xc, gc):
        if layer.rank == 1:
            xc = xc[:, None, :, :]
        if s2d:
            a, columns = _s2d_patches(xc, kernel_size, strides, padding)
        else:
            a, columns = conv_patches(xc, kernel_size, strides, dilation, padding), None
        per = tf.einsum("btd,btp->bdp", a, gc)
        return per if columns is None else tf.gather(per, columns, axis=1)

    def grouped_chunk(xc, gc):
        if layer.rank == 1:
            xc = xc[:, None, :, :]
        return _grouped_gradient(xc, gc, kernel_size, strides, padding, out_spatial)

    def grad_fn(dz):
        g = dz_fn(dz)
        xg = tf.cast(x, g.dtype)
        steps = g.shape[1]
        # (XLA: no grouped convolution with the chunk's dynamic size as its groups)
        grouped = (out_spatial is not None and max(dilation) == 1
                   and not _internals.compiling_with_xla()
                   and _grouped_gradient_works(g.dtype))
        if grouped:
            chunk = _grouped_chunk(x[0].shape.num_elements(), steps, width, layer.filters,
                                   g.dtype.size)
        else:
            chunk = max(1, _CHUNK_BYTES // (steps * width * g.dtype.size))
        per = _in_chunks(grouped_chunk if grouped else patches_chunk, xg, g, chunk, width,
                         layer.filters)
        return tf.reshape(per, (-1,) + kernel_shape)

    return grad_fn


#: a chunk of the grouped filter gradient's operands takes at most about this many bytes
#: (fastest of 16-128 examples per chunk for six shapes on an AVX-512 CPU: about 2 MiB)
_GROUPED_CHUNK_BYTES = 2 << 20


def _grouped_chunk(inputs, steps, width, filters, itemsize) -> int:
    """Examples per chunk of ``_grouped_gradient``: ``inputs`` entries of one example's
    input, ``steps`` output positions, a (``width``, ``filters``) kernel. Counted: the
    chunk's input, output gradient, gradients and oneDNN's patches."""
    per_example = inputs + steps * (filters + width) + width * filters
    return max(1, _GROUPED_CHUNK_BYTES // (per_example * itemsize))


def _grouped_gradient(x, g, kernel_size, strides, padding, out_spatial):
    """Per-example kernel gradients (c, kh*kw*cin, p) of a 2-D convolution (dilation 1)
    of the channels-last ``x`` (c, H, W, cin), whose output gradient is ``g`` (c, T, p),
    as ONE filter gradient of a grouped convolution: the examples side by side in the
    channels, (1, H, W, c*cin) against (1, H', W', c*p), are c groups of cin input and p
    output channels, so group b's filter gradient is example b's kernel gradient.
    """
    _, h, w, cin = x.shape
    (kh, kw), (sh, sw), (ho, wo) = kernel_size, strides, out_spatial
    p = g.shape[-1]
    c = tf.shape(x)[0]
    xt = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, h, w, -1])
    gt = tf.reshape(tf.transpose(tf.reshape(g, [-1, ho, wo, p]), [1, 2, 0, 3]),
                    [1, ho, wo, -1])
    f = tf.raw_ops.Conv2DBackpropFilter(
        input=xt, filter_sizes=tf.stack([kh, kw, cin, c * p]), out_backprop=gt,
        strides=[1, sh, sw, 1], padding=padding.upper())
    # f: (kh, kw, cin, c*p), output channel b*p + o of group b
    return tf.transpose(tf.reshape(f, [kh * kw * cin, -1, p]), [1, 0, 2])


_GROUPED_WORKS: dict = {}


def _grouped_gradient_works(dtype) -> bool:
    """Whether ``_grouped_gradient`` runs in ``dtype`` here and gives, exactly, each
    example's own kernel gradient: probed once per dtype (eagerly, out of any trace) on
    integer-valued operands, so that every kernel's sums are exact, against one ordinary
    (ungrouped) filter gradient per example. A kernel that refuses groups (TensorFlow's
    own CPU kernel, when oneDNN is off) or mixes the examples (which would break the
    clip bound) is not used; the patches are.
    """
    key = tf.as_dtype(dtype).name
    if key not in _GROUPED_WORKS:
        with tf.init_scope():
            _GROUPED_WORKS[key] = _probe_grouped(tf.as_dtype(dtype))
    return _GROUPED_WORKS[key]


def _probe_grouped(dtype) -> bool:
    # 3 examples, 5x4 input with 2 channels, 3x2 kernel, strides 2, "same": 3x2 outputs
    # with 3 channels; values in {-2, ..., 2}, a different pattern per example.
    x = (np.arange(3 * 5 * 4 * 2).reshape(3, 5, 4, 2) * 7 % 5 - 2).astype(np.float32)
    g = (np.arange(3 * 3 * 2 * 3).reshape(3, 3, 2, 3) * 3 % 5 - 2).astype(np.float32)
    x[1] = x[1, ::-1]
    g[2] = -g[2, :, ::-1]
    try:
        got = _grouped_gradient(tf.constant(x, dtype), tf.constant(g.reshape(3, 6, 3), dtype),
                                (3, 2), (2, 2), "same", (3, 2))
        got = tf.cast(got, tf.float32).numpy()
        want = np.stack([tf.raw_ops.Conv2DBackpropFilter(
            input=x[b:b + 1], filter_sizes=[3, 2, 2, 3], out_backprop=g[b:b + 1],
            strides=[1, 2, 2, 1], padding="SAME").numpy().reshape(12, 3) for b in range(3)])
    except (tf.errors.OpError, ValueError, TypeError) as e:
        _LOG.info("tf_dp: per-example convolution kernel gradients through patches in %s "
                  "(no grouped filter gradient here: %s)", dtype.name,
                  str(e).splitlines()[0][:200])
        return False
    if not np.array_equal(got, want):
        _LOG.warning("tf_dp: this TensorFlow's grouped filter gradient in %s does not give "
                     "each example's own kernel gradient; using patches instead", dtype.name)
        return False
    return True


#: the most examples in one chunk of ``_in_chunks`` (every chunk has exactly this many rows,
#: or the byte budget's number if smaller: a batch smaller than a chunk is padded to one)
_MAX_CHUNK = 64


def _in_chunks(fn, x, g, chunk, width, filters):
    """``fn(x, g)`` (B, width, filters) over chunks of ``c = min(chunk, _MAX_CHUNK)``
    examples, one after the other: n = ceil(B / c) chunks, the last one padded with zero
    rows to c (their results are cut off). Works for an unknown batch and for B = 0.

    EVERY chunk has c rows, whatever B: an example's gradient must not depend on how many
    other examples the batch holds. With chunks of ceil(B / n) rows, the grouped filter
    gradient ran with a number of groups that followed B, and oneDNN rounds a group's
    result differently for 1 group than for 2: an example whose gradient is mostly rounding
    (two uses of a shared convolution that cancel) then moved by a third of its norm when
    one other example joined the batch, and the clipped sum by 1.14 C (session 20 audit;
    ``tests/privacy/batch_invariance_test.py``).

    A plain ``tf.while_loop`` (``tf.map_fn`` over chunk indices took a third more graph ops
    and time to trace and optimise: issue 14, the step's first call) that writes each chunk
    into its block of ONE (n * c, width, filters) buffer, in place (``_write_block``): the
    result is a prefix of that buffer, with no second copy. (Chunks kept in a TensorArray
    and concatenated held both at the step's memory peak, the tutorial CNN's conv2: 32 of
    79 MiB at batch 1024, docs/scaling.md §7; reading the chunks one by one instead cost
    the JL steps 5-15 % in loop overhead, docs/step_time.md session 11.) Under XLA, which
    has no in-place update and plans its own buffers, a TensorArray concatenated at the
    end, the batch read as rows of an (n, c, ...) reshape (slices whose size XLA inferred
    from the loop index failed to compile for B = 1).
    """
    c = max(1, min(int(chunk), _MAX_CHUNK))
    if isinstance(x.shape[0], int) and x.shape[0] <= c:
        # A static batch within one chunk: that chunk, padded to c rows, without a loop.
        return fn(padded_rows(x, c), padded_rows(g, c))[:x.shape[0]]
    b = tf.shape(x)[0]
    # (at least one chunk: XLA compiles the loop body's read for B = 0 too)
    n = tf.maximum((b + c - 1) // c, 1)
    if _internals.compiling_with_xla():
        def chunks(t):
            t = padded_rows(t, n * c)
            return tf.reshape(t, tf.concat([[n, c], tf.shape(t)[1:]], 0))

        xs, gs = chunks(x), chunks(g)
        parts = tf.TensorArray(g.dtype, size=n, element_shape=tf.TensorShape(
            [c, width, filters]))

        def body(i, parts):
            return i + 1, parts.write(i, fn(xs[i], gs[i]))

        _, parts = tf.while_loop(lambda i, _: i < n, body, (tf.constant(0), parts),
                                 parallel_iterations=1)
        return parts.concat()[:b]

    # One (c * width * filters) row per chunk, each written as one contiguous block; rows
    # beyond the batch (at most c - 1) are sliced off at the end: a prefix, which
    # TensorFlow's slice returns as a view. Allocated once g exists (at the step's start it
    # would be held through the backward pass).
    block = width * filters
    with tf.control_dependencies([g]):
        out = tf.raw_ops.Empty(shape=tf.stack([n, c * block]), dtype=g.dtype)

    def padded(t, start):
        return tf.ensure_shape(padded_rows(t[start:start + c], c), [c] + t.shape[1:].as_list())

    def body(i, out):
        start = i * c
        part = fn(padded(x, start), padded(g, start))
        return i + 1, _write_block(out, i, tf.reshape(part, [1, c * block]))

    _, out = tf.while_loop(lambda i, _: i < n, body, (tf.constant(0), out),
                           parallel_iterations=1)
    return tf.reshape(out, [-1, width, filters])[:b]


def _write_block(buffer, i, block):
    """``buffer`` with its row ``i`` set to ``block`` (1, m), IN PLACE.

    ``InplaceUpdate`` writes into its input's memory and returns it (TensorFlow's kernel
    aliases them: the Python wrapper ``inplace_update`` copies first; this does not). Sound
    only for a buffer nothing else reads before the last write: here, an ``Empty`` made for
    one loop (a stateful op, never merged with another by Grappler or constant-folded), every
    row written by exactly one iteration, read after the loop only. Row i holds the examples
    i * c .. i * c + c - 1 of the batch, in order, so example j's gradient is the j-th of
    the flattened buffer (tests/core/conv_memory_test.py pins it against brute force, two
    layers of the same kernel shape in one model and successive calls included).
    """
    return tf.raw_ops.InplaceUpdate(x=buffer, i=tf.reshape(i, [1]), v=block)


# ------------------------------------------------------------- depthwise and separable


def _depthwise(ctx, layer, kernel_var, x):
    """The depthwise convolution of a channels-last ``x`` and its kernel's direct term.

    Returns ``u`` (B, *out, C * multiplier)."""
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
    z = keras.ops.conv_transpose(x, ctx.read(layer.kernel, x.dtype),
                                 strides=list(layer.strides), padding=layer.padding,
                                 output_padding=layer.output_padding,
                                 data_format="channels_last",
                                 dilation_rate=layer.dilation_rate)
    in_spatial = _spatial_sizes(x)
    cin, kernel_shape = x.shape[-1], tuple(layer.kernel.shape)

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
