"""The C++ softmax of attention_backend's bf16 matmul path (attention_ops.cpp), with a logged fallback.

Interface:
  attention_ops() -> module | None   the compiled ops, or None when attention_backend must use its
      torch ops (scale, masked_fill, softmax): the CPU lacks AVX-512 (F, BW, DQ), the extension cannot
      be built (no compiler, no ninja, a build error), or LAYERSTREAM_ATTENTION_OPS=torch asks for
      that (auto, the default: the ops where they build and run). The reason is logged once.
      Decided once per process; tests reset it with `attention_ops.cache_clear()`.
  The module: softmax_(s, scale, open_keys, hidden), see attention_ops.cpp.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from .build import CFLAGS, optional_kernel

SOURCE = Path(__file__).with_name("attention_ops.cpp")
NAME = "layerstream_attention_ops"
# ATen's vector types in their AVX-512 form (the CPU_CAPABILITY a torch build compiles per ISA).
BUILD_FLAGS = (*CFLAGS, "-mavx512dq", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512")


@functools.cache
def attention_ops() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_ATTENTION_OPS", "torch",
                           "attention softmax: using torch ops, not the fused C++ softmax", NAME, SOURCE, BUILD_FLAGS,
                           cpu_check="the CPU lacks AVX-512 F/BW/DQ")
