"""The prepacked entry's writer (engine/weights/packed/chunked_file.py) and the checkpoint mappings
(engine/weights/formats/views.py map_file): the same bytes as writing part by part, written in whole aligned
chunks, so that the page cache holds them in huge folios that a mapping maps whole."""

from __future__ import annotations

import os

import numpy as np
import pytest

from engine.weights.formats.views import file_mappings, map_file
from engine.weights.packed import chunked_file
from engine.weights.packed.chunked_file import ChunkedFileWriter
from tests.support.large_folios import no_large_folios

MADV_POPULATE_READ = 22


def _parts(seed: int = 0, count: int = 40, chunk: int = 1 << 16):
    """(offset, bytes) pieces in file order with gaps, some longer than a chunk, some inside one."""
    rng = np.random.default_rng(seed)
    at, parts = 0, []
    for _ in range(count):
        at += int(rng.integers(0, chunk // 2))
        n = int(rng.integers(1, 3 * chunk))
        parts.append((at, rng.integers(0, 256, n, dtype=np.uint8)))
        at += n
    return parts, at


def test_same_bytes_as_seeking_and_writing_in_aligned_chunks(tmp_path, monkeypatch):
    chunk = 1 << 16
    parts, size = _parts(chunk=chunk)
    with open(tmp_path / "expected", "wb") as f:
        f.truncate(size + 5)
        for at, data in parts:
            f.seek(at)
            f.write(data.tobytes())
    writes = []
    real = os.pwrite
    monkeypatch.setattr(chunked_file.os, "pwrite", lambda fd, b, at: writes.append((at, len(b))) or real(fd, b, at))
    with open(tmp_path / "chunked", "wb") as f:
        f.truncate(size + 5)
        out = ChunkedFileWriter(f.fileno(), chunk)
        for at, data in parts:
            out.write(at, data)
        out.flush()
    assert (tmp_path / "chunked").read_bytes() == (tmp_path / "expected").read_bytes()
    assert all(at % chunk == 0 for at, _ in writes)
    assert all(n == chunk for _, n in writes[:-1]) and 0 < writes[-1][1] <= chunk
    assert len(writes) <= -(-size // chunk)  # one call per chunk at most, not per part


def test_a_write_that_goes_back_is_refused(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        out = ChunkedFileWriter(f.fileno(), 1 << 12)
        out.write(100, np.ones(50, dtype=np.uint8))
        with pytest.raises(ValueError, match="goes back"):
            out.write(120, np.ones(1, dtype=np.uint8))


def test_chunked_writes_are_mapped_in_huge_pages(tmp_path):
    """A file written in chunks and mapped by map_file is mapped mostly in huge pages once faulted in; the
    same bytes written 64 KiB at a time (small folios) are not: what the writer is for."""
    why = no_large_folios(tmp_path)
    if why:
        pytest.skip(why)
    data = np.random.default_rng(1).integers(0, 256, 32 << 20, dtype=np.uint8)
    with open(tmp_path / "chunked", "wb") as f:
        out = ChunkedFileWriter(f.fileno())
        out.write(0, data)
        out.flush()
    with open(tmp_path / "small", "wb") as f:
        for at in range(0, data.size, 1 << 16):
            f.write(data[at:at + (1 << 16)].tobytes())
    shares = {}
    for name in ("chunked", "small"):
        fd = os.open(tmp_path / name, os.O_RDONLY)
        mapping = map_file(fd)
        try:
            mapping.madvise(MADV_POPULATE_READ)
            shares[name] = file_mappings().get(os.path.realpath(tmp_path / name), (0, 0))
        finally:
            mapping.close()
            os.close(fd)
    rss, huge = shares["chunked"]
    assert rss == data.size and huge >= data.size // 2, shares
    assert shares["small"][1] == 0, shares
