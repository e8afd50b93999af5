"""Offline data set loaders: `load(name)` gives NumPy arrays without any download.

Light to import: TensorFlow is loaded only when a tensorflow-datasets copy is actually read.
"""

from tf_dp.datasets.errors import DatasetNotAvailableError
from tf_dp.datasets.fashion_mnist import (
    DEBIAN_FASHION_MNIST_DIR,
    load_fashion_mnist_idx,
    prepare_fashion_mnist_manual_dir,
)
from tf_dp.datasets.idx import read_idx_images, read_idx_labels, restore_gzip_header
from tf_dp.datasets.loaders import KNOWN_DATASETS, load
from tf_dp.datasets.mnist import load_mnist_subset
from tf_dp.datasets.text import read_rotten_tomatoes_csv

__all__ = [
    "DEBIAN_FASHION_MNIST_DIR",
    "DatasetNotAvailableError",
    "KNOWN_DATASETS",
    "load",
    "load_fashion_mnist_idx",
    "load_mnist_subset",
    "prepare_fashion_mnist_manual_dir",
    "read_idx_images",
    "read_idx_labels",
    "read_rotten_tomatoes_csv",
    "restore_gzip_header",
]
