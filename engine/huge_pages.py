"""Anonymous memory that can live in huge pages, for the buffers every step reads through: resident weight copies
(engine/weights/transports/resident_copy.py) and the CPU KV pools (engine/kv_pages.py).

A kernel walking gigabytes a step reads them faster from 2 MiB pages than from 4 KiB ones (fewer TLB misses, and
the prefetchers do not stop at every 4 KiB boundary: docs/benchmarks/pages.md). Linux gives huge pages to memory
that asks (MADV_HUGEPAGE) and collapses memory already in small pages on request (MADV_COLLAPSE, Linux 6.1).

  anonymous_bytes(n) -> (n,) uint8      fresh anonymous memory on a 2 MiB boundary (zeros; untouched pages free)
  huge_range(t) -> (start, end)         the whole 2 MiB pages inside t's bytes
  madvise(start, end, advice) -> errno  0, or why not (-1: no such advice here, or an empty range)
  offer_huge_pages(t)                   MADV_HUGEPAGE over huge_range(t): khugepaged may collapse it, in time
  collapse(start, end) -> errno         MADV_COLLAPSE: into huge pages now (the calling thread does the work)
  touched(start, end) -> bool           whether any 4 KiB page of the range is in memory (mincore)
  nicer_thread()                        this thread COLLAPSE_NICE nicer than the process (Linux; else nothing)
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading

import torch

HUGE_PAGE = 2 << 20
SMALL_PAGE = mmap.PAGESIZE
IDLE_S = 0.5  # how long no step has run before a collapse thread works
MADV_COLLAPSE = 25  # Linux 6.1 (Python's mmap module does not name it)
COLLAPSE_NICE = 10  # a collapse thread's niceness above the process's: compute keeps the cores under load


def anonymous_bytes(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 of fresh anonymous memory of its own (freed when the last tensor viewing it goes), starting
    on a 2 MiB boundary so that its whole 2 MiB pages can become huge pages. Zeros; untouched pages cost nothing."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive (nbytes + HUGE_PAGE,)
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start:start + nbytes]


def huge_range(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) addresses of the whole 2 MiB pages inside `t`'s bytes (empty where there is none): the tail
    stays in small pages, so memory held stays the bytes rounded to 4 KiB, the figure the plan counts."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(start, end)


def madvise(start: int, end: int, advice: int | None) -> int:
    """madvise `advice` over [start, end): 0, or the errno (-1 where the range is empty or there is no such advice
    here). ctypes releases the GIL for the call."""
    if advice is None or end <= start:
        return -1
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


def offer_huge_pages(t: torch.Tensor) -> None:
    """Let khugepaged collapse the whole 2 MiB pages of `t`'s bytes into huge pages (MADV_HUGEPAGE), in the
    background; nothing where the kernel has no transparent huge pages."""
    madvise(*huge_range(t), getattr(mmap, "MADV_HUGEPAGE", None))  # best effort


def collapse(start: int, end: int) -> int:
    """[start, end) (whole 2 MiB pages) collapsed into huge pages now (MADV_COLLAPSE): 0, or the errno (EINVAL: a
    kernel without it; EAGAIN, ENOMEM: no huge page to be had)."""
    return madvise(start, end, MADV_COLLAPSE)


def touched(start: int, end: int) -> bool:
    """Whether any 4 KiB page of [start, end) (page-aligned) is in memory: written once, for anonymous memory."""
    pages = (end - start + SMALL_PAGE - 1) // SMALL_PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        return False
    return any(b & 1 for b in bytes(vec))


def nicer_thread() -> None:
    try:
        me = threading.get_native_id()  # this thread only (Linux)
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + COLLAPSE_NICE))
    except (AttributeError, OSError):
        pass


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)
