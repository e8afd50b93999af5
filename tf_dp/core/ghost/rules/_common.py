"""Checks every built-in rule makes before covering a layer."""

from __future__ import annotations


def covers(layer, cls) -> bool:
    """True if ``layer`` computes exactly what ``cls.call`` does: not overridden by a
    subclass, no LoRA and no quantization (other weights, other formulas)."""
    return type(layer).call is cls.call and not is_variant(layer)


def is_variant(layer) -> bool:
    """LoRA or quantized: other weights, other formulas."""
    return bool(getattr(layer, "lora_enabled", False)) or getattr(
        layer, "quantization_mode", None) is not None


def activation(layer, z):
    return layer.activation(z) if getattr(layer, "activation", None) is not None else z
