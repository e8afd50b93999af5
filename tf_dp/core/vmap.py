"""Exact per-example gradients by vectorization, for layers without a ghost-norm formula.

``tf.vectorized_map`` turns one example's gradient into a batched computation. Keras
recurrent layers run a ``tf.while_loop`` over TensorArrays that pfor cannot convert (the
"variant dtype" failure also seen with TF Privacy), so recurrent layers are unrolled while
the per-example function is traced when their time axis is static; when vectorization still
fails, a ``tf.map_fn`` loop over examples is the last resort (exact, slower).

While it vectorizes, three of pfor's converters are replaced by faster ones for the cases
they take (``_PFOR_OVERRIDES``: per-example filter gradients, max-pool gradients, sums of
per-example products; docs/design.md, "Kernels chosen for speed").
"""

from __future__ import annotations

import contextlib
import logging
from typing import NamedTuple

import keras
import tensorflow as tf

from tf_dp import _internals

_log = logging.getLogger("tf_dp")


def _einsum_dense_call(layer):
    def call(inputs, training=None):
        # Keras' ops.einsum rewrites some equations as reshape + matmul, whose vectorized
        # gradient is wrong in TF 2.21 (garbage or NaN per-example gradients); tf.einsum
        # vectorizes correctly.
        x = tf.einsum(layer.equation, tf.cast(inputs, layer.compute_dtype),
                      tf.cast(layer.kernel, layer.compute_dtype))
        if layer.bias is not None:
            x = x + tf.cast(layer.bias, x.dtype)
        return layer.activation(x) if layer.activation is not None else x
    return call


@contextlib.contextmanager
def vectorizable(model):
    """Unrolls recurrent layers and routes EinsumDense through tf.einsum while tracing."""
    patched = []
    for layer in _internals.all_layers(model, include_self=False):
        if (type(layer) is keras.layers.EinsumDense and not getattr(layer, "lora_enabled", False)
                and getattr(layer, "quantization_mode", None) is None
                and "call" not in layer.__dict__):
            layer.call = _einsum_dense_call(layer)
            patched.append(layer)
    try:
        with _unrolled_rnns(model):
            yield
    finally:
        for layer in patched:
            del layer.call


@contextlib.contextmanager
def _unrolled_rnns(model):
    rnns = []
    for layer in _internals.all_layers(model, include_self=False):
        if isinstance(layer, keras.layers.Bidirectional):
            rnns += [layer.forward_layer, layer.backward_layer]
        elif isinstance(layer, keras.layers.RNN):
            rnns.append(layer)
    saved = [(layer, layer.unroll) for layer in rnns]
    try:
        for layer in rnns:
            layer.unroll = True
        yield bool(rnns)
    finally:
        for layer, value in saved:
            layer.unroll = value


class _PforFallbackFilter(logging.Filter):
    """Drops pfor's "<op> uses a while_loop. Fix that!" notes (one per op kind and trace):
    the loop it falls back to is exact, and tf_dp's fallback is documented."""

    def filter(self, record):
        return "uses a while_loop. Fix that!" not in record.getMessage()


@contextlib.contextmanager
def _quiet_pfor_fallbacks():
    logger = logging.getLogger("tensorflow")
    quiet = _PforFallbackFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _conv2d_backprop_filter(pfor_input, original):
    """pfor's Conv2DBackpropFilter with stacked inputs (each example's own kernel gradient):
    TensorFlow's converter runs one filter gradient per example in a while loop; here one
    grouped filter gradient per chunk of examples (``rules.conv._grouped_gradient``, the
    examples as the groups; 5x faster for the tutorial CNN), where it applies (NHWC,
    undilated, one example per iteration, static shapes, no XLA, and the probe
    ``_grouped_gradient_works`` passed for the dtype). Else TensorFlow's converter."""
    from tf_dp.core.ghost.rules import conv

    pfor_input.stack_inputs(stack_indices=[2])
    x, x_stacked, _ = pfor_input.input(0)
    g = pfor_input.stacked_input(2)
    sizes = tf.get_static_value(pfor_input.unstacked_input(1))
    strides = list(pfor_input.get_attr("strides"))
    padding = tf.compat.as_str(pfor_input.get_attr("padding"))
    if (not x_stacked or sizes is None or x.dtype != g.dtype
            or tf.compat.as_str(pfor_input.get_attr("data_format")) != "NHWC"
            or padding not in ("SAME", "VALID") or strides[0] != 1 or strides[3] != 1
            or any(d != 1 for d in pfor_input.get_attr("dilations"))
            or x.shape.rank != 5 or g.shape.rank != 5 or x.shape[1] != 1 or g.shape[1] != 1
            or not x.shape[2:].is_fully_defined() or not g.shape[2:].is_fully_defined()
            or _internals.compiling_with_xla() or not conv._grouped_gradient_works(g.dtype)):
        return original(pfor_input)
    kh, kw, cin, p = (int(v) for v in sizes)
    ho, wo = g.shape[2], g.shape[3]
    width = kh * kw * cin
    chunk = conv._grouped_chunk(x.shape[2:].num_elements(), ho * wo, width, p, g.dtype.size)
    per = conv._in_chunks(
        lambda xc, gc: conv._grouped_gradient(xc, gc, (kh, kw), tuple(strides[1:3]),
                                              padding, (ho, wo)),
        x[:, 0], tf.reshape(g[:, 0], [-1, ho * wo, p]), chunk, width, p)
    return _internals.pfor_wrap(tf.reshape(per, [-1, kh, kw, cin, p]))


def _max_pool_grad(pfor_input, original):
    """pfor's MaxPoolGrad: TensorFlow's converter merges the examples into the batch and
    keeps the pooled output it was given (reshaped), which oneDNN cannot pair with a
    forward pool: Eigen's MaxPoolGrad then took 15 of the tutorial CNN's 66 ms. Here the
    pool is formed again from the same input (the same values) next to its gradient,
    which oneDNN pairs (0.9 ms). Only where that output is the max pool of that input
    (as in every gradient of ``tf.nn.max_pool``), in NHWC, without XLA."""
    op = pfor_input.op
    pooled = op.inputs[1].op
    padding = tf.compat.as_str(pfor_input.get_attr("padding"))
    if (pooled.type != "MaxPool" or pooled.inputs[0].name != op.inputs[0].name
            or list(pooled.get_attr("ksize")) != list(pfor_input.get_attr("ksize"))
            or list(pooled.get_attr("strides")) != list(pfor_input.get_attr("strides"))
            or tf.compat.as_str(pooled.get_attr("padding")) != padding
            or padding not in ("SAME", "VALID")
            or tf.compat.as_str(pfor_input.get_attr("data_format")) != "NHWC"
            or _internals.compiling_with_xla()):
        return original(pfor_input)
    pfor_input.stack_inputs()
    x, dy = pfor_input.stacked_input(0), pfor_input.stacked_input(2)
    if x.shape.rank != 5 or dy.shape.rank != 5:
        return original(pfor_input)

    def merged(t):
        inner = t.shape[2:] if t.shape[2:].is_fully_defined() else tf.shape(t)[2:]
        return tf.reshape(t, tf.concat([[-1], inner], 0))

    attrs = dict(ksize=list(pfor_input.get_attr("ksize")),
                 strides=list(pfor_input.get_attr("strides")), padding=padding)
    xm = merged(x)
    dx = tf.raw_ops.MaxPoolGrad(orig_input=xm, orig_output=tf.raw_ops.MaxPool(input=xm, **attrs),
                                grad=merged(dy), **attrs)
    return _internals.pfor_wrap(tf.reshape(dx, tf.shape(x)))


def _add_n(pfor_input, original):
    """pfor's AddN of per-example matrix products, as an unrolled recurrent layer's kernel
    gradient is (one (d x 4h) outer product per time step and example, summed): ONE
    product over the factors concatenated along the contracted axis, the same sum (in
    another order), plus whatever other inputs the sum has. The vectorized BiLSTM spent
    1.8 of its 2.4 s in those products and their sum. The products taken are rank 3
    (BatchMatMulV2) with the first one's adjoint flags, dtype and operand shapes but for the
    contracted axis; with fewer than two of them, TensorFlow's converter."""
    inputs = [pfor_input.input(i) for i in range(pfor_input.num_inputs)]
    products = [t.op for t, stacked, _ in inputs if stacked and t.op.type == "BatchMatMulV2"]
    if len(products) < 2:
        return original(pfor_input)
    first = products[0]
    adj_x, adj_y = first.get_attr("adj_x"), first.get_attr("adj_y")
    kx, ky = (1 if adj_x else 2), (2 if adj_y else 1)  # the contracted axis of each operand

    def rest(shape, axis):
        dims = shape.as_list() if shape.rank == 3 else None
        return None if dims is None else dims[:axis] + dims[axis + 1:]

    def fits(op):
        x, y = op.inputs[0], op.inputs[1]
        return (op.get_attr("adj_x") == adj_x and op.get_attr("adj_y") == adj_y
                and rest(x.shape, kx) is not None and rest(y.shape, ky) is not None
                and rest(x.shape, kx) == rest(first.inputs[0].shape, kx)
                and rest(y.shape, ky) == rest(first.inputs[1].shape, ky)
                and x.dtype == y.dtype == first.inputs[0].dtype)

    taken = [op for op in products if fits(op)]
    if len(taken) < 2:
        return original(pfor_input)
    taken_ids = {id(op) for op in taken}
    out = tf.linalg.matmul(tf.concat([op.inputs[0] for op in taken], kx),
                           tf.concat([op.inputs[1] for op in taken], ky),
                           adjoint_a=adj_x, adjoint_b=adj_y)
    # the other inputs (an unstacked one is the same for every example)
    others = [t if stacked else tf.broadcast_to(t, tf.shape(out))
              for t, stacked, _ in inputs if not (stacked and id(t.op) in taken_ids)]
    if others:
        out = tf.add_n([out] + others)
    return _internals.pfor_wrap(out)


_PFOR_OVERRIDES = {"Conv2DBackpropFilter": _conv2d_backprop_filter,
                   "MaxPoolGrad": _max_pool_grad, "AddN": _add_n}


def _expand(structure):
    return tf.nest.map_structure(lambda t: None if t is None else t[None], structure)


class RowGradients(NamedTuple):
    """Per-example gradients of a table read by row lookups (an embedding): example i adds
    ``values[i, t]`` to row ``ids[i, t]`` (repeated ids add up), as the gradient of a gather.
    (B, T) ids and (B, T, width) values instead of a dense (B, rows, width) tensor."""

    ids: tf.Tensor
    values: tf.Tensor


def per_example_gradients(model, per_example_loss, x, y, sample_weight, variables,
                          mode: str = "auto", rows: bool = False):
    """Per-example gradients of ``variables`` (each (B, *var.shape)), losses and outputs.

    Args:
      model: the Keras model (called with ``training=True`` on one example at a time).
      per_example_loss: ``fn(y_true, y_pred, sample_weight) -> (B,)``.
      x, y, sample_weight: the batch (nested structures allowed; sample_weight may be None).
      variables: the variables whose per-example gradients are wanted.
      mode: "auto" (vectorize, else loop), "vectorize" or "loop".
      rows: a 2-D variable whose per-example gradient comes out of row lookups (TensorFlow
        gives it as ``IndexedSlices``) is returned as ``RowGradients`` instead of a dense
        (B, rows, width) tensor: for a Transformer's 8000-row embedding that dense tensor was
        2 MiB per example, most of the vectorized step's time.

    Returns:
      (list of per-example gradients: tensors, or ``RowGradients`` with ``rows``; per-example
      losses (B,); outputs (B, ...)).
    """
    variables = list(variables)
    sparse = [None] * len(variables)  # per variable: whether its gradient came as row slices

    has_weight = sample_weight is not None

    def one(args):
        xi, yi, swi = args if has_weight else (*args, None)
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch([v.value if hasattr(v, "value") else v for v in variables])
            pred = model(_expand(xi), training=True)
            loss = per_example_loss(_expand(yi), pred,
                                    None if swi is None else _expand(swi))
            loss = tf.reduce_sum(loss)
        grads = tape.gradient(loss, [v.value if hasattr(v, "value") else v for v in variables],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        out = []
        for k, (g, v) in enumerate(zip(grads, variables)):
            as_rows = (rows and isinstance(g, tf.IndexedSlices) and v.shape.rank == 2
                       and g.values.shape.rank == 2)
            # The same trace decides for every example (and a loop's first-example probe).
            sparse[k] = as_rows
            out.append((tf.reshape(g.indices, [-1]), g.values) if as_rows
                       else tf.convert_to_tensor(g))
        squeeze = tf.nest.map_structure(lambda t: t[0], pred)
        return out, loss, squeeze

    elems = (x, y, sample_weight) if has_weight else (x, y)
    if mode in ("auto", "vectorize"):
        try:
            with vectorizable(model), _quiet_pfor_fallbacks(), _internals.pfor_converters(
                    _PFOR_OVERRIDES):
                result = vectorized_per_example(one, elems)
            if result is not None:
                return _as_rows(result, sparse)
            _log.info("tf_dp: the per-example computation branches or loops per example; "
                      "it runs in a loop over examples (vectorized, a branch would run on a "
                      "subset of rows that follows the other examples).")
        except Exception as err:  # pfor conversion errors surface as many types
            if mode == "vectorize":
                raise
            _log.warning("tf_dp: vectorized per-example gradients failed (%s); falling back "
                         "to a loop over examples (exact, slower).", str(err).split("\n")[0])
    return _as_rows(_loop(one, elems, model, variables), sparse)


def vectorized_per_example(one, elems):
    """``tf.vectorized_map(one, elems)``, or None where pfor partitioned the examples: a
    branch (``tf.cond``) or loop whose predicate differs per example runs on the subset of
    rows that take it (``DynamicPartition``), a tensor whose size and each row's index in it
    follow the other examples, and kernels round a row by both (Eigen's scalar path for a
    tensor's last partial SIMD packet). Session 21 audit: a custom layer with a per-example
    ``tf.cond`` let one example move the vectorized strategy's clipped sum by 14 C (and a
    custom loss, ``losses._per_row``). A loop over examples (``tf.map_fn``) runs every
    example's branch on its own row."""
    if tf.executing_eagerly():
        traced = tf.function(lambda e: tf.vectorized_map(one, e, fallback_to_while_loop=True))
        concrete = traced.get_concrete_function(elems)
        ops = [op.type for op in concrete.graph.get_operations()]
        if "DynamicPartition" in ops:
            return None
        return concrete(elems)
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    result = tf.vectorized_map(one, elems, fallback_to_while_loop=True)
    if any(op.type == "DynamicPartition" for op in graph.get_operations()[before:]):
        return None  # (the vectorized ops are left unused: pruned from the step)
    return result


def _as_rows(result, sparse):
    grads, losses, outputs = result
    return ([RowGradients(*g) if s else g for g, s in zip(grads, sparse)], losses, outputs)


def _loop(one, elems, model, variables):
    # map_fn needs the output signature; one example's outputs give it (a small extra cost).
    first = tf.nest.map_structure(lambda t: None if t is None else t[0], elems)
    sample = one(first)
    out_spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), sample)
    return tf.map_fn(one, elems, fn_output_signature=out_spec, parallel_iterations=16)
