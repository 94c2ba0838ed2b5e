"""mtjax.store.pending: gradient sums parked in checksummed chunk files.

The resume of a one-copy store with a damaged pending file: tests/test_store_one_copy.py.
"""

import struct

import crc32c
import jax
import numpy as np
import pytest

from mtjax.store import layout
from mtjax.store.errors import StoreError
from mtjax.store.pending import PendingFiles

SUM = {"a.kernel": np.arange(12, dtype=np.float32).reshape(3, 4) / 7, "b": np.float32(2.5) * np.ones((), np.float32)}


def _schema(arrays):
    return {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in arrays.items()}


def test_round_trip_rename_and_the_chunk_format(tmp_path):
    files = PendingFiles(parent=str(tmp_path))
    files.put("block.0.sum", SUM)
    files.rename("block.0.sum", layout.pending_key("block.0", "g1"))
    assert "block.0.sum" not in files and "block.0.g1" in files
    path = files.dir / layout.pending_file("block.0.g1", "a.kernel")
    raw = path.read_bytes()  # one chunk: the leaf's little-endian bytes, then their crc32c
    assert raw[:-4] == SUM["a.kernel"].tobytes() and struct.unpack("<I", raw[-4:])[0] == crc32c.crc32c(raw[:-4])
    got = files.take("block.0.g1")
    assert all(np.array_equal(got[n], SUM[n]) and got[n].dtype == SUM[n].dtype for n in SUM)
    assert "block.0.g1" not in files and not path.exists()
    assert files.io_bytes == [sum(a.nbytes for a in SUM.values())] * 2
    files.close()
    assert not files.dir.exists()


def test_durable_files_stay_until_forgotten_and_are_adopted(tmp_path):
    files = PendingFiles(directory=tmp_path)
    files.put("head.g3", SUM)
    assert all(np.array_equal(files.take("head.g3", keep=True)[n], SUM[n]) for n in SUM)
    files.close()  # a durable directory outlives its process
    again = PendingFiles(directory=tmp_path)
    again.adopt("head.g3", _schema(SUM))
    got = again.take("head.g3", keep=True)
    assert all(np.array_equal(got[n], SUM[n]) for n in SUM)
    again.forget("head.g3")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("durable", [True, False])
def test_a_file_damaged_after_put_is_refused_when_taken(tmp_path, durable):
    files = PendingFiles(directory=tmp_path) if durable else PendingFiles(parent=str(tmp_path))
    files.put("embed.g1", SUM)
    path = files.dir / layout.pending_file("embed.g1", "a.kernel")
    data = bytearray(path.read_bytes())
    data[5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum mismatch") as err:
        files.take("embed.g1")
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    files.close()


def test_adopt_checks_every_file_before_anything_is_taken(tmp_path):
    files = PendingFiles(directory=tmp_path)
    files.put("embed.g1", SUM)
    (tmp_path / layout.pending_file("embed.g1", "b")).write_bytes(b"\0" * 8)  # the right size, not its bytes
    with pytest.raises(StoreError, match="checksum mismatch"):
        PendingFiles(directory=tmp_path).adopt("embed.g1", _schema(SUM))
    (tmp_path / layout.pending_file("embed.g1", "b")).write_bytes(b"\0" * 3)
    with pytest.raises(StoreError, match="has 3 bytes, expected 8"):
        PendingFiles(directory=tmp_path).adopt("embed.g1", _schema(SUM))
