"""Offline data set loaders: `load(name)` gives NumPy arrays without any download.

Light to import: TensorFlow is loaded only when a tensorflow-datasets copy is actually read.
The readers behind ``load`` (IDX files, the Rotten Tomatoes CSV, the MNIST subset) are in
their modules (``tf_dp.datasets.idx``, ``.text``, ``.mnist``).
"""

from tf_dp.datasets.errors import DatasetNotAvailableError
from tf_dp.datasets.fashion_mnist import (
    DEBIAN_FASHION_MNIST_DIR,
    load_fashion_mnist_idx,
    prepare_fashion_mnist_manual_dir,
)
from tf_dp.datasets.loaders import KNOWN_DATASETS, load

__all__ = [
    "DEBIAN_FASHION_MNIST_DIR",
    "DatasetNotAvailableError",
    "KNOWN_DATASETS",
    "load",
    "load_fashion_mnist_idx",
    "prepare_fashion_mnist_manual_dir",
]
