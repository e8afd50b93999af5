"""DPAdamJL: DP-Adam with per-example norms estimated by JL projections."""

import keras

from tf_dp.optimizers.dp_adam import DPAdam
from tf_dp.optimizers.dp_optimizer import JLAlias


@keras.saving.register_keras_serializable(package="tf_dp")
class DPAdamJL(JLAlias, DPAdam):
    """``DPAdam(..., norm_strategy=tf_dp.JL(num_projections))`` under its own name (see
    ``tf_dp.optimizers.dp_optimizer.JLAlias`` for the algorithm and its accounting).

    Args:
      l2_norm_clip, noise_multiplier: C and sigma.
      num_projections: r >= 1, the number of JL projections (default 5).
      **kwargs: the arguments of ``DPAdam``.
    """
