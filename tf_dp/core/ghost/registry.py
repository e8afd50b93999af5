"""The public registry of ghost rules: ``tf_dp.register_ghost_rule``.

A ghost rule computes a layer's call and records, for each trainable weight it uses, a term
(``tf_dp.core.ghost.terms``) from which the private step forms every example's gradient
norm and the clipped sum without materialising per-example gradients (Goodfellow 2015;
Li et al. 2022; Bu et al. 2022). See docs/extending.md for a worked example.
"""

from __future__ import annotations

import inspect
from typing import Callable

_RULES: dict[type, Callable] = {}


def register_ghost_rule(*layer_classes: type):
    """Registers ``rule(layer, ctx, inputs, *args, **kwargs) -> outputs`` for layer classes.

    The rule replaces the layer's ``call`` while the private step captures the forward pass
    (the layer's own ``__call__`` still runs: masking, autocasting, building). It must:

    * compute exactly what ``layer.call`` computes;
    * read each weight with ``ctx.read(weight, dtype)`` (a weight read any other way counts
      as used outside the rule, and goes to the exact vectorized fallback);
    * record a term for each such weight: ``ctx.outer(...)``, ``ctx.embedding(...)`` or
      ``ctx.direct(...)``, all from tensors whose leading axis is the batch
      (``ctx.batch_input`` checks it);
    * or return ``NotImplemented`` for a configuration it does not cover.

    A rule that raises is not fatal either: its terms are discarded, the layer's own ``call``
    runs, and its weights get exact per-example gradients from the vectorized fallback (a
    warning names the layer). The most derived registered class of a layer wins; a layer
    class may also define its own rule as a method ``ghost_call(self, ctx, inputs, ...)``.

    Example::

        @tf_dp.register_ghost_rule(ScaledDense)
        def _scaled_dense(layer, ctx, inputs):
            x = ctx.batch_input(layer, inputs)
            z = layer.scale * tf.matmul(x, ctx.read(layer.kernel, x.dtype))
            ctx.outer(layer.kernel, z, lambda: layer.scale * x[:, None, :])
            return z

    Raises:
      TypeError: if a ``layer_classes`` entry is not a class.
    """
    if not layer_classes:
        raise TypeError("`layer_classes`: register_ghost_rule needs at least one layer class.")
    for cls in layer_classes:
        if not inspect.isclass(cls):
            raise TypeError(f"`layer_classes` must be classes, got {cls!r}.")

    def deco(rule):
        if not callable(rule):
            raise TypeError(f"A ghost rule must be callable, got {rule!r}.")
        for cls in layer_classes:
            _RULES[cls] = rule
        return rule

    return deco


def rule_for(layer):
    """The rule covering ``layer`` (its class's ``ghost_call`` or the registered rule of the
    most derived class), or None."""
    own = getattr(type(layer), "ghost_call", None)
    if own is not None:
        return own
    for cls in type(layer).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def registered_classes() -> list:
    """The layer classes with a registered rule (for the coverage table)."""
    return list(_RULES)
