"""Per-example losses from whatever loss the user compiled.

The private step needs one loss value per example (it clips per example), while Keras
reduces the compiled loss to a scalar. These helpers rebuild the unreduced loss from the
user's ``compile(loss=...)`` argument.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from tf_dp.core.vmap import vectorized_per_example

_SUM_REDUCTIONS = ("sum",)


def _loss_callable(loss: Any) -> tuple[Callable, bool, bool]:
    """Returns (fn(y_true, y_pred) -> unreduced values, sums_within_example, keras' own)."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        within_sum = getattr(loss, "reduction", None) in _SUM_REDUCTIONS
        # `Loss.call` is the unreduced computation by Keras's contract; masks and
        # sample weights are applied by the caller.
        return loss.call, within_sum, _is_keras_own(loss)
    if callable(loss):
        return loss, False, _is_keras_own(loss)
    if isinstance(loss, (list, tuple, dict)):
        raise TypeError(
            f"tf_dp: `loss` nests losses inside a loss of one output ({loss!r}): tf_dp takes "
            "one loss per model output, as a list in the outputs' order or a dict by their "
            "names, for a model whose outputs are a flat list or dict. Give the model a flat "
            "list or dict of outputs (session 26 audit: outputs {'a': [A, B]} with losses "
            "{'a': [...]})."
        )
    raise TypeError(
        f"`loss` must be a string, a `keras.losses.Loss` or a callable, got {loss!r}."
    )


def _keras_losses():
    """(classes, functions) that ``keras.losses`` exports: Keras' own losses."""
    members = [getattr(keras.losses, name) for name in dir(keras.losses)
               if not name.startswith("_")]
    classes = {m for m in members if isinstance(m, type) and issubclass(m, keras.losses.Loss)
               and m is not keras.losses.Loss}
    functions = {m for m in members if callable(m) and not isinstance(m, type)}
    return classes, functions


_KERAS_LOSSES = None


def _is_keras_own(loss) -> bool:
    """Whether ``loss`` is one of Keras' own losses, whose value for a row depends on that
    row alone: an instance of a class ``keras.losses`` exports (exactly, not a subclass, with
    its own ``call``), or a function it exports, or a ``LossFunctionWrapper`` of one. By
    identity, not by module name (session 21 audit: a Keras loss instance whose ``call`` was
    replaced, or a user class claiming ``__module__ = "keras.losses"``, ran on the batch)."""
    global _KERAS_LOSSES
    if _KERAS_LOSSES is None:
        _KERAS_LOSSES = _keras_losses()
    classes, functions = _KERAS_LOSSES
    if isinstance(loss, keras.losses.Loss):
        if "call" in vars(loss) or type(loss) not in classes:
            return False
        fn = getattr(loss, "fn", None)  # Keras' function-backed losses: their function too
        return fn is None or fn in functions
    return loss in functions


def build_per_example_loss(loss: Any, loss_weights: Any = None, output_names=None) -> Callable:
    """Builds ``fn(y_true, y_pred, sample_weight) -> (B,)`` from a compiled loss argument.

    A loss over several outputs (list or dict, matched to the model's outputs) sums the
    outputs' per-example losses with ``loss_weights``. Inside one example, values over
    extra axes (time steps, pixels) are averaged, or summed when the Loss object's
    reduction is ``"sum"``, so the per-example loss is on the scale Keras reports.

    Args:
      loss: the ``loss`` given to ``compile``.
      loss_weights: the ``loss_weights`` given to ``compile`` (same structure) or None.
      output_names: the model's output names, to match a dict of losses.

    Raises:
      ValueError: if ``loss`` is None.
    """
    if loss is None:
        raise ValueError(
            "`loss` must be given to `compile()`: the private step needs per-example losses."
        )
    if isinstance(loss, dict):
        names = list(output_names or loss.keys())
        missing = [k for k in loss if k not in names]
        if missing:
            raise ValueError(
                f"`loss` has keys {missing} that are not model outputs {names}."
            )
        # A dict of targets or predictions is read by key, anything else by position.
        entries = [((k, names.index(k)), _loss_callable(v),
                    _weight(loss_weights, k, names.index(k))) for k, v in loss.items()
                   if v is not None]
    elif isinstance(loss, (list, tuple)):
        # A dict of targets is read by the output's name, as Keras does (it was read in the
        # dict's insertion order: output a trained toward target b, session 25 audit).
        entries = [((_name(output_names, i), i), _loss_callable(v),
                    _weight(loss_weights, _name(output_names, i), i))
                   for i, v in enumerate(loss) if v is not None]
    elif output_names is not None and len(output_names) > 1:
        # One loss for a model of several outputs: Keras applies it to every output and sums
        # (tf_dp applied it to the first output only).
        entries = [((output_names[i], i), _loss_callable(loss),
                    _weight(loss_weights, output_names[i], i))
                   for i in range(len(output_names))]
    else:
        entries = [((None, None), _loss_callable(loss), _weight(loss_weights, None, None))]

    def per_example_loss(y_true, y_pred, sample_weight=None):
        if isinstance(sample_weight, (dict, list, tuple)):
            raise ValueError(
                "Per-output sample weights (a dict or list of them) are not supported by "
                "tf_dp's private step: pass one sample weight per example (or per time step) "
                "for all outputs.")
        total = None
        for where, (fn, within_sum, own), weight in entries:
            yt, yp = _output(y_true, *where), _output(y_pred, *where)
            values = _unreduced(fn, yt, yp, within_sum, own, sample_weight)
            if weight is not None:
                values = values * weight
            total = values if total is None else total + values
        return total

    return per_example_loss


def _name(output_names, index):
    return None if output_names is None or index >= len(output_names) else output_names[index]


def _weight(loss_weights, key, index):
    """The weight of the output named ``key`` at position ``index`` (a dict of weights is
    read by name, as Keras does, also for a list of losses)."""
    if loss_weights is None:
        return None
    if isinstance(loss_weights, dict):
        return loss_weights.get(key if key is not None else index, 1.0)
    if isinstance(loss_weights, (list, tuple)):
        return loss_weights[index if index is not None else 0]
    return float(loss_weights)


def _output(y, key, index):
    """One output of targets or predictions ``y``: by ``key`` (the output's name) from a
    dict, else at position ``index`` (None: a single output). A dict of several entries
    without that key is refused: its order says nothing about which output each is for."""
    if isinstance(y, dict):
        if key is not None and key in y:
            return y[key]
        if len(y) == 1 and not index:
            return next(iter(y.values()))
        raise ValueError(
            f"tf_dp: the targets are a dict with keys {sorted(y)}, none of which names the "
            f"model's output {key if key is not None else index!r}: Keras pairs a dict of "
            "targets with the outputs by the output layers' names (model.output_names).")
    elif not isinstance(y, (list, tuple)):
        y = [y]
    return y[0 if index is None else index]


def _keras_mask(y_pred):
    """The Keras mask a layer attached to ``y_pred`` (Keras 3.15 no longer exports
    ``keras.backend.get_keras_mask``; the mask was then silently ignored)."""
    get = getattr(keras.backend, "get_keras_mask", None)
    if get is None:
        try:
            from keras.src.backend import get_keras_mask as get  # noqa: PLC0415
        except ImportError:  # pragma: no cover (older Keras 3: an attribute)
            return getattr(y_pred, "_keras_mask", None)
    return get(y_pred)


_SCALAR_LOSS = (
    "The compiled `loss` returned a scalar; differentially private training needs one "
    "loss value per example. Pass a `keras.losses.Loss` instance, a loss name, or a "
    "function that returns a tensor of shape (batch_size, ...).")


#: ops that write state: a loss holding state written from the data carries one example's
#: values into the others' losses (session 21 audit: 9.9 C under the vectorized strategy)
_STATE_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                 "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub",
                 "ResourceScatterNdUpdate", "ResourceScatterNdAdd", "TensorArrayWriteV3")
_LOSS_TRACES = {}


def _loss_trace(fn, y_true, y_pred):
    """(op types, output) of ``fn`` traced on one example (nested functions included; the
    output a symbolic tensor of its shape and dtype), cached per fn and shapes."""
    key = (id(fn), tuple(y_true.shape[1:]), y_true.dtype, tuple(y_pred.shape[1:]),
           y_pred.dtype)
    if key not in _LOSS_TRACES:
        with tf.init_scope():
            concrete = tf.function(lambda yt, yp: tf.convert_to_tensor(fn(yt, yp)),
                                   autograph=True).get_concrete_function(
                tf.TensorSpec([1] + y_true.shape[1:].as_list(), y_true.dtype),
                tf.TensorSpec([1] + y_pred.shape[1:].as_list(), y_pred.dtype))
            ops = {op.type for op in concrete.graph.get_operations()}
            for f in concrete.graph.as_graph_def().library.function:
                ops.update(node.op for node in f.node_def)
        _LOSS_TRACES[key] = (fn, ops, concrete.structured_outputs)  # (fn kept: its id stays)
    return _LOSS_TRACES[key][1:]


def _per_row(fn, y_true, y_pred):
    """``fn`` of a custom loss evaluated on each example's rows alone, a batch of one each:
    whatever ``fn`` does, an example's loss cannot depend on another example (session 21
    audit: a loss that mixed the batch only for some label values passed the first-batch
    check and let one example move the clipped sum by 4.98 C).

    Vectorized (``vmap.vectorized_per_example``) unless pfor partitions the examples (a
    branch or loop per example would run on a subset of rows whose size follows the other
    examples): then in a loop over examples (``tf.map_fn``). A loss that writes state is
    refused. A batch of static size 1 (the vectorized strategy's examples) is evaluated as
    is."""
    ops, output = _loss_trace(fn, y_true, y_pred)
    writes = sorted(ops.intersection(_STATE_WRITES))
    if writes:
        raise ValueError(
            f"The compiled `loss` writes state ({', '.join(writes)}): a loss that keeps state "
            "written from the data carries one example's values into the other examples' "
            "losses, beyond what clipping bounds. Compute the loss from (y_true, y_pred) alone.")
    if output.shape.rank == 0:
        raise ValueError(_SCALAR_LOSS)
    if y_pred.shape[0] == 1:
        return fn(y_true, y_pred)

    def one(rows):
        return tf.convert_to_tensor(fn(rows[0][None], rows[1][None]))[0]

    values = vectorized_per_example(one, (y_true, y_pred))
    if values is None:
        values = tf.map_fn(one, (y_true, y_pred), fn_output_signature=tf.TensorSpec(
            output.shape[1:], output.dtype))
    return values


def _unreduced(fn, y_true, y_pred, within_sum, keras_own=True, sample_weight=None):
    """One loss value per example: ``fn``'s values over the example's own entries (time
    steps, pixels) averaged — or summed for a ``"sum"`` reduction — with its Keras mask and
    its per-entry sample weights applied entry by entry (per-example weights multiply)."""
    y_pred = tf.convert_to_tensor(y_pred)
    y_true = tf.convert_to_tensor(y_true)
    mask = _keras_mask(y_pred)
    if y_true.dtype.is_floating and y_true.dtype != y_pred.dtype:
        y_true = tf.cast(y_true, y_pred.dtype)
    values = tf.convert_to_tensor(fn(y_true, y_pred) if keras_own
                                  else _per_row(fn, y_true, y_pred))
    if values.shape.rank == 0:
        raise ValueError(_SCALAR_LOSS)
    values = tf.cast(values, tf.float32) if values.dtype != tf.float64 else values
    batch = tf.shape(values)[0]
    flat = tf.reshape(values, [batch, -1])
    per_example = None
    if sample_weight is not None:
        sw = tf.cast(tf.convert_to_tensor(sample_weight), values.dtype)
        sw = tf.reshape(sw, [tf.shape(sw)[0], -1])
        if sw.shape[1] == 1:
            per_example = sw[:, 0]
        else:
            # per time step (entry), as Keras weights them: each entry's value (before, the
            # weights' mean multiplied the values' mean, so steps of weight 0 trained)
            flat = flat * sw
    if mask is not None:
        mask = tf.cast(tf.reshape(mask, [batch, -1]), values.dtype)
        flat = flat * mask
        out = (tf.reduce_sum(flat, axis=1) if within_sum else
               tf.math.divide_no_nan(tf.reduce_sum(flat, axis=1), tf.reduce_sum(mask, axis=1)))
    else:
        out = tf.reduce_sum(flat, axis=1) if within_sum else tf.reduce_mean(flat, axis=1)
    return out if per_example is None else out * per_example
