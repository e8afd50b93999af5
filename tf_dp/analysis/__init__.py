"""Analysis tools: the measurements the papers behind tf_dp make their case with.

* ``synthetic``: least squares with a chosen feature spectrum and its excess empirical loss
  (Li et al., NeurIPS 2022, §4.1: restricted Lipschitz continuity);
  ``examples/restricted_lipschitz.py``.
* ``geometry``: ``stable_rank``, ``projection_residual`` (alignment of a gradient with the
  top singular subspaces of the historical update ``W − W0``) and the random-subspace
  contrast (Yu et al., RGP, ICML 2021, §3–4); ``GradientGeometry`` logs them per epoch
  during ``fit``; ``examples/gradient_geometry.py``.
* ``spectra``: ``StreamingPCA`` (Frequent Directions: top eigenvalues and principal
  components of a gradient stream in O(ℓ·d) memory); ``GradientSpectrum`` streams gradients
  along ``fit`` into it and ``ProjectedSGD`` re-trains in the top-k subspace (Li et al.,
  NeurIPS 2022, §4.2); ``examples/gradient_spectra.py``.

Statistics of raw gradients of private data are not differentially private; docs/analysis.md
says which numbers are outside the guarantee. The NumPy functions import without TensorFlow;
``GradientGeometry``, ``GradientSpectrum`` and ``ProjectedSGD`` load Keras on first access.
"""

from tf_dp.analysis.geometry import (
    kernel_matrix,
    principal_subspaces,
    projection_residual,
    random_projection_residual,
    random_subspaces,
    stable_rank,
    subspace_residual,
)
from tf_dp.analysis.spectra import StreamingPCA
from tf_dp.analysis.synthetic import (
    excess_empirical_loss,
    least_squares_loss,
    least_squares_optimum,
    linear_regression_data,
    power_law_spectrum,
)

__all__ = [
    "GradientGeometry",
    "GradientSpectrum",
    "ProjectedSGD",
    "StreamingPCA",
    "excess_empirical_loss",
    "kernel_matrix",
    "least_squares_loss",
    "least_squares_optimum",
    "linear_regression_data",
    "power_law_spectrum",
    "principal_subspaces",
    "projection_residual",
    "random_projection_residual",
    "random_subspaces",
    "stable_rank",
    "subspace_residual",
]


def __getattr__(name):
    if name == "GradientGeometry":
        from tf_dp.analysis.gradient_geometry import GradientGeometry

        return GradientGeometry
    if name == "GradientSpectrum":
        from tf_dp.analysis.gradient_spectrum import GradientSpectrum

        return GradientSpectrum
    if name == "ProjectedSGD":
        from tf_dp.analysis.projected_sgd import ProjectedSGD

        return ProjectedSGD
    raise AttributeError(f"module 'tf_dp.analysis' has no attribute {name!r}")
