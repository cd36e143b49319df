"""Resident weights copied out of a mapping into anonymous memory of their own.

Where a block's bytes already are in the compute form (a prepacked entry, a plain checkpoint in the compute
dtype) it could stay a view of the mapping for its whole life. A copy costs the load a pass over the bytes and
the process that much anonymous memory (the plan counts a resident block's bytes in the budget either way), but
on some machines it is read faster, every step, for as long as the server runs: on a virtual machine the page
cache's pages can be read measurably slower than fresh anonymous memory (docs/benchmarks/pages.md, resident
copies), and a kernel may reclaim a mapping's clean pages under pressure, so that a "resident" view silently
becomes a read from disk. `--resident-weights` (engine.args) chooses.

The copy is made in small pages, then a background thread (HugePageCollapse) asks the kernel, while no step
runs, to collapse it into huge pages (MADV_COLLAPSE; where the kernel lacks it, MADV_HUGEPAGE leaves it
to khugepaged, over minutes). Asking for huge pages before the copy would make each fault find a free 2 MiB page,
compacting memory in the loading thread when there is none, which on a long-running machine made a load many
times slower (on a VM even while the kernel listed free 2 MiB blocks: likely ones the host had taken back);
after it, that work waits for idle time instead of delaying the load. Idle time, because a collapse running
beside a step slowed the step: the kernel's work for it, and the TLB flushes it sends to the cores computing,
which the parallel kernels then wait for. The measurements: docs/benchmarks/pages.md, resident copies.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import logging
import mmap
import os
import threading
import time
from typing import Callable

import torch

log = logging.getLogger("layerstream")

HUGE_PAGE = 2 << 20
IDLE_S = 0.5  # how long no step has run before the collapse thread works
MADV_COLLAPSE = 25  # Linux 6.1 (Python's mmap module does not name it)
COLLAPSE_NICE = 10  # the collapse thread's niceness above the process's: compute keeps the cores under load
MODES = ("auto", "copy", "map")
PART_NAMES = ("codes", "scales", "data")  # a packed weight's tensors (packed/weights.py)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"resident_weights must be one of {', '.join(MODES)}, got {mode!r}")


def anonymous_bytes(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 of fresh anonymous memory of its own (freed when the last tensor viewing it goes), starting
    on a 2 MiB boundary so that its whole 2 MiB pages can become huge pages. Untouched pages cost nothing."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive (nbytes + HUGE_PAGE,)
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start:start + nbytes]


def _huge_range(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) addresses of the whole 2 MiB pages inside `t`'s bytes (empty where there is none): the tail
    stays in small pages, so memory held stays the bytes rounded to 4 KiB, the figure the plan counts."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(start, end)


def _madvise(t: torch.Tensor, advice: int | None) -> int:
    """madvise `advice` over _huge_range(t): 0, or the errno (-1 where there is nothing to advise or no such
    advice here). ctypes releases the GIL for the call."""
    start, end = _huge_range(t)
    if advice is None or end == start:
        return -1
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


def offer_huge_pages(t: torch.Tensor) -> None:
    """Let khugepaged collapse the whole 2 MiB pages of `t`'s bytes into huge pages (MADV_HUGEPAGE), in the
    background; nothing where the kernel has no transparent huge pages."""
    _madvise(t, getattr(mmap, "MADV_HUGEPAGE", None))  # best effort


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def copied(raw: torch.Tensor) -> torch.Tensor:
    """`raw` ((nbytes,) uint8) copied into anonymous_bytes, offered to khugepaged."""
    out = anonymous_bytes(raw.numel())
    out.copy_(raw)
    offer_huge_pages(out)
    return out


def copied_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Contiguous copies of `tensors` side by side in one anonymous_bytes allocation (each 64-byte aligned), same
    dtypes, shapes and values, offered to khugepaged; and that allocation ((bytes,) uint8)."""
    offsets, at = {}, 0
    for name, t in tensors.items():
        offsets[name] = at
        at += (t.nbytes + 63) // 64 * 64
    raw = anonymous_bytes(at)
    out = {}
    for name, t in tensors.items():
        view = raw[offsets[name]:offsets[name] + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[name] = view
    offer_huge_pages(raw)
    return out, raw


def copies(mode: str, transport) -> bool:
    """Whether `transport`'s resident views are copied under --resident-weights `mode` (auto: where the transport
    says its views read faster copied, measured per kind of weights)."""
    return mode == "copy" or (mode == "auto" and transport.views_read_faster_copied())


def tensor_parts(w) -> dict[str, torch.Tensor]:
    """The tensors holding a weight's bytes: {"": w} for a tensor, else a packed weight's parts by name (codes,
    scales; a GGUF weight's data)."""
    if isinstance(w, torch.Tensor):
        return {"": w}
    return {a: getattr(w, a) for a in PART_NAMES if isinstance(getattr(w, a, None), torch.Tensor)}


def owned(weights: dict[str, object]) -> tuple[dict[str, object], torch.Tensor]:
    """A block's weights with every tensor, and every packed weight's parts (codes, scales; a GGUF weight's data),
    copied into one copied_tensors allocation: the same values in memory of the block's own; and that
    allocation."""
    parts: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        parts.update({f"{name}.{a}" if a else name: t for a, t in tensor_parts(w).items()})
    own, raw = copied_tensors(parts)
    out: dict[str, object] = {}
    for name, w in weights.items():
        if isinstance(w, torch.Tensor):
            out[name] = own[name]
        else:
            out[name] = copy.copy(w)
            for a in PART_NAMES:
                if f"{name}.{a}" in own:
                    setattr(out[name], a, own[f"{name}.{a}"])
    return out, raw


class HugePageCollapse:
    """A daemon thread that collapses `tensors`' memory (copies made here) into huge pages one at a time
    (MADV_COLLAPSE), COLLAPSE_NICE nicer than the process, each once IDLE_S has passed since last_use() (a
    time.monotonic() reading: when the weights were last in use, which is now while a step holds a block). Stops
    at the first refusal (a kernel without MADV_COLLAPSE: EINVAL; no huge page to be had: EAGAIN, ENOMEM),
    leaving the rest to khugepaged.
    close() stops it between tensors, or while it waits for idle time."""

    def __init__(self, tensors: list[torch.Tensor], last_use: Callable[[], float] = lambda: 0.0):
        self.collapsed = 0  # tensors collapsed so far (one without a whole 2 MiB page has nothing to collapse)
        self.refused: int | None = None  # the errno that stopped it, if any
        self._tensors = list(tensors)
        self._last_use = last_use
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layerstream-huge-pages", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            me = threading.get_native_id()  # this thread only (Linux)
            os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + COLLAPSE_NICE))
        except (AttributeError, OSError):
            pass
        while self._tensors and not self._stop.is_set():
            busy = self._last_use() + IDLE_S - time.monotonic()
            if busy > 0:
                self._stop.wait(busy)
                continue
            err = _madvise(self._tensors.pop(0), MADV_COLLAPSE)
            if err > 0:
                self.refused = err
                log.debug("resident copies left to khugepaged: MADV_COLLAPSE refused (%s)", os.strerror(err))
                break
            self.collapsed += err == 0
        self._tensors.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the thread is done (every tensor collapsed, or it stopped), waiting up to `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
