"""Exact per-example gradient norms from layer inputs and output gradients ("ghost norms").

During one captured forward pass (``capture``) every layer with a ghost rule records, for
each weight it uses, a term describing that weight's per-example gradient in factored form
(``terms``). One backward pass to the recorded outputs gives the factors of every weight
(``factors``), from which the norms, JL projections and the clipped sum ``sum_i w_i g_i``
are formed without per-example gradients ("book-keeping", Bu et al. 2022, "Differentially
Private Optimization on Large Model at Small Cost"). Every norm comes with an upper bound of
what the sum adds for the example, rounding included (``precision``), so each example's
contribution is bounded by the clipping norm for any input.

Rules live one file per layer family in ``rules/`` and are registered when this package is
imported; users add their own with ``tf_dp.register_ghost_rule`` (docs/extending.md).
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp.core.ghost.capture import GhostContext, capturable_layers, capture
from tf_dp.core.ghost.factors import (FactorOptions, Factors, MaterialisedFactors,
                                      combined_norms, factors_for, joint_weighted_sums)
from tf_dp.core.ghost.precision import (SUM_DTYPE, accumulation_dtype, computes_in_float16,
                                        weighted_per_example_sum)
from tf_dp.core.ghost.registry import register_ghost_rule, registered_classes, rule_for
from tf_dp.core.ghost.terms import DirectTerm, EmbeddingTerm, OuterTerm, conv_patches, rows


def backward(ctx: GhostContext, tape: tf.GradientTape, total_loss,
             options: FactorOptions = FactorOptions()):
    """One backward pass to the recorded outputs: the factors of every covered weight.

    Output gradients reach the factors in float32 (float64 for float64 models) whatever the
    compute dtype. A weight is not covered (left to the vectorized fallback) when one of its
    recorded outputs gets no gradient (used inside a loop the tape cannot see into), when
    its handle gets a gradient of its own (it was also used outside every rule, see
    ``capture``), or when its terms cannot describe it.

    Returns {id(variable): Factors} for the covered weights.
    """
    checks = ctx.finish()  # the batch-axis checks (made at the end of `capture`)
    entries = ctx.terms()
    if not entries:
        return {}
    zs = ctx.outputs()
    handles = [_handle(v) for v, _ in entries.values()]
    seed = None
    if checks:
        # Every output gradient, hence every factor, norm and clipped sum, waits for the
        # batch-axis checks: a layer that mixed examples stops the step with the checks'
        # message before any number is formed from it (not after, by a race).
        with tf.control_dependencies(checks):
            seed = tf.ones_like(total_loss)
    grads = tape.gradient(total_loss, zs + handles, output_gradients=seed,
                          unconnected_gradients=tf.UnconnectedGradients.NONE)
    dz_map = {id(z): None if dz is None else tf.convert_to_tensor(dz)
              for z, dz in zip(zs, grads[:len(zs)])}
    backward_done = [dz for dz in dz_map.values() if dz is not None]

    def dz_for(variable):
        """``dz_of(term)`` for ``variable``'s terms. A weight larger than its term's output
        gradient (per example) gets that gradient only once the whole backward pass has run
        (every output gradient exists): a per-example gradient formed from it as soon as it
        exists would be held, larger than what it replaces, through the rest of the backward
        pass (the CNN's conv2: [B, 256, 32] next to conv1's activations; docs/scaling.md §7).
        A smaller weight's per-example gradient (biases, normalisation scales, a first
        convolution) is formed early and frees its output gradient. Same values either way.
        """
        size = variable.shape.num_elements()

        def dz_of(t):
            dz = dz_map[id(t.z)]
            per_example = t.z.shape[1:].num_elements()
            if size is None or per_example is None or size > per_example:
                with tf.control_dependencies(backward_done):
                    dz = tf.identity(dz)
            return tf.cast(dz, accumulation_dtype(dz.dtype))
        return dz_of

    formed = {}
    # Last recorded weight first, i.e. in the order the backward pass reaches them: the
    # buffers of per-example gradients (rules.conv._in_chunks) are stateful ops, which
    # tf.function runs in the order they were made; made in the forward order, a later
    # layer's buffer would wait for the output gradient of the first layer, the last one
    # the backward pass forms (holding every output gradient until then).
    for (key, (var, terms)), outside in reversed(list(zip(entries.items(),
                                                          grads[len(zs):]))):
        if outside is not None or any(dz_map[id(t.z)] is None for t in terms):
            continue
        factors = factors_for(var, terms, dz_for(var), options)
        if factors is not None:
            formed[key] = factors
    return {key: formed[key] for key in entries if key in formed}


def _handle(variable):
    return variable.value if hasattr(variable, "value") else variable


# Registers the built-in rules (one module per layer family).
from tf_dp.core.ghost import rules  # noqa: E402,F401

__all__ = ["DirectTerm", "EmbeddingTerm", "FactorOptions", "Factors", "GhostContext",
           "MaterialisedFactors", "OuterTerm", "SUM_DTYPE", "accumulation_dtype", "backward",
           "capturable_layers", "capture", "combined_norms", "computes_in_float16",
           "conv_patches", "factors_for", "joint_weighted_sums", "register_ghost_rule", "registered_classes", "rows",
           "rule_for", "weighted_per_example_sum"]
