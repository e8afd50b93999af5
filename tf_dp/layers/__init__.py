"""Reparametrized layers for RGP / LSG private training, and their carrier math.

Layers (registered for Keras serialization under the ``tf_dp`` package):
`ReparamDense`, `ReparamConv2D`, `ReparamEinsumDense`; `reparametrize(model, rank=...)` swaps
them into a functional or Sequential model, `reparam_layers(model)` lists them. Pure
functions: `power_method`, `gram_schmidt`, `random_carriers`, `reconstruct_update`
(carriers.py) and `unit_importances`, `num_kept_units`, `top_units_mask`, `lsg_masks`
(lsg.py).
"""

from tf_dp.layers._reparam_layer import ReparamLayer
from tf_dp.layers.carriers import gram_schmidt, power_method, random_carriers, reconstruct_update
from tf_dp.layers.lsg import lsg_masks, num_kept_units, top_units_mask, unit_importances
from tf_dp.layers.reparam_conv2d import ReparamConv2D
from tf_dp.layers.reparam_dense import ReparamDense
from tf_dp.layers.reparam_einsum_dense import ReparamEinsumDense
from tf_dp.layers.reparametrize import reparam_layers, reparametrize

__all__ = [
    "ReparamConv2D",
    "ReparamDense",
    "ReparamEinsumDense",
    "ReparamLayer",
    "gram_schmidt",
    "lsg_masks",
    "num_kept_units",
    "power_method",
    "random_carriers",
    "reconstruct_update",
    "reparam_layers",
    "reparametrize",
    "top_units_mask",
    "unit_importances",
]
