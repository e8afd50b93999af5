"""Private Keras models: ``make_private(model)``, ``DPSequential``, ``DPModel``,
``load_model`` for saved private models, ``validate(model, fix=...)`` and ``BudgetJournal``
(the spent budget written ahead of every step, for restarts after a crash)."""

from tf_dp.keras.budget_journal import BudgetJournal
from tf_dp.keras.dp_model import (DPModel, DPSequential, DPTrainMixin, make_private,
                                  private_subclass)
from tf_dp.keras.validate import Finding, validate


def load_model(filepath, custom_objects=None, compile=True, safe_mode=True):
    """``keras.saving.load_model`` with every tf_dp class registered (models, optimizers,
    layers); the loaded model keeps its spent privacy budget (it never goes down).

    A private subclassed model (``make_private(MyModel())``) is remade from its base class,
    which must be registered (``keras.saving.register_keras_serializable``) or given in
    ``custom_objects``, as for any subclassed Keras model.
    """
    import keras

    import tf_dp.layers  # noqa: F401 (registers the reparametrized layers)
    import tf_dp.optimizers  # noqa: F401 (registers the DP optimizers)

    with keras.saving.custom_object_scope(custom_objects or {}):
        for base_name in _private_bases(filepath):
            base = keras.saving.get_registered_object(base_name, custom_objects)
            if base is None:
                raise ValueError(f"`filepath` holds a private model of class {base_name!r}, "
                                 "which is not registered: register it with keras.saving."
                                 "register_keras_serializable or pass it in `custom_objects`.")
            private_subclass(base)
    return keras.saving.load_model(filepath, custom_objects=custom_objects, compile=compile,
                                   safe_mode=safe_mode)


def _private_bases(filepath):
    """Registered names of the base classes of private subclassed models in a .keras file."""
    import json
    import zipfile

    if not str(filepath).endswith(".keras") or not zipfile.is_zipfile(filepath):
        return []
    with zipfile.ZipFile(filepath) as archive:
        config = json.loads(archive.read("config.json"))
    found = []

    def visit(node):
        if isinstance(node, dict):
            extra = node.get("tf_dp")
            if isinstance(extra, dict) and extra.get("base_class"):
                found.append(extra["base_class"])
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    return found


__all__ = ["BudgetJournal", "DPModel", "DPSequential", "DPTrainMixin", "Finding", "load_model", "make_private",
           "validate"]
