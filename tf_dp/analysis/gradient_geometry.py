"""`GradientGeometry`: per-epoch stable rank and historical alignment of kernel gradients."""

from __future__ import annotations

import logging
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_dp.analysis import geometry
from tf_dp.layers._reparam_layer import kernel_gradients

_LOG = logging.getLogger("tf_dp")

NOT_PRIVATE_WARNING = (
    "tf_dp: GradientGeometry reads the raw (unclipped, un-noised) gradient of its analysis "
    "batch. If that batch is private data, its statistics (stable rank, residuals) are NOT "
    "covered by the model's differential-privacy guarantee: keep them out of anything you "
    "release, or give the callback public data.")


class GradientGeometry(keras.callbacks.Callback):
    """Logs the stable rank of kernel gradients and their alignment with the historical update.

    Once per epoch, for each chosen kernel ``W`` (Dense, Conv, EinsumDense, ...; seen as a
    ``[m, n]`` matrix, ``tf_dp.analysis.kernel_matrix``) and a fixed analysis batch::

        G        = ∂ loss(batch) / ∂W                  (the batch-mean gradient at W_t)
        stable_rank/<layer>             = ‖G‖_F² / ‖G‖_2²
        residual_history_r<r>/<layer>   = ‖(I − P_L) G (I − P_R)‖_F / ‖G‖_F
                                          L, R: top-r singular vectors of W_t − W_0
        residual_random_r<r>/<layer>    = the same for uniformly random L, R of rank r
                                          (mean over `random_draws` draws)

    ``W_0`` is the kernel when training begins (``on_train_begin``; ``reset_reference`` moves
    it). The values go into the epoch's ``logs``, so ``History``, ``CSVLogger`` and
    ``TensorBoard`` record them. A small history residual at small ``r`` is RGP's premise
    (Yu et al., ICML 2021, §3–4): carriers built from the historical update keep most of the
    current gradient. Cost: one forward and backward pass on the analysis batch and one SVD
    per kernel and epoch, nothing per step.

    **Not private.** ``G`` is the raw gradient of the analysis batch, neither clipped nor
    noised. If the batch is private (training) data, the logged statistics are outside the
    model's (ε, δ) guarantee (a one-time warning says so); on public data they are
    post-processing of the private weights and cost no privacy.

    Args:
        x: analysis inputs (array or anything the model accepts), a few hundred examples.
        y: analysis targets, for the model's compiled loss.
        layers: layers or layer names whose ``kernel`` to measure; None (default) takes every
            layer with a trainable kernel of 2 or more axes. An RGP/LSG layer
            (`tf_dp.layers.reparametrize`) is measured at its effective weight: ``G`` is the
            full ``∂loss/∂W``, which its training never forms (only the carriers' gradients).
        ranks: the ranks ``r`` of the subspaces (int or sequence of ints ≥ 1); a rank above
            ``min(m, n)`` of a kernel is skipped for that kernel.
        sample_weight: optional per-example weights of the analysis batch.
        random_draws: random subspace pairs averaged for the contrast (≥ 1).

    Reference: Yu, Zhang, Chen, Yin, Liu, "Large Scale Private Learning via Low-rank
    Reparametrization", ICML 2021.
    """

    def __init__(self, x, y, layers=None, ranks=(8,), sample_weight=None, random_draws=8):
        super().__init__()
        if (isinstance(random_draws, bool) or not isinstance(random_draws, numbers.Integral)
                or random_draws < 1):
            raise ValueError(f"`random_draws` must be an integer >= 1, got {random_draws!r}.")
        self.random_draws = int(random_draws)
        if isinstance(ranks, numbers.Integral) and not isinstance(ranks, bool):
            ranks = (ranks,)
        try:
            ranks = tuple(ranks)
        except TypeError:
            raise ValueError(f"`ranks` must be an integer >= 1 or a sequence of them, "
                             f"got {ranks!r}.") from None
        if not ranks or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1
                            for r in ranks):
            raise ValueError(f"`ranks` must be an integer >= 1 or a sequence of them, "
                             f"got {ranks!r}.")
        if layers is not None and (isinstance(layers, (str, keras.layers.Layer))):
            layers = [layers]
        if x is None or y is None:
            raise ValueError("`x` and `y` (the analysis batch) are required, got "
                             f"x={type(x).__name__}, y={type(y).__name__}.")
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.ranks = tuple(int(r) for r in ranks)
        self._requested = None if layers is None else list(layers)
        self._layers = []
        self._reference = {}
        self._warned = False

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        if not self._warned:
            self._warned = True
            _LOG.warning(NOT_PRIVATE_WARNING)
        self._layers = self._resolve_layers()
        if not self._reference:
            self.reset_reference()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs.update(self.measure())

    # ------------------------------------------------------------------ public helpers
    def reset_reference(self):
        """``W_0 ← W`` for every measured kernel (the start of the historical update)."""
        self._layers = self._layers or self._resolve_layers()
        self._reference = {id(layer): layer.kernel.numpy().copy() for layer in self._layers}

    def measure(self) -> dict:
        """The statistics now, as ``{key: float}`` (what ``on_epoch_end`` adds to ``logs``)."""
        self._layers = self._layers or self._resolve_layers()
        gradients = self._gradients()
        values = {}
        for layer, gradient in zip(self._layers, gradients):
            g = geometry.kernel_matrix(gradient)
            values[f"stable_rank/{layer.name}"] = geometry.stable_rank(g)
            reference = self._reference.get(id(layer))
            history = None
            if reference is not None:
                history = geometry.kernel_matrix(layer.kernel.numpy() - reference)
            for r in self.ranks:
                if r > min(g.shape):
                    continue
                if history is not None and np.any(history):
                    values[f"residual_history_r{r}/{layer.name}"] = (
                        geometry.projection_residual(g, history, r))
                else:
                    values[f"residual_history_r{r}/{layer.name}"] = float("nan")
                values[f"residual_random_r{r}/{layer.name}"] = float(np.mean(
                    [geometry.random_projection_residual(g, r)
                     for _ in range(self.random_draws)]))
        return values

    # ------------------------------------------------------------------ internals
    def _resolve_layers(self):
        model = self.model
        if model is None:
            raise ValueError("GradientGeometry has no model yet: pass it to `fit(callbacks=...)` "
                             "or call `set_model` first.")
        if self._requested is None:
            chosen = [layer for layer in _all_layers(model) if _measurable(layer)]
            if not chosen:
                raise ValueError("GradientGeometry found no layer with a trainable kernel of 2 "
                                 "or more axes in the model; pass `layers=`.")
            return chosen
        chosen = []
        for item in self._requested:
            try:
                layer = model.get_layer(item) if isinstance(item, str) else item
            except ValueError:
                raise ValueError(f"`layers` entry {item!r} is not a layer of the model "
                                 f"{model.name!r}.") from None
            kernel = getattr(layer, "kernel", None)
            if kernel is None or len(kernel.shape) < 2:
                raise ValueError(f"`layers` entry {layer.name!r} has no kernel of 2 or more axes.")
            chosen.append(layer)
        return chosen

    def _gradients(self):
        kernels = [layer.kernel for layer in self._layers]
        # An RGP/LSG layer's kernel enters its forward pass as stop_gradient(W); for the
        # analysis its full gradient is taken instead (forward values unchanged).
        with kernel_gradients(self._layers), tf.GradientTape() as tape:
            y_pred = self.model(self.x, training=False)
            loss = self.model.compute_loss(x=self.x, y=self.y, y_pred=y_pred,
                                           sample_weight=self.sample_weight, training=False)
        gradients = tape.gradient(loss, kernels)
        missing = [layer.name for layer, g in zip(self._layers, gradients) if g is None]
        if missing:
            raise ValueError(f"the loss has no gradient with respect to the kernel of {missing}.")
        return [g.numpy() for g in gradients]


def _all_layers(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):  # a nested model: its own layers too
            yield from _all_layers(layer)


def _measurable(layer):
    kernel = getattr(layer, "kernel", None)
    return (kernel is not None and getattr(kernel, "trainable", False)
            and len(kernel.shape) >= 2)
