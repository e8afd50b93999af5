"""Swapping a model's Dense / Conv2D / EinsumDense layers for their reparametrized versions."""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tf_dp import _internals
from tf_dp.layers._reparam_layer import ReparamLayer, validate_reparam_args
from tf_dp.layers.reparam_conv2d import ReparamConv2D
from tf_dp.layers.reparam_dense import ReparamDense
from tf_dp.layers.reparam_einsum_dense import ReparamEinsumDense, split_einsum_kernel_axes

# Exact types only: a user subclass of Dense may change `call`, and swapping it would too.
_REPARAM_CLASS = {
    keras.layers.Dense: ReparamDense,
    keras.layers.Conv2D: ReparamConv2D,
    keras.layers.EinsumDense: ReparamEinsumDense,
}
# Keras options the reparam layers accept only as None; dropped from a plain layer's config.
_UNSUPPORTED_KEYS = ("lora_rank", "lora_alpha", "quantization_config", "gptq_unpacked_column_size")


def reparam_layers(model: keras.layers.Layer) -> list[ReparamLayer]:
    """Every reparametrized layer in ``model``, nested layers and models included."""
    return [
        layer
        for layer in _internals.all_layers(model)
        if isinstance(layer, ReparamLayer)
    ]


def _ineligibility(layer) -> str | None:
    """Why ``layer`` cannot be swapped, or None when it can."""
    if type(layer) not in _REPARAM_CLASS:
        return f"its type {type(layer).__name__} is not exactly Dense, Conv2D or EinsumDense"
    if not layer.built:
        return "it is not built"
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "it uses LoRA or quantization"
    if isinstance(layer, keras.layers.Conv2D) and layer.groups != 1:
        return f"it is a grouped convolution (groups={layer.groups})"
    if isinstance(layer, keras.layers.EinsumDense):
        try:
            split_einsum_kernel_axes(layer.equation)
        except ValueError as error:
            return str(error)
    return None


def _matrix_dims(layer) -> tuple[int, int]:
    """``(m, n)`` of the kernel's matrix view, as the reparam layer will see it."""
    shape = tuple(layer.kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        _, kernel_spec, _, input_axes, _ = split_einsum_kernel_axes(layer.equation)
        m = 1
        for axis in input_axes:
            m *= shape[kernel_spec.index(axis)]
        total = 1
        for d in shape:
            total *= d
        return m, total // m
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, shape[-1]


def reparametrize(
    model: keras.Model,
    rank: int,
    sparsity: float | None = None,
    layers: Sequence[str] | None = None,
    **carrier_options,
) -> keras.Model:
    """A copy of ``model`` whose chosen Dense/Conv2D/EinsumDense layers are reparametrized.

    The new model gives the same predictions: every weight is copied in, and each new layer's
    reference weights ``W0`` and carriers are reset from the copied kernel. The original model
    is left untouched; the copy is not compiled.

    Args:
        model: a built functional or Sequential model (nested ones are cloned too).
        rank: carrier rank ``r`` for every swapped layer.
        sparsity: LSG fraction of units to freeze, or None for plain RGP.
        layers: names of the layers to swap; each must be exactly a Dense, Conv2D
            (``groups=1``) or EinsumDense (kernel one matrix) with ``rank <= min(m, n)``.
            None swaps every such layer with ``min(m, n) > rank`` (where the low rank saves
            dimensions).
        **carrier_options: ``power_iterations``, ``warmup_steps``, ``carrier_init``, ``seed``;
            with ``seed = s`` the i-th swapped layer (model order) gets seed ``s + i``.

    Returns:
        The new model. The copy of a private model is private and carries its spent budget
        (the weights are the same: its steps continue that record), its delta and target.
    """
    options = {
        "power_iterations": 1,
        "warmup_steps": 0,
        "carrier_init": "historical",
        "seed": None,
    }
    unknown = set(carrier_options) - set(options)
    if unknown:
        raise ValueError(
            f"`carrier_options` may only hold {sorted(options)}, got {sorted(unknown)}"
        )
    options.update(carrier_options)
    validate_reparam_args(rank, sparsity, **options)
    if not isinstance(model, (keras.Sequential, _internals.functional_class())):
        raise ValueError(
            f"`model` must be a functional or Sequential Keras model, got {type(model).__name__}"
        )
    if not model.built:
        raise ValueError("`model` must be built (call it once or give it an Input) first")

    all_layers = _internals.all_layers(model, include_self=False)
    if layers is None:
        targets = [
            layer
            for layer in all_layers
            if _ineligibility(layer) is None and min(_matrix_dims(layer)) > rank
        ]
    else:
        if isinstance(layers, str):
            raise ValueError(f"`layers` must be a list of layer names, got {layers!r}")
        by_name = {layer.name: layer for layer in all_layers}
        targets = []
        for name in layers:
            if name not in by_name:
                raise ValueError(f"`layers` names {name!r}, which is not a layer of the model")
            reason = _ineligibility(by_name[name])
            if reason is not None:
                raise ValueError(f"`layers` names {name!r}, which cannot be swapped: {reason}")
            m, n = _matrix_dims(by_name[name])
            if rank > min(m, n):
                raise ValueError(
                    f"`rank` must be <= min(m, n) = {min(m, n)} for layer {name!r} (a {m}x{n} "
                    f"kernel matrix), got {rank}"
                )
            targets.append(by_name[name])
    seeds = {}
    for i, layer in enumerate(targets):
        seeds[id(layer)] = None if options["seed"] is None else options["seed"] + i

    copies = []

    def clone_function(layer):
        config = layer.get_config()
        if id(layer) in seeds:
            for key in _UNSUPPORTED_KEYS:
                config.pop(key, None)
            config.update(options, rank=rank, sparsity=sparsity, seed=seeds[id(layer)])
            new_layer = _REPARAM_CLASS[type(layer)].from_config(config)
        else:
            new_layer = layer.__class__.from_config(config)
        copies.append((layer, new_layer))
        return new_layer

    new_model = keras.models.clone_model(model, clone_function=clone_function, recursive=True)
    for layer, new_layer in copies:
        if layer.weights:
            # Plain kernel/bias into a reparam layer resets its W0 and carriers.
            new_layer.set_weights(layer.get_weights())
    return _carry_budget(model, new_model)


def _carry_budget(source, copy):
    """The copy holds the source's weights, so it carries the source's spent budget (the
    same history: the copy's own steps continue it); the copy of a private model is private
    (Keras clones a DPSequential as a plain Sequential). Session 21 audit: the copy of a
    model that had spent 8 steps reported only its own 4 (eps 4.21 for weights that had
    spent 6.45). Returns the copy."""
    spent = getattr(source, "privacy_budget", None)
    if spent is None:
        return copy
    drain = getattr(source, "_dp_drain", None)
    if drain is not None:
        drain()
    if not hasattr(copy, "privacy_budget"):
        from tf_dp.keras import make_private  # noqa: PLC0415 (a cycle)

        copy = make_private(copy, delta=source.privacy_delta,
                            target_epsilon=source.target_epsilon)
    copy.privacy_budget.merge(spent.get_config())
    return copy
