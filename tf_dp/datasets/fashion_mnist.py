"""Fashion-MNIST (Xiao et al. 2017, arXiv:1708.07747): 60,000 / 10,000 28×28 grey images."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from tf_dp.datasets import _tfds
from tf_dp.datasets.errors import DatasetNotAvailableError
from tf_dp.datasets.idx import read_idx_images, read_idx_labels, restore_gzip_header

DEBIAN_FASHION_MNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")

_TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
_TRAIN_LABELS = "train-labels-idx1-ubyte.gz"
_TEST_IMAGES = "t10k-images-idx3-ubyte.gz"
_TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
_FILES = (_TRAIN_IMAGES, _TRAIN_LABELS, _TEST_IMAGES, _TEST_LABELS)

# The upstream files as tensorflow-datasets registers them: {name: (size, sha256)}.
UPSTREAM_CHECKSUMS = {
    _TRAIN_IMAGES: (26421880, "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
    _TRAIN_LABELS: (29515, "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
    _TEST_IMAGES: (4422102, "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
    _TEST_LABELS: (5148, "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
}
# The gzip mtimes of the upstream files (Debian replaced them and dropped the stored names).
_UPSTREAM_MTIME = {"train": 1504176606, "t10k": 1504176627}

INSTALL_HINT = (
    "Install Debian's copy with `apt-get install dataset-fashion-mnist` (files in "
    f"{DEBIAN_FASHION_MNIST_DIR}), or put the four IDX .gz files in `data_dir`."
)


def _find_idx_dir(candidates: list[pathlib.Path]) -> pathlib.Path | None:
    for directory in candidates:
        if all((directory / f).is_file() for f in _FILES):
            return directory
    return None


def load_fashion_mnist_idx(
    directory: str | os.PathLike,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Reads the four Fashion-MNIST IDX .gz files in `directory` (no tensorflow-datasets)."""
    directory = pathlib.Path(directory)
    splits = []
    for images_file, labels_file in ((_TRAIN_IMAGES, _TRAIN_LABELS), (_TEST_IMAGES, _TEST_LABELS)):
        x = read_idx_images(directory / images_file)
        y = read_idx_labels(directory / labels_file)
        if len(x) != len(y):
            raise ValueError(
                f"{directory}: {images_file} holds {len(x)} images but {labels_file} holds "
                f"{len(y)} labels"
            )
        if x.shape[1:] != (28, 28):
            raise ValueError(f"{directory / images_file}: images are {x.shape[1:]}, not 28×28")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise ValueError(f"{directory / labels_file}: labels outside 0..9")
        splits.append((x, y))
    return splits[0], splits[1]


def load_fashion_mnist(
    data_dir: str | os.PathLike | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Fashion-MNIST as ((x_train, y_train), (x_test, y_test)); uint8 (N, 28, 28), int64 (N,).

    Sources, first found wins:
      1. tensorflow-datasets' prepared ``fashion_mnist`` in `data_dir` (default
         ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``), or its raw files with the
         registered checksums in ``<data_dir>/downloads/manual`` (built then, offline; see
         `prepare_fashion_mnist_manual_dir`);
      2. the four IDX .gz files directly in `data_dir`;
      3. Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).
    """
    tfds_dir = pathlib.Path(data_dir).expanduser() if data_dir else _tfds.default_data_dir()
    if _tfds.tfds_installed():
        manual = _tfds.manual_dir(tfds_dir)
        if _tfds.is_prepared("fashion_mnist", tfds_dir):
            return _squeeze(_tfds.load_arrays("fashion_mnist", tfds_dir))
        if _tfds.manual_files_match(manual, UPSTREAM_CHECKSUMS):
            return _squeeze(_tfds.load_arrays("fashion_mnist", tfds_dir, prepare_from=manual))
    candidates = [tfds_dir] if data_dir else []
    found = _find_idx_dir(candidates + [DEBIAN_FASHION_MNIST_DIR])
    if found is None:
        raise DatasetNotAvailableError(
            f"Fashion-MNIST not found: no tensorflow-datasets copy in {tfds_dir} and no IDX "
            f"files in {', '.join(map(str, candidates + [DEBIAN_FASHION_MNIST_DIR]))}. "
            + INSTALL_HINT
        )
    return load_fashion_mnist_idx(found)


def _squeeze(splits):
    # tfds images are (N, 28, 28, 1); the IDX path gives (N, 28, 28).
    return tuple((x.reshape(x.shape[:3]).astype(np.uint8), y) for x, y in splits)


def prepare_fashion_mnist_manual_dir(
    data_dir: str | os.PathLike | None = None,
    source_dir: str | os.PathLike = DEBIAN_FASHION_MNIST_DIR,
) -> pathlib.Path:
    """Writes Debian's Fashion-MNIST files where tensorflow-datasets accepts them offline.

    Debian rewrote only the gzip headers (stored file name dropped, mtime changed); restoring
    them (name without ".gz", mtime 1504176606 for train-*, 1504176627 for t10k-*, XFL 0,
    OS 3) gives the upstream files byte for byte, which tfds then takes from its manual
    directory instead of downloading. The next `load("fashion_mnist", data_dir)` builds the
    tfds copy from them.

    Args:
      data_dir: tensorflow-datasets data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``); files go to ``<data_dir>/downloads/manual``.
      source_dir: where Debian's files are.

    Returns:
      The manual directory written to.

    Raises:
      DatasetNotAvailableError: a source file is missing.
      ValueError: a restored file does not match the registered checksum.
    """
    source_dir = pathlib.Path(source_dir)
    tfds_dir = pathlib.Path(data_dir).expanduser() if data_dir else _tfds.default_data_dir()
    target = _tfds.manual_dir(tfds_dir)
    target.mkdir(parents=True, exist_ok=True)
    for filename, (size, digest) in UPSTREAM_CHECKSUMS.items():
        src = source_dir / filename
        if not src.is_file():
            raise DatasetNotAvailableError(f"{src} not found. " + INSTALL_HINT)
        data = restore_gzip_header(
            src.read_bytes(),
            filename=filename.removesuffix(".gz"),
            mtime=_UPSTREAM_MTIME[filename.split("-")[0]],
        )
        tmp = target / (filename + ".tmp")
        tmp.write_bytes(data)
        if len(data) != size or _tfds.sha256(tmp) != digest:
            tmp.unlink()
            raise ValueError(
                f"{src}: restored file does not match the registered upstream checksum "
                "(a different Debian build of the data?)"
            )
        os.replace(tmp, target / filename)
    return target
