"""DPAdamW: differentially private Adam with decoupled weight decay."""

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin


@keras.saving.register_keras_serializable(package="tf_dp")
class DPAdamW(DPOptimizerMixin, keras.optimizers.AdamW):
    """Differentially private AdamW (decoupled weight decay), as used for DP-BERT.

    ```
    g     = (sum_i min(1, C/||g_i||) g_i + N(0, sigma^2 C^2 I)) / E
    theta <- theta - lr * weight_decay * theta          # decoupled: data independent
    theta <- Adam(theta, g)
    ```

    Args:
      {{dp_args}}
      learning_rate, weight_decay, beta_1, beta_2, epsilon, amsgrad: as in
        ``keras.optimizers.AdamW``.
      **kwargs: other ``keras.optimizers.Optimizer`` arguments (clipnorm, use_ema, name, ...).

    Reference: Loshchilov & Hutter 2019 (AdamW); Anil, Ghazi, Gupta, Kumar, Manurangsi,
    "Large-Scale Differentially Private BERT", 2021.
    """
