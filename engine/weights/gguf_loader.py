"""A GGUF checkpoint opened for the loader: index, config, plan sizes (in packed bytes) and the packed
weights (packed transport, packed globals) behind the same ModelWeights interface as safetensors.

engine.loader plans and assembles the model exactly as for safetensors; the plan counts each block
twice over: its resident compute form (`block_bytes`) and the packed GGML bytes a streamed block
moves (`streamed_block_bytes`).

Still to do (the ideal design): a GGUF reader as one more CheckpointReader branch of
formats.open_checkpoint, with its packed transport chosen in tiers.make_transport, so that this
class and the loader's GGUF branch disappear.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..planner import MemoryPlan
from .gguf_file import GGUFIndex
from .gguf_config import GLOBAL_NAMES, GGUFBlockSource, PackedFormat, load_gguf_config, validate_gguf
from .model_weights import ModelWeights, PlacedGlobals
from .packed_transport import PackedCpuTransport


class GGUFCheckpoint:
    """A GGUF file (or split set) opened, its config read from the metadata and every tensor checked.
    Owns the index (mappings, file descriptors) until close()."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = GGUFIndex(self.path)
        try:
            self.cfg = load_gguf_config(self.index)
            validate_gguf(self.cfg, self.index)
            self.source = GGUFBlockSource(self.index, self.cfg)
        except BaseException:
            self.index.close()
            raise

    def _globals(self):
        index = self.index
        embed = index.entry(GLOBAL_NAMES["embed"])
        head = index.entry(GLOBAL_NAMES["lm_head"]) if GLOBAL_NAMES["lm_head"] in index else embed
        return embed, index.entry(GLOBAL_NAMES["norm"]), head

    def sizes(self, dtype: torch.dtype) -> tuple[int, int, int]:
        """(one block resident in compute form, embeddings + norm + head, one block's packed bytes)."""
        fmt = PackedFormat(dtype)
        block_bytes = sum(fmt.resident_bytes(t) for t in self.source.tensors(0).values())
        embed, norm, head = self._globals()
        global_bytes = embed.nbytes + fmt.resident_bytes(head) + fmt.resident_bytes(norm)
        return block_bytes, global_bytes, self.source.nbytes(0)

    def total_bytes(self) -> int:
        return self.index.total_bytes()

    def describe(self, dtype: torch.dtype) -> str:
        fmt = PackedFormat(dtype)
        types = sorted({t.qtype.name for t in self.index.entries.values()})
        return (f"GGUF tensor types {', '.join(types)}; compute "
                + ("exact fp32 dequantization" if fmt.exact else f"packed kernels in {dtype}"))

    def open_weights(self, plan: MemoryPlan, dtype: torch.dtype, transport: str = "auto",
                     on_progress: Callable[[int], None] | None = None) -> ModelWeights:
        """The packed weights for a frozen plan, on the CPU (transport: auto, cpu or simulated)."""
        fmt = PackedFormat(dtype)
        t = PackedCpuTransport(self.source, fmt, release_pages=plan.release_pages)
        if transport == "simulated":
            from .simulated_transport import SimulatedTransport

            t = SimulatedTransport(t)
        index = self.index

        def place() -> PlacedGlobals:
            embed, norm, head = self._globals()
            return PlacedGlobals(fmt.embedding(embed, index.raw(embed.name)), fmt.resident(norm, index.raw(norm.name)),
                                 fmt.resident(head, index.raw(head.name)), dtype)

        return ModelWeights.from_transport(plan, t, place, on_progress)

    def close(self) -> None:
        self.index.close()
