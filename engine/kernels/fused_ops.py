"""Fused CPU ops for the per-token small ops of engine/ops.py (fused_ops.cpp), with a logged fallback.

Interface:
  fused_ops() -> module | None   the compiled ops, or None when engine/ops.py uses its torch
      code: LAYERSTREAM_FUSED_OPS=torch asks for that (auto, the default: the ops where they build),
      or the extension cannot be built (no compiler, no ninja, a build error); the reason is logged
      once. Decided once per process; tests reset it with `fused_ops.cache_clear()`.
  The module's ops (CPU tensors, float32 / bfloat16 / float16, one dtype, last dim contiguous):
      rms_norm(x, w, eps), add_rms_norm(x, r, w, eps) -> (x + r, rms_norm(x + r)),
      silu_mul(gate, up), rotary(x, cos, sin): see fused_ops.cpp for what each computes;
      stream_read(tensors) -> int: every byte read once as the kernels stream weights (a bench probe).

Portable C++ (no instruction-set flags), so the one build runs on any CPU torch runs on.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from .build import optional_kernel

SOURCE = Path(__file__).with_name("fused_ops.cpp")
# what fused_ops.cpp #includes
INCLUDES = (Path(__file__).with_name("exp_approx.h"), Path(__file__).with_name("stream_prefetch.h"))
NAME = "layerstream_fused_ops"
# No FMA contraction: a*b + c must round twice, as torch's separate mul and add do. No trapping math
# and no errno from math functions: neither changes a result, and without them GCC will not vectorize
# SiLU's exp (its clamps and floor count as control flow that may trap).
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno")


@functools.cache
def fused_ops() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_FUSED_OPS", "torch",
                           "RMSNorm, SwiGLU and rotary: using torch ops, not the fused CPU ops", NAME, SOURCE, CFLAGS,
                           INCLUDES, subject="they")
