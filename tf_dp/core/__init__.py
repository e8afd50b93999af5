"""The private-step pipeline: norm strategies, gradient carriers, ghost rules, noise
(docs/design.md)."""

from tf_dp.core.clipping import AdaptiveClipping
from tf_dp.core.carriers import GradientCarrier, LowRank, Plain, carrier_for
from tf_dp.core.ghost import register_ghost_rule
from tf_dp.core.losses import build_per_example_loss
from tf_dp.core.norm_strategies import JL, Auto, ClippedSum, Ghost, NormStrategy, Vectorized
from tf_dp.core.private_step import batch_size_of, clip_factors, clipped_sum, gaussian_noise

__all__ = ["JL", "AdaptiveClipping", "Auto", "ClippedSum", "Ghost", "GradientCarrier", "LowRank", "NormStrategy",
           "Plain", "Vectorized", "batch_size_of", "build_per_example_loss", "carrier_for",
           "clip_factors", "clipped_sum", "gaussian_noise", "register_ghost_rule"]
