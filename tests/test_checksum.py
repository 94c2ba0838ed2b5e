"""mtjax.store.checksum: the fallback CRC-32C equals the crc32c package's, and mtjax
imports and checksums chunks where the crc32c package is missing (the GPU image)."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import crc32c
import numpy as np
import pytest

from mtjax.store import checksum

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 4096, 100_003])
def test_fallback_equals_crc32c_whole_and_chained(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert checksum._fallback(data) == crc32c.crc32c(data)
    for cut in sorted({0, n // 3, n // 2 + 1, n} & set(range(n + 1))):  # chained over two pieces
        assert checksum._fallback(data[cut:], checksum._fallback(data[:cut])) == crc32c.crc32c(data)
    assert checksum._fallback(b"", crc32c.crc32c(data)) == crc32c.crc32c(data)  # empty input keeps the value


def test_fallback_reads_any_buffer_as_its_bytes():
    a = np.random.default_rng(1).standard_normal((33, 17)).astype(np.float32)
    for buf in (memoryview(a), memoryview(a.reshape(-1))[5:], bytearray(a.tobytes()), memoryview(b"")):
        assert checksum._fallback(buf) == crc32c.crc32c(buf)


def test_without_numba_either_it_names_the_package_to_install(tmp_path):
    """An interpreter where neither package imports: the checksum names crc32c to install
    (the store's modules alone: nothing imports JAX)."""
    for package in ("crc32c", "numba"):
        (tmp_path / f"{package}.py").write_text(f"raise ImportError('{package} is not installed here')\n")
    code = """
from mtjax.errors import MissingPackage
from mtjax.store import checksum
assert checksum.IMPLEMENTATION is None, checksum.IMPLEMENTATION
try:
    checksum.crc32c(b"abc")
except MissingPackage as e:
    print(e)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "needs the crc32c package, which is not installed: pip install crc32c" in r.stdout


@pytest.mark.slow  # imports jax in a subprocess and compiles the fallback there
def test_mtjax_imports_and_checksums_chunks_without_the_crc32c_package(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "crc32c.py").write_text("raise ImportError('crc32c is not installed here')\n")
    chunk = tmp_path / "c.0"
    code = f"""
from pathlib import Path
import numpy as np
import mtjax, mtjax.stream
from mtjax.store import checksum, chunks
assert checksum.IMPLEMENTATION == "numba", checksum.IMPLEMENTATION
a = np.arange(1000, dtype=np.float32)
chunks.write_chunk(Path({str(chunk)!r}), chunks.flat(a), padding=24)
b = np.zeros_like(a)
chunks.read_chunk(Path({str(chunk)!r}), chunks.flat(b), padding=24)
assert np.array_equal(a, b)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    raw = chunk.read_bytes()  # the chunk the fallback wrote carries the crc32c package's checksum
    assert len(raw) == 4000 + 24 + 4 and struct.unpack("<I", raw[-4:])[0] == crc32c.crc32c(raw[:-4])
