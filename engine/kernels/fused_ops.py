"""Fused CPU ops for the per-token small ops of engine/model.py (fused_ops.cpp), with a logged fallback.

Interface:
  fused_ops() -> module | None   the compiled ops, or None when engine/model.py must use its torch
      code: LAYERSTREAM_FUSED_OPS=torch asks for that (auto, the default: the ops where they build),
      or the extension cannot be built (no compiler, no ninja, a build error); the reason is logged
      once. Decided once per process; tests reset it with `fused_ops.cache_clear()`.
  The module's ops (CPU tensors, float32 / bfloat16 / float16, one dtype, last dim contiguous):
      rms_norm(x, w, eps), add_rms_norm(x, r, w, eps) -> (x + r, rms_norm(x + r)),
      silu_mul(gate, up), rotary(x, cos, sin): see fused_ops.cpp for what each computes.

Portable C++ (no instruction-set flags), so the one build runs on any CPU torch runs on.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

from .build import compile_or_reason

log = logging.getLogger("layerstream")

SOURCE = Path(__file__).with_name("fused_ops.cpp")
NAME = "layerstream_fused_ops"
# No FMA contraction: a*b + c must round twice, as torch's separate mul and add do. No trapping math
# and no errno from math functions: neither changes a result, and without them GCC will not vectorize
# SiLU's exp (its clamps and floor count as control flow that may trap).
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno")
MODES = ("auto", "torch")


@functools.cache
def fused_ops() -> ModuleType | None:
    wanted = os.environ.get("LAYERSTREAM_FUSED_OPS", "auto")
    if wanted not in MODES:
        raise ValueError(f"LAYERSTREAM_FUSED_OPS must be auto or torch, got {wanted!r}")
    if wanted == "torch":
        reason = "LAYERSTREAM_FUSED_OPS=torch"
    else:
        module, why = compile_or_reason(NAME, SOURCE, CFLAGS)
        if module is not None:
            return module
        reason = f"they {why}"
    log.warning("RMSNorm, SwiGLU and rotary: using torch ops, not the fused CPU ops: %s", reason)
    return None
