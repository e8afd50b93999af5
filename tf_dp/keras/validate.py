"""``validate(model)``: what would break privacy or the fast paths, and ``fix=True``.

Like Opacus' ``ModuleValidator``: a list of findings before any training, and a fixer that
swaps BatchNormalization (its batch statistics mix examples) for GroupNormalization.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from tf_dp import _internals
from tf_dp.core import ghost, independence


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing ``validate`` found about a layer.

    level: "error" (training is refused or would not be private), "warning" (outside the
      guarantee) or "info" (a cost, not a privacy problem).
    """

    level: str
    layer: str
    message: str

    def __str__(self):
        return f"{self.level}: {self.layer}: {self.message}"


def validate(model: keras.Model, fix: bool = False):
    """Lists what in ``model`` would break private training or its fast paths.

    * error: trainable BatchNormalization (its batch statistics mix examples);
    * warning: preprocessing layers ``adapt``-ed on data (their statistics are outside ε);
    * info: trainable layers without a ghost rule, with the number of parameters whose
      per-example gradients the exact vectorized fallback forms.

    Layers that mix examples in other ways are found by the check ``fit`` runs on the first
    batch (``tf_dp.core.independence``), which needs data.

    Args:
      model: a Keras model.
      fix: return a fixed copy of a functional or Sequential model as well: every
        BatchNormalization becomes a GroupNormalization (``min(32, channels)`` groups that
        divide the channels, same axis, epsilon, center and scale, with BatchNormalization's
        gamma and beta); every other layer (but the inputs) is shared with ``model``, weights
        included.

    Returns:
      The list of ``Finding``s, or with ``fix=True`` (fixed model, findings of the fixed
      model).

    Raises:
      TypeError: if ``model`` is not a ``keras.Model``; ValueError: ``fix=True`` on a
        subclassed model (its layers cannot be swapped from outside: replace them in code).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not fix:
        return _findings(model)
    if not (isinstance(model, keras.Sequential) or _internals.is_functional(model)
            or isinstance(model, _internals.functional_class())):
        raise ValueError("`fix=True` rebuilds functional and Sequential models only; in a "
                         "subclassed model replace BatchNormalization by GroupNormalization "
                         "in its code.")
    if isinstance(model, keras.Sequential):
        fixed = keras.models.clone_model(model, clone_function=_fixed_layer)
    else:
        fixed = keras.models.clone_model(model, clone_function=_fixed_layer,
                                         call_function=_call_fixed)
    return fixed, _findings(fixed)


def _findings(model):
    found = []
    covered = {id(layer) for layer in ghost.capturable_layers(model)}
    for layer in _internals.all_layers(model, include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            found.append(Finding("error", layer.name, "BatchNormalization mixes the examples "
                                 "of a batch; use validate(model, fix=True) or "
                                 "GroupNormalization / LayerNormalization, or freeze it"))
    for layer in independence.adapted_preprocessing_layers(model):
        found.append(Finding("warning", layer.name, "adapted on data: its statistics are "
                             "in the model but outside epsilon (fit them on public data)"))
    for layer in _internals.all_layers(model, include_self=False):
        own = [v for v in layer.trainable_variables
               if not any(v is w for sub in _internals.sublayers(layer)
                          for w in sub.trainable_variables)]
        if own and id(layer) not in covered and not isinstance(
                layer, keras.layers.BatchNormalization):
            size = int(sum(np.prod(v.shape) for v in own))
            found.append(Finding("info", layer.name, f"no ghost rule for "
                                 f"{type(layer).__name__}: exact vectorized per-example "
                                 f"gradients of its {size} parameters (slower, more memory)"))
    return found


def _call_fixed(layer, *args, **kwargs):
    if isinstance(layer, keras.layers.GroupNormalization):
        kwargs.pop("mask", None)  # BatchNormalization's call took one; GroupNormalization not
    return layer(*args, **kwargs)


def _groups(channels):
    return next(g for g in range(min(32, channels), 0, -1) if channels % g == 0)


def _fixed_layer(layer):
    if not isinstance(layer, keras.layers.BatchNormalization):
        return layer  # shared, weights included
    axis = layer.axis if isinstance(layer.axis, int) else layer.axis[0]
    channels = int(layer.gamma.shape[0] if layer.gamma is not None else layer.beta.shape[0])
    norm = keras.layers.GroupNormalization(
        groups=_groups(channels), axis=axis, epsilon=layer.epsilon, center=layer.center,
        scale=layer.scale, name=f"{layer.name}_group_norm")
    norm.build(_built_shape(layer, axis, channels))
    if layer.scale:
        norm.gamma.assign(layer.gamma)
    if layer.center:
        norm.beta.assign(layer.beta)
    return norm


def _built_shape(layer, axis, channels):
    spec = getattr(layer, "input_spec", None)
    ndim = getattr(spec, "ndim", None) or getattr(spec, "min_ndim", None) or 2
    shape = [None] * ndim
    shape[axis] = channels
    return tuple(shape)
