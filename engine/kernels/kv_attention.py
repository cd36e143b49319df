"""Attention over the quantized KV cache (kv_attention.cpp), with a logged fallback.

Interface:
  kv_attention() -> module | None   the compiled kernel, or None when engine/ops.py attends over the
      quantized cache with torch (gathering and dequantizing a bounded group of sequences at a time):
      LAYERSTREAM_KV_ATTENTION=torch asks for that (auto, the default: the kernel where it builds), or the
      extension cannot be built (no compiler, no ninja, a build error); the reason is logged once.
      Decided once per process; tests reset it with `kv_attention.cache_clear()`.
  The module: attention(q, k_codes, k_scales, v_codes, v_scales, block_tables, positions, window, bits,
      scale), see kv_attention.cpp.

Portable C++ (per-function target clones for AVX-512 and AVX2), so the one build runs on any x86-64 CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from .build import optional_kernel

SOURCE = Path(__file__).with_name("kv_attention.cpp")
INCLUDES = (Path(__file__).with_name("exp_approx.h"),)  # what kv_attention.cpp #includes
NAME = "layerstream_kv_attention"
CFLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno")


@functools.cache
def kv_attention() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_KV_ATTENTION", "torch",
                           "attention over the quantized KV cache: using torch (dequantizing a group of sequences "
                           "at a time), not the C++ kernel", NAME, SOURCE, CFLAGS, INCLUDES)
