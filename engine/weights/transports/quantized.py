"""Blocks of a plain (bf16/fp16/fp32) checkpoint quantized at load to int8/int4 (packed/quant_cache.py):
the projections come from the quantization cache entry's mapping, norms and biases from the checkpoint
in the compute dtype.

Resident blocks are copied out of the mapping once at load. A streamed block is zero-copy views of
the mapped entry: prepare() (prefetch thread) faults its packed pages in ahead of use, and the ticket
counts those packed bytes, which is what the plan counts too; with release_pages, retire() drops them.
"""

from __future__ import annotations

import mmap

import torch

from ..packed.quant_cache import QuantizedBlocks
from ..packed.quantize import PROJECTIONS
from ..formats.safetensors_index import MADV_POPULATE_READ
from ..formats.block_source import BlockSource
from .base import Ticket, Transport, nbytes_of, to_compute


def _owned(w):
    return w.clone()


class QuantizedTransport(Transport):
    def __init__(self, source: BlockSource, dtype: torch.dtype, store: QuantizedBlocks, release_pages: bool = False):
        self.source, self.dtype, self.store = source, dtype, store
        self.device = torch.device("cpu")
        self.release_pages = release_pages
        self._mapped: set[int] = set()

    def _plain(self, block: int, copy: bool) -> dict[str, torch.Tensor]:
        views = {k: v for k, v in self.source.views(block).items() if k not in PROJECTIONS}
        return to_compute(views, self.dtype, self.device, copy=copy)

    def resident(self, block: int) -> dict[str, object]:
        return {**self._plain(block, True), **{k: _owned(w) for k, w in self.store.block(block).items()}}

    def prepare(self, block: int) -> Ticket:
        if self.release_pages or block not in self._mapped:
            self.store.advise(block, MADV_POPULATE_READ)
            self._mapped.add(block)
        plain, packed = self._plain(block, False), self.store.block(block)
        return Ticket(block, {**plain, **packed}, nbytes_of(plain) + sum(w.nbytes for w in packed.values()))

    def retire(self, ticket: Ticket) -> None:
        ticket.weights = {}
        if self.release_pages:
            self.store.advise(ticket.block, mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.store.close()
