"""End to end: Debian's Fashion-MNIST files → tfds manual dir → tfds build, all offline.

Slow (a full tensorflow-datasets build of 70,000 images, about 20 s here), so it is kept out
of the default suite: `pytest -m slow tests/datasets/tfds_offline_test.py`.
"""

import sys

import numpy as np
import pytest

import tf_dp.datasets
from tf_dp.datasets import DEBIAN_FASHION_MNIST_DIR


@pytest.mark.slow
@pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST_DIR.is_dir(), reason="apt-get install dataset-fashion-mnist"
)
def test_tfds_builds_fashion_mnist_from_restored_debian_files(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets")
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "unused"))
    tf_dp.datasets.prepare_fashion_mnist_manual_dir(tmp_path)

    (x_train, y_train), (x_test, y_test) = tf_dp.datasets.load("fashion_mnist", data_dir=tmp_path)

    assert (tmp_path / "fashion_mnist").is_dir()  # it really went through tfds
    assert x_train.shape == (60000, 28, 28) and x_train.dtype == np.uint8
    assert y_train.dtype == np.int64
    # tfds stores the examples in its own order: compare as multisets of (image, label).
    (x_idx, y_idx), (xt_idx, yt_idx) = tf_dp.datasets.load_fashion_mnist_idx(
        DEBIAN_FASHION_MNIST_DIR
    )

    def fingerprint(x, y):
        keys = x.reshape(len(x), -1).astype(np.int64) @ np.arange(1, 785) + 1_000_003 * y
        return np.sort(keys)

    np.testing.assert_array_equal(fingerprint(x_test, y_test), fingerprint(xt_idx, yt_idx))
    np.testing.assert_array_equal(fingerprint(x_train, y_train), fingerprint(x_idx, y_idx))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
