"""Reparametrized layers for RGP / LSG private training.

Layers (registered for Keras serialization under the ``tf_dp`` package):
``ReparamDense``, ``ReparamConv2D``, ``ReparamEinsumDense`` (``ReparamLayer`` their base);
``reparametrize(model, rank=...)`` swaps them into a functional or Sequential model,
``reparam_layers(model)`` lists them. Their carrier math lives in ``tf_dp.layers.carriers``
(power method, reconstruction) and ``tf_dp.layers.lsg`` (LSG unit selection).
"""

from tf_dp.layers._reparam_layer import ReparamLayer
from tf_dp.layers.reparam_conv2d import ReparamConv2D
from tf_dp.layers.reparam_dense import ReparamDense
from tf_dp.layers.reparam_einsum_dense import ReparamEinsumDense
from tf_dp.layers.reparametrize import reparam_layers, reparametrize

__all__ = ["ReparamConv2D", "ReparamDense", "ReparamEinsumDense", "ReparamLayer",
           "reparam_layers", "reparametrize"]
