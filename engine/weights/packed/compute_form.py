"""What each stored tensor of a packed checkpoint (GGUF) becomes for compute.

  exact (float32): dense fp32, dequantized bit-exactly (once at load for resident blocks, at each use
                   for streamed ones) - the reference mode;
  fast (bf16/fp16): Q4_0/Q4_1/Q4_K repacked at load for the int4 kernel (codes kept), other
                   quantized types requantized at load to per-row int8 for the int8 kernel; with the
                   VNNI kernels and the C++ repack, Q4_K and Q6_K rearranged with every bit kept
                   (KQuantWeight: as few bytes per weight as the file's);
                   streamed blocks move their GGML bytes and, with the VNNI kernels, are put in this
                   same resident form by the prefetch thread (stream_repack.py, in C++); without
                   them (aten's kernels) they are dequantized to the compute dtype on use (`streamed`).
Norms and other 1-D tensors are dequantized to the compute dtype; F32/F16/BF16 tensors are cast.

On a CUDA device there is no int4/int8 weight-only kernel here (aten's are CPU kernels): fast mode keeps
a resident block's quantized tensors packed on the device as `GGUFWeight` (dequantized to the compute
dtype by the matmul that uses them), so the device holds packed bytes; exact mode holds dense fp32.

Every method takes the tensor's `TensorInfo` and its bytes as rows, `(rows..., bytes per row)` uint8
(views.byte_rows), already in engine row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import ops
from ..formats.reader import TensorInfo
from .dequant import dequantize
from ..formats.gguf_file import ggml_type
from .weights import (INT4_TYPES, INT8_REPACK_TYPES, KQUANT_TYPES, GGUFWeight, Int4Weight, Int8Weight, KQuantWeight,
                      int4_from_gguf, int4_nbytes, int8_nbytes, kquant_nbytes, vnni_parts)


@dataclass(frozen=True)
class PackedFormat:
    dtype: torch.dtype  # the compute dtype
    device: torch.device = torch.device("cpu")

    @property
    def exact(self) -> bool:
        return self.dtype == torch.float32

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def resident(self, t: TensorInfo, rows: torch.Tensor):
        if t.quant is None:
            return rows.view(t.dtype).reshape(t.shape).to(device=self.device, dtype=self.dtype, copy=True)
        q = ggml_type(t)
        # A vector, or a stack of per-head matrices (DeepSeek's split kv_b, multiplied by einsum): unpacked, as
        # only a 2-D matrix goes to the packed products.
        if self.exact or len(t.shape) != 2:
            return dequantize(rows, q, t.shape).to(device=self.device, dtype=self.dtype)
        if not self.on_cpu:
            return GGUFWeight(rows.to(self.device, copy=True), q, t.shape, self.dtype)
        return _repack(rows, q, t.shape, self.dtype)

    def resident_bytes(self, t: TensorInfo) -> int:
        numel = t.numel
        if t.quant is None or self.exact or len(t.shape) != 2:
            return numel * self.dtype.itemsize
        if not self.on_cpu:
            return t.nbytes
        layout = kquant_layout(ggml_type(t), t.shape)
        if layout is not None:
            return kquant_nbytes(t.shape, layout)
        if ggml_type(t) in INT4_TYPES:
            return int4_nbytes(t.shape, self.dtype)
        return int8_nbytes(t.shape, self.dtype)

    def streamed(self, t: TensorInfo, rows: torch.Tensor):
        if t.quant is None:
            v = rows.view(t.dtype).reshape(t.shape)
            return v if v.dtype == self.dtype else v.to(self.dtype)
        if len(t.shape) != 2:
            return dequantize(rows, ggml_type(t), t.shape).to(self.dtype)
        return GGUFWeight(rows, ggml_type(t), t.shape, self.dtype)

    def embedding(self, t: TensorInfo, rows: torch.Tensor):
        """The token table is only gathered from: it stays packed (or a view) and rows are unpacked on
        lookup; on a CUDA device it is copied there as it is stored."""
        if t.quant is None:
            table = rows.view(t.dtype).reshape(t.shape)
            return table if self.on_cpu else table.to(self.device, copy=True)
        return GGUFWeight(rows if self.on_cpu else rows.to(self.device, copy=True), ggml_type(t), t.shape, self.dtype)

    def embedding_bytes(self, t: TensorInfo) -> int:
        return t.nbytes


# Rows converted at a time by the torch fallback: its temporaries (the rows dequantized to fp32 and a
# few passes over them) then stay a few tens of MiB, where a whole tied head would briefly take
# several times the head's final size, memory the plan does not hold.
_CHUNK_ROWS = 2048


def kquant_layout(q, shape: tuple[int, ...]) -> str | None:
    """"q4k" / "q6k" where a Q4_K / Q6_K (out, in) weight keeps its sub-scales for the VNNI kernel
    (KQuantWeight: the fewest bytes a decode step reads), else None (the int4 / int8 forms)."""
    layout = KQUANT_TYPES.get(q)
    if layout is None or len(shape) != 2 or shape[1] % 256 or ops.gguf_repack() is None:
        return None
    return layout


def _repack(rows: torch.Tensor, q, shape: tuple[int, int], dtype: torch.dtype):
    """A quantized (out, in) tensor in the CPU kernels' resident form: the C++ repack writing straight
    into the result where it runs (no temporaries), else the torch code, a chunk of rows at a time."""
    out, inner = shape
    module = ops.gguf_repack() if inner % 32 == 0 and q in INT4_TYPES + INT8_REPACK_TYPES else None
    layout = kquant_layout(q, shape)
    if layout is not None:
        (code_dtype, code_shape), (scale_dtype, scale_shape) = vnni_parts(layout, shape)
        codes, scales = torch.empty(code_shape, dtype=code_dtype), torch.empty(scale_shape, dtype=scale_dtype)
        ops.gguf_repack().repack_kquant(rows.contiguous(), int(q), inner, codes, scales, None)
        return KQuantWeight(codes, scales, shape, layout)
    if module is not None:
        int4 = q in INT4_TYPES
        (code_dtype, code_shape), (scale_dtype, scale_shape) = vnni_parts("int4" if int4 else "int8", shape)
        codes, scales = torch.empty(code_shape, dtype=code_dtype), torch.empty(scale_shape, dtype=scale_dtype)
        (module.repack_int4 if int4 else module.repack_int8)(rows.contiguous(), int(q), inner, codes, scales, None)
        return (Int4Weight if int4 else Int8Weight)(codes, scales, shape, "vnni")
    parts = []
    for first in range(0, out, _CHUNK_ROWS):
        part = rows[first:first + _CHUNK_ROWS]
        part_shape = (part.shape[0], inner)
        parts.append(int4_from_gguf(part, q, part_shape, dtype) if q in INT4_TYPES
                     else Int8Weight.quantize(dequantize(part, q, part_shape), dtype))
    if len(parts) == 1:
        return parts[0]
    stacked = type(parts[0]).stack_rows(parts)
    assert stacked is not None, "chunks of whole 16-row blocks always stack"
    return stacked
