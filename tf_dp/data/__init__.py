"""Data pipelines whose sampling matches the privacy accounting."""

from tf_dp.data.poisson import PoissonSampler, expected_steps

__all__ = ["PoissonSampler", "expected_steps"]
