"""Streamed GGUF blocks put in their resident twins' compute form, on the prefetch thread (CPU fast mode).

A resident GGUF block is repacked once at load (PackedFormat.resident: Q4_0/Q4_1 to the int4 VNNI
layout, Q4_K/Q6_K to their k-quant layouts, Q8_0/Q5_x/Q5_K requantized to the int8 twin's) and its
q/k/v and gate/up stacked (fuse.py). Without this module a streamed block stays GGUFWeight views, dequantized to bf16 by every
matmul: a slower computation than its resident twin's, and a different one (other tokens).

StreamRepacker writes a streamed block, with the C++ repack (engine/kernels/ggml_repack.cpp), into
exactly that form, byte for byte: the same Int4Weight / Int8Weight bytes, stacked the same way (a
fused weight's parts are written straight into their rows of it), so a streamed block runs the same
kernels as a resident one and the model computes the same tokens whatever the plan. It works from the
stored bytes (the mapped file, or a disk read's staging buffer) into one of a few reusable slots:
the streamer keeps at most depth + 1 blocks in flight, so at most that many slots are ever made
(the plan's stream buffers: a slot holds at most one block in its resident form), and nothing is
allocated per step. The source's bytes are not needed once the block is repacked.

Only in fast mode on the CPU with the VNNI kernels loaded (`make_repacker` says None otherwise: fp32
exact mode dequantizes per use as before, and so does the fallback with aten's kernels, whose
layouts this does not write; the transports then hand out GGUFWeight views as before).
"""

from __future__ import annotations

import math
import queue
from dataclasses import dataclass

import torch

from ... import ops
from ..formats.reader import TensorInfo
from .fuse import FUSED, FUSED_BIAS
from ..formats.gguf_file import ggml_type
from .weights import (INT4_TYPES, INT8_REPACK_TYPES, KQUANT_BYTES, LANES, Int4Weight, Int8Weight, KQuantWeight,
                      vnni_parts)
from .compute_form import PackedFormat, kquant_layout
from ..formats.block_source import BlockSource

ALIGN = 64  # every region of a slot starts on a cache line (and on its dtype's size)


@dataclass(frozen=True)
class _Output:
    """One weight of the block's compute form that is written into a slot: a fused weight (parts
    stacked along the output rows) or a single repacked one."""

    name: str  # its name in the block's weights ("wqkv", "bqkv", "w_gate_up", or a stored short name)
    kind: str  # "int4" | "int8" | "q4k" | "q6k" (VNNI layouts), "dense" (2-D, compute dtype), "bias" (1-D)
    parts: tuple[str, ...]  # stored tensors, in row order
    shape: tuple[int, ...]  # (out, in), or (out,) for a bias
    offsets: tuple[int, int]  # slot byte offsets of (codes, scales), or of (values, -)


PACKED_KINDS = ("int4", "int8", *KQUANT_BYTES)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Layout:
    """Where one block's compute form lies in a slot: which weights are written there, and the rest
    (norms, biases, unfused dense tensors), which are made per step by PackedFormat.streamed as before."""

    def __init__(self, infos: dict[str, TensorInfo], fmt: PackedFormat):
        kinds = {short: self._kind(t) for short, t in infos.items()}
        groups: list[tuple[str, str, tuple[str, ...]]] = []  # (name, kind, parts)
        fused: set[str] = set()
        # Stacked exactly where fuse.stack_rows stacks a resident block's parts: one kind, one input
        # size, and in the VNNI layouts every part but the last whole blocks of 16 rows.
        for name, parts in FUSED.items():
            if not all(p in infos for p in parts):
                continue
            kind = kinds[parts[0]]
            if (kind is None or any(kinds[p] != kind for p in parts)
                    or len({infos[p].shape[1] for p in parts}) != 1
                    or (kind != "dense" and any(infos[p].shape[0] % LANES for p in parts[:-1]))):
                continue
            bias_name, bias_parts = FUSED_BIAS.get(name, (None, ()))
            present = [b for b in bias_parts if b in infos]
            if present and len(present) != len(bias_parts):
                continue  # some projections biased and others not: kept apart, as fuse.py does
            groups.append((name, kind, parts))
            fused.update(parts)
            if present:
                groups.append((bias_name, "bias", tuple(bias_parts)))
                fused.update(bias_parts)
        groups += [(s, k, (s,)) for s, k in kinds.items() if k in PACKED_KINDS and s not in fused]
        outputs, offset = [], 0
        for name, kind, parts in groups:
            rows = sum(infos[p].shape[0] for p in parts)
            shape = (rows, infos[parts[0]].shape[1]) if kind != "bias" else (rows,)
            sizes = self._sizes(kind, shape, fmt.dtype)
            offsets = (offset, offset + _round_up(sizes[0]))
            offset = offsets[1] + _round_up(sizes[1])
            outputs.append(_Output(name, kind, parts, shape, offsets))
        self.outputs: tuple[_Output, ...] = tuple(outputs)
        self.nbytes = offset
        self.kept = tuple(s for s in infos if s not in fused and kinds[s] not in PACKED_KINDS)

    @staticmethod
    def _kind(t: TensorInfo) -> str | None:
        if len(t.shape) != 2:
            return None
        if t.quant is None:
            return "dense"
        return kquant_layout(ggml_type(t), t.shape) or ("int4" if ggml_type(t) in INT4_TYPES else "int8")

    @staticmethod
    def _sizes(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        """Bytes of (codes, scales), or (values, 0)."""
        if kind in ("dense", "bias"):
            return math.prod(shape) * dtype.itemsize, 0
        codes, scales = vnni_parts(kind, shape)
        return tuple(math.prod(part_shape) * dtype.itemsize for dtype, part_shape in (codes, scales))


class StreamRepacker:
    """Thread-safe: fill() runs on the prefetch thread, give() on the compute thread."""

    def __init__(self, source: BlockSource, fmt: PackedFormat, module):
        self.source, self.fmt, self._module = source, fmt, module
        self._layouts = [_Layout(source.tensors(b), fmt) for b in range(source.num_blocks)]
        self.slot_bytes = max((lay.nbytes for lay in self._layouts), default=0)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        # Named as BufferPool's, for the weights telemetry (host buffer sets, blocks converted on the host).
        self.sets_made = 0  # slots allocated: stays <= the streamer's depth + 1
        self.takes = 0  # blocks repacked

    def compute_form(self, block: int) -> tuple[tuple[_Output, ...], tuple[str, ...]]:
        """What fill() makes of block `block`: the weights it writes into a slot (name, kind, shape), and
        the stored tensors it keeps (made by PackedFormat.streamed). The prepacked cache entry
        (prepacked.py) lays a block out from this."""
        layout = self._layouts[block]
        return layout.outputs, layout.kept

    def _take(self) -> torch.Tensor:
        self.takes += 1
        try:
            return self._free.get_nowait()
        except queue.Empty:
            self.sets_made += 1
            return torch.empty(self.slot_bytes, dtype=torch.uint8)  # (slot_bytes,) pages untouched until written

    def give(self, slot: torch.Tensor) -> None:
        self._free.put(slot)

    def fill(self, block: int, stored: dict[str, torch.Tensor]) -> tuple[dict[str, object], torch.Tensor]:
        """Block `block`'s weights in their resident compute form, and the slot they live in (give it back
        with give() once the block's kernels ran). `stored`: the block's tensors as stored (stored row
        order; packed ones as (rows, bytes per row) uint8 rows, plain ones typed), from the mapping or a
        disk read; they are not read after this returns."""
        layout, src, fmt = self._layouts[block], self.source, self.fmt
        infos = src.tensors(block)
        slot = self._take()
        try:
            weights = {s: fmt.streamed(infos[s], src.reorder(s, stored[s])) for s in layout.kept}
            for out in layout.outputs:
                weights[out.name] = self._write(out, infos, stored, slot)
        except BaseException:
            self.give(slot)
            raise
        return weights, slot

    def _region(self, slot: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return slot[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)

    def _write(self, out: _Output, infos: dict[str, TensorInfo], stored: dict[str, torch.Tensor],
               slot: torch.Tensor):
        src, dtype = self.source, self.fmt.dtype
        if out.kind in ("dense", "bias"):
            values = self._region(slot, out.offsets[0], dtype, out.shape)  # (out, in) or (out,)
            row = 0
            for p in out.parts:
                part = self.fmt.streamed(infos[p], src.reorder(p, stored[p]))
                values[row:row + part.shape[0]].copy_(part)
                row += part.shape[0]
            return values
        inner = out.shape[1]
        (code_dtype, code_shape), (scale_dtype, scale_shape) = vnni_parts(out.kind, out.shape)
        codes = self._region(slot, out.offsets[0], code_dtype, code_shape)
        scales = self._region(slot, out.offsets[1], scale_dtype, scale_shape)
        repack = {"int4": self._module.repack_int4, "int8": self._module.repack_int8}.get(out.kind,
                                                                                         self._module.repack_kquant)
        first = 0  # first row block of the part (every part but the last is whole blocks)
        for p in out.parts:
            t = infos[p]
            n = -(-t.shape[0] // LANES)
            repack(stored[p], int(ggml_type(t)), inner, codes[first:first + n], scales[first:first + n],
                   src.row_order(p))
            first += n
        if out.kind == "int4":
            return Int4Weight(codes, scales, out.shape, "vnni")
        if out.kind == "int8":
            return Int8Weight(codes, scales, out.shape, "vnni")
        return KQuantWeight(codes, scales, out.shape, out.kind)


def make_repacker(source: BlockSource, fmt: PackedFormat) -> StreamRepacker | None:
    """The repacker for this packed source's streamed blocks, or None where they stay GGUFWeight views
    dequantized per use: exact (fp32) mode, a non-CPU device, a type the C++ repack does not take (MXFP4), or
    no VNNI kernels / repack build (engine.kernels.ggml_repack logs why)."""
    if not source.packed or fmt.exact or not fmt.on_cpu:
        return None
    stored = {ggml_type(t) for b in range(source.num_blocks) for t in source.tensors(b).values() if t.quant}
    if not stored <= set(INT4_TYPES + INT8_REPACK_TYPES):
        return None
    module = ops.gguf_repack()
    if module is None:
        return None
    return StreamRepacker(source, fmt, module)
