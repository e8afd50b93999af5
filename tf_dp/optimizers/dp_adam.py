"""DPAdam: differentially private Adam as a Keras 3 optimizer."""

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin


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
      {{dp_args}}
      learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay: as in
        ``keras.optimizers.Adam``.
      **kwargs: other ``keras.optimizers.Optimizer`` arguments (clipnorm, use_ema, name, ...).

    Reference: Abadi et al. 2016 (DP-SGD); Kingma & Ba 2015 (Adam).
    """
