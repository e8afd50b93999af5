"""DPSGD: differentially private SGD (Abadi et al. 2016) as a Keras 3 optimizer."""

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin, validate_dp_args


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSGD(DPOptimizerMixin, keras.optimizers.SGD):
    """Differentially private SGD with per-example clipping and Gaussian noise.

    One logical step over a Poisson-sampled batch B with expected size E = q*N:

    ```
    w_i = min(1, C / ||g_i||)                       # per-example clip factor
    g   = (sum_{i in B} w_i g_i + N(0, sigma^2 C^2 I)) / E
    theta <- SGD(theta, g)                          # momentum / nesterov as in keras SGD
    ```

    It must be compiled into a private model (``tf_dp.keras.make_private(model)``,
    ``DPSequential`` or ``DPModel``), whose train step computes the per-example clipping;
    a plain Keras model raises at its first step rather than train without privacy.

    Args:
      l2_norm_clip: the clipping norm C (> 0).
      noise_multiplier: sigma, noise std in units of C (>= 0; 0 gives no privacy).
      learning_rate, momentum, nesterov, weight_decay: as in ``keras.optimizers.SGD``.
      gradient_accumulation_steps: k >= 1 micro-batches per logical step; clipped sums are
        accumulated and noise is added once per logical step.
      seed: debugging only. None (default): noise from fresh OS entropy, never saved
        or replayed. An int makes the noise a public function of the seed, so the
        privacy guarantee does not hold (a warning says so).
      norm_strategy: "auto", "ghost" or "vmap" (how per-example norms are computed).
      **kwargs: other ``keras.optimizers.Optimizer`` arguments (clipnorm, use_ema, name...).

    Reference: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    """

    def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.01, momentum=0.0,
                 nesterov=False, weight_decay=None, gradient_accumulation_steps=1, seed=None,
                 norm_strategy="auto", name="DPSGD", **kwargs):
        validate_dp_args(l2_norm_clip, noise_multiplier, gradient_accumulation_steps,
                         norm_strategy, seed)
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov,
                         weight_decay=weight_decay, name=name,
                         **kwargs)
        self._init_dp(l2_norm_clip, noise_multiplier, seed, norm_strategy,
                      gradient_accumulation_steps)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}
