"""Kernel dispatch: which kernel runs each operation of the model math, decided here and nowhere else.

engine/model.py is the math; it calls the operations below and never names a kernel.

  linear(x, w, bias=None) -> (..., out)
      x @ w.T + bias for a dense (out, in) weight or a packed one (engine.weights: GGUFWeight,
      Int4Weight, Int8Weight, told apart by `w.kind`): the packed weight's layout names its kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .kernels.bf16_rows import bf16_rows


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ w.T + bias -> (..., out), where w is a dense (out, in) tensor or a packed weight."""
    if not isinstance(w, torch.Tensor):
        return _PACKED[w.kind](x, w, bias)
    if _few_bf16_rows(x):
        return bf16_rows().linear(x, w, bias)  # its kernel where it applies, else F.linear's (bf16_rows.cpp)
    return F.linear(x, w, bias)


def _few_bf16_rows(x: torch.Tensor) -> bool:
    """2-16 bf16 rows on the CPU with the AVX512-BF16 kernel in use: a decode step of a few sequences,
    whose products kernels/bf16_rows.cpp runs faster than oneDNN on a CPU without AMX (the figures:
    docs/benchmarks/bf16-rows.md, `layerstream bench-bf16-rows`). With AMX, oneDNN is the faster and
    bf16_rows() is None."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_cpu or x.shape[0] < 2:
        return False
    kernel = bf16_rows()
    return kernel is not None and x.shape[0] <= kernel.MAX_ROWS


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # (tokens, in)


def _gguf_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    # GGML blocks dequantized to the compute dtype for this product only: (out, in)
    return F.linear(x, w.dense(), bias)


def _int4_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if w.layout == "vnni":
        return kernels.int4_linear(x, w.codes, w.scales, w.shape[0], bias)  # (..., out)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_rows(x), w.codes, w.group, w.scales)  # (tokens, out)
    y = y.reshape(*x.shape[:-1], w.shape[0])  # (..., out)
    return y if bias is None else y + bias


def _int8_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if w.layout == "vnni":
        return kernels.int8_linear(x, w.codes, w.scales, w.shape[0], bias)  # (..., out)
    y = torch.ops.aten._weight_int8pack_mm(_rows(x), w.codes, w.scales)  # (tokens, out)
    y = y.reshape(*x.shape[:-1], w.shape[0])  # (..., out)
    return y if bias is None else y + bias


_PACKED = {"gguf": _gguf_linear, "int4": _int4_linear, "int8": _int8_linear}
