"""Native CPU kernels, compiled on first use, each with a logged fallback to a torch kernel.

Interface:
  int4_backend() -> "vnni" | "aten"   the int4 weight-only matmul this process uses, decided once:
      "vnni"  our AVX512-VNNI kernel (int4_vnni.cpp): activations quantized to int8 per 32 on the
              fly, integer dot products, llama.cpp's method; its weight layout is Int4Weight "vnni".
      "aten"  torch's `_weight_int4pack_mm_for_cpu` and its layout, used when the CPU lacks
              AVX512-VNNI, when the kernel cannot be built (no compiler, no ninja, a build error),
              or when LAYERSTREAM_INT4_KERNEL=aten asks for it. The reason is logged once.
  (LAYERSTREAM_INT4_KERNEL: auto, the default, or vnni, which is the same: the kernel where it can run.)
  int4_linear(x, codes, scales, out_features, bias)  the vnni kernel itself (only when int4_backend() == "vnni").
  int8_linear(x, codes, scales, out_features, bias)  its int8-weight twin (one scale per row; Int8Weight
      "vnni"), used on the same condition; its fallback is aten's `_weight_int8pack_mm`.
  kquant_linear(x, codes, scales, out_features, bias)  Q4_K / Q6_K with their sub-scales kept (KQuantWeight),
      on the same condition; without it those types take the int4 / int8 layouts.
  dequantize_bf16_t(codes, scales, K, b0, b1, out)  any of those layouts' rows as bf16, transposed, for a
      dense product of many rows (engine/ops.py: prompt chunks on AMX).
  onednn_has_amx() -> bool   whether oneDNN can use AMX tiles here, for the choices that turn on it
      (engine/ops.py makes them: bf16_rows, the one-row products, CPU attention).

The choice fixes the int4 weight layout, so everything that stores int4 weights (the quantization
cache) keys on it. Tests reset the choice with `int4_backend.cache_clear()`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

from .build import compile_extension

log = logging.getLogger("layerstream")

SOURCE = Path(__file__).with_name("int4_vnni.cpp")
NAME = "layerstream_int4_vnni"
INCLUDES = (Path(__file__).with_name("stream_prefetch.h"),)  # what int4_vnni.cpp #includes
BACKENDS = ("vnni", "aten")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_module = None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def onednn_has_amx() -> bool:
    """Whether torch's oneDNN can use AMX tiles here (Intel Sapphire Rapids and later; the OS must
    allow them too, which torch's probe asks). Where it can, oneDNN's bf16 products and SDPA's CPU
    flash kernel (which packs K and V for them) beat the engine's own bf16 paths:
    docs/benchmarks/amx.md says by how much."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, so probed: absent means no
    return bool(probe is not None and probe())


def _why_not_vnni() -> str | None:
    """None when the vnni kernel can run here; else the reason it cannot."""
    wanted = os.environ.get("LAYERSTREAM_INT4_KERNEL", "auto")
    if wanted not in ("auto", *BACKENDS):
        raise ValueError(f"LAYERSTREAM_INT4_KERNEL must be auto, vnni or aten, got {wanted!r}")
    if wanted == "aten":
        return "LAYERSTREAM_INT4_KERNEL=aten"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    missing = [f for f in REQUIRED_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


@functools.cache
def int4_backend() -> str:
    global _module
    reason = _why_not_vnni()
    if reason is None:
        try:
            module = compile_extension(NAME, SOURCE, includes=INCLUDES)
            if module.cpu_supported():
                _module = module
                return "vnni"
            reason = "the CPU lacks AVX512-VNNI (cpuid)"
        except Exception as e:  # noqa: BLE001 - any build failure means the fallback, loudly
            reason = f"it could not be built ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''})"
    log.warning("int4 matmul: using aten's _weight_int4pack_mm_for_cpu, not the AVX512-VNNI kernel: %s", reason)
    return "aten"


def _loaded():
    if _module is None:
        raise RuntimeError("the VNNI kernels are not loaded (int4_backend() chose aten)")
    return _module


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, two_pass: bool = True) -> torch.Tensor:
    """x (..., K) float32/bf16/fp16 @ W.T -> (..., out_features) in x's dtype; W in Int4Weight's
    "vnni" layout (engine/weights/packed/weights.py)."""
    return _loaded().int4_linear(x, codes, scales, out_features, bias, two_pass)


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None, two_pass: bool = True) -> torch.Tensor:
    """The same for Int8Weight's "vnni" layout (engine/weights/packed/weights.py)."""
    return _loaded().int8_linear(x, codes, scales, out_features, bias, two_pass)


def dequantize_bf16_t(codes: torch.Tensor, scales: torch.Tensor, inner: int, b0: int, b1: int,
                      out: torch.Tensor) -> torch.Tensor:
    """Row blocks [b0, b1) of 16 rows of an Int4Weight / Int8Weight "vnni" or KQuantWeight, dequantized into
    out (inner, 16 (b1 - b0)) bf16 transposed (out[k, n] = w[16 b0 + n, k]), or, out (2 inner, ...), into the
    bf16 rounding and its remainder, which sum to the weight; returns out."""
    return _loaded().dequantize_bf16_t(codes, scales, inner, b0, b1, out)


def kquant_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, two_pass: bool = True) -> torch.Tensor:
    """The same for KQuantWeight's layouts (engine/weights/packed/weights.py)."""
    return _loaded().kquant_linear(x, codes, scales, out_features, bias, two_pass)
