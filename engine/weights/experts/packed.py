"""A packed checkpoint's (GGUF) routed experts in the expert cache's device slots: each expert's tensors move as
they are stored (GGML blocks, the bytes the planner priced them at) and compute reads them as `GGUFWeight`, the
form a streamed GGUF block takes on the device (dequantized to the compute dtype by the product that uses it: the
values a resident expert holds, fp32 in exact mode, or the same packed bytes on a GPU in fast mode).

A slot holds one expert of any block: llama.cpp's mixes may store one block's experts in another type than the
next's (Q4_K_M keeps some ffn_down_exps in Q6_K), so each tensor's room in a slot is the largest over every block,
and the slot remembers which expert it holds to view its bytes with that expert's type and shape.
"""

from __future__ import annotations

import torch

from ..formats.block_source import BlockSource
from ..formats.gguf_file import ggml_type
from ..formats.reader import TensorInfo
from ..formats.views import byte_rows
from ..packed.weights import GGUFWeight

Key = tuple[int, int]  # (block, expert)


class PackedExperts:
    """The slot layout of a packed source's experts, and their weights over a slot's bytes."""

    def __init__(self, source: BlockSource, dtype: torch.dtype):
        self.source, self.dtype = source, dtype
        infos = [source.expert_tensors(b, e) for b in source.expert_blocks() for e in range(source.num_experts(b))]
        names = list(infos[0])
        # name -> (shape, dtype) of its room in a slot: the stored bytes of a packed tensor (the largest of any
        # block's), a plain one (1-D biases, an F32 tensor) in the compute dtype as the plain slots hold it
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name in names:
            t = infos[0][name]
            if t.quant is None:
                self.specs[name] = (tuple(t.shape), dtype)
            else:
                self.specs[name] = ((max(i[name].nbytes for i in infos),), torch.uint8)

    def nbytes(self, key: Key) -> int:
        """What filling a slot with expert `key` moves: its packed tensors as stored, plain ones in the compute
        dtype (what the planner's group bytes count)."""
        return sum(t.nbytes if t.quant is not None else t.numel * self.dtype.itemsize
                   for t in self.source.expert_tensors(*key).values())

    def stage(self, stored: dict[str, torch.Tensor], room: dict[str, torch.Tensor]) -> None:
        """An expert's stored tensors (BlockSource.expert_stored) into a slot's (or staging buffer's) rooms."""
        for name, v in stored.items():
            if self.specs[name][1] == torch.uint8:  # GGML rows, at the start of the room
                room[name][:v.numel()].copy_(v.reshape(-1))
            else:
                room[name].copy_(v)

    def weights(self, key: Key, room: dict[str, torch.Tensor]) -> dict[str, object]:
        """Expert `key`'s weights over a slot's rooms: GGUFWeight over its GGML rows, plain tensors as they are."""
        return {name: _weight(t, room[name], self.dtype) for name, t in self.source.expert_tensors(*key).items()}


def _weight(t: TensorInfo, room: torch.Tensor, dtype: torch.dtype):
    if t.quant is None:
        return room
    assert len(t.shape) == 2, f"{t.name}: a packed expert tensor is a matrix"
    return GGUFWeight(byte_rows(room[:t.nbytes], t.shape), ggml_type(t), t.shape, dtype)  # rows: (out, bytes per row)
