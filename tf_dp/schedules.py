"""Batch-size schedules for private training (Anil et al., "Large-Scale Differentially
Private BERT", 2021, §5.2.2: 262K -> 1M examples per batch over 7.5K steps in four stages).

A schedule gives the expected logical batch size of every logical step; ``fit(x, y,
batch_size=schedule)`` Poisson-samples step t at its own rate q_t = size_t / N, divides the
noised sum by q_t N and records q_t for that step, so the accountant composes the phases as
they ran (heterogeneous composition). TensorFlow-free, so that accounting code can use it.
"""

from __future__ import annotations

import bisect
import numbers
from typing import List, Sequence, Tuple


class PiecewiseBatchSize:
    """Piecewise-constant expected batch size in the logical step.

    ``batch_sizes[0]`` for steps ``[0, boundaries[0])``, ``batch_sizes[i]`` for steps
    ``[boundaries[i-1], boundaries[i])``, ``batch_sizes[-1]`` from ``boundaries[-1]`` on (as
    ``keras.optimizers.schedules.PiecewiseConstantDecay``). Sizes are in the units of fit's
    ``batch_size``: with ``gradient_accumulation_steps=k`` a logical batch is k times the
    size; ``fit(max_physical_batch_size=M)`` keeps any of them within memory.

    Args:
      boundaries: strictly increasing logical step numbers >= 1.
      batch_sizes: one more positive number than ``boundaries``.
    """

    def __init__(self, boundaries: Sequence[int], batch_sizes: Sequence[float]):
        boundaries = list(boundaries)
        batch_sizes = list(batch_sizes)
        for b in boundaries:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
                raise ValueError(f"`boundaries` must be integers >= 1, got {boundaries!r}.")
        if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
            raise ValueError(f"`boundaries` must be strictly increasing, got {boundaries!r}.")
        if len(batch_sizes) != len(boundaries) + 1:
            raise ValueError(f"`batch_sizes` must have one more entry than `boundaries` "
                             f"({len(boundaries) + 1}), got {len(batch_sizes)}.")
        for s in batch_sizes:
            if isinstance(s, bool) or not isinstance(s, numbers.Real) or not s > 0:
                raise ValueError(f"`batch_sizes` must be numbers > 0, got {batch_sizes!r}.")
        self.boundaries = [int(b) for b in boundaries]
        self.batch_sizes = [float(s) for s in batch_sizes]

    def phase(self, step: int) -> int:
        """The index of the phase that logical step ``step`` (from 0) is in."""
        return bisect.bisect_right(self.boundaries, int(step))

    def __call__(self, step: int) -> float:
        return self.batch_sizes[self.phase(step)]

    def phases(self, steps: int, start: int = 0) -> List[Tuple[float, int]]:
        """[(batch size, number of steps)] of the logical steps ``start .. steps - 1`` (the
        first ``steps`` by default)."""
        out = []
        begin = 0
        for i, size in enumerate(self.batch_sizes):
            end = self.boundaries[i] if i < len(self.boundaries) else steps
            end = min(end, steps)
            lo = max(begin, start)
            if end > lo:
                out.append((size, end - lo))
            begin = max(begin, end)
        return out

    def examples_seen(self, steps: int) -> float:
        """Expected number of examples processed in the first ``steps`` logical steps."""
        return sum(size * n for size, n in self.phases(steps))

    def scaled(self, factor: float) -> "PiecewiseBatchSize":
        return PiecewiseBatchSize(self.boundaries, [s * factor for s in self.batch_sizes])

    def get_config(self) -> dict:
        return {"boundaries": list(self.boundaries), "batch_sizes": list(self.batch_sizes)}

    @classmethod
    def from_config(cls, config: dict) -> "PiecewiseBatchSize":
        return cls(**config)

    def __eq__(self, other):
        return isinstance(other, PiecewiseBatchSize) and self.get_config() == other.get_config()

    def __repr__(self):
        return (f"tf_dp.schedules.PiecewiseBatchSize(boundaries={self.boundaries}, "
                f"batch_sizes={self.batch_sizes})")
