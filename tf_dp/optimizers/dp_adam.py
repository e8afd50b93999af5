"""DPAdam: differentially private Adam as a Keras 3 optimizer."""

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin, validate_dp_args


@keras.saving.register_keras_serializable(package="tf_dp")
class DPAdam(DPOptimizerMixin, keras.optimizers.Adam):
    """Differentially private Adam: Adam applied to the clipped, noised mean gradient.

    ```
    w_i = min(1, C / ||g_i||)
    g   = (sum_i w_i g_i + N(0, sigma^2 C^2 I)) / E      # E = expected batch size
    m, v <- Adam moments of g ; theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)
    ```

    Adam's moments are post-processing of the noised gradient, so the privacy guarantee is
    that of DP-SGD with the same sigma, sampling rate and steps.

    Args:
      l2_norm_clip: the clipping norm C (> 0).
      noise_multiplier: sigma (>= 0).
      learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay: as in
        ``keras.optimizers.Adam``.
      gradient_accumulation_steps: micro-batches per logical step (noise once per step).
      seed: debugging only. None (default): noise from fresh OS entropy, never saved
        or replayed. An int makes the noise a public function of the seed, so the
        privacy guarantee does not hold (a warning says so).
      norm_strategy: "auto", "ghost" or "vmap".
      **kwargs: other ``keras.optimizers.Optimizer`` arguments.

    Reference: Abadi et al. 2016 (DP-SGD); Kingma & Ba 2015 (Adam).
    """

    def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.001, beta_1=0.9,
                 beta_2=0.999, epsilon=1e-7, amsgrad=False, weight_decay=None,
                 gradient_accumulation_steps=1, seed=None, norm_strategy="auto", name="DPAdam",
                 **kwargs):
        validate_dp_args(l2_norm_clip, noise_multiplier, gradient_accumulation_steps,
                         norm_strategy, seed)
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, amsgrad=amsgrad, weight_decay=weight_decay, name=name,
                         **kwargs)
        self._init_dp(l2_norm_clip, noise_multiplier, seed, norm_strategy,
                      gradient_accumulation_steps)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}
