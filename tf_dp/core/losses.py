"""Per-example losses from whatever loss the user compiled.

The private step needs one loss value per example (it clips per example), while Keras
reduces the compiled loss to a scalar. These helpers rebuild the unreduced loss from the
user's ``compile(loss=...)`` argument.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

_SUM_REDUCTIONS = ("sum",)


def _loss_callable(loss: Any) -> tuple[Callable, bool]:
    """Returns (fn(y_true, y_pred) -> unreduced values, sums_within_example)."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        within_sum = getattr(loss, "reduction", None) in _SUM_REDUCTIONS
        # `Loss.call` is the unreduced computation by Keras's contract; masks and
        # sample weights are applied by the caller.
        return loss.call, within_sum
    if callable(loss):
        return loss, False
    raise TypeError(
        f"`loss` must be a string, a `keras.losses.Loss` or a callable, got {loss!r}."
    )


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
        entries = [((None, i), _loss_callable(v), _weight(loss_weights, None, i))
                   for i, v in enumerate(loss) if v is not None]
    else:
        entries = [((None, None), _loss_callable(loss), _weight(loss_weights, None, None))]

    def per_example_loss(y_true, y_pred, sample_weight=None):
        total = None
        for where, (fn, within_sum), weight in entries:
            yt, yp = _output(y_true, *where), _output(y_pred, *where)
            values = _unreduced(fn, yt, yp, within_sum)
            if weight is not None:
                values = values * weight
            total = values if total is None else total + values
        if sample_weight is not None:
            sample_weight = tf.cast(sample_weight, total.dtype)
            sample_weight = tf.reshape(sample_weight, [tf.shape(sample_weight)[0], -1])
            # A per-example weight; per-time-step weights are averaged to one per example.
            total = total * tf.reduce_mean(sample_weight, axis=1)
        return total

    return per_example_loss


def _weight(loss_weights, key, index):
    """The weight of the output named ``key`` (a dict loss) at position ``index``."""
    if loss_weights is None:
        return None
    if isinstance(loss_weights, dict):
        return loss_weights.get(key if key is not None else index, 1.0)
    if isinstance(loss_weights, (list, tuple)):
        return loss_weights[index if index is not None else 0]
    return float(loss_weights)


def _output(y, key, index):
    """One output of targets or predictions ``y``: by ``key`` from a dict that has it, else
    at position ``index`` (None: a single output)."""
    if isinstance(y, dict):
        if key is not None and key in y:
            return y[key]
        y = list(y.values())
    elif not isinstance(y, (list, tuple)):
        y = [y]
    return y[0 if index is None else index]


def _unreduced(fn, y_true, y_pred, within_sum):
    y_pred = tf.convert_to_tensor(y_pred)
    y_true = tf.convert_to_tensor(y_true)
    mask = keras.backend.get_keras_mask(y_pred) if hasattr(keras.backend, "get_keras_mask") else None
    if y_true.dtype.is_floating and y_true.dtype != y_pred.dtype:
        y_true = tf.cast(y_true, y_pred.dtype)
    values = tf.convert_to_tensor(fn(y_true, y_pred))
    if values.shape.rank == 0:
        raise ValueError(
            "The compiled `loss` returned a scalar; differentially private training needs one "
            "loss value per example. Pass a `keras.losses.Loss` instance, a loss name, or a "
            "function that returns a tensor of shape (batch_size, ...)."
        )
    values = tf.cast(values, tf.float32) if values.dtype != tf.float64 else values
    batch = tf.shape(values)[0]
    if mask is not None:
        mask = tf.cast(tf.reshape(mask, [batch, -1]), values.dtype)
        flat = tf.reshape(values, [batch, -1]) * mask
        if within_sum:
            return tf.reduce_sum(flat, axis=1)
        return tf.math.divide_no_nan(tf.reduce_sum(flat, axis=1), tf.reduce_sum(mask, axis=1))
    flat = tf.reshape(values, [batch, -1])
    return tf.reduce_sum(flat, axis=1) if within_sum else tf.reduce_mean(flat, axis=1)
