"""A decoder block of a decode step as one C++ call (decode_block.cpp), with a logged fallback.

Interface:
  decode_block() -> module | None   the compiled block, or None when engine/ops.py runs the
      block op by op: LAYERSTREAM_DECODE_BLOCK=off asks for that (auto, the default: the C++ block
      where it builds), as do the fused CPU ops being off (it is made of them) and the AVX512-VNNI
      kernels not being in use (it is made of them too, and built for their instruction sets); a
      build failure likewise. The reason is logged once. Tests reset it with `decode_block.cache_clear()`.
  module.block(x, attn_norm, mlp_norm, eps, wqkv, bqkv, wo, bo, w_gate_up, w_down, cos, sin, k_cache,
               v_cache, slots, block_tables, positions, window, heads, kv_heads, head_dim, few_rows) -> (seqs, hidden)
      a weight being (tensor, scales or None, out_features, adapter or None): see decode_block.cpp; wqkv and w_gate_up are
      lists of parts (one stacked weight, or q, k, v and gate, up apart), bqkv a list of their biases (or
      empty); few_rows: dense bf16 products of 1-16 rows take bf16_rows.cpp's kernel (as engine/ops.py's
      linear does when it is loaded). A weight's fourth item, the served adapters' term or None, is
      (A (sum R, in), B^T (sum R, out), each row's columns (rows, 2) int64), for at most LORA_ROWS_MAX rows.
  module.lora_rows_add_(y, x, a, b_t, row_cols) -> y   y += each row's own adapter's low-rank product, in
      place (one dtype for all; engine/ops.py's _lora_rows_linear calls it too, so both paths agree bit for
      bit); module.LORA_ROWS_MAX (32): the most rows it is given.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from . import INCLUDES as INT4_INCLUDES
from . import build, bf16_rows, fused_ops, int4_backend

SOURCE = Path(__file__).with_name("decode_block.cpp")
INCLUDES = (Path(__file__).with_name("int4_vnni.cpp"), *INT4_INCLUDES, fused_ops.SOURCE,  # what it #includes
            *fused_ops.INCLUDES, bf16_rows.SOURCE, *bf16_rows.INCLUDES)
NAME = "layerstream_decode_block"
# The kernels' instruction sets, and fused_ops' rounding flags (which leave the kernels' explicit
# intrinsics alone).
CFLAGS = build.CFLAGS + tuple(f for f in fused_ops.CFLAGS if f not in build.CFLAGS)


def _blocked() -> str | None:
    """Why not to build it: it is made of the fused ops and the VNNI kernels."""
    if fused_ops.fused_ops() is None:
        return "the fused CPU ops are off"
    if int4_backend() != "vnni":
        return "the AVX512-VNNI kernels are not in use"
    return None


@functools.cache
def decode_block() -> ModuleType | None:
    return build.optional_kernel("LAYERSTREAM_DECODE_BLOCK", "off",
                                 "decode steps: running each block op by op, not as one C++ call", NAME, SOURCE,
                                 CFLAGS, INCLUDES, blocked=_blocked)
