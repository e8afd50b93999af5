"""The private-step pipeline: per-example norms, clipping, noise (see DESIGN.md)."""

from tf_dp.core.losses import build_per_example_loss
from tf_dp.core.private_step import (ClippedSum, NORM_STRATEGIES, batch_size_of, clip_factors,
                                     clipped_sum, gaussian_noise)

__all__ = ["ClippedSum", "NORM_STRATEGIES", "batch_size_of", "build_per_example_loss",
           "clip_factors", "clipped_sum", "gaussian_noise"]

# Registers the ghost-norm formulas of the reparametrized layers (tf_dp.layers).
from tf_dp.core import ghost_reparam  # noqa: E402,F401
# ... and of Keras LSTM layers.
from tf_dp.core import ghost_rnn  # noqa: E402,F401
