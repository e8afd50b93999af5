"""tf_dp: differentially private deep learning for TensorFlow 2 / Keras 3.

Public optimizers are importable from the top level (``tf_dp.DPAdam``); subpackages
(``tf_dp.keras``, ``tf_dp.data``, ``tf_dp.datasets``, ``tf_dp.accounting``, ``tf_dp.layers``)
are loaded on first access so that ``import tf_dp.accounting`` never needs TensorFlow.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("accounting", "analysis", "core", "data", "datasets", "keras", "layers", "optimizers")
_OPTIMIZERS = ("DPSGD", "DPAdam", "DPAdamW", "DPSGDJL", "DPAdamJL", "DPAdamWJL",
               "make_private_optimizer")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"tf_dp.{name}")
    if name in _OPTIMIZERS:
        return getattr(importlib.import_module("tf_dp.optimizers"), name)
    raise AttributeError(f"module 'tf_dp' has no attribute {name!r}")


def __dir__():
    return sorted(list(_SUBMODULES) + list(_OPTIMIZERS) + ["__version__"])
