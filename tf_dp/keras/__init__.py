"""Private Keras models: ``make_private(model)``, ``DPSequential``, ``DPModel``, and
``load_model`` for saved private models."""

from tf_dp.keras.dp_model import DPModel, DPSequential, DPTrainMixin, make_private


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
    """``keras.saving.load_model`` with every tf_dp class registered (models, optimizers,
    layers); the loaded model keeps its spent privacy budget (it never goes down)."""
    import keras

    import tf_dp.layers  # noqa: F401 (registers the reparametrized layers)
    import tf_dp.optimizers  # noqa: F401 (registers the DP optimizers)

    return keras.saving.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                   safe_mode=safe_mode)


__all__ = ["DPModel", "DPSequential", "DPTrainMixin", "load_model", "make_private"]
