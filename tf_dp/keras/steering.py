"""Callbacks that steer training with metrics computed without noise.

Keras' training logs (``loss``, ``accuracy``, every compiled metric) are computed on the
sampled training batches before any clipping or noise, and ``val_*`` on the validation data.
A callback that *decides* something from them — when training stops (``EarlyStopping``,
``TerminateOnNaN``), the learning rate (``ReduceLROnPlateau``), which weights are kept or
saved (``ModelCheckpoint(save_best_only=True)``, ``restore_best_weights``) — makes the
released model a function of those statistics, outside epsilon. One example can flip such a
decision with certainty (an outlier whose loss crosses ``EarlyStopping``'s baseline), so no
(epsilon, delta) covers it: the decision not to act tells as much as acting, so the callback's
presence is enough.

``fit`` calls :func:`steering_caveats` with its callbacks:
- a monitored training metric, or ``val_*`` on ``validation_split`` (rows of the private
  ``x``), voids the guarantee (caveat ``METRIC_STEERED``);
- ``val_*`` on ``validation_data`` is noted (``VALIDATION_STEERED``): within the guarantee
  only if that data is not private;
- tf_dp's own logs (``epsilon``, ``epsilon_exact_clipping``, and ``gradient_snr`` when it is
  estimated from the noised update) are post-processing of the private run: monitoring them
  is free.
Callbacks of the user's own are not inspected (a statement's ``not covered`` line says so).
"""

from __future__ import annotations

import keras

#: logs that are functions of the noised updates and public parameters only.
PUBLIC_LOGS = ("epsilon", "epsilon_exact_clipping")

VOIDING_PREFIX = "METRIC_STEERED"
NOTED_PREFIX = "VALIDATION_STEERED"


def flatten(callbacks):
    """A fit's ``callbacks`` argument as a flat list: None, one callback, any iterable, and
    ``CallbackList``s at any depth (Keras runs the callbacks inside a nested list too)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    elif isinstance(callbacks, keras.callbacks.Callback):
        return [callbacks]
    out = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.CallbackList):
            out.extend(flatten(callback))
        else:
            out.append(callback)
    return out


def _is_monitor_callback(callback):
    # Keras' MonitorCallback (EarlyStopping, ReduceLROnPlateau, ModelCheckpoint and
    # OrbaxCheckpoint) is not exported; its name in the MRO identifies it without importing a
    # private module (OrbaxCheckpoint's would import orbax).
    return any(cls.__name__ == "MonitorCallback" for cls in type(callback).__mro__)


def _decision(callback):
    """(what it decides, the metric it reads) for a callback that steers training, else None."""
    if isinstance(callback, keras.callbacks.TerminateOnNaN):
        return "stops training", "loss"
    monitor = getattr(callback, "monitor", None)
    if not isinstance(monitor, str):
        return None
    if isinstance(callback, keras.callbacks.EarlyStopping):
        what = "stops training" + (" and restores the best weights"
                                   if getattr(callback, "restore_best_weights", False) else "")
        return what, monitor
    if isinstance(callback, keras.callbacks.ReduceLROnPlateau):
        return "lowers the learning rate", monitor
    if _is_monitor_callback(callback) or isinstance(callback, keras.callbacks.ModelCheckpoint):
        if getattr(callback, "save_best_only", False):
            return "chooses which weights are saved", monitor
        return None  # saves every time: the metric is not read
    return None


def steering_caveats(callbacks, *, validation_private: bool, gradient_snr: str | None):
    """The caveats of a fit's ``callbacks`` (list of str; see the module docstring).

    ``validation_private``: the ``val_*`` logs come from rows of the training input
    (``validation_split``). ``gradient_snr``: fit's argument ("private" logs a noised
    estimate, public; "exact" the un-noised norm)."""
    public = PUBLIC_LOGS + (("gradient_snr",) if gradient_snr == "private" else ())
    caveats = []
    for callback in flatten(callbacks):
        decision = _decision(callback)
        if decision is None:
            continue
        what, metric = decision
        if metric in public:
            continue
        name = f"{type(callback).__name__}(monitor={metric!r})"
        if metric.startswith("val_") and not validation_private:
            caveats.append(
                f"{NOTED_PREFIX}: {name} {what} from {metric!r}, computed on validation_data "
                "without noise. This is within the guarantee only if validation_data is not "
                "private data; its examples are not covered by epsilon.")
            continue
        source = ("the validation_split rows of the training input" if metric.startswith("val_")
                  else "the training batches")
        caveats.append(
            f"{VOIDING_PREFIX}: {name} {what} from {metric!r}, computed on {source} without "
            "noise: the released model depends on it outside epsilon, and one example can "
            "change that decision with certainty, so the reported epsilon does NOT hold. "
            "Monitor a metric of public validation data (validation_data=) or 'epsilon', or "
            "train a fixed number of epochs (target_epsilon= stops within the budget).")
    return caveats
