"""`ProjectedSGD`: SGD whose update of chosen variables lies in a fixed k-dimensional subspace."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tf_dp")
class ProjectedSGD(keras.optimizers.SGD):
    """SGD on the projection of the gradient onto a fixed subspace (Li et al. 2022, §4.2).

    The gradients of the chosen variables, flattened and concatenated in the order of
    ``variable_paths`` into one vector ``g`` of length d, are replaced by their orthogonal
    projection onto the span of the orthonormal columns of ``basis`` (d × k) before Keras'
    SGD rule (momentum, Nesterov, weight decay as configured)::

        g ← U (Uᵀ g)                       U = basis, UᵀU = I_k
        theta ← SGD(theta, g)

    Other variables get the plain SGD update. Made private with
    ``tf_dp.make_private_optimizer(ProjectedSGD(U, ...), l2_norm_clip=C, noise_multiplier=σ)``
    the projection acts on the clipped and *noised* gradient (``apply_private`` adds the noise,
    then calls this optimizer's ``apply``): post-processing of a private quantity, so the
    run's (ε, δ) is that of the unprojected run **provided U does not depend on the private
    data** (compute it from public or proxy data, e.g. with ``GradientSpectrum`` on a public
    split; a subspace from private gradients is outside the guarantee). Projecting removes
    the noise in the d − k discarded directions: ‖noise‖² drops from σ²C²d to σ²C²k
    (divided by the batch size squared).

    Args:
        basis: d × k array with orthonormal columns (``StreamingPCA.components(k)``).
        variable_paths: the variables projected, in the order of ``basis``' rows: each entry
            matches the variable whose ``path`` equals it or ends with ``"/" + entry`` (so
            ``"conv1/kernel"`` matches ``"my_model/conv1/kernel"``). None: every variable the
            optimizer updates, in the order it receives them.
        learning_rate, momentum, nesterov, **kwargs: as for ``keras.optimizers.SGD``.

    Reference: Li, Liu, Hashimoto, Inan, Kulkarni, Lee, Thakurta, "When Does Differentially
    Private Learning Not Suffer in High Dimensions?", NeurIPS 2022, §4.2.
    """

    def __init__(self, basis, variable_paths=None, learning_rate=0.01, momentum=0.0,
                 nesterov=False, **kwargs):
        basis = np.asarray(basis, dtype=np.float32)
        if basis.ndim != 2 or basis.shape[1] < 1 or basis.shape[0] < basis.shape[1]:
            raise ValueError(f"`basis` must be a d x k array with 1 <= k <= d, got shape "
                             f"{list(basis.shape)}.")
        gram = basis.T.astype(np.float64) @ basis.astype(np.float64)
        if not np.allclose(gram, np.eye(basis.shape[1]), atol=1e-4):
            raise ValueError("`basis` must have orthonormal columns (basis.T @ basis = I), got "
                             f"max |basis.T @ basis - I| = {np.abs(gram - np.eye(len(gram))).max():.3g}.")
        if variable_paths is not None:
            if isinstance(variable_paths, str) or not all(
                    isinstance(p, str) and p for p in variable_paths):
                raise ValueError("`variable_paths` must be a list of variable paths (strings), "
                                 f"got {variable_paths!r}.")
            variable_paths = list(variable_paths)
            if len(set(variable_paths)) != len(variable_paths):
                raise ValueError(f"`variable_paths` has duplicates: {variable_paths!r}.")
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov,
                         **kwargs)
        self._basis = basis
        self._variable_paths = variable_paths

    @property
    def basis(self) -> np.ndarray:
        """The d × k orthonormal basis of the subspace (a copy)."""
        return self._basis.copy()

    @property
    def variable_paths(self):
        return None if self._variable_paths is None else list(self._variable_paths)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        return super().apply(self.project(grads, variables), trainable_variables)

    def project(self, grads, variables):
        """The gradients with the chosen variables' part replaced by ``U Uᵀ g`` (a new list)."""
        chosen = self._chosen(variables)
        sizes = [int(np.prod(variables[i].shape)) for i in chosen]
        if sum(sizes) != self._basis.shape[0]:
            raise ValueError(f"`basis` has {self._basis.shape[0]} rows but the projected "
                             f"variables have {sum(sizes)} entries "
                             f"({[variables[i].path for i in chosen]}).")
        u = tf.constant(self._basis)  # a graph constant per trace (no state to save)
        flat = tf.concat([tf.reshape(tf.cast(grads[i], u.dtype), [-1]) for i in chosen], 0)
        projected = tf.linalg.matvec(u, tf.linalg.matvec(u, flat, transpose_a=True))
        parts = tf.split(projected, sizes)
        grads = list(grads)
        for i, part in zip(chosen, parts):
            grads[i] = tf.cast(tf.reshape(part, variables[i].shape), grads[i].dtype)
        return grads

    def _chosen(self, variables):
        if self._variable_paths is None:
            return list(range(len(variables)))
        chosen = []
        for entry in self._variable_paths:
            hits = [i for i, v in enumerate(variables)
                    if v.path == entry or v.path.endswith("/" + entry)]
            if len(hits) != 1:
                raise ValueError(f"`variable_paths` entry {entry!r} matches {len(hits)} of the "
                                 f"variables {[v.path for v in variables]}; it must match one.")
            chosen.append(hits[0])
        return chosen

    def get_config(self):
        config = super().get_config()
        config.update({"basis": self._basis.tolist(), "variable_paths": self.variable_paths})
        return config
