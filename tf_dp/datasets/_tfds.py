"""Reading tensorflow-datasets copies that are already on disk, without downloading.

The checks here look at the file system first, so that TensorFlow (imported by
tensorflow_datasets) is only loaded when a prepared data set or its raw files are present.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib

import numpy as np


def default_data_dir() -> pathlib.Path:
    """tensorflow-datasets' own default: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return pathlib.Path(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")).expanduser()


def manual_dir(data_dir: pathlib.Path) -> pathlib.Path:
    """Where tensorflow-datasets looks for raw files before downloading them."""
    return data_dir / "downloads" / "manual"


def tfds_installed() -> bool:
    return importlib.util.find_spec("tensorflow_datasets") is not None


def looks_prepared(name: str, data_dir: pathlib.Path) -> bool:
    """Whether `data_dir/name/<version>/dataset_info.json` exists (cheap pre-check)."""
    root = data_dir / name
    return root.is_dir() and any(root.glob("*/dataset_info.json"))


def sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manual_files_match(directory: pathlib.Path, expected: dict[str, tuple[int, str]]) -> bool:
    """Whether every file in `expected` ({name: (size, sha256)}) is in `directory`, intact."""
    for filename, (size, digest) in expected.items():
        path = directory / filename
        if not path.is_file() or path.stat().st_size != size or sha256(path) != digest:
            return False
    return True


def _builder(name: str, data_dir: pathlib.Path):
    import tensorflow_datasets as tfds  # heavy: imports TensorFlow

    return tfds.builder(name, data_dir=os.fspath(data_dir))


def is_prepared(name: str, data_dir: pathlib.Path) -> bool:
    """Whether tensorflow-datasets can read `name` from `data_dir` without preparing it."""
    return tfds_installed() and looks_prepared(name, data_dir) and _builder(
        name, data_dir
    ).is_prepared()


def load_arrays(
    name: str, data_dir: pathlib.Path, *, prepare_from: pathlib.Path | None = None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads the train and test splits of a supervised tfds data set as NumPy arrays.

    Args:
      name: tfds name, with its config if any (``"imdb_reviews/plain_text"``).
      data_dir: the tfds data directory.
      prepare_from: a manual-download directory holding the raw files; when given and the
        data set is not prepared yet, it is built from those files (no network call).
        Without it the data set must already be prepared (see `is_prepared`).
    """
    import tensorflow_datasets as tfds

    builder = _builder(name, data_dir)
    if prepare_from is not None:  # a no-op when the data set is already prepared
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(prepare_from))
        )
    splits = []
    for split in ("train", "test"):
        # Fixed-size batches, concatenated: batch_size=-1 relies on a known cardinality.
        xs, ys = [], []
        for x, y in tfds.as_numpy(builder.as_dataset(split=split, as_supervised=True).batch(8192)):
            xs.append(x)
            ys.append(y)
        splits.append((np.concatenate(xs), np.concatenate(ys).astype(np.int64)))
    return splits[0], splits[1]
