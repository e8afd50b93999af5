"""Which variables the private step privatizes: the ``GradientCarrier`` seam.

    Plain()      the trainable variables themselves
    LowRank(...) RGP (Yu et al. 2021): a layer's kernel W is replaced, for privacy, by its
                 gradient carriers L, R (W = L R + sg(W - L R)); per-example norms, clipping
                 and noise act on L, R (and the other trainable variables); after the noise,
                 W's gradient is rebuilt as dL R + L dR - L L^T dL R (Corollary 2.1.1).
                 LSG (Ito et al.) is its sparsity option: noise masks zero the frozen
                 rows / columns of the carriers.

A carrier is chosen per model by ``carrier_for(model)``: ``LowRank`` when the model holds
trainable layers following the ``LowRankLayer`` protocol (``tf_dp.layers.ReparamDense``,
``ReparamConv2D``, ``ReparamEinsumDense``, or any layer with these methods), else
``Plain``. ``core`` knows those layers only through the protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tf_dp import _internals


@runtime_checkable
class LowRankLayer(Protocol):
    """What a layer provides to be trained through gradient carriers (RGP / LSG)."""

    kernel: object  # the weight the carriers stand for

    def carrier_variables(self) -> list:
        """[left, right] carriers: the variables per-example gradients are taken of."""

    def noise_masks(self) -> list:
        """[left, right] 0/1 masks broadcastable to the carriers (all ones without LSG)."""

    def update_carriers(self) -> None:
        """New carriers (and masks) for the coming step, from public information."""

    def reconstruct_gradient(self, grad_left, grad_right):
        """The kernel's gradient from the noised carrier gradients (post-processing)."""


class GradientCarrier:
    """Base class: what is privatized and how its noised gradients reach the weights."""

    def __init__(self, trainable):
        self.trainable = list(trainable)  # what the optimizer updates

    @property
    def privatized(self) -> list:
        """The variables that get per-example gradients, clipping and noise."""
        return self.trainable

    @property
    def noise_masks(self) -> list:
        """Per privatized variable: None or a 0/1 mask the noise is multiplied by."""
        return [None] * len(self.privatized)

    def begin_step(self) -> None:
        """Prepares the carriers of a step (before its per-example gradients)."""
        # An explicit statement: AutoGraph cannot convert a docstring-only body (it warned
        # "could not transform begin_step" on every trace).
        return None

    def to_trainable(self, grads, variables):
        """Maps noised gradients of ``privatized`` to gradients of ``trainable``."""
        return grads, variables


class Plain(GradientCarrier):
    """The trainable variables carry their own gradients."""


class LowRank(GradientCarrier):
    """RGP / LSG gradient carriers for ``layers`` (``LowRankLayer``s), plain for the rest."""

    def __init__(self, trainable, layers):
        super().__init__(trainable)
        self.layers = list(layers)
        kernels = {id(layer.kernel) for layer in self.layers}
        self._privatized = [v for v in self.trainable if id(v) not in kernels]
        self._plain = len(self._privatized)
        for layer in self.layers:
            self._privatized += list(layer.carrier_variables())

    @property
    def privatized(self):
        return self._privatized

    @property
    def noise_masks(self):
        """The LSG masks as they are NOW, read at each access: ``begin_step`` recomputes them
        from the current weights, and the noise must be masked like the clipped sum it is
        added to. (A snapshot taken when the carrier was made, before ``begin_step``, left
        every newly kept unit with a clipped sum and no noise: session 13 audit.)"""
        masks = [None] * self._plain
        for layer in self.layers:
            masks += list(layer.noise_masks())
        return masks

    def begin_step(self):
        for layer in self.layers:
            layer.update_carriers()

    def to_trainable(self, grads, variables):
        by_id = {id(v): g for g, v in zip(grads, variables)}
        kernels = {id(layer.kernel): layer for layer in self.layers}
        out = []
        for v in self.trainable:
            if id(v) in kernels:
                left, right = kernels[id(v)].carrier_variables()
                out.append(kernels[id(v)].reconstruct_gradient(by_id[id(left)],
                                                               by_id[id(right)]))
            else:
                out.append(by_id[id(v)])
        return out, list(self.trainable)


def carrier_for(model) -> GradientCarrier:
    """``LowRank`` over the model's trainable low-rank layers, or ``Plain``."""
    trainable = list(model.trainable_variables)
    layers = [layer for layer in _internals.all_layers(model)
              if isinstance(layer, LowRankLayer) and layer.trainable
              and layer.kernel.trainable]
    return LowRank(trainable, layers) if layers else Plain(trainable)
