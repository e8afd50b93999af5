"""Private Keras models: ``make_private(model)``, ``DPSequential``, ``DPModel``."""

from tf_dp.keras.dp_model import DPModel, DPSequential, DPTrainMixin, make_private

__all__ = ["DPModel", "DPSequential", "DPTrainMixin", "make_private"]
