"""The CPU KV pools' pages collapsed into huge pages in idle time.

A decode step reads every cached key and value of its sequences once per layer, through the block table: at long
contexts that read is a large part of the step, and it ran faster from huge pages than from 4 KiB ones
(docs/benchmarks/decode-profile.md, KV pages). The pools are allocated untouched (engine/kv_cache.py: memory
follows the tokens cached), so the pages a step writes first are small ones, and asking for huge pages at the
fault instead would put the kernel's work for a 2 MiB page (compaction; on a VM, the host backing it again) inside
the step that first writes there: every layer's pool crosses into a new 2 MiB page at the same token. So a thread
collapses them while no step runs (MADV_COLLAPSE), as engine/weights/transports/resident_copy.py does for resident
weight copies: after each stretch of steps, once IDLE_S has passed, it looks for 2 MiB pages of the pools that
hold a written page and are not huge yet, and collapses them one at a time, stopping as soon as a step starts.
A collapsed page holds 2 MiB whatever was written in it: at most one such page per pool beyond the tokens cached,
inside the pool's bytes, which the plan counts whole.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from . import huge_pages
from .huge_pages import HUGE_PAGE, collapse, huge_range, nicer_thread, touched

log = logging.getLogger("layerstream")


class KVPageCollapse:
    """A daemon thread collapsing the written 2 MiB pages of `pools` (tensors in huge_pages.anonymous_bytes memory)
    into huge pages whenever IDLE_S has passed since last_use() (time.monotonic() of the last step; now while one
    runs) and a step has run since it last looked. Stops at the first refusal (EINVAL: a kernel without
    MADV_COLLAPSE; EAGAIN, ENOMEM: no huge page to be had). close() stops it."""

    def __init__(self, pools: list[torch.Tensor], last_use: Callable[[], float]):
        self.collapsed = 0  # 2 MiB pages collapsed so far
        self.refused: int | None = None  # the errno that stopped it, if any
        self._pages = [p for t in pools for p in range(*huge_range(t), HUGE_PAGE)]  # start addresses
        self._done: set[int] = set()
        self._last_use = last_use
        self._looked_after: float | None = None  # last_use() when it last went over every page
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layerstream-kv-pages", daemon=True)
        if self._pages:
            self._thread.start()

    def _run(self) -> None:
        nicer_thread()
        while not self._stop.is_set():
            last = self._last_use()
            wait = last + huge_pages.IDLE_S - time.monotonic()
            if wait > 0 or last == self._looked_after:
                self._stop.wait(max(wait, huge_pages.IDLE_S))
                continue
            if self._pass(last):
                self._looked_after = last
            if self.refused is not None:
                break

    def _pass(self, last: float) -> bool:
        """One look over the pages not yet collapsed; False where a step started meanwhile (looked again later)."""
        for page in self._pages:
            if self._stop.is_set() or self._last_use() != last:
                return False
            if page in self._done or not touched(page, page + HUGE_PAGE):
                continue
            err = collapse(page, page + HUGE_PAGE)
            if err > 0:
                self.refused = err
                log.debug("KV pages left in 4 KiB pages: MADV_COLLAPSE refused (%s)", err)
                return True
            self._done.add(page)
            self.collapsed += 1
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
