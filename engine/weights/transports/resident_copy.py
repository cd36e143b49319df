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
import logging
import os
import threading
import time
from typing import Callable

import torch

from ...huge_pages import IDLE_S, anonymous_bytes, collapse, huge_range, nicer_thread, offer_huge_pages

log = logging.getLogger("layerstream")

MODES = ("auto", "copy", "map")
PART_NAMES = ("codes", "scales", "data")  # a packed weight's tensors (packed/weights.py)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"resident_weights must be one of {', '.join(MODES)}, got {mode!r}")


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
    (MADV_COLLAPSE), nicer than the process (huge_pages.nicer_thread), each once IDLE_S has passed since last_use() (a
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
        nicer_thread()
        while self._tensors and not self._stop.is_set():
            busy = self._last_use() + IDLE_S - time.monotonic()
            if busy > 0:
                self._stop.wait(busy)
                continue
            err = collapse(*huge_range(self._tensors.pop(0)))
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
