"""DPSGDJL: DP-SGD with per-example norms estimated by JL projections."""

import keras

from tf_dp.optimizers.dp_sgd import DPSGD
from tf_dp.optimizers.dp_optimizer import JLAlias


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSGDJL(JLAlias, DPSGD):
    """``DPSGD(..., norm_strategy=tf_dp.JL(num_projections))``: DP-SGD whose per-example
    gradient norms come from r JL projections.

    ```
    v_1..v_r ~ N(0, I)                       # fresh each step, from a secret stream
    P_ij = <grad l_i, v_j>  (forward-mode AD, one JVP per direction)
    M_i  = sqrt(mean_j P_ij^2)                         # E[M_i^2] = ||grad l_i||^2
    g    = (grad sum_i l_i / max(1, M_i / C) + N(0, sigma^2 C^2 I)) / E
    ```

    Works for any Keras model (recurrent, attention, custom layers) at close to
    non-private memory: no per-example gradient is ever formed. Each step is accounted as
    the JL mechanism (the clipped contribution has norm <= C sqrt(r / chi2_r)), whose epsilon
    is much larger than exact clipping's for small r: use small r for fast hyper-parameter
    search and large r (or exact clipping) for the final run.

    Args:
      l2_norm_clip: C (> 0).
      noise_multiplier: sigma (>= 0).
      num_projections: r >= 1, the number of JL projections.
      **kwargs: the arguments of ``DPSGD`` (learning rate, ..., gradient_accumulation_steps,
        seed).

    Reference: Bu, Gopi, Kulkarni, Lee, Shen, Tantipongpipat, "Fast and Memory Efficient
    Differentially Private-SGD via JL Projections", NeurIPS 2021 (Algorithm 1).
    """
