"""Kernel dispatch: which kernel runs each operation of the model math, decided here and nowhere else.

engine/model.py is the math: it calls the operations below and never names a kernel, a CPU feature or
a switch. Each choice is made once per process from the CPU's features, the LAYERSTREAM_* switches
and whether the kernel builds (each loader in engine.kernels caches its answer and logs a fallback
once); per call the dispatch reads only facts about the data (dtype, device, rows). `choose(device,
dtype)` resolves every choice at load and returns them as `KernelChoices`, which the loader logs in one
line and the telemetry snapshot carries (EngineTelemetry.kernels). Why each threshold is where it is:
docs/benchmarks/ (bf16-rows.md, amx.md, int4.md, decode-profile.md).

  products     linear(x, w, bias): dense weights on F.linear (oneDNN / MKL), 1-16 bf16 rows on
               bf16_rows.cpp (AVX512-BF16; one row only with AMX; LAYERSTREAM_BF16_ROWS), a single bf16
               row where that kernel is not in use on torch's matrix-vector kernel with oneDNN off around
               the step (single_row_products: without AMX); packed weights (engine.weights: GGUFWeight,
               Int4Weight, Int8Weight, KQuantWeight, told apart by `kind`) on int4_vnni.cpp (AVX512-VNNI),
               prompt chunks on AMX as dequantized bf16 (LAYERSTREAM_AMX_PREFILL), or aten's weight-only
               kernels (int4_layout(): LAYERSTREAM_INT4_KERNEL, which also fixes how int4/int8 weights are
               stored), GGUF blocks
               dequantized to the compute dtype for each product; a LoRA-adapted weight (kind "lora",
               engine.finetune) as its base's product plus the adapters' low-rank products in torch;
               served adapters (kind "lora_rows", engine.lora_serving) as one base product for the
               step's rows plus each adapter's low-rank product on its own rows, in torch.
               A tensor autograd follows (fine-tuning's recomputed blocks) never reaches a C++ kernel.
  small ops    rms_norm, add_rms_norm, apply_rotary, silu_mul: fused_ops.cpp on the CPU
               (LAYERSTREAM_FUSED_OPS), else torch.
  attention    token by token (token_by_token, decode_attention: fused_ops.cpp) for 16-bit CPU decode steps
               and the prompt chunks tokenwise_attention_pays picks; else the padded batch (attend): on the
               CPU in bf16 two fp32 oneDNN matmuls around attention_ops.cpp's softmax where the CPU has
               AVX512-BF16 and no AMX (bf16_matmul_attention: LAYERSTREAM_CPU_ATTENTION,
               LAYERSTREAM_ATTENTION_OPS), else SDPA; attention_backend.py holds both and bounds their memory.
  quantized KV a cache of int8/int4 codes (engine.kv_quant, --kv-cache-dtype): token by token on
               kv_attention.cpp, reading the codes in place, on the CPU (LAYERSTREAM_KV_ATTENTION), where
               token_by_token would run; else gathered and dequantized a bounded group of sequences at a time
               into `attend` (attend_quantized; the CUDA path). The fused decode block is not used with it.
  block        a whole Llama block of such a step as one C++ call (fused_block: decode_block.cpp,
               LAYERSTREAM_DECODE_BLOCK), else op by op; op by op for a step with served adapters' rows
               (StepInputs.lora), which the C++ block would leave out.
  GGUF repack  GGUF blocks put in the VNNI kernels' layout by ggml_repack.cpp (gguf_repack(), which the
               weights package asks: LAYERSTREAM_STREAM_REPACK), else by torch at load and dequantized per
               product when streamed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import attention_backend, kernels
from .kernels import _cpu_flags, onednn_has_amx
from .kernels.attention_ops import attention_ops
from .kernels.bf16_rows import bf16_rows, max_rows as bf16_rows_max
from .kernels.decode_block import decode_block
from .kernels.fused_ops import fused_ops
from .kernels.ggml_repack import ggml_repack
from .kernels.kv_attention import kv_attention
from .kv_quant import QuantizedKV, dequantize

if TYPE_CHECKING:
    from .arch import ModelConfig
    from .model import StepInputs

log = logging.getLogger("layerstream")


# -- the choices --------------------------------------------------------------------------------------

def int4_layout() -> str:
    """"vnni" (int4_vnni.cpp) or "aten": the int4/int8 weight products this process runs, and so the layout
    every int4/int8 weight is stored in (engine.weights.packed; the quantization cache keys on it)."""
    return kernels.int4_backend()


def gguf_repack() -> ModuleType | None:
    """ggml_repack.cpp where GGUF blocks are put in the VNNI kernels' layouts by it, else None (torch
    repacks at load; streamed blocks stay packed and are dequantized per product)."""
    return ggml_repack() if int4_layout() == "vnni" else None


def _bf16_dot_products() -> bool:
    """Whether this CPU is of the kind the bf16 matmul attention path was measured faster on: bf16 dot
    products (AVX512-BF16) without AMX. With AMX, SDPA's flash kernel packs K and V for oneDNN's AMX
    micro-kernels and is the faster, and oneDNN's bf16 math mode there really rounds the fp32 inputs to
    bf16 (docs/benchmarks/amx.md: `python -m layerstream.bench.amx`). Elsewhere SDPA keeps running,
    unmeasured against it."""
    return torch.backends.mkldnn.is_available() and "avx512_bf16" in _cpu_flags() and not onednn_has_amx()


CPU_ATTENTION_MODES = ("auto", "sdpa")


def cpu_attention_mode() -> str:
    """LAYERSTREAM_CPU_ATTENTION: auto (the default: the matmul path for bf16 where the CPU is of the
    kind it was measured on) or sdpa (SDPA for every dtype, as before; for A/B runs of a benchmark)."""
    mode = os.environ.get("LAYERSTREAM_CPU_ATTENTION", "auto")
    if mode not in CPU_ATTENTION_MODES:
        raise ValueError(f"LAYERSTREAM_CPU_ATTENTION must be auto or sdpa, got {mode!r}")
    return mode


@functools.cache
def bf16_matmul_attention() -> bool:
    """Whether bf16 attention over a padded batch on the CPU takes the matmul path (attention_backend:
    two fp32 oneDNN matmuls around an fp32 softmax) instead of SDPA's flash kernel. Decided once."""
    return cpu_attention_mode() == "auto" and _bf16_dot_products()


# A step with prompt chunks attends token by token (token_by_token) when its chunks' tokens read at most this
# many keys in all: where the two paths' measured costs cross on the benchmark model
# (docs/benchmarks/decode-profile.md).
TOKENWISE_MAX_KEYS = 12288


def tokenwise_attention_pays(device: torch.device, dtype: torch.dtype, prefill_keys: int) -> bool:
    """Whether a step with prompt chunks (maybe beside decodes) should attend token by token, as decode
    steps do, rather than through the padded batch `attend` takes; prefill_keys: the keys its chunks'
    tokens read in all (decode tokens are not counted: token by token is their better path at any
    context). Token by token, a chunk's tokens each read their keys again (no reuse of a key across a
    chunk's rows); the padded path pays a fixed cost per call (gathering K/V, mask, padding, fp32
    copies, two small matmuls) and then reuses every key across the chunk: short prompts go token by
    token, long ones keep `attend`. The CPU in a 16-bit dtype only: that kernel's domain."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and prefill_keys <= TOKENWISE_MAX_KEYS


@dataclass(frozen=True)
class KernelChoices:
    """What a model computing in `dtype` on `device` runs, by operation: a kernel's name, or the torch
    code it falls back to. For the log line at load and the telemetry snapshot."""

    device: str
    dtype: str
    products: str  # dense products
    packed: str  # int4/int8 weight products (and their weights' layout)
    small_ops: str  # RMSNorm, SwiGLU, rotary
    attention: str
    block: str  # a decode step's whole block
    gguf_repack: str

    def describe(self) -> str:
        return (f"kernels ({self.dtype} on {self.device}): products {self.products}; int4/int8 {self.packed}; "
                f"norms, SwiGLU, rotary {self.small_ops}; attention {self.attention}; decode block {self.block}; "
                f"GGUF repack {self.gguf_repack}")


_logged: set[tuple[str, torch.dtype]] = set()


def choose(device: torch.device, dtype: torch.dtype) -> KernelChoices:
    """Every choice for a model in `dtype` on `device`, resolved now (building what this CPU will use:
    engine.kernels.prepare), logged once per device type and dtype."""
    from .kernels.prepare import prepare

    prepare()
    cpu, half = device.type == "cpu", dtype in (torch.bfloat16, torch.float16)
    bf16_cpu = cpu and dtype == torch.bfloat16
    fused = cpu and fused_ops() is not None
    products = "oneDNN/MKL (F.linear)" if cpu else "F.linear"
    if bf16_cpu and bf16_rows() is not None:
        rows = bf16_rows_max(bf16_rows())
        products += ", 1 row bf16_rows" if rows == 1 else f", 1-{rows} rows bf16_rows"
    if bf16_cpu and not onednn_has_amx():
        products += ", 1 row torch gemv (oneDNN off)"
    if not cpu:
        padded = "SDPA (memory-efficient, cuDNN off)"
    elif bf16_cpu and bf16_matmul_attention():
        padded = "bf16 matmul path, softmax " + ("attention_ops" if attention_ops() is not None else "torch")
    else:
        padded = "SDPA"
    attention = (f"token by token fused_ops (decode, prompts <= {TOKENWISE_MAX_KEYS} keys), else {padded}"
                 if fused and half else padded)
    if cpu and kv_attention() is not None:
        attention += "; a quantized KV cache: kv_attention token by token, else dequantized per group into that"
    block = "decode_block" if fused and half and decode_block() is not None else "op by op"
    repack = "ggml_repack" if cpu and gguf_repack() is not None else "torch at load, dequantized per product streamed"
    choices = KernelChoices(device.type, str(dtype).replace("torch.", ""), products,
                            int4_layout() if cpu else "dequantized per product (GGUF on a GPU)",
                            "fused_ops" if fused else "torch", attention, block, repack)
    if (device.type, dtype) not in _logged:
        _logged.add((device.type, dtype))
        log.info("%s", choices.describe())
    return choices


# -- products -----------------------------------------------------------------------------------------

def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ w.T + bias -> (..., out), where w is a dense (out, in) tensor or a packed weight."""
    if not isinstance(w, torch.Tensor):
        if x.requires_grad and w.kind in ("int4", "int8", "kquant"):
            return _FrozenPackedLinear.apply(x, w, bias)  # the kernels have no backward
        return _PACKED[w.kind](x, w, bias)
    if _few_bf16_rows(x):
        return bf16_rows().linear(x, w, bias)  # its kernel where it applies, else F.linear's (bf16_rows.cpp)
    return F.linear(x, w, bias)


def _few_bf16_rows(x: torch.Tensor) -> bool:
    """1-16 bf16 rows on the CPU with the AVX512-BF16 kernel in use: a decode step of a few sequences,
    whose products kernels/bf16_rows.cpp runs faster than oneDNN (and, at one row, than torch's own
    matrix-vector kernel) on a CPU without AMX (the figures: docs/benchmarks/bf16-rows.md,
    `layerstream bench-bf16-rows`). With AMX, oneDNN is the faster from 2 rows on: one row only
    (bf16_rows_max). Not for a tensor autograd follows: the kernel has no backward."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_cpu or x.shape[0] < 1 or x.requires_grad:
        return False
    kernel = bf16_rows()
    return kernel is not None and x.shape[0] <= bf16_rows_max(kernel)


def _one_bf16_row_on_cpu(x: torch.Tensor) -> bool:
    """A single bf16 row on a CPU without AMX: every dense product of the step is a matrix-vector
    product, which torch's own bf16 kernel runs faster than oneDNN's there (it reads the weight at
    close to the memory's bandwidth). From 2 rows on it runs row by row; 2-16 rows take
    kernels/bf16_rows.cpp (linear), more take oneDNN. With AMX, oneDNN is the faster at one row too (or
    no slower). The figures: docs/benchmarks/bf16-rows.md and amx.md."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1] and not onednn_has_amx()


@contextlib.contextmanager
def single_row_products(x: torch.Tensor):
    """Around a step's forward whose activations are x (tokens, hidden): for a single bf16 row on a
    CPU without AMX, torch's dense products (F.linear here, at::linear in kernels/decode_block.cpp) without
    oneDNN; otherwise nothing. The switch is process-wide: the engine's one compute thread is the only one
    multiplying while it is off."""
    if not _one_bf16_row_on_cpu(x):
        yield
        return
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # (tokens, in)


class _FrozenPackedLinear(torch.autograd.Function):
    """A frozen int4/int8 weight's product with a backward for x (fine-tuning over a quantized base, QLoRA's
    way): the forward is the kernel's; the backward multiplies by the dequantized weight, which is the
    kernel's own product of the identity (its int8 quantization of a one-hot row is exact), so the weight's
    packed layout needs no dequantizer of its own. Formed per call: (out, in) in x's dtype, then freed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.w, ctx.dtype = w, x.dtype
        return _PACKED[w.kind](x.detach(), w, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.w
        eye = torch.eye(w.shape[1], dtype=ctx.dtype, device=grad.device)  # (in, in)
        w_t = _PACKED[w.kind](eye, w, None)  # (in, out) = W^T
        return grad.to(ctx.dtype) @ w_t.T, None, None  # (..., in)


def _gguf_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    # GGML blocks dequantized to the compute dtype for this product only: (out, in)
    return F.linear(x, w.dense(), bias)


# Packed weights times many bf16 rows on a CPU with AMX: the weight dequantized to bf16, a chunk of its
# rows at a time, and one oneDNN product per chunk (AMX tiles) outrun the integer kernel from about this many
# rows (a prompt chunk; decode steps stay on the integer kernel, which reads the fewest bytes). The figures:
# docs/benchmarks/scale.md. LAYERSTREAM_AMX_PREFILL=off keeps every product on the integer kernel. The weight is
# split in two bf16 parts (its rounding and the remainder; x meets both in one product of twice the inputs):
# bf16 alone keeps too few of a dequantized weight's bits (tests/engine/test_kv_accuracy.py noticed).
DENSE_PRODUCT_ROWS = 128
DENSE_CHUNK_ELEMENTS = 4 << 20  # one chunk's dequantized weight: 8 MiB of bf16, reused chunk after chunk


@functools.cache
def amx_prefill() -> bool:
    """Whether packed weights take the dense bf16 product for prompt chunks (CPU with AMX, the VNNI kernels)."""
    mode = os.environ.get("LAYERSTREAM_AMX_PREFILL", "auto")
    if mode not in ("auto", "off"):
        raise ValueError(f"LAYERSTREAM_AMX_PREFILL={mode!r}: expected auto or off")
    return mode == "auto" and onednn_has_amx() and kernels.int4_backend() == "vnni"


def _dense_rows(x: torch.Tensor, w) -> bool:
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() >= DENSE_PRODUCT_ROWS * x.shape[-1]
            and getattr(w, "layout", "vnni") != "aten" and amx_prefill())


def _chunk_blocks(inner: int) -> int:
    """Row blocks of 16 dequantized per chunk of _dense_product."""
    return max(1, min(DENSE_CHUNK_ELEMENTS // (inner * 16), 128))


def dense_product_workspace_bytes(tokens: int, inner: int) -> int:
    """What _dense_product allocates for a step of `tokens` rows whose packed weights take `inner` inputs at
    most: one chunk's dequantized weight and its product (the plan's workspace counts it)."""
    if tokens < DENSE_PRODUCT_ROWS or not amx_prefill():
        return 0
    rows = _chunk_blocks(inner) * 16
    return (2 * inner * rows + tokens * rows + tokens * 2 * inner) * 2


def _dense_product(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ W.T for a packed VNNI-layout weight, as bf16 oneDNN products over chunks of W's rows,
    each chunk dequantized exactly by int4_vnni.cpp's dequantize_bf16_t into two bf16 parts that sum to it."""
    out, inner = w.shape
    rows = _rows(x)  # (tokens, in)
    doubled = torch.cat([rows, rows], dim=1)  # (tokens, 2 in): meets the weight's two parts
    y = torch.empty(rows.shape[0], out, dtype=x.dtype)  # (tokens, out)
    per = _chunk_blocks(inner)
    blocks = w.codes.shape[0]
    chunk = torch.empty(2 * inner, min(per, blocks) * 16, dtype=torch.bfloat16)  # (2 in, chunk rows)
    for b0 in range(0, blocks, per):
        b1 = min(blocks, b0 + per)
        wt = kernels.dequantize_bf16_t(w.codes, w.scales, inner, b0, b1, chunk[:, :(b1 - b0) * 16])
        n0, n1 = b0 * 16, min(out, b1 * 16)
        y[:, n0:n1] = doubled @ wt[:, :n1 - n0]  # (tokens, chunk rows)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], out)


def _int4_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if w.layout == "vnni":
        if _dense_rows(x, w):
            return _dense_product(x, w, bias)
        return kernels.int4_linear(x, w.codes, w.scales, w.shape[0], bias)  # (..., out)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_rows(x), w.codes, w.group, w.scales)  # (tokens, out)
    y = y.reshape(*x.shape[:-1], w.shape[0])  # (..., out)
    return y if bias is None else y + bias


def _int8_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if w.layout == "vnni":
        if _dense_rows(x, w) and w.shape[1] % 32 == 0:
            return _dense_product(x, w, bias)
        return kernels.int8_linear(x, w.codes, w.scales, w.shape[0], bias)  # (..., out)
    y = torch.ops.aten._weight_int8pack_mm(_rows(x), w.codes, w.scales)  # (tokens, out)
    y = y.reshape(*x.shape[:-1], w.shape[0])  # (..., out)
    return y if bias is None else y + bias


def _kquant_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if _dense_rows(x, w):
        return _dense_product(x, w, bias)
    return kernels.kquant_linear(x, w.codes, w.scales, w.shape[0], bias)  # (..., out)


def _lora_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """A frozen base product plus low-rank adapters (engine.finetune's LoRAWeight): y = x W^T + b, and each
    output segment s of y (q, k, v of a stacked wqkv; the whole of y otherwise) adds
    scale * (x A_s^T) B_s^T, in the adapter's dtype, rounded to y's dtype after the sum as PEFT does."""
    y = linear(x, w.base, bias)  # (..., out)
    xa = x.to(w.dtype)
    deltas = [F.linear(F.linear(xa, a), b) * w.scale if a is not None  # (..., segment) adapter dtype
              else xa.new_zeros(*y.shape[:-1], n) for a, b, n in zip(w.a, w.b, w.sizes)]
    return (y + (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1))).to(y.dtype)


def _lora_rows_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """Served adapters (engine.lora_serving's RowLoRAWeight): one base product y = x W^T + b over every row
    of x (tokens, in), then y + (x A^T) B^T with each row through its own adapter's columns, in the adapters'
    dtype (the compute dtype: fp32 as PEFT computes, bf16 as vLLM does, added to y in place: widening y for
    the sum cost more than the adapters' products; B holds the scales, a stacked weight's B is block
    diagonal). On the CPU, up to LORA_ROWS_MAX rows (a decode step's), decode_block.cpp's lora_rows_add_ does
    that row by row, as the C++ decode block does (the same bits); otherwise (a prompt chunk's many rows,
    where dense products beat it; a GPU) the adapters' products run side by side with a mask keeping each
    row's own columns (on this CPU that beat a pair of products per adapter on its own rows, whose gathers
    and small calls cost more than the masked columns). A row of no adapter adds nothing."""
    y = linear(x, w.base, bias)  # (tokens, out)
    block = decode_block() if x.device.type == "cpu" else None
    if (block is not None and x.dtype == y.dtype == w.a.dtype and x.dim() == 2
            and x.shape[0] <= block.LORA_ROWS_MAX):
        return block.lora_rows_add_(y, x.contiguous(), w.a, w.b_t, w.rows.row_cols(w.cols))
    xa = linear(x.to(w.a.dtype), w.a).mul_(w.rows.mask(w.cols, w.a.dtype))  # (tokens, sum of R)
    delta = xa @ w.b_t  # (tokens, out)
    return y.add_(delta) if y.dtype == delta.dtype else (y.float() + delta).to(y.dtype)


_PACKED = {"gguf": _gguf_linear, "int4": _int4_linear, "int8": _int8_linear, "kquant": _kquant_linear,
           "lora": _lora_linear,
           "lora_rows": _lora_rows_linear}


# -- small ops ----------------------------------------------------------------------------------------

_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fusable(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the fused CPU ops take these tensors: on the CPU, one floating dtype, last dimension
    contiguous (the ops check the rest and raise)."""
    # The C++ ops have no backward: a tensor autograd follows (fine-tuning) takes torch's ops.
    if x.requires_grad or any(t.requires_grad for t in others):
        return False
    return (x.is_cpu and x.dtype in _FUSED_DTYPES and x.stride(-1) == 1
            and all(t.dtype == x.dtype and t.stride(-1) == 1 for t in others) and fused_ops() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, accumulated in fp32."""
    if _fusable(x, weight):
        return fused_ops().rms_norm(x, weight, eps)  # the same math in one call (fused_ops.cpp)
    return _rms_norm_torch(x, weight, eps)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Accumulate in fp32 as the reference does, so bf16/fp16 inputs round the same way.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + r and rms_norm(h): a residual add and the norm after it, one call on the CPU."""
    if _fusable(x, r, weight):
        return fused_ops().add_rms_norm(x, r, weight, eps)
    h = x + r
    return h, _rms_norm_torch(h, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos, sin: (tokens, 1, head_dim) from model.rotary_cos_sin.
    The reference computes x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); here the halves
    are swapped by roll and the sign sits in sin: (-x2) * s == x2 * (-s) bit for bit, so this is exact."""
    if _fusable(x, cos, sin) and x.dim() == 3:
        return fused_ops().rotary(x, cos, sin)  # (tokens, heads, head_dim), the same roundings
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up: (tokens, intermediate), one call on the CPU."""
    if _fusable(gate, up):
        return fused_ops().silu_mul(gate, up)
    return F.silu(gate) * up


# -- attention ----------------------------------------------------------------------------------------

def token_by_token(step: StepInputs, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor | None:
    """The block table of each token's sequence, (tokens, max_blocks), when this step's attention goes
    to the fused CPU kernel token by token (decode_attention), else None. That kernel writes every
    token's K/V first, then attends each token over its own sequence's cache up to its own position:
    causal attention, so a chunk of prompt tokens is as many one-token attentions. It runs on the CPU in
    a 16-bit dtype (float32 is the exact mode, kept on SDPA, which the reference tests hold to
    transformers), for a decode step (one token per sequence: the block tables are already per token)
    and for the steps where the runner found it pays (tokenwise_attention_pays). For decodes it beat
    the gather + SDPA at every context measured, most at short ones (docs/benchmarks/decode-profile.md)."""
    if x.dtype == torch.float32 or not _fusable(x, *others):
        return None
    if step.max_query == 1 and step.pad_rows is None:
        return step.block_tables
    return step.token_tables


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, step: StepInputs, tables: torch.Tensor) -> torch.Tensor:
    """Each token's K/V written to the cache, then each token attending its own sequence's cache up to its
    position (token_by_token's tables): q (tokens, heads, head_dim), k, v (tokens, kv_heads, head_dim) ->
    (tokens, heads * head_dim). One C++ call (fused_ops.cpp)."""
    return fused_ops().decode_attention(q, k, v, k_cache, v_cache, step.slot_mapping, tables, step.positions,
                                        step.window or 0)


def uses_bf16_matmul(q: torch.Tensor) -> bool:
    """Whether attend runs these queries through the bf16 matmul path rather than SDPA."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu" and not q.requires_grad and bf16_matmul_attention()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, chunk_bytes: int | None = None,
           open_keys: int = 0, scratch: attention_backend.AttentionScratch | None = None, scale: float | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a padded batch (attention_backend.attend: its arguments and shapes) on the kernel
    chosen for these queries. A soft-cap or attention sinks (GPT-OSS) take the eager torch path: no SDPA
    kernel and neither C++ attention kernel computes them."""
    return attention_backend.attend(q, k, v, mask, chunk_bytes, open_keys, scratch, scale, softcap,
                                    matmul=uses_bf16_matmul(q), softmax=attention_ops(), sinks=sinks)


def attend_latent(q: torch.Tensor, latent: torch.Tensor, width: int, mask: torch.Tensor, scale: float | None,
                  chunk_bytes: int | None = None) -> torch.Tensor:
    """Multi-head latent attention (model.latent_attention) over a padded batch: q (seqs, heads, max_query, d),
    latent (seqs, 1, context, d), values its first `width` dims -> (seqs, heads, max_query, width). Torch's
    ops on every device (attention_backend.attend_latent): the C++ kernels take K and V of one head_dim."""
    return attention_backend.attend_latent(q, latent, width, mask, scale, chunk_bytes)


# -- attention over a quantized KV cache ---------------------------------------------------------------

def quantized_kv_tables(step: StepInputs, q: torch.Tensor) -> torch.Tensor | None:
    """The block table of each token's sequence when attention over a quantized cache runs token by token
    on kv_attention.cpp (reading the codes where they lie), else None (attend_quantized): a CPU step with
    the kernel built, one token per sequence (decode) or the prompt chunks the runner chose token by token
    for (tokenwise_attention_pays)."""
    if not q.is_cpu or kv_attention() is None:
        return None
    if step.max_query == 1 and step.pad_rows is None:
        return step.block_tables
    return step.token_tables


def write_quantized(cache: QuantizedKV, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """x (tokens, kv_heads, head_dim) quantized into the cache's slots: one C++ call on the CPU where the kernel
    built (the same codes and scales as kv_quant.quantize), else torch's ops."""
    if x.is_cpu and kv_attention() is not None:
        kv_attention().write(x.float(), cache.codes, cache.scales, slot_mapping, cache.quant.bits)
    else:
        cache.write(slot_mapping, x)


def quantized_decode_attention(q: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV, step: StepInputs,
                               tables: torch.Tensor, scale: float) -> torch.Tensor:
    """q (tokens, heads, head_dim) attending each token's own sequence up to its position over the
    quantized cache (already holding the step's K/V) -> (tokens, heads, head_dim) fp32. One C++ call."""
    return kv_attention().attention(q.float().contiguous(), k_cache.codes, k_cache.scales, v_cache.codes,
                                    v_cache.scales, tables, step.positions, step.window or 0, k_cache.quant.bits,
                                    scale)


def attend_quantized(q: torch.Tensor, k_cache: QuantizedKV, v_cache: QuantizedKV, step: StepInputs, scale: float,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over a padded batch (as attend) whose K/V are in a quantized cache: q (seqs, heads,
    max_query, head_dim) -> the same shape. The sequences' codes are gathered (still quantized) and
    dequantized to q's dtype a group of sequences at a time, the group's K and V bounded by the step's
    attention bound (step.attn_chunk_bytes, which the plan's workspace counts): never a dequantized copy
    of the whole batch's context."""
    seqs = q.shape[0]
    nkv, hd, ctx = k_cache.codes.shape[2], q.shape[-1], step.context_len
    per_seq = 2 * nkv * ctx * hd * q.element_size()
    bound = attention_backend.CHUNK_BYTES if step.attn_chunk_bytes is None else step.attn_chunk_bytes
    group = max(1, bound // max(1, per_seq))
    outs = []
    for a in range(0, seqs, group):
        tables = step.block_tables[a:a + group]
        keys = dequantize(*k_cache.gather(tables, ctx), k_cache.quant, q.dtype)  # (n, kv_heads, context, head_dim)
        values = dequantize(*v_cache.gather(tables, ctx), v_cache.quant, q.dtype)
        outs.append(attend(q[a:a + group], keys, values, step.attn_mask[a:a + group], step.attn_chunk_bytes,
                           step.open_keys, step.attn_scratch, scale=scale, softcap=softcap, sinks=sinks))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# -- a whole block ------------------------------------------------------------------------------------

def fused_block(x: torch.Tensor, w: dict[str, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                step: StepInputs, cfg: ModelConfig) -> torch.Tensor | None:
    """A Llama block (the caller checked that it is one) as one C++ call (decode_block.cpp), or None
    when this step or these weights cannot run there: the same ops as model.block_forward op by op."""
    args = _decode_block_args(x, w, k_cache, v_cache, step, cfg)
    return None if args is None else decode_block().block(*args)


def _decode_block_args(x: torch.Tensor, w: dict[str, torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                       step: StepInputs, cfg: ModelConfig) -> tuple | None:
    """decode_block().block's arguments when this block can run as one C++ call, else None: a step whose
    attention runs token by token (decode steps, and the short prefill chunks the runner chose it for) on
    the CPU in a 16-bit dtype (float32, the exact mode, stays op by op), q/k/v and gate/up stacked
    (engine.weights fuses copies; the streamed blocks' repack does it too) or apart (views of the mapping),
    no per-head norms or clipping, a KV cache in the compute dtype, and every matmul a dense weight of x's
    dtype or a VNNI-layout one."""
    qkv_names = _parts(w, "wqkv", ("wq", "wk", "wv"))
    gate_up_names = _parts(w, "w_gate_up", ("w_gate", "w_up"))
    if (qkv_names is None or gate_up_names is None or cfg.qk_norm or cfg.clip_qkv is not None
            or not isinstance(k_cache, torch.Tensor) or decode_block() is None):  # a quantized cache: op by op
        return None
    bias_names = ("bqkv",) if qkv_names == ("wqkv",) else ("bq", "bk", "bv")
    biases = [w.get(b) for b in bias_names]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        return None  # some projections biased and others not: op by op
    tables = token_by_token(step, x, w["attn_norm"], w["mlp_norm"], step.cos, k_cache)
    if tables is None:
        return None
    wqkv = [_kernel_weight(w[n], x.dtype) for n in qkv_names]
    w_gate_up = [_kernel_weight(w[n], x.dtype) for n in gate_up_names]
    wo, w_down = _kernel_weight(w["wo"], x.dtype), _kernel_weight(w["w_down"], x.dtype)
    if None in (*wqkv, *w_gate_up, wo, w_down):
        return None
    return (x, w["attn_norm"], w["mlp_norm"], cfg.rms_norm_eps, wqkv, biases if biases[0] is not None else [], wo,
            w.get("bo"), w_gate_up, w_down, step.cos, step.sin, k_cache, v_cache, step.slot_mapping, tables,
            step.positions, step.window or 0, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, _few_bf16_rows(x))


def _parts(w: dict, stacked: str, parts: tuple[str, ...]) -> tuple[str, ...] | None:
    """The names a projection's weights go by in this block: stacked at load (engine.weights.packed.fuse) or
    apart (views of a mapped checkpoint, which stacking would copy); None when neither is there."""
    if stacked in w:
        return (stacked,)
    return parts if all(p in w for p in parts) else None


def _kernel_weight(w, dtype: torch.dtype) -> tuple | None:
    """(tensor, scales or None, out_features, adapter or None) as decode_block takes a weight, or None when it
    cannot. A served adapters' weight (kind "lora_rows") is its base's with the adapter term (A, B^T, each
    row's columns) that _lora_rows_linear adds."""
    adapter = None
    if getattr(w, "kind", None) == "lora_rows":
        block = decode_block()
        if w.a.dtype != dtype or block is None or len(w.rows.slots) > block.LORA_ROWS_MAX:
            return None
        adapter, w = (w.a, w.b_t, w.rows.row_cols(w.cols)), w.base
    if isinstance(w, torch.Tensor):
        return (w, None, w.shape[0], adapter) if w.dtype == dtype and w.dim() == 2 else None
    args = w.vnni_args() if hasattr(w, "vnni_args") else None
    return (*args, adapter) if args is not None else None
