"""DPAdamW: differentially private Adam with decoupled weight decay."""

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin, validate_dp_args


@keras.saving.register_keras_serializable(package="tf_dp")
class DPAdamW(DPOptimizerMixin, keras.optimizers.AdamW):
    """Differentially private AdamW (decoupled weight decay), as used for DP-BERT.

    ```
    g     = (sum_i min(1, C/||g_i||) g_i + N(0, sigma^2 C^2 I)) / E
    theta <- theta - lr * weight_decay * theta          # decoupled: data independent
    theta <- Adam(theta, g)
    ```

    Args:
      l2_norm_clip: the clipping norm C (> 0).
      noise_multiplier: sigma (>= 0).
      learning_rate, weight_decay, beta_1, beta_2, epsilon, amsgrad: as in
        ``keras.optimizers.AdamW``.
      gradient_accumulation_steps: micro-batches per logical step (noise once per step);
        Anil et al. accumulate to mega-batches this way.
      seed: debugging only. None (default): noise from fresh OS entropy, never saved
        or replayed. An int makes the noise a public function of the seed, so the
        privacy guarantee does not hold (a warning says so).
      norm_strategy: "auto", "ghost" or "vmap".
      **kwargs: other ``keras.optimizers.Optimizer`` arguments.

    Reference: Loshchilov & Hutter 2019 (AdamW); Anil, Ghazi, Gupta, Kumar, Manurangsi,
    "Large-Scale Differentially Private BERT", 2021.
    """

    def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.001, weight_decay=0.004,
                 beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False,
                 gradient_accumulation_steps=1, seed=None, norm_strategy="auto",
                 name="DPAdamW", **kwargs):
        validate_dp_args(l2_norm_clip, noise_multiplier, gradient_accumulation_steps,
                         norm_strategy, seed)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, beta_1=beta_1,
                         beta_2=beta_2, epsilon=epsilon, amsgrad=amsgrad, name=name,
                         **kwargs)
        self._init_dp(l2_norm_clip, noise_multiplier, seed, norm_strategy,
                      gradient_accumulation_steps)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}
