"""Deterministic stratified train/test splits."""

from __future__ import annotations

import numpy as np


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (train_indices, test_indices), each in a seeded random order.

    Each class contributes ``round(test_fraction * class_count)`` examples to the test split.
    """
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))
