"""DPSGD: differentially private SGD (Abadi et al. 2016) as a Keras 3 optimizer."""

import keras

from tf_dp.optimizers.dp_optimizer import DPOptimizerMixin


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
      {{dp_args}}
      learning_rate, momentum, nesterov, weight_decay: as in ``keras.optimizers.SGD``.
      **kwargs: other ``keras.optimizers.Optimizer`` arguments (clipnorm, use_ema, name, ...).

    Reference: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    """
