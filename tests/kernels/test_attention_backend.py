"""The engine's attention (engine.ops.attend over attention_backend) against the reference math, and its
memory against the planner's estimate.

Tolerances, stated: fp32 atol = rtol = 1e-5 against a float64 reference (the two orderings of the
same sums); bf16 atol = rtol = 2e-2 (8 mantissa bits). Memory is measured with torch's profiler
(profile_memory=True: every CPU allocation and free, in order), never by timing.
"""

from __future__ import annotations


import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from engine import LLM, attention_backend, ops
from engine.attention_backend import call_bytes, split
from engine.ops import attend
from engine.workspace import MIN_ATTN_CHUNK_BYTES, attention_chunk_bytes, workspace_bytes
from engine.scheduler import ScheduledChunk, Sequence
from tests.support.attention import padded_problem, reference_attention


MIXED = ([9, 1, 1, 4], [0, 20, 7, 3])  # a prefill chunk, two decodes, a mid-prompt chunk


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_bytes", [None, 40_000, 1], ids=["one-call", "split-seqs", "split-rows"])
def test_attend_equals_reference_math(kv_heads, dtype, chunk_bytes):
    q, k, v, mask = padded_problem(*MIXED, heads=4, kv_heads=kv_heads, head_dim=16, dtype=dtype)
    if chunk_bytes is not None:  # the split really happens: more than one call
        sp, rp = split(q.shape[0], q.shape[2] * 4 // kv_heads, k.shape[2], kv_heads, 16, dtype.itemsize, chunk_bytes)
        assert sp < q.shape[0] and (rp < q.shape[2] or chunk_bytes > 1)
    out = attend(q, k, v, mask, chunk_bytes=chunk_bytes)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask), atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa2"])
@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-call", "split-rows"])
def test_attend_with_sinks_equals_reference_math(kv_heads, chunk_bytes):
    """GPT-OSS's attention sinks: each query head's sink logit joins the softmax's denominator and takes no
    value, exp(s) / (sum exp(s) + exp(sink)), held to float64 with each head's own sink (GQA's row order), split
    or not. Without the sinks the result is far off: the test sees them."""
    q, k, v, mask = padded_problem(*MIXED, heads=4, kv_heads=kv_heads, head_dim=16, dtype=torch.float32)
    sinks = torch.tensor([1.5, -0.5, 0.7, 2.5])  # (heads,)
    out = attend(q, k, v, mask, chunk_bytes=chunk_bytes, sinks=sinks)
    group = 4 // kv_heads
    kr, vr = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ kr.transpose(-1, -2) / 4.0).masked_fill(~mask, float("-inf"))  # (seqs, heads, mq, ctx)
    e = scores.exp()
    p = e / (e.sum(-1, keepdim=True) + sinks.double().exp()[None, :, None, None])
    torch.testing.assert_close(out.double(), p @ vr, atol=1e-5, rtol=1e-5)
    assert (attend(q, k, v, mask, chunk_bytes=chunk_bytes) - out).abs().max() > 0.1


def test_attend_equals_torch_gqa_sdpa():
    """Folding GQA into the query axis gives what SDPA's own enable_gqa gives (fp32, same kernel family)."""
    q, k, v, mask = padded_problem(*MIXED, heads=8, kv_heads=2, head_dim=16, dtype=torch.float32, seed=3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, mask), want, atol=1e-5, rtol=1e-5)


def test_split_respects_the_bound():
    for args in [(16, 2048, 4096, 8, 128, 2), (1, 8192, 8192, 8, 128, 2), (256, 4, 4096, 8, 128, 2)]:
        sp, rp = split(*args, chunk_bytes=64 << 20)
        assert 1 <= sp <= args[0] and 1 <= rp <= args[1]
        cost = call_bytes(sp, rp, *args[2:])
        assert cost <= 64 << 20 or (sp == 1 and rp == 1), (args, sp, rp, cost)
        if sp < args[0] and rp == args[1]:  # as many whole sequences as fit
            assert call_bytes(sp + 1, rp, *args[2:]) > 64 << 20


def peak_bytes(fn) -> int:
    """Peak of the bytes allocated and not yet freed while fn() runs, over every CPU allocation."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_call_bytes_bounds_the_math_path(dtype):
    """One math-path SDPA call on the folded problem allocates at most call_bytes, and not less than
    half of it (the formula is the math path's, not a blanket margin)."""
    q, k, v, mask = padded_problem([40, 1, 1, 1], [0, 60, 30, 10], heads=2, kv_heads=2, head_dim=16, dtype=dtype)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.MATH]):
        measured = peak_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    bound = call_bytes(q.shape[0], q.shape[2], k.shape[2], 2, 16, dtype.itemsize)
    assert measured <= bound <= 2 * measured, (measured, bound)


def old_workspace_estimate(cfg, tokens, seqs, max_len, itemsize) -> int:
    """The estimate before this change: attention scores for `tokens` rows, no padding, no K/V, no mask."""
    act = tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * itemsize
    return act + min(tokens, seqs * max_len) * cfg.num_heads * max_len * 4 + seqs * cfg.vocab_size * 4 * 3


@pytest.mark.parametrize("chunk_bytes", [None, 20_000], ids=["one-call", "chunked"])
def test_mixed_step_peak_within_the_planned_workspace(llama_dir, monkeypatch, chunk_bytes):
    """The worst step the scheduler forms for these limits (3 decodes at the end of the context and a
    prefill chunk taking the rest of the token budget, padded to one layout), run through the real
    runner on the math path (the backend that takes the most memory): its peak allocation stays
    inside the plan's workspace, and the plan is not a blanket margin (under 2.5x; measured here: 1.65x
    unchunked, 1.8x chunked). The old estimate, which ignored the padding, was 5x short of it."""
    if chunk_bytes is not None:
        monkeypatch.setattr(attention_backend, "CHUNK_BYTES", chunk_bytes)
    seqs, tokens, max_len = 4, 64, 128
    from tests.support.steps import capture_runners

    with capture_runners() as runners:
        llm = LLM(str(llama_dir), max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    try:
        runner = runners[0]  # the real runner, fed a hand-made worst-case step
        cfg = runner.cfg
        chunks = []
        for slot in range(seqs - 1):  # decodes that attend to the whole context
            s = Sequence(f"d{slot}", [3] * (max_len - 1), 4)
            per_seq = max_len // runner.kv.block_size  # each sequence its own run of blocks
            s.block_table, s.output_ids = list(range(slot * per_seq, (slot + 1) * per_seq)), [7]
            chunks.append(ScheduledChunk(s, max_len - 1, 1))
        p = Sequence("p", [5] * (tokens - seqs + 1), 4)
        p.block_table = list(range((seqs - 1) * per_seq, seqs * per_seq))
        chunks.append(ScheduledChunk(p, 0, tokens - seqs + 1))
        with torch.inference_mode(), sdpa_kernel([SDPBackend.MATH]):
            runner.execute(chunks)  # warm-up: lazily made buffers are not the step's
            measured = peak_bytes(lambda: runner.execute(chunks))
        planned = llm.plan.workspace_bytes
        assert planned == workspace_bytes(cfg, tokens, seqs, max_len, torch.float32)
        assert measured <= planned <= 2.5 * measured, (measured, planned)
        if chunk_bytes is None:
            assert old_workspace_estimate(cfg, tokens, seqs, max_len, 4) < measured
    finally:
        llm.close()


def test_a_small_budget_bounds_each_call_to_an_eighth_of_it():
    """With the default 256 MiB bound, a 240 MB budget could not even hold one step's attention;
    below 2 GiB the bound is an eighth of the budget (at least 8 MiB), and the plan's workspace
    estimate and the runner's calls use the same bound (engine.loader passes it to both)."""
    assert attention_chunk_bytes(None) is None
    assert attention_chunk_bytes(4 << 30) is None
    assert attention_chunk_bytes(240_000_000) == 30_000_000
    assert attention_chunk_bytes(10_000_000) == MIN_ATTN_CHUNK_BYTES
    bound = attention_chunk_bytes(240_000_000)
    s, r = attention_backend.split(16, 4 * 497, 2304, 4, 64, 2, bound)
    assert attention_backend.call_bytes(s, r, 2304, 4, 64, 2) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_steps_run_the_flash_kernel_within_its_bound(dtype, monkeypatch):
    """Every shape a step forms (decodes, mixed chunks, a long prefill chunk; GQA folded) goes to the
    CPU flash kernel, whose measured peak stays under flash_cpu_call_bytes; for a large call the
    bound is not a blanket margin (the per-thread tiles are a fixed part, so small calls are looser)."""
    monkeypatch.setattr(ops, "bf16_matmul_attention", lambda: False)  # a CPU without bf16 dot products
    problems = [padded_problem(*MIXED, heads=8, kv_heads=2, head_dim=16, dtype=dtype),
                padded_problem([1] * 16, list(range(40, 56)), heads=16, kv_heads=4, head_dim=64, dtype=dtype),
                padded_problem([128], [1872], heads=16, kv_heads=4, head_dim=64, dtype=dtype)]
    for q, k, v, mask in problems:
        seqs, nh, mq, hd = q.shape
        nkv, ctx = k.shape[1], k.shape[2]
        qf = q.reshape(seqs, nkv, nh // nkv * mq, hd)  # folded as attend folds it
        mf = mask[:, :, None].expand(seqs, 1, nh // nkv, mq, ctx).reshape(seqs, 1, nh // nkv * mq, ctx)
        assert attention_backend.uses_flash_cpu(qf, k, v, mf)
        with torch.inference_mode():
            measured = peak_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=mf))
        bound = attention_backend.flash_cpu_call_bytes(seqs, qf.shape[2], ctx, nkv, hd, dtype.itemsize)
        assert measured <= bound, (q.shape, measured, bound)
    assert bound <= 2 * measured, (measured, bound)  # the 128-token chunk over 2000 keys


def test_cpu_flash_is_not_split_by_the_math_paths_bound(monkeypatch):
    """A 25%-budget call bound (29 MiB) splits a 128-token chunk over a 2000-token context into three
    math-path calls; on the CPU the flash kernel runs, which needs a fraction of that, so attend
    makes one call (three re-read K/V with smaller tiles: 1.07-1.15x the time here) with the same result.
    Under sdpa_kernel(MATH) the math path runs, and the math bound splits it again."""
    monkeypatch.setattr(ops, "bf16_matmul_attention", lambda: False)  # a CPU without bf16 dot products
    q, k, v, mask = padded_problem([128], [1872], heads=16, kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    bound = 30_282_880
    sp, rp = split(1, 4 * 128, 2000, 4, 64, 2, bound)
    assert (sp, -(-4 * 128 // rp)) == (1, 3)  # 3 math-path calls
    calls = []
    real = attention_backend._sdpa
    monkeypatch.setattr(attention_backend, "_sdpa", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        out = attend(q, k, v, mask, bound)
        assert calls == [(1, 4, 4 * 128, 64)]
        calls.clear()
        with sdpa_kernel([SDPBackend.MATH]):
            want = attend(q, k, v, mask, bound)
        assert len(calls) == 3
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask), atol=2e-2, rtol=2e-2)


# bf16 attention on a CPU with bf16 dot products: two fp32 oneDNN matmuls around an fp32 softmax. The
# tests force the path on (ops.bf16_matmul_attention), whatever the CPU. Its accuracy and memory claims hold where
# the engine uses it, a CPU without AMX: with AMX, oneDNN's bf16 math mode rounds the fp32 inputs to
# bf16 (in temporaries of its own), and the engine takes SDPA's flash kernel instead.
AMX = attention_backend.onednn_has_amx()
BF16_PROBLEMS = {
    "mixed": (MIXED, 8, 2, 16),
    "decodes": (([1] * 16, list(range(40, 56))), 16, 4, 64),
    "cached-chunk": (([128], [1872]), 16, 4, 64),
    "two-chunks": (([64, 32], [900, 1500]), 16, 4, 64),
}


def abs_errors(out, want):
    err = (out.double() - want).abs()
    return err.max().item(), err.mean().item()


@pytest.mark.parametrize("name", list(BF16_PROBLEMS))
def test_bf16_matmul_path_is_at_least_as_accurate_as_flash(name, monkeypatch):
    """Against float64, the matmul path's largest and mean errors are no larger than the CPU flash
    kernel's on the same problem (its scores are the same fp32 products, its probabilities are not
    rounded to bf16 before multiplying V); the keys before the earliest chunk skip the mask, which
    changes nothing; the result is the same split into many calls; the oneDNN setting is restored."""
    (counts, starts), nh, nkv, hd = BF16_PROBLEMS[name]
    q, k, v, mask = padded_problem(counts, starts, heads=nh, kv_heads=nkv, head_dim=hd, dtype=torch.bfloat16)
    want = reference_attention(q, k, v, mask)
    precision = torch.backends.mkldnn.matmul.fp32_precision
    with torch.inference_mode():
        monkeypatch.setattr(ops, "bf16_matmul_attention", lambda: False)
        flash = attend(q, k, v, mask)
        monkeypatch.setattr(ops, "bf16_matmul_attention", lambda: True)
        assert ops.uses_bf16_matmul(q) and not ops.uses_bf16_matmul(q.float())
        scratch = attention_backend.AttentionScratch()
        ours = attend(q, k, v, mask, open_keys=min(starts), scratch=scratch)
        masked = attend(q, k, v, mask, open_keys=0, scratch=scratch)
        split_calls = attend(q, k, v, mask, chunk_bytes=1, open_keys=min(starts), scratch=scratch)
    assert torch.backends.mkldnn.matmul.fp32_precision == precision
    assert ours.shape == q.shape and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, masked, atol=0, rtol=0)
    torch.testing.assert_close(split_calls, ours, atol=2e-2, rtol=2e-2)
    (mf, af), (mo, ao) = abs_errors(flash, want), abs_errors(ours, want)
    if AMX:  # rounded to bf16 there (see AMX above): flash's error class, not below it
        assert mo <= 1.5 * mf and ao <= 1.5 * af, ((mo, ao), (mf, af))
    else:
        assert mo <= mf and ao <= af, ((mo, ao), (mf, af))


def test_bf16_matmul_path_reads_the_mask():
    """The mask is applied, not assumed causal: a random mask (every row keeps key 0) gives the
    reference's result, and ignoring it would not."""
    q, k, v, _ = padded_problem([16, 8], [40, 50], heads=8, kv_heads=2, head_dim=16, dtype=torch.bfloat16, seed=5)
    mask = torch.rand(2, 1, 16, 58, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[..., 0] = True
    with torch.inference_mode():
        ours = attention_backend._attend_bf16_matmul(
            q.reshape(2, 2, 64, 16), k, v, mask[:, :, None].expand(2, 1, 4, 16, 58).reshape(2, 1, 64, 58), 0, None,
            None, softmax=ops.attention_ops())
    want = reference_attention(q, k, v, mask)
    torch.testing.assert_close(ours.reshape(q.shape).double(), want, atol=2e-2, rtol=2e-2)
    assert (reference_attention(q, k, v, torch.ones_like(mask)) - want).abs().max() > 0.1


@pytest.mark.skipif(AMX, reason="with AMX oneDNN's bf16 math mode adds temporaries (flash runs there)")
def test_bf16_matmul_path_within_its_bound():
    """A call's measured peak, with an empty scratch (so the scratch's allocation counts), stays
    under matmul_cpu_call_bytes, which is not a blanket margin and is below the math path's formula
    for the same call (the plan's workspace); a second call with the same scratch allocates far less."""
    q, k, v, mask = padded_problem([128], [1872], heads=16, kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    qf = q.reshape(1, 4, 512, 64)
    mf = mask[:, :, None].expand(1, 1, 4, 128, 2000).reshape(1, 1, 512, 2000)
    bound = 8 << 20  # splits the rows
    softmax = ops.attention_ops()
    probs = softmax is None  # the C++ softmax needs no second score buffer
    cost = lambda *shape: attention_backend.matmul_cpu_call_bytes(*shape, probs=probs)  # noqa: E731
    sp, rp = split(1, 512, 2000, 4, 64, 2, bound, cost)
    assert rp < 512
    scratch = attention_backend.AttentionScratch()
    with torch.inference_mode():
        first = peak_bytes(lambda: attention_backend._attend_bf16_matmul(qf, k, v, mf, 1872, bound, scratch,
                                                                         softmax=softmax))
        again = peak_bytes(lambda: attention_backend._attend_bf16_matmul(qf, k, v, mf, 1872, bound, scratch,
                                                                         softmax=softmax))
    limit = cost(sp, rp, 2000, 4, 64, 2)
    out_bytes = qf.numel() * 2  # the result, which outlives the call
    assert first - out_bytes <= limit <= 2 * (first - out_bytes), (first, limit)
    assert limit <= bound
    for shape in [(sp, rp, 2000, 4, 64, 2), (16, 4, 80, 4, 64, 2), (1, 1, 4096, 8, 128, 2)]:  # per call, below
        assert attention_backend.matmul_cpu_call_bytes(*shape) <= call_bytes(*shape)  # what the plan reserves
    assert again < first / 4, (again, first)


def test_cpu_attention_setting(monkeypatch):
    """LAYERSTREAM_CPU_ATTENTION picks the matmul path (auto) or SDPA; anything else is refused by name."""
    monkeypatch.setenv("LAYERSTREAM_CPU_ATTENTION", "sdpa")
    assert ops.cpu_attention_mode() == "sdpa"
    monkeypatch.delenv("LAYERSTREAM_CPU_ATTENTION")
    assert ops.cpu_attention_mode() == "auto"
    monkeypatch.setenv("LAYERSTREAM_CPU_ATTENTION", "flash")
    with pytest.raises(ValueError, match="LAYERSTREAM_CPU_ATTENTION must be auto or sdpa, got 'flash'"):
        ops.cpu_attention_mode()


@pytest.mark.parametrize("flags,amx,matmul", [({"avx512_bf16"}, False, True),
                                              ({"avx512_bf16", "amx_bf16"}, True, False),
                                              (set(), False, False)], ids=["avx512-bf16", "amx", "neither"])
def test_the_matmul_path_is_for_bf16_dot_products_without_amx(monkeypatch, flags, amx, matmul):
    """AVX512-BF16 without AMX: the matmul path. With AMX, SDPA's flash kernel (faster there, and oneDNN's
    bf16 math mode rounds); neither: SDPA, unmeasured against it. With AMX the flash bound counts the
    packed K/V copies."""
    monkeypatch.setattr(ops, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(ops, "onednn_has_amx", lambda: amx)
    monkeypatch.setattr(attention_backend, "onednn_has_amx", lambda: amx)
    assert ops._bf16_dot_products() == (matmul and torch.backends.mkldnn.is_available())
    plain = attention_backend.flash_cpu_call_bytes(1, 512, 2000, 4, 64, 2, threads=2)
    monkeypatch.setattr(attention_backend, "onednn_has_amx", lambda: not amx)
    other = attention_backend.flash_cpu_call_bytes(1, 512, 2000, 4, 64, 2, threads=2)
    packed = 2 * 4 * 2001 * 64 * 2
    assert (plain - other) == (packed if amx else -packed)
    fp32 = []
    for has in (True, False):  # fp32 is never packed
        monkeypatch.setattr(attention_backend, "onednn_has_amx", lambda has=has: has)
        fp32.append(attention_backend.flash_cpu_call_bytes(1, 512, 2000, 4, 64, 4, threads=2))
    assert fp32[0] == fp32[1]
