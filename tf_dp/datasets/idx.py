"""IDX files (the MNIST family's format) and their gzip headers.

IDX layout (big-endian): a 4-byte magic ``0x00 0x00 <dtype code> <ndim>``, then ``ndim``
uint32 dimension sizes, then the data. Images (magic 2051) carry a 16-byte header
``(count, rows, cols)``; labels (magic 2049) an 8-byte header ``(count,)``.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

IMAGES_MAGIC = 0x00000803  # uint8 data, 3 dimensions
LABELS_MAGIC = 0x00000801  # uint8 data, 1 dimension

# gzip header flag bits (RFC 1952, section 2.3.1).
_FTEXT, _FHCRC, _FEXTRA, _FNAME, _FCOMMENT = 0x01, 0x02, 0x04, 0x08, 0x10


def _read_bytes(path: str | os.PathLike) -> bytes:
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return f.read()


def _read_idx(path: str | os.PathLike, magic: int) -> np.ndarray:
    data = _read_bytes(path)
    ndim = magic & 0xFF
    header_size = 4 + 4 * ndim
    if len(data) < 4:
        raise ValueError(f"{os.fspath(path)}: too short for an IDX header ({len(data)} bytes)")
    (got_magic,) = struct.unpack(">I", data[:4])
    if got_magic != magic:
        raise ValueError(
            f"{os.fspath(path)}: bad IDX magic number {got_magic:#010x}, expected {magic:#010x}"
        )
    if len(data) < header_size:
        raise ValueError(f"{os.fspath(path)}: too short for an IDX header ({len(data)} bytes)")
    shape = struct.unpack(f">{ndim}I", data[4:header_size])
    expected = int(np.prod(shape, dtype=np.int64))
    if len(data) - header_size != expected:
        raise ValueError(
            f"{os.fspath(path)}: header promises {shape} = {expected} bytes of data, "
            f"file holds {len(data) - header_size}"
        )
    # bytearray: the caller gets a writable array.
    return np.frombuffer(bytearray(data[header_size:]), dtype=np.uint8).reshape(shape)


def read_idx_images(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX image file (optionally gzipped) into a uint8 array (N, rows, cols)."""
    return _read_idx(path, IMAGES_MAGIC)


def read_idx_labels(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX label file (optionally gzipped) into an int64 array (N,)."""
    return _read_idx(path, LABELS_MAGIC).astype(np.int64)


def _gzip_header_length(data: bytes) -> int:
    if len(data) < 10 or data[:2] != b"\x1f\x8b":
        raise ValueError("not a gzip file")
    if data[2] != 8:
        raise ValueError(f"unsupported gzip compression method {data[2]}")
    flags = data[3]
    pos = 10
    if flags & _FEXTRA:
        (xlen,) = struct.unpack("<H", data[pos : pos + 2])
        pos += 2 + xlen
    for flag in (_FNAME, _FCOMMENT):
        if flags & flag:
            end = data.index(b"\x00", pos)
            pos = end + 1
    if flags & _FHCRC:
        pos += 2
    return pos


def restore_gzip_header(
    data: bytes, *, filename: str, mtime: int, xfl: int = 0, os_code: int = 3
) -> bytes:
    """Returns gzip `data` with its header replaced; the compressed stream is kept as is.

    The new header stores `filename` (FNAME), `mtime`, `xfl` and `os_code` and nothing else.
    Debian's Fashion-MNIST files differ from the upstream ones only in this header, so this
    turns them back into the files tensorflow-datasets has checksums for.

    Args:
      data: a whole gzip file.
      filename: the original file name to store (upstream stores it without ".gz").
      mtime: modification time to store, seconds since the epoch.
      xfl: the extra-flags byte.
      os_code: the operating-system byte (3 = Unix).
    """
    body = data[_gzip_header_length(data) :]
    header = b"\x1f\x8b\x08" + bytes([_FNAME]) + struct.pack("<IBB", mtime, xfl, os_code)
    return header + filename.encode("latin-1") + b"\x00" + body
