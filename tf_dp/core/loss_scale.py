"""Fixed loss scaling for private training under the ``mixed_float16`` policy.

In float16 the output gradients of a backward pass underflow below 6e-8, so the loss is
scaled up before it. Keras scales dynamically (``keras.optimizers.LossScaleOptimizer``): it
halves the scale and *skips the step* when a gradient overflows, and doubles it after 2000
clean steps. Both decisions depend on the private data: whether a step was taken reveals that
some example's gradient overflowed, which no clipping bounds (a DP auditor would count the
skip as an unaccounted release). tf_dp therefore uses a fixed, data-independent scale S, a
power of two so that scaling and unscaling are exact in float32:

    per-example loss S * l_i  ->  norms and clip factors of S g_i against S C (float32)
    ->  (sum_i w_i S g_i) / S  =  sum_i w_i g_i

An example whose scaled gradient overflows float16 gets the clip factor 0 (it adds nothing,
which depends on that example alone, so every contribution stays within C); the step is
never skipped or stopped for it. ``tf_dp.core.private_step`` does this for every model that
computes in float16.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tf_dp.core import ghost, private_step

#: The default scale of per-example losses under mixed_float16. Keras starts its dynamic
#: scale at 2^15 for a loss averaged over the batch, i.e. 2^15 / B per example: 2^7-2^10
#: for batches of 32-256. Per-example output gradients of cross-entropy are at most 1, so
#: 2^8 leaves them 256x below float16's largest value (65504) and lifts gradients of 1e-6
#: well above its smallest normal number (6.1e-5).
DEFAULT_LOSS_SCALE = 2.0**8


def fixed_loss_scale(model, loss_scale: float = None):
    """The loss scale a private model trains with: ``loss_scale`` if given, else
    ``DEFAULT_LOSS_SCALE`` when a layer of ``model`` computes in float16, else None (no
    scaling). Decided by the layers' policies, never by the data.

    Raises:
      ValueError: if ``loss_scale`` is not a positive finite power of two.
    """
    if loss_scale is not None:
        if (isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float))
                or not math.isfinite(loss_scale) or loss_scale <= 0
                or math.frexp(loss_scale)[0] != 0.5):
            raise ValueError("`loss_scale` must be a positive power of two (scaling is then "
                             f"exact), got {loss_scale!r}.")
        return float(loss_scale)
    return DEFAULT_LOSS_SCALE if ghost.computes_in_float16(model) else None


@tf.autograph.experimental.do_not_convert
def scaled_clipped_sum(model, x, y, sample_weight, per_example_loss, l2_norm_clip,
                       loss_scale=None, **kwargs) -> private_step.ClippedSum:
    """``private_step.clipped_sum`` of ``loss_scale`` times the per-example loss, unscaled.

    Norms and clip factors are those of the scaled gradients against ``loss_scale * C`` (in
    float32, see ``private_step.clip_factors``); dividing the clipped sums, norms and losses
    by the power of two ``loss_scale`` is exact. ``loss_scale=None`` is ``clipped_sum``.
    ``kwargs`` go to ``clipped_sum`` (variables, norm_strategy, seed).
    """
    if loss_scale is None:
        return private_step.clipped_sum(model, x, y, sample_weight, per_example_loss,
                                        l2_norm_clip, **kwargs)
    scale = float(loss_scale)

    def scaled_loss(y_true, y_pred, weight):
        losses = per_example_loss(y_true, y_pred, weight)
        return losses * tf.cast(scale, losses.dtype)

    res = private_step.clipped_sum(model, x, y, sample_weight, scaled_loss,
                                   l2_norm_clip * scale, **kwargs)
    return private_step.ClippedSum(
        grads=[g * tf.cast(1.0 / scale, g.dtype) for g in res.grads],
        losses=res.losses * tf.cast(1.0 / scale, res.losses.dtype),
        y_pred=res.y_pred,
        norms=res.norms * tf.cast(1.0 / scale, res.norms.dtype))
