"""Typed tensors over raw bytes without copying: the one helper every reader and staging buffer uses;
and opening and closing the file mappings they view."""

from __future__ import annotations

import math
import mmap
import os

import torch


def typed_view(raw: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` ((nbytes,) uint8) seen as a `dtype` tensor of `shape`, zero-copy. `offset` is where raw
    starts in its allocation: bytes not aligned to the dtype's size cannot be viewed as it, so those
    (rare, only hand-made files) are copied, the one correct option."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    if offset % dtype.itemsize:
        return raw.clone().view(dtype).reshape(shape)
    return raw.view(dtype).reshape(shape)


def row_shape(shape: tuple[int, ...], nbytes: int) -> tuple[int, ...]:
    """The shape of a tensor's `nbytes` stored bytes as rows: (rows..., bytes per row) for its logical
    `shape` (a packed GGML row is a run of whole blocks, so rows stay independent)."""
    if len(shape) < 2:
        return (nbytes,)
    rows = math.prod(shape[:-1])
    return (*shape[:-1], nbytes // rows if rows else 0)


def byte_rows(raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's (nbytes,) uint8 bytes viewed as row_shape(shape), zero-copy."""
    return raw.view(row_shape(shape, raw.numel()))


def map_file(fd: int) -> mmap.mmap:
    """A checkpoint file's whole mapping: MAP_PRIVATE (ACCESS_COPY: torch gets a writable buffer, the file is
    never written; pages stay shared with the page cache unless someone writes to them), asking the kernel for
    huge pages (MADV_HUGEPAGE) before anything is faulted in.

    Why: a decode step streams every weight once, and from 4 KiB pages scattered over the machine's memory
    that stream is slower than from 2 MiB runs (docs/benchmarks/pages.md: a TLB miss every 4 KiB, and the
    memory's prefetchers stop at every page's end). With the hint, a page fault reads the file in folios of the
    huge-page size where the file system keeps large folios (ext4, xfs, btrfs on recent kernels), and maps each
    with one entry, also when pages evicted under memory pressure come back by faults; pages the page cache
    already holds in small folios stay as they are (the prepacked entry's writer avoids making them:
    packed/chunked_file.py). A kernel without transparent huge pages ignores the hint."""
    mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):
        pass  # no MADV_HUGEPAGE here (not Linux, or a kernel built without it): 4 KiB pages
    return mapping


def file_mappings() -> dict[str, tuple[int, int]]:
    """{path: (bytes resident, of which mapped by huge pages)} over this process's file mappings, from
    /proc/self/smaps (Rss, FilePmdMapped); {} where there is none (not Linux)."""
    out: dict[str, tuple[int, int]] = {}
    path = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if " " in key:  # a mapping's first line: "start-end perms offset dev inode [path]"
                    fields = line.split(maxsplit=5)
                    path = fields[5].rstrip("\n") if len(fields) == 6 and fields[5].startswith("/") else None
                elif path and key in ("Rss", "FilePmdMapped"):
                    rss, huge = out.get(path, (0, 0))
                    n = int(rest.split()[0]) << 10
                    out[path] = (rss + n, huge) if key == "Rss" else (rss, huge + n)
    except OSError:
        pass
    return out


def close_mapping(mapping: mmap.mmap | None, fd: int) -> None:
    """Unmap a file mapping and close its descriptor (either may be absent: None, -1). Tensors that
    still view the mapping keep it alive: it is unmapped when they are collected."""
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass  # exported views remain; the mapping goes with the last of them
    if fd >= 0:
        os.close(fd)
