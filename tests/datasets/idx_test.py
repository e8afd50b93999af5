"""IDX parsing and gzip header restoration, on tiny synthetic files (and Debian's if present)."""

import gzip
import hashlib
import struct
import sys

import numpy as np
import pytest

from tf_dp.datasets import DEBIAN_FASHION_MNIST_DIR
from tf_dp.datasets.idx import read_idx_images, read_idx_labels, restore_gzip_header
from tf_dp.datasets.fashion_mnist import UPSTREAM_CHECKSUMS


def _idx_bytes(magic, shape, data):
    return struct.pack(">I", magic) + struct.pack(f">{len(shape)}I", *shape) + bytes(data)


def _write(path, payload, compress=True):
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path


def test_reads_images_gzipped_and_plain(tmp_path):
    pixels = np.arange(3 * 4 * 5, dtype=np.uint8)
    payload = _idx_bytes(0x803, (3, 4, 5), pixels)
    for compress in (True, False):
        x = read_idx_images(_write(tmp_path / f"img{compress}", payload, compress))
        assert x.shape == (3, 4, 5) and x.dtype == np.uint8
        np.testing.assert_array_equal(x.ravel(), pixels)
        assert x.flags.writeable


def test_reads_labels_as_int64(tmp_path):
    y = read_idx_labels(_write(tmp_path / "lbl.gz", _idx_bytes(0x801, (4,), [3, 0, 9, 1])))
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, [3, 0, 9, 1])


def test_wrong_magic_number_raises(tmp_path):
    labels = _write(tmp_path / "lbl.gz", _idx_bytes(0x801, (2,), [1, 2]))
    with pytest.raises(ValueError, match="bad IDX magic number 0x00000801, expected 0x00000803"):
        read_idx_images(labels)


def test_count_mismatch_raises(tmp_path):
    short = _write(tmp_path / "img.gz", _idx_bytes(0x803, (2, 2, 2), [0] * 7))
    with pytest.raises(ValueError, match="header promises"):
        read_idx_images(short)
    with pytest.raises(ValueError, match="too short"):
        read_idx_labels(_write(tmp_path / "tiny.gz", b"\x00\x00"))


def test_restore_gzip_header_on_synthetic_file():
    payload = b"tf_dp " * 100
    original = gzip.compress(payload, mtime=0)
    restored = restore_gzip_header(original, filename="t10k-x", mtime=1504176627)
    assert restored[:4] == b"\x1f\x8b\x08\x08"  # deflate, FNAME only
    assert struct.unpack("<I", restored[4:8])[0] == 1504176627
    assert restored[8:10] == b"\x00\x03"  # XFL 0, OS 3 (Unix)
    assert restored[10:17] == b"t10k-x\x00"
    assert restored[17:] == original[10:]  # compressed stream untouched
    assert gzip.decompress(restored) == payload


def test_restore_gzip_header_strips_every_optional_field():
    payload = b"abc" * 10
    body = gzip.compress(payload)[10:]
    flags = 0x04 | 0x08 | 0x10 | 0x02  # FEXTRA, FNAME, FCOMMENT, FHCRC
    header = b"\x1f\x8b\x08" + bytes([flags]) + b"\x00" * 4 + b"\x02\xff"
    header += struct.pack("<H", 3) + b"xyz" + b"old-name\x00" + b"a comment\x00" + b"\x00\x00"
    restored = restore_gzip_header(header + body, filename="new", mtime=7)
    assert restored == b"\x1f\x8b\x08\x08" + struct.pack("<IBB", 7, 0, 3) + b"new\x00" + body
    assert gzip.decompress(restored) == payload


def test_restore_gzip_header_rejects_non_gzip():
    with pytest.raises(ValueError, match="not a gzip file"):
        restore_gzip_header(b"plain bytes", filename="x", mtime=0)


@pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST_DIR.is_dir(), reason="apt-get install dataset-fashion-mnist"
)
@pytest.mark.parametrize("filename", sorted(UPSTREAM_CHECKSUMS))
def test_restored_debian_files_match_upstream_checksums(filename):
    data = (DEBIAN_FASHION_MNIST_DIR / filename).read_bytes()
    mtime = 1504176606 if filename.startswith("train") else 1504176627
    restored = restore_gzip_header(data, filename=filename[: -len(".gz")], mtime=mtime)
    size, digest = UPSTREAM_CHECKSUMS[filename]
    assert len(restored) == size
    assert hashlib.sha256(restored).hexdigest() == digest


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
