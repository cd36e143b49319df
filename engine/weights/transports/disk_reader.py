"""Reading a block's bytes off disk at disk speed: large aligned reads into aligned staging buffers.

The page-fault path (touching an mmap) reads a model larger than RAM in readahead-sized pieces,
one fault at a time, and leaves most of a fast disk idle. Here a block's byte ranges are read
with `O_DIRECT` `preadv` calls of `chunk_bytes` each, `in_flight` of them at once on a small pool
(`preadv` releases the GIL), into a staging buffer aligned for `O_DIRECT`; the tensors are then
views into that buffer, so the bytes are never copied again on the host.

`O_DIRECT` bypasses the page cache, so reading a model larger than RAM neither evicts anything
else nor charges page cache to the process's memory cgroup. Where the file system refuses it
(`EINVAL` at open or at the first read: tmpfs on older kernels, some FUSE and network mounts),
the file is read buffered instead, and the pages just read are dropped from the cache
(`POSIX_FADV_DONTNEED`) so a larger-than-RAM model still does not fill it.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats.reader import TensorInfo
from ..formats.views import byte_rows, typed_view

# O_DIRECT wants file offset, length and memory address aligned to the logical block size
# (512 or 4096 bytes); 4096 satisfies both and is the page size, so buffers are page aligned too.
ALIGN = 4096
CHUNK_BYTES = 16 << 20  # one preadv; large enough that per-request overhead is noise
IN_FLIGHT = 8  # preadv calls outstanding at once: a virtio disk needs a deep queue to reach its speed
MIN_CHUNK_BYTES = 1 << 20  # the smallest preadv a block's read is cut into
MERGE_GAP = 1 << 20  # tensors closer than this are read as one range (reading the gap is cheaper)


def _align_down(n: int) -> int:
    return n - n % ALIGN


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StagingBuffer:
    """`nbytes` of host memory whose first byte is ALIGN-aligned; pinned when it feeds a GPU copy."""

    def __init__(self, nbytes: int, pin_memory: bool = False):
        self.nbytes = nbytes
        # torch.empty leaves pages untouched: an unused buffer costs no resident memory.
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)  # (nbytes + ALIGN,)
        skip = (-raw.data_ptr()) % ALIGN
        self._raw = raw
        self.tensor = raw[skip:skip + nbytes]  # (nbytes,) uint8, ALIGN-aligned
        self.memory = memoryview(self.tensor.numpy()).cast("B")  # writable, for preadv


@dataclass(frozen=True)
class Span:
    """One aligned range of one file, read to `buf_offset` of a staging buffer."""

    path: Path
    start: int  # aligned file offset
    end: int  # aligned end; may pass the end of the file (the read is then short)
    buf_offset: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorSlot:
    offset: int  # byte offset in the staging buffer
    dtype: torch.dtype | None  # None: a packed tensor, viewed as its stored rows of bytes
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ReadPlan:
    """Where a group of tensors (one block) lies on disk and in a staging buffer."""

    spans: tuple[Span, ...]
    tensors: dict[str, TensorSlot] = field(hash=False)
    payload_bytes: int  # tensor bytes (what the block needs)

    @property
    def buffer_bytes(self) -> int:
        return sum(s.nbytes for s in self.spans)

    def views(self, buf: StagingBuffer) -> dict[str, torch.Tensor]:
        """Tensors over the staging buffer's bytes: no copy unless a tensor is misaligned for its dtype.
        A packed tensor is its stored bytes as rows, (rows..., bytes per row) uint8."""
        out = {}
        for name, t in self.tensors.items():
            raw = buf.tensor[t.offset:t.offset + t.nbytes]  # (nbytes,) uint8
            out[name] = byte_rows(raw, t.shape) if t.dtype is None else typed_view(raw, t.offset, t.dtype, t.shape)
        return out


def plan_reads(entries: dict[str, TensorInfo], merge_gap: int = MERGE_GAP) -> ReadPlan:
    """Coalesce tensors into few large aligned spans (a block's tensors are usually contiguous in
    its shard, so one span per block is the common case)."""
    runs: list[list] = []  # [path, start, end, [(name, entry)]]
    for name, e in sorted(entries.items(), key=lambda kv: (str(kv[1].path), kv[1].start)):
        last = runs[-1] if runs else None
        if last is not None and last[0] == e.path and e.start - last[2] <= merge_gap:
            last[2] = max(last[2], e.end)
            last[3].append((name, e))
        else:
            runs.append([e.path, e.start, e.end, [(name, e)]])
    spans, tensors, offset = [], {}, 0
    for path, start, end, members in runs:
        span = Span(path, _align_down(start), _align_up(end), offset)
        spans.append(span)
        for name, e in members:
            tensors[name] = TensorSlot(offset + e.start - span.start, e.dtype, e.shape, e.nbytes)
        offset += span.nbytes
    return ReadPlan(tuple(spans), tensors, sum(e.nbytes for e in entries.values()))


@dataclass
class ReadStats:
    bytes_read: int = 0
    seconds: float = 0.0  # wall time inside read(), summed
    buffered_fallbacks: int = 0


class _File:
    """One checkpoint file opened for reading: O_DIRECT if the file system allows it."""

    def __init__(self, path: Path, direct: bool):
        self.path = path
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self._lock = threading.Lock()
        self._retired: list[int] = []  # O_DIRECT descriptor after a fallback: reads may still use it

    def to_buffered(self) -> bool:
        """Reopen without O_DIRECT; False if another reader already did."""
        with self._lock:
            if not self.direct:
                return False
            fd = os.open(self.path, os.O_RDONLY)
            # Reads in flight on the old descriptor finish or fail (and retry) on their own, so it
            # stays open until close().
            self._retired.append(self.fd)
            self.fd, self.direct = fd, False
        return True

    def close(self) -> None:
        for fd in [self.fd, *self._retired]:
            os.close(fd)


class DiskReader:
    """Reads ReadPlans into staging buffers with `in_flight` large preadv calls at once."""

    def __init__(self, paths, direct: bool = True, chunk_bytes: int = CHUNK_BYTES, in_flight: int = IN_FLIGHT):
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.chunk_bytes = chunk_bytes
        self.in_flight = in_flight
        self.stats = ReadStats()
        self._files: dict[Path, _File] = {}
        try:
            for p in paths:
                p = Path(p)
                self._files[p] = _File(p, direct)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="layerstream-disk")

    @property
    def direct(self) -> bool:
        """True while every file is still read with O_DIRECT."""
        return all(f.direct for f in self._files.values())

    def read(self, plan: ReadPlan, buf: StagingBuffer) -> int:
        """Fill `buf` with the plan's spans; returns the bytes read from the files."""
        if plan.buffer_bytes > buf.nbytes:
            raise ValueError(f"staging buffer of {buf.nbytes} bytes cannot hold a {plan.buffer_bytes}-byte read")
        t0 = time.perf_counter()
        # A block smaller than in_flight whole chunks is cut finer, so every request slot is busy:
        # the disk reaches its speed only with a deep queue, and the queue drains at each block's end.
        chunk = max(MIN_CHUNK_BYTES, min(self.chunk_bytes, _align_up(-(-plan.buffer_bytes // self.in_flight))))
        jobs = []
        for span in plan.spans:
            f = self._files[span.path]
            for off in range(0, span.nbytes, chunk):
                n = min(chunk, span.nbytes - off)
                jobs.append((f, span.start + off, span.buf_offset + off, n))
        futures = [self._pool.submit(self._read_chunk, buf, *job) for job in jobs]
        total = 0
        error = None
        for fut in futures:  # wait for all, even after an error: none may still write into buf
            try:
                total += fut.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, once every read is done
                error = error or e
        if error is not None:
            raise error
        self.stats.bytes_read += total
        self.stats.seconds += time.perf_counter() - t0
        return total

    def _read_chunk(self, buf: StagingBuffer, f: _File, file_off: int, buf_off: int, n: int) -> int:
        want = min(n, max(0, f.size - file_off))  # bytes that exist; the rest of n is alignment past EOF
        done = 0
        while done < want:
            direct = f.direct
            fd = f.fd
            length = n - done if direct else want - done  # O_DIRECT lengths stay aligned
            try:
                got = os.preadv(fd, [buf.memory[buf_off + done:buf_off + done + length]], file_off + done)
            except OSError as e:
                if direct and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    if f.to_buffered():
                        self.stats.buffered_fallbacks += 1
                    continue
                raise OSError(e.errno, f"reading {f.path} at byte {file_off + done}: {e.strerror}") from e
            if got == 0:
                raise OSError(errno.EIO, f"{f.path}: unexpected end of file at byte {file_off + done} "
                                         f"(file is {f.size} bytes); was it truncated while in use?")
            done += got
        if not f.direct and want and hasattr(os, "posix_fadvise"):
            # Buffered fallback: drop what we just read, so streaming a larger-than-RAM model does
            # not fill the page cache (nor the memory cgroup it is charged to).
            os.posix_fadvise(f.fd, file_off, want, os.POSIX_FADV_DONTNEED)
        return want

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for f in self._files.values():
            f.close()
        self._files = {}
