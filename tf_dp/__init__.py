"""tf_dp: differentially private deep learning for TensorFlow 2 / Keras 3.

The public API (about twenty names) is available from the top level and loaded on first
access, so that ``import tf_dp.accounting`` never needs TensorFlow:

* models: ``make_private``, ``DPModel``, ``DPSequential`` (``tf_dp.keras``);
* optimizers: ``DPSGD``, ``DPAdam``, ``DPAdamW``, the JL aliases ``DPSGDJL``, ``DPAdamJL``,
  ``DPAdamWJL``, and ``make_private_optimizer`` for any Keras optimizer;
* norm strategies: ``Auto``, ``Ghost``, ``Vectorized``, ``JL`` (``NormStrategy`` the base);
* ``register_ghost_rule`` for custom layers (docs/extending.md);
* ``AdaptiveClipping`` (the optimizers' ``adaptive_clipping=``; per-layer clipping is their
  ``per_layer_clipping=``);
* ``PoissonSampler`` (``tf_dp.data``), ``PrivacyAccountant`` and ``compute_epsilon``
  (``tf_dp.accounting``).

Subpackages: ``accounting``, ``analysis``, ``audit``, ``core``, ``data``, ``datasets``, ``keras``,
``layers``, ``optimizers``. docs/design.md says where each part lives.
"""

import importlib
import sys

__version__ = "0.1.0"

_SUBMODULES = ("accounting", "analysis", "audit", "core", "data", "datasets", "keras", "layers",
               "optimizers", "schedules")
_PUBLIC = {
    "DPSGD": "optimizers", "DPAdam": "optimizers", "DPAdamW": "optimizers",
    "DPSGDJL": "optimizers", "DPAdamJL": "optimizers", "DPAdamWJL": "optimizers",
    "make_private_optimizer": "optimizers",
    "make_private": "keras", "DPModel": "keras", "DPSequential": "keras",
    "NormStrategy": "core", "Auto": "core", "Ghost": "core", "Vectorized": "core", "JL": "core",
    "register_ghost_rule": "core", "AdaptiveClipping": "core",
    "PoissonSampler": "data",
    "PrivacyAccountant": "accounting", "compute_epsilon": "accounting",
}


def _register_keras_classes():
    """Imports the modules that register tf_dp's Keras classes (models, optimizers, layers)
    for deserialization, so that ``keras.saving.load_model`` finds them after ``import
    tf_dp``. Done at import only when Keras is already loaded: ``import tf_dp.accounting``
    alone must not load TensorFlow. ``tf_dp.keras.load_model`` always works."""
    for module in ("keras", "optimizers", "layers"):
        importlib.import_module(f"tf_dp.{module}")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"tf_dp.{name}")
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"tf_dp.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'tf_dp' has no attribute {name!r}")


def __dir__():
    return sorted(list(_SUBMODULES) + list(_PUBLIC) + ["__version__"])


if "keras" in sys.modules:
    _register_keras_classes()
