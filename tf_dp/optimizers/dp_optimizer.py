"""What every tf_dp optimizer shares: the DP configuration, noise once per logical step,
normalisation by the expected batch size, and the refusal to run outside a private step."""

from __future__ import annotations

import math
import os

import tensorflow as tf

from tf_dp.core import private_step

_PLAIN_MODEL_MESSAGE = (
    "{name} is a differentially private optimizer but was called by a plain Keras train "
    "step, which would train WITHOUT privacy (no per-example clipping). Wrap the model with "
    "`tf_dp.keras.make_private(model)` (or build it as tf_dp.keras.DPSequential / DPModel) "
    "before compile().")


def validate_dp_args(l2_norm_clip, noise_multiplier, gradient_accumulation_steps,
                     norm_strategy, seed):
    """Raises ValueError/TypeError naming the argument for each bad DP argument."""
    if isinstance(l2_norm_clip, bool) or not isinstance(l2_norm_clip, (int, float)):
        raise TypeError(f"`l2_norm_clip` must be a number, got {l2_norm_clip!r}.")
    if not l2_norm_clip > 0 or math.isnan(l2_norm_clip):
        raise ValueError(f"`l2_norm_clip` must be > 0, got {l2_norm_clip}.")
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)):
        raise TypeError(f"`noise_multiplier` must be a number, got {noise_multiplier!r}.")
    if not noise_multiplier >= 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"`noise_multiplier` must be finite and >= 0, got {noise_multiplier}.")
    if gradient_accumulation_steps is not None and (
            isinstance(gradient_accumulation_steps, bool)
            or not isinstance(gradient_accumulation_steps, int)
            or gradient_accumulation_steps < 1):
        raise ValueError("`gradient_accumulation_steps` must be an integer >= 1, got "
                         f"{gradient_accumulation_steps!r}.")
    if norm_strategy not in private_step.NORM_STRATEGIES:
        raise ValueError(f"`norm_strategy` must be one of {private_step.NORM_STRATEGIES}, "
                         f"got {norm_strategy!r}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"`seed` must be an int or None, got {seed!r}.")


class DPOptimizerMixin:
    """Mixed into a Keras optimizer class (before it in the bases) to make it private.

    The private train step (``tf_dp.keras.DPModel``) clips per example and calls
    ``apply_private``; this class adds the Gaussian noise once per logical step, scales by
    the expected batch size and hands the result to the Keras update rule.
    """

    _dp_keys = ("l2_norm_clip", "noise_multiplier", "seed", "norm_strategy")

    def _init_dp(self, l2_norm_clip, noise_multiplier, seed, norm_strategy):
        # Arguments were validated by `validate_dp_args` before the Keras base __init__.
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.norm_strategy = norm_strategy
        self.seed = seed
        # An unseeded optimizer draws its noise seed from the OS: noise must be unpredictable.
        self._noise_seed = seed if seed is not None else int.from_bytes(os.urandom(4),
                                                                         "little") >> 1
        self._inside_private_step = False

    @staticmethod
    def _keras_accumulation(gradient_accumulation_steps):
        # Keras accumulates (and all-reduces across replicas) for k >= 2; k = 1 means none.
        k = gradient_accumulation_steps or 1
        return None if k == 1 else k

    @property
    def accumulation_steps(self) -> int:
        return self.gradient_accumulation_steps or 1

    def apply(self, grads, trainable_variables=None):
        if not self._inside_private_step:
            raise RuntimeError(_PLAIN_MODEL_MESSAGE.format(name=type(self).__name__))
        return super().apply(grads, trainable_variables)

    def apply_private(self, clipped_sums, variables, expected_batch_size, noise_masks=None):
        """Adds noise once per logical step, normalises and applies the update.

        Args:
          clipped_sums: ``sum_i w_i g_i`` per variable for this replica's micro-batch.
          variables: the variables they belong to.
          expected_batch_size: the expected size of one *global* micro-batch (q*N under
            Poisson sampling), never the realised one.
          noise_masks: optional per-variable 0/1 masks (None entries allowed): noise is
            multiplied by them (LSG's frozen entries get none).
        """
        k = self.accumulation_steps
        is_last = tf.equal((self._iterations + 1) % k, 0) if k > 1 else tf.constant(True)
        ctx = tf.distribute.get_replica_context()
        replica_id = ctx.replica_id_in_sync_group if ctx is not None else 0
        first_replica = tf.equal(tf.cast(replica_id, tf.int32), 0)
        stddev = self.noise_multiplier * self.l2_norm_clip
        seed = tf.stack([tf.constant(self._noise_seed, tf.int64),
                         tf.cast(self.iterations, tf.int64)])
        shapes = [(v.shape, g.dtype) for g, v in zip(clipped_sums, variables)]
        if stddev > 0:
            add = tf.logical_and(is_last, first_replica)
            noise = tf.cond(
                add, lambda: private_step.gaussian_noise(shapes, stddev, seed),
                lambda: [tf.zeros(s, d) for s, d in shapes])
        else:
            noise = [tf.zeros(s, d) for s, d in shapes]
        if noise_masks is not None:
            noise = [n if m is None else n * tf.cast(m, n.dtype)
                     for n, m in zip(noise, noise_masks)]
        scale = 1.0 / tf.cast(expected_batch_size, tf.float32)
        grads = [(g + n) * tf.cast(scale, g.dtype) for g, n in zip(clipped_sums, noise)]
        self._inside_private_step = True
        try:
            self.apply(grads, variables)
        finally:
            self._inside_private_step = False

    def _dp_config(self):
        return {k: getattr(self, k) for k in self._dp_keys}
