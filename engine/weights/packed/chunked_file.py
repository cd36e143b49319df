"""Writing a file the kernels will stream from the page cache: in whole, aligned chunks.

The page cache keeps a buffered write's bytes in folios no larger than the write and aligned to their own size,
so a file written part by part (a few KiB of scales, then MiBs of codes, each starting wherever the last
ended) is cached mostly in small folios, mapped 4 KiB at a time. ChunkedFileWriter gathers the parts into
CHUNK-byte windows that start on a multiple of CHUNK and writes each window with one call: the file's bytes
are then cached in folios as large as a huge page, which views.map_file maps whole (why that matters is
map_file's docstring)."""

from __future__ import annotations

import os

import numpy as np

CHUNK = 8 << 20  # a multiple of every huge page size in use (2 MiB on x86-64 and most arm64)


class ChunkedFileWriter:
    """Writes to the open file `fd` front to back: write(offset, data) with offsets that never go back. Bytes
    between the parts are zeros. flush() writes what is gathered (the file's end); the caller fsyncs."""

    def __init__(self, fd: int, chunk: int = CHUNK):
        self.fd, self.chunk = fd, chunk
        self._window = np.zeros(chunk, dtype=np.uint8)
        self._start = 0  # the file offset of the window's first byte: a multiple of chunk (until a flush mid-file)
        self._end = 0  # one past the last byte written into the window (a file offset)

    def write(self, offset: int, data: np.ndarray) -> None:
        """data ((n,) uint8) at file offset `offset`, which must not be before the end of the last write."""
        if offset < self._end:
            raise ValueError(f"write at {offset} goes back (the last one ended at {self._end})")
        data = data.reshape(-1)
        while data.size:
            if offset >= self._start + self.chunk:  # past this window: write it out whole, start the one at offset
                if self._end > self._start:
                    self._end = self._start + self.chunk  # its zeros too: the file goes on past it
                self.flush()
                self._start = offset // self.chunk * self.chunk
            at = offset - self._start
            n = min(data.size, self.chunk - at)
            self._window[at:at + n] = data[:n]
            offset += n
            self._end = offset
            data = data[n:]

    def flush(self) -> None:
        """Writes the window's bytes up to the last written one, then starts an empty window after them."""
        if self._end > self._start:
            view = memoryview(self._window)[: self._end - self._start]
            while view:
                done = os.pwrite(self.fd, view, self._start)
                self._start += done
                view = view[done:]
            self._window[:] = 0
        self._start = self._end = max(self._start, self._end)
