"""Any Keras 3 optimizer, made private: ``make_private_optimizer`` and ``private_class``.

``DPSGD``, ``DPAdam`` and ``DPAdamW`` are hand-written; every other Keras optimizer
(RMSprop, Lion, Lamb — the usual mega-batch optimizer —, Adafactor, ...) gets the same
private update from a class made once per Keras optimizer class::

    g     = (sum_i min(1, C/||g_i||) g_i + N(0, sigma^2 C^2 I)) / E
    theta <- Base(theta, g)          # the Keras optimizer's own rule and state

The classes of every built-in Keras optimizer are made and registered for serialization
when ``tf_dp.optimizers`` is imported, so a saved model compiled with one loads in a fresh
process (``tf_dp>DPLamb``, ...).
"""

from __future__ import annotations

import inspect
import threading

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin

_CLASSES = {}
_LOCK = threading.Lock()

_DOC = """Differentially private {base}: per-example clipping and Gaussian noise, then
    ``keras.optimizers.{base}``'s own update rule.

    ```
    g     = (sum_i min(1, C/||g_i||) g_i + N(0, sigma^2 C^2 I)) / E
    theta <- {base}(theta, g)
    ```

    Made by ``tf_dp.optimizers.private_class(keras.optimizers.{base})``; compile it into a
    private model (``tf_dp.keras.make_private``).

    Args:
      {{{{dp_args}}}}
      **kwargs: the arguments of ``keras.optimizers.{base}`` (learning rate, ...).

    Reference: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    """


def private_class(base: type) -> type:
    """The private version of the Keras optimizer class ``base`` (made once, registered).

    Raises:
      TypeError: if ``base`` is not a ``keras.optimizers.Optimizer`` subclass, is already
        private, or wraps another optimizer (LossScaleOptimizer, MultiOptimizer).
    """
    if not (inspect.isclass(base) and issubclass(base, keras.optimizers.Optimizer)):
        raise TypeError(f"`base` must be a keras.optimizers.Optimizer class, got {base!r}.")
    if issubclass(base, DPOptimizerMixin):
        raise TypeError(f"`base` {base.__name__} is already a tf_dp DP optimizer.")
    if base.__name__ in ("LossScaleOptimizer", "MultiOptimizer"):
        raise TypeError(f"`base` {base.__name__} wraps other optimizers; make those private.")
    with _LOCK:
        if base in _CLASSES:
            return _CLASSES[base]
        name = f"DP{base.__name__}"

        cls = type(name, (DPOptimizerMixin, base), {
            "__doc__": _DOC.format(base=base.__name__), "__module__": __name__})
        cls = keras.saving.register_keras_serializable(package="tf_dp", name=name)(cls)
        _CLASSES[base] = cls
        return cls


def make_private_optimizer(optimizer, l2_norm_clip, noise_multiplier, **dp_kwargs):
    """A private copy of a Keras optimizer instance (its configuration, fresh state).

    ```
    opt = tf_dp.optimizers.make_private_optimizer(
        keras.optimizers.Lamb(learning_rate=1e-3), l2_norm_clip=1.0, noise_multiplier=1.1,
        gradient_accumulation_steps=8)
    ```

    Args:
      optimizer: a ``keras.optimizers.Optimizer`` instance (not yet used for training) or
        class.
      l2_norm_clip, noise_multiplier: C and sigma.
      **dp_kwargs: ``gradient_accumulation_steps``, ``norm_strategy`` (e.g.
        ``tf_dp.JL(5)``), ``seed`` (see ``tf_dp.optimizers.DP_ARGS_DOC``).

    Raises:
      TypeError: for anything but a Keras optimizer; ValueError: if the optimizer uses
        Keras' own ``gradient_accumulation_steps`` (it would add noise at every micro-step:
        pass ``gradient_accumulation_steps`` here instead).
    """
    if inspect.isclass(optimizer):
        return private_class(optimizer)(l2_norm_clip, noise_multiplier, **dp_kwargs)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    config = dict(optimizer.get_config())
    if config.get("gradient_accumulation_steps"):
        raise ValueError("`optimizer` uses Keras' gradient_accumulation_steps="
                         f"{config['gradient_accumulation_steps']}, which would add noise at "
                         "every micro-step; give `gradient_accumulation_steps` to "
                         "make_private_optimizer instead.")
    config.pop("gradient_accumulation_steps", None)
    config.pop("name", None)
    lr = config.get("learning_rate")
    if isinstance(lr, dict):  # a serialized schedule
        config["learning_rate"] = keras.optimizers.schedules.deserialize(lr)
    return private_class(type(optimizer))(l2_norm_clip, noise_multiplier, **dp_kwargs, **config)


def _register_builtins():
    for name in ("Adadelta", "Adafactor", "Adagrad", "Adamax", "Ftrl", "Lamb", "Lion", "Nadam",
                 "RMSprop", "Muon", "ScheduleFreeAdamW"):
        base = getattr(keras.optimizers, name, None)
        if base is not None:
            private_class(base)


_register_builtins()
