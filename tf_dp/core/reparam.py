"""Which variables the private step privatizes, and how their gradients map back.

Plain models privatize their trainable variables. Reparametrized layers (RGP / LSG,
``tf_dp.layers``) swap their kernel W for the gradient carriers L, R: the per-example
gradients, clipping and noise act on the carriers (and the other trainable variables), and
after the noise W's gradient is rebuilt as dL R + L dR - L L^T dL R (Yu et al. 2021,
Corollary 2.1.1) before the inner optimizer's update.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class GradientPlan:
    trainable: list  # what the optimizer updates
    privatized: list  # what gets per-example gradients, clipping and noise
    noise_masks: list  # per privatized variable: None or a 0/1 mask (LSG)
    layers: list  # reparametrized layers, in order

    def update_carriers(self):
        for layer in self.layers:
            layer.update_carriers()

    def to_trainable(self, grads, variables):
        """Maps noised gradients of ``privatized`` to gradients of ``trainable``."""
        if not self.layers:
            return grads, variables
        by_id = {id(v): g for g, v in zip(grads, variables)}
        kernels = {id(layer.kernel): layer for layer in self.layers}
        out = []
        for v in self.trainable:
            if id(v) in kernels:
                layer = kernels[id(v)]
                left, right = layer.carrier_variables()
                out.append(layer.reconstruct_gradient(by_id[id(left)], by_id[id(right)]))
            else:
                out.append(by_id[id(v)])
        return out, list(self.trainable)


def gradient_plan(model) -> GradientPlan:
    trainable = list(model.trainable_variables)
    try:
        from tf_dp.layers import reparam_layers
    except ImportError:  # pragma: no cover
        layers = []
    else:
        layers = reparam_layers(model)
    layers = [layer for layer in layers if layer.trainable and layer.kernel.trainable]
    if not layers:
        return GradientPlan(trainable, trainable, [None] * len(trainable), [])
    kernels = {id(layer.kernel) for layer in layers}
    privatized = [v for v in trainable if id(v) not in kernels]
    masks = [None] * len(privatized)
    for layer in layers:
        privatized += list(layer.carrier_variables())
        masks += list(layer.noise_masks())
    return GradientPlan(trainable, privatized, masks, layers)
