"""Scaled dot-product attention over a padded batch, and how much memory one call may take. engine.ops
chooses the path per call (`matmul`, `softmax`); everything here is the kernels and their bounds.

- On CUDA, cuDNN attention is turned off (on the first call): memory-efficient attention runs,
  with the math path as the fallback. With a boolean mask in bf16/fp16 and cuDNN >= 9.15 SDPA would pick
  cuDNN, which builds a graph for every new shape; decode changes the context length every step, each
  build is costly and the graph cache grows without bound in a server. Flash takes no mask.
- GQA is folded into the query axis: the `group` query heads that share a KV head become `group`
  times as many query rows of that KV head. The call is then plain multi-head attention over the KV
  heads as stored, which memory-efficient attention accepts with a mask in every torch version
  (its enable_gqa support came late), and which the math path runs without materialising K and V
  repeated per query head.
- Calls are split over sequences and query rows so that the math path's temporaries (fp32 copies
  of Q/K/V, scores, softmax, the additive mask) stay under `chunk_bytes`. A mixed prefill + decode
  step pads every decode to the prefill's length; unsplit, a Llama-3-8B step of one 512-token chunk
  and 15 decodes at 4096 context needed ~10 GB. `call_bytes` is that formula and the planner's
  workspace estimate uses it (`workspace_bytes`), so the plan and the kernel agree.
- On the CPU, SDPA runs its flash kernel (whenever `torch._fused_sdp_choice` says so, which it does
  for every shape the engine forms). That kernel works in per-thread tiles: beyond its output it
  holds only the mask made additive, so `flash_cpu_call_bytes` bounds its calls, not the math
  path's formula. Split by the math formula, a 128-token chunk over a 2000-token context at a 25%
  budget became three calls, each re-reading all of K/V with smaller tiles, for memory the flash
  kernel never takes. The plan keeps the math path's bound (the most any backend takes), so a step's
  flash calls always fit inside it.
- On the CPU, bf16 attention can be two fp32 oneDNN matmuls around an fp32 softmax instead
  (`_attend_bf16_matmul`, where engine.ops.bf16_matmul_attention chose it: a CPU with AVX512-BF16 and
  without AMX). SDPA's CPU flash kernel does its bf16 x bf16 -> fp32 tile products through MKL, which on
  such a CPU (an AMD EPYC, measured) converts them to fp32 and runs its sgemm, so bf16 attention ran no
  faster than fp32. torch sends fp32 matmuls to oneDNN instead of MKL only under oneDNN's "bf16" math
  mode, which it sets around these calls; oneDNN then computes at fp32 accuracy (on random fp32 inputs
  the same largest error against float64 as IEEE fp32), and faster than the default fp32 path. The
  scores' inputs are bf16 values, so even a CPU where oneDNN does round to bf16 in that mode gets the
  exact products flash computes; the probabilities (fp32) times V would there be rounded as flash rounds
  them. Its errors against float64 are below flash's (tests/kernels/test_attention_backend.py checks it). Keys
  that every query row of the call may see (`open_keys`: the cached prefix before the earliest chunk)
  skip the mask. fp32 (exact mode) and fp16 keep SDPA. Timings of both paths: docs/benchmarks/amx.md
  (`python -m layerstream.bench.amx`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from .kernels import onednn_has_amx

log = logging.getLogger("layerstream")

CHUNK_BYTES = 256 << 20  # bound on one call's temporaries (math path); smaller steps make one call


def call_bytes(seqs: int, rows: int, ctx: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Peak temporaries of one SDPA call on the math path (the most memory any backend takes), with
    `heads` KV heads after folding and `rows` query rows per head. What the math path holds at its
    peak (inside the softmax): the boolean mask folded and made additive, Q and K scaled in fp32
    (Q, K, V first upcast when half precision), scores, softmax output and its masked copy in fp32,
    a boolean of the scores, then the fp32 output and its cast back."""
    half = itemsize < 4
    mask = seqs * rows * ctx * (1 + itemsize)
    qkv = seqs * heads * head_dim * 4 * ((2 if half else 1) * rows + (3 if half else 1) * ctx)
    scores = seqs * heads * rows * ctx * (3 * 4 + 1)
    out = seqs * heads * rows * head_dim * (4 + itemsize)
    return mask + qkv + scores + out


_FLASH = int(SDPBackend.FLASH_ATTENTION)
# The CPU flash kernel's tiles: at most 256 query rows by 512 keys, per thread.
FLASH_CPU_Q_TILE, FLASH_CPU_KV_TILE = 256, 512


def flash_cpu_call_bytes(seqs: int, rows: int, ctx: int, heads: int, head_dim: int, itemsize: int,
                         threads: int | None = None) -> int:
    """Peak temporaries of one SDPA call on the CPU flash kernel (same arguments as call_bytes): the
    boolean mask made additive in the query's dtype, the output and its log-sum-exp, per thread one
    tile of fp32 scores (plus its half-precision copy) and fp32 output rows, and, in half precision on
    a CPU with AMX, K and V copied into oneDNN's packed layout (torch packs them there for calls of at
    least 64 rows and keys: test_cpu_steps_run_the_flash_kernel_within_its_bound measured them on an Intel
    Xeon with AMX before these copies were counted)."""
    threads = torch.get_num_threads() if threads is None else threads
    mask = seqs * rows * ctx * itemsize
    out = seqs * heads * rows * (head_dim * itemsize + 4)
    tile = FLASH_CPU_Q_TILE * (FLASH_CPU_KV_TILE * (4 + itemsize) + 2 * head_dim * 4 + 8)
    packed = 2 * seqs * heads * (ctx + 1) * head_dim * itemsize if itemsize < 4 and onednn_has_amx() else 0
    return mask + out + threads * tile + packed


# SDPA's own dispatch decision (private in torch): without it, assume the math path (the larger bound).
_sdp_choice = getattr(torch, "_fused_sdp_choice", None)


def uses_flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether SDPA will run these on the CPU flash kernel (its own dispatch decision, which costs a few
    microseconds: asked only for calls the math path's bound would split)."""
    return q.device.type == "cpu" and _sdp_choice is not None and _sdp_choice(q, k, v, attn_mask=mask) == _FLASH


def matmul_cpu_call_bytes(seqs: int, rows: int, ctx: int, heads: int, head_dim: int, itemsize: int,
                          probs: bool = True) -> int:
    """Temporaries of one `_attend_bf16_matmul` call (same arguments as call_bytes), all in its
    AttentionScratch but the last two: K and V in fp32, the scores in fp32 and, unless the C++
    softmax overwrites them in place (probs=False), their softmax; then the inverted mask and the
    fp32 output before its cast."""
    return (_scratch_floats(seqs, rows, ctx, heads, head_dim, probs) * 4 + seqs * rows * ctx
            + seqs * heads * rows * head_dim * (4 + itemsize))


def _scratch_floats(seqs: int, rows: int, ctx: int, heads: int, head_dim: int, probs: bool = True) -> int:
    return seqs * heads * (2 * ctx * head_dim + (2 if probs else 1) * rows * ctx)


# At most this much per bf16 matmul call, whatever the plan allows: larger calls paid page faults on
# memory the allocator had returned to the system (a 128-token chunk over 2032 keys on one thread took
# twice as long in calls of ~30 MB as in calls of 12-24 MiB); more, smaller calls cost little (each
# re-reads only K and V).
MATMUL_CPU_CALL_BYTES = 16 << 20


class AttentionScratch:
    """fp32 memory the bf16 matmul path reuses from call to call (a runner owns one, passed in through
    StepInputs): fresh temporaries of several MiB per call are page-faulted in again whenever the
    allocator has given them back to the system, which made the same call markedly slower. It grows to
    the largest call's need, at most MATMUL_CPU_CALL_BYTES (within the plan's attention workspace, which
    this memory is part of)."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def take(self, floats: int) -> torch.Tensor:
        """A flat fp32 tensor of `floats` elements, its contents undefined."""
        if self._buf.numel() < floats:
            self._buf = torch.empty(floats)
        return self._buf[:floats]


def split(seqs: int, rows: int, ctx: int, heads: int, head_dim: int, itemsize: int,
          chunk_bytes: int | None = None, cost_fn=call_bytes) -> tuple[int, int]:
    """(sequences, query rows) per call so that cost_fn (call_bytes: the math path) stays under
    chunk_bytes (CHUNK_BYTES by default), whole sequences first; at least one sequence and one row per call."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    cost = lambda s, r: cost_fn(s, r, ctx, heads, head_dim, itemsize)  # noqa: E731
    if cost(seqs, rows) <= chunk_bytes:
        return seqs, rows
    if cost(1, rows) <= chunk_bytes:
        return max(1, chunk_bytes // cost(1, rows)), rows
    fixed = cost(1, 0)
    return 1, max(1, (chunk_bytes - fixed) // max(1, cost(1, 1) - fixed))


def workspace_bytes(seqs: int, rows: int, ctx: int, heads: int, head_dim: int, itemsize: int,
                    chunk_bytes: int | None = None) -> int:
    """Temporaries of the largest call `attend` makes for a (seqs, rows, ctx) problem."""
    s, r = split(seqs, rows, ctx, heads, head_dim, itemsize, chunk_bytes)
    return call_bytes(s, r, ctx, heads, head_dim, itemsize)


@contextlib.contextmanager
def _fp32_matmul_as_bf16():
    """oneDNN's bf16 math mode for fp32 matmuls, for the calls inside only. The setting is process
    wide: the engine's one compute thread is the only one multiplying while it is set."""
    mm = torch.backends.mkldnn.matmul
    old = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = old


def _attend_bf16_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, open_keys: int,
                        chunk_bytes: int | None, scratch: AttentionScratch | None, scale: float | None = None,
                        softmax: ModuleType | None = None) -> torch.Tensor:
    """Folded attention (GQA already folded into q's rows) as two matmuls: q (seqs, kv_heads, rows,
    head_dim) bf16; k, v (seqs, kv_heads, context, head_dim); mask (seqs, 1, rows, context), whose first
    open_keys columns are all True; scale multiplies q . k (None: 1 / sqrt(head_dim)); softmax: the C++
    scale + mask + softmax in place (kernels/attention_ops.py), or None for torch's ops. Returns (seqs,
    kv_heads, rows, head_dim) bf16."""
    seqs, nkv, rows, hd = q.shape
    scale = hd ** -0.5 if scale is None else scale
    ctx = k.shape[2]
    bound = min(CHUNK_BYTES if chunk_bytes is None else chunk_bytes, MATMUL_CPU_CALL_BYTES)
    ops = softmax
    probs = ops is None  # torch's softmax writes a second (rows x context) buffer
    cost = functools.partial(matmul_cpu_call_bytes, probs=probs)
    sp, rp = split(seqs, rows, ctx, nkv, hd, q.element_size(), bound, cost)
    buf = (scratch or AttentionScratch()).take(_scratch_floats(sp, rp, ctx, nkv, hd, probs))
    hidden = mask[..., open_keys:].logical_not() if open_keys < ctx else None  # (seqs, 1, rows, context - open_keys)
    out = q.new_empty(q.shape)
    with _fp32_matmul_as_bf16():
        for a in range(0, seqs, sp):
            n = min(sp, seqs - a)
            kf, vf, rest = _carve(buf, (n, nkv, ctx, hd), (n, nkv, ctx, hd))
            kf.copy_(k[a:a + n])  # exact: bf16 values in fp32
            vf.copy_(v[a:a + n])
            kt = kf.transpose(-1, -2)  # (n, kv_heads, head_dim, context)
            for r in range(0, rows, rp):
                m = min(rp, rows - r)
                # (n, kv_heads, m, context) scores, and their softmax where torch's writes it apart
                s_r, p_r, _ = _carve(rest, (n, nkv, m, ctx), (n, nkv, m, ctx) if probs else (0,))
                torch.matmul(q[a:a + n, :, r:r + m].float(), kt, out=s_r)  # fp32 scores of bf16 values
                hide = hidden[a:a + n, :, r:r + m] if hidden is not None else None
                if ops is not None:
                    ops.softmax_(s_r, scale, open_keys, hide)  # in place: p_r unused
                    p_r = s_r
                else:
                    s_r.mul_(scale)  # in fp32 after the product, as flash scales
                    if hide is not None:
                        s_r[..., open_keys:].masked_fill_(hide, float("-inf"))
                    torch.softmax(s_r, dim=-1, out=p_r)
                out[a:a + n, :, r:r + m] = torch.matmul(p_r, vf)  # rounded to bf16 once
    return out


def _carve(buf: torch.Tensor, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Consecutive contiguous views of buf with these shapes, then the rest of buf."""
    views, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(buf[start:start + n].view(shape))
        start += n
    return [*views, buf[start:]]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
          ) -> torch.Tensor:
    if q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled():
        # cuDNN SDPA off for the process, once, rather than an sdpa_kernel() context around every call:
        # entering and leaving it costs tens of microseconds, per block per step. With cuDNN off and a mask
        # given (flash takes none), SDPA's own order is then memory-efficient, then math (the probe and the
        # cuda tests check which one ran).
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("attention: cuDNN SDPA turned off for this process; memory-efficient attention runs instead")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  cap: float | None, sinks: torch.Tensor | None, chunk_bytes: int | None) -> torch.Tensor:
    """Folded attention that no SDPA kernel takes, in the reference's eager order in fp32, split as the math
    path is: scores soft-capped, cap * tanh(s / cap) before the mask (Gemma 2), and/or a sink logit per row
    joining the softmax's denominator and dropped from its output (GPT-OSS). q: (seqs, kv_heads, rows,
    head_dim); k, v: (seqs, kv_heads, context, head_dim); mask (seqs, 1, rows, context); sinks (kv_heads,
    rows) fp32, each row's head's sink. Returns (seqs, kv_heads, rows, head_dim) in q's dtype."""
    seqs, nkv, rows, hd = q.shape
    ctx = k.shape[2]
    sp, rp = split(seqs, rows, ctx + (sinks is not None), nkv, hd, q.element_size(), chunk_bytes)
    out = q.new_empty(q.shape)
    for a in range(0, seqs, sp):
        kt = k[a:a + sp].float().transpose(-1, -2)  # (n, kv_heads, head_dim, context)
        vf = v[a:a + sp].float()
        for r in range(0, rows, rp):
            s = torch.matmul(q[a:a + sp, :, r:r + rp].float(), kt) * scale  # (n, kv_heads, m, context) fp32
            if cap is not None:
                s = torch.tanh(s / cap) * cap
            s = s.masked_fill(~mask[a:a + sp, :, r:r + rp], float("-inf"))
            if sinks is None:
                out[a:a + sp, :, r:r + rp] = torch.matmul(torch.softmax(s, dim=-1), vf)
                continue
            sink = sinks[:, r:r + rp, None].expand(s.shape[0], -1, -1, 1)  # (n, kv_heads, m, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]  # (n, kv_heads, m, context)
            out[a:a + sp, :, r:r + rp] = torch.matmul(p, vf)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           chunk_bytes: int | None = None, open_keys: int = 0, scratch: AttentionScratch | None = None,
           scale: float | None = None, softcap: float | None = None, *, matmul: bool = False,
           softmax: ModuleType | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: (seqs, heads, max_query, head_dim); k, v: (seqs, kv_heads, context, head_dim);
    mask: (seqs, 1, max_query, context) bool, True = may attend; its first open_keys columns must be
    all True (a promise the bf16 matmul path relies on; 0 makes none); scratch: memory that path reuses;
    scale: multiplies q . k (None: 1 / sqrt(head_dim)); softcap: scores -> softcap * tanh(scores / softcap).
    matmul: bf16 queries on the CPU take the matmul path, with `softmax` (its C++ softmax, or None: torch's
    ops), not SDPA (engine.ops chooses). sinks: (heads,) a logit per query head in each softmax's denominator
    (GPT-OSS), or None. Returns (seqs, heads, max_query, head_dim)."""
    seqs, nh, mq, hd = q.shape
    nkv, ctx = k.shape[1], k.shape[2]
    group = nh // nkv
    if group > 1:
        # Query head h reads KV head h // group (repeat_interleave order), so heads split as (nkv, group).
        q = q.reshape(seqs, nkv, group * mq, hd)  # (seqs, kv_heads, group * max_query, head_dim)
        mask = mask[:, :, None].expand(seqs, 1, group, mq, ctx).reshape(seqs, 1, group * mq, ctx)
    rows = q.shape[2]
    if softcap is not None or sinks is not None:
        if sinks is not None:  # row group * max_query + t of kv head j is query head j * group + g
            sinks = sinks.float().view(nkv, group, 1).expand(nkv, group, mq).reshape(nkv, group * mq)
        out = _attend_eager(q, k, v, mask, hd ** -0.5 if scale is None else scale, softcap, sinks, chunk_bytes)
        return out.reshape(seqs, nh, mq, hd)
    if matmul and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        out = _attend_bf16_matmul(q, k, v, mask, open_keys, chunk_bytes, scratch, scale, softmax)
        return out.reshape(seqs, nh, mq, hd)
    sp, rp = split(seqs, rows, ctx, nkv, hd, q.element_size(), chunk_bytes)
    if (sp < seqs or rp < rows) and uses_flash_cpu(q, k, v, mask):
        # Only a call the math path's bound would split asks SDPA's dispatch (not free, and once per
        # block per step otherwise): the CPU flash kernel takes far less, so split by its own bound.
        sp, rp = split(seqs, rows, ctx, nkv, hd, q.element_size(), chunk_bytes, flash_cpu_call_bytes)
    if sp >= seqs and rp >= rows:
        out = _sdpa(q, k, v, mask, scale)
    else:
        out = q.new_empty(q.shape)
        for a in range(0, seqs, sp):
            for r in range(0, rows, rp):
                out[a:a + sp, :, r:r + rp] = _sdpa(q[a:a + sp, :, r:r + rp], k[a:a + sp], v[a:a + sp],
                                                  mask[a:a + sp, :, r:r + rp], scale)
    # reshape, not view: memory-efficient attention returns a (seqs, rows, heads, head_dim) layout.
    return out.reshape(seqs, nh, mq, hd)


def attend_latent(q: torch.Tensor, latent: torch.Tensor, width: int, mask: torch.Tensor, scale: float | None,
                  chunk_bytes: int | None = None) -> torch.Tensor:
    """Multi-head latent attention over one shared cached head: q (seqs, heads, max_query, d) with each head's
    query already in latent space; latent (seqs, 1, context, d) the keys, whose first `width` dims are also the
    values; mask (seqs, 1, max_query, context). Returns (seqs, heads, max_query, width) in q's dtype.

    No SDPA kernel takes values narrower than the keys, and none of the C++ kernels a cache of one wide head:
    the eager math (scores, masked softmax in fp32, the product with the values), every head folded into the
    query rows of the one KV head, split as the math path is so one call's temporaries stay bounded."""
    seqs, nh, mq, d = q.shape
    ctx = latent.shape[2]
    rows = nh * mq
    q = q.reshape(seqs, 1, rows, d)  # (seqs, 1, heads * max_query, d): head-major, as mask's expansion below
    mask = mask[:, :, None].expand(seqs, 1, nh, mq, ctx).reshape(seqs, 1, rows, ctx)
    scale = d ** -0.5 if scale is None else scale
    sp, rp = split(seqs, rows, ctx, 1, d, q.element_size(), chunk_bytes)
    out = q.new_empty(seqs, 1, rows, width)
    for a in range(0, seqs, sp):
        kt = latent[a:a + sp].transpose(-1, -2)  # (n, 1, d, context)
        v = latent[a:a + sp, :, :, :width]  # (n, 1, context, width)
        for r in range(0, rows, rp):
            s = torch.matmul(q[a:a + sp, :, r:r + rp], kt).float() * scale  # (n, 1, m, context) fp32
            s = s.masked_fill(~mask[a:a + sp, :, r:r + rp], float("-inf"))
            out[a:a + sp, :, r:r + rp] = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
    return out.view(seqs, nh, mq, width)
