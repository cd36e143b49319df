"""The CUDA transport on a GPU: exactness against transformers, copy/compute overlap measured with
CUDA events, and no buffer-reuse hazard under a stress loop. Every test is marked `cuda` and skips
without a GPU (tests/conftest.py).

Tolerances, stated:
  fp32  logits atol = rtol = 1e-4 (TF32 off), greedy tokens identical
  fp16  logits atol = rtol = 2e-2; bf16 logits atol = 8e-2, rtol = 5e-2 (8 and 11 mantissa bits;
        two orderings of the same sums differ by a few ulps of the largest partial sum)
  fp16/bf16 greedy: identical, or at the first divergence our token is in transformers' top 5
        and within the logit tolerance of its best (vLLM's check_logprobs_close, one-sided).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.models import ARCHS
from tests.support.reference import budget_for
from tests.support.cuda_replay import capture_cuda_transports
from tests.support.reference import PROMPT, prompt_logits

pytestmark = pytest.mark.cuda

TOL = {"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2), "bfloat16": (8e-2, 5e-2)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Whether a pinned cache fits is decided against host memory; MemAvailable on a fresh VM may start
# small, so every test that pins says how much host memory it may use.
HOST = "8GiB"
# The reference comparisons are trimmed so the check's time goes to the copy-stream tests: every
# dtype x mode on llama; for each other architecture the exact case (fp32 resident) and the one
# furthest from it (bf16 streaming).
REFERENCE_CASES = ([("llama", d, s) for d in DTYPES for s in (False, True)]
                   + [(a, d, s) for a in ARCHS if a != "llama" for d, s in (("float32", False), ("bfloat16", True))])
# The copy path's matrix: pinned cache or staging from the mmap, prefetch depth, dtype.
STRESS_CASES = [(pin, depth, dtype) for pin in (False, True) for depth in (1, 2) for dtype in ("bfloat16", "float32")]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def hf_greedy(folder, dtype: str, prompt: list[int], n: int):
    """transformers on the GPU: prompt logits and a plain greedy loop with each step's logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to("cuda").eval()
    ids, steps = list(prompt), []
    with torch.no_grad():
        prompt_out = model(torch.tensor([prompt], device="cuda")).logits[0].float()
        for _ in range(n):
            logits = model(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            steps.append(logits.cpu())
            ids.append(int(logits.argmax()))
    del model
    torch.cuda.empty_cache()
    return ids[len(prompt):], prompt_out.cpu(), steps


def check_greedy_close(ours: list[int], ref: list[int], ref_steps: list[torch.Tensor], dtype: str) -> None:
    if dtype == "float32":
        assert ours == ref
        return
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        logits = ref_steps[i]
        top = logits.topk(5).indices.tolist()
        atol, rtol = TOL[dtype]
        assert a in top, f"step {i}: ours {a} not in transformers' top-5 {top}"
        assert logits[b] - logits[a] <= atol + rtol * abs(float(logits[b])) * 4, (
            f"step {i}: ours {a} is {float(logits[b] - logits[a]):.4f} below transformers' {b}")
        return  # after a divergence the two continue from different prefixes


@pytest.mark.parametrize("arch,dtype,streaming", REFERENCE_CASES,
                         ids=[f"{a}-{d}-{'streaming' if s else 'resident'}" for a, d, s in REFERENCE_CASES])
def test_matches_transformers_on_gpu(model_dirs, arch, dtype, streaming):
    folder = model_dirs[arch]
    ref_tokens, ref_logits, ref_steps = hf_greedy(folder, dtype, PROMPT, 24)
    budget = budget_for(folder, resident=1, dtype=dtype) if streaming else None
    llm = LLM(str(folder), device="cuda", dtype=dtype, max_model_len=128, max_num_seqs=2,
              max_device_memory=budget)
    try:
        if streaming:
            assert len(llm.plan.resident_blocks) == 1 and llm.plan.streamed_blocks
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(prompt_logits(llm, PROMPT).cpu(), ref_logits, atol=atol, rtol=rtol)
        out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0]
        check_greedy_close(out.token_ids, ref_tokens, ref_steps, dtype)
        if streaming:
            telemetry = llm.telemetry()
            h2d = telemetry.links.h2d_gbps
            assert telemetry.transport_name == "CudaTransport" and h2d and h2d > 0.1
            assert telemetry.total.blocks_streamed >= 24 * len(llm.plan.streamed_blocks)
    finally:
        llm.close()


def test_pinned_cache_equals_staging(llama_dir, monkeypatch):
    built = capture_cuda_transports(monkeypatch)
    budget = budget_for(llama_dir, resident=1, dtype="bfloat16")
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=2, max_device_memory=budget)
    staged, pinned = LLM(str(llama_dir), **kw), None
    try:
        pinned = LLM(str(llama_dir), pin_host_memory=True, max_host_memory=HOST, **kw)
        t = built[-1]
        assert t._pinned and not t._stage, "the tiny model's pinned cache must fit host memory"
        # Same kernels on the same values; the tolerance only allows for algorithm choice by address.
        torch.testing.assert_close(prompt_logits(staged, PROMPT), prompt_logits(pinned, PROMPT), atol=1e-2, rtol=1e-2)
    finally:
        staged.close()
        if pinned is not None:
            pinned.close()


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """~90M parameters in bf16 (21.5 MiB blocks): copies long enough to see on a timeline."""
    from transformers import LlamaConfig

    from engine.demo import build_random_model

    cfg = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return build_random_model(tmp_path_factory.mktemp("mid") / "llama", cfg, dtype=torch.bfloat16, seed=3)


def test_copies_overlap_compute(mid_model, monkeypatch):
    """CUDA events around every copy (copy stream) and every block's kernels (compute stream): the
    copy of the next block runs while the current one computes, a step takes well under
    copy + compute, and the overlapped step's logits are the all-resident model's."""
    from engine.weights.transports.cuda import CudaTransport

    budget = budget_for(mid_model, resident=0, dtype="bfloat16")
    resident = LLM(str(mid_model), device="cuda", max_model_len=128, max_num_seqs=2)
    try:
        want = resident.engine.prompt_logits(list(PROMPT)).cpu()
    finally:
        resident.close()
    built = capture_cuda_transports(monkeypatch)
    # Pinned cache: prepare() only issues the DMA, so the copy engine (not the host filling staging
    # buffers) paces the copies and the timeline shows the device-side overlap.
    llm = LLM(str(mid_model), device="cuda", max_model_len=128, max_num_seqs=2, max_device_memory=budget,
              pin_host_memory=True, max_host_memory=HOST)
    try:
        t = built[0]
        assert isinstance(t, CudaTransport) and not llm.plan.resident_blocks and t._pinned
        t.trace = True
        # ~0.4 ms of extra kernel time per block, so compute is comparable to the copy of a block.
        orig_activate = t.activate

        def slow_activate(ticket):
            w = orig_activate(ticket)
            torch.cuda._sleep(800_000)
            return w
        t.activate = slow_activate
        for _ in range(4):
            llm.engine.prompt_logits(list(PROMPT))
        t.traces.clear()
        got = llm.engine.prompt_logits(list(PROMPT)).cpu()
        iv = t.trace_intervals()
        # Same kernels on the same values; the tolerance only allows for algorithm choice by address.
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        assert len(iv) == len(llm.plan.streamed_blocks)
        # Block 0's copy ran during the previous step (the prefetcher cycles), so the step's span runs
        # from block 0's compute; serial execution would need at least every later copy + all compute.
        copy_ms = sum(c[1] - c[0] for _, c, _ in iv[1:])
        compute_ms = sum(k[1] - k[0] for _, _, k in iv)
        span = iv[-1][2][1] - iv[0][2][0]
        overlapping = sum(1 for (_, _, k), (_, c, _) in zip(iv, iv[1:]) if c[0] < k[1] and k[0] < c[1])
        why = f"copy {copy_ms:.2f} ms, compute {compute_ms:.2f} ms, span {span:.2f} ms, intervals {iv}"
        assert overlapping >= (len(iv) - 1) // 2, why
        assert span < 0.9 * (copy_ms + compute_ms), why
    finally:
        llm.close()


@pytest.fixture(scope="module")
def resident_refs(llama_dir):
    """dtype -> the all-resident model on the GPU, the stress test's reference (one per dtype)."""
    refs = {}
    yield lambda dtype: refs.setdefault(dtype, LLM(str(llama_dir), device="cuda", dtype=dtype, max_model_len=128,
                                                   max_num_seqs=2))
    for llm in refs.values():
        llm.close()


@pytest.mark.parametrize("pin,depth,dtype", STRESS_CASES,
                         ids=[f"{'pinned' if p else 'staging'}-depth{d}-{t}" for p, d, t in STRESS_CASES])
def test_no_buffer_reuse_hazard_under_stress(llama_dir, resident_refs, monkeypatch, pin, depth, dtype):
    """Random extra kernel time on both streams lets the host race far ahead of the device; any
    buffer overwritten while a kernel still reads it, or read before its copy lands, would give
    another block's weights and visibly wrong logits (compared with the all-resident model's)."""
    budget = budget_for(llama_dir, resident=0, depth=depth, dtype=dtype)
    ref = resident_refs(dtype)
    built = capture_cuda_transports(monkeypatch)
    llm = LLM(str(llama_dir), device="cuda", dtype=dtype, max_model_len=128, max_num_seqs=2,
              max_device_memory=budget, prefetch_depth=depth, pin_host_memory=pin, max_host_memory=HOST)
    # Same kernels on the same values: fp32 to rounding; bf16 allows for algorithm choice by address.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=2e-2, rtol=2e-2)
    try:
        t = built[0]
        assert not llm.plan.resident_blocks and t.num_buffers == depth + 1
        assert bool(t._pinned) == pin and bool(t._stage) != pin, "pinned cache must fit the stated host memory"
        rng_copy, rng_compute = random.Random(1), random.Random(2)
        orig_copy, orig_activate = t.rt.copy, t.activate

        def slow_copy(dst, src, stream):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(rng_copy.choice([0, 0, 20_000, 200_000]))
            orig_copy(dst, src, stream)

        def slow_activate(ticket):
            w = orig_activate(ticket)
            torch.cuda._sleep(rng_compute.choice([0, 0, 20_000, 200_000]))
            return w
        t.rt.copy, t.activate = slow_copy, slow_activate
        rng = random.Random(0)
        for i in range(40):
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
            torch.testing.assert_close(prompt_logits(llm, prompt), prompt_logits(ref, prompt), **tol,
                                       msg=lambda m, i=i: f"iteration {i}: {m}")
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        if dtype == "float32":  # batched decode through the same stressed copies: identical tokens
            prompts = [PROMPT, PROMPT[:3]]
            assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                    == [o.outputs[0].token_ids for o in ref.generate(prompts, params)])
    finally:
        llm.close()


def test_startup_oom_names_the_plan(llama_dir):
    """A plan that claims more than the GPU has (budget given by hand) fails with the plan in the message."""
    from engine.errors import DeviceMemoryError

    _free, total = torch.cuda.mem_get_info()
    seqs = int(2 * total / (128 * 1280)) + 1  # KV cache of the tiny llama: 1280 bytes per token per sequence
    msg = None
    try:
        LLM(str(llama_dir), device="cuda", max_model_len=128, max_num_seqs=seqs, max_device_memory=8 * total,
            max_num_batched_tokens=seqs)
    except DeviceMemoryError as e:
        msg = str(e)
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    assert msg is not None, "expected a DeviceMemoryError"
    assert "ran out of memory" in msg and "memory plan" in msg and "--max-device-memory" in msg, msg


def test_failed_host_register_falls_back_cleanly(monkeypatch):
    """A cudaHostRegister that fails (here: registering pages already registered, the way a sandbox
    without it would) leaves its error pending in the runtime; pinned_bytes must fall back to the
    pinned allocator and leave nothing for the next kernel launch to raise."""
    from engine.weights.transports.cuda_runtime import PAGE, CudaRuntime

    rt = CudaRuntime(torch.device("cuda", torch.cuda.current_device()))
    first = rt.pinned_bytes(PAGE)
    if not rt._registered:
        pytest.skip("cudaHostRegister fails here for every buffer: the fallback is all there is")
    taken = rt._registered[0][1]
    real = torch.cuda.cudart()

    class Failing:
        def cudaHostRegister(self, _ptr, _size, flags):
            return real.cudaHostRegister(taken, PAGE, flags)  # fails: already registered

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Failing())
    try:
        second = rt.pinned_bytes(3 * PAGE)
        assert len(rt._registered) == 1 and second.is_pinned() and second.numel() == 3 * PAGE
        second.fill_(7)
        dev = second.to("cuda", non_blocking=True)
        assert int(dev.sum()) == 7 * 3 * PAGE  # kernels launch and run after the failure
    finally:
        monkeypatch.undo()
        torch.cuda.synchronize()
        rt.release()
        del first


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_runs_the_chosen_kernel(dtype):
    """Our attention call with a boolean mask runs memory-efficient attention (never cuDNN, whose
    per-shape graph builds decode would pay every step) and equals the reference math."""
    from layerstream.bench.gpu_probe import decode_problem, sdpa_backends_used
    from engine.ops import attend
    from tests.support.attention import padded_problem, reference_attention

    q, k, v, m = decode_problem(1000, torch.device("cuda"), DTYPES[dtype])
    with torch.inference_mode():
        used = sdpa_backends_used(lambda: attend(q, k, v, m))
    assert used == ["memory-efficient"], used
    q, k, v, m = (t.cuda() for t in padded_problem([9, 1, 1, 4], [0, 20, 7, 3], heads=8, kv_heads=2, head_dim=64,
                                                    dtype=DTYPES[dtype]))
    tol = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(attend(q, k, v, m).double(), reference_attention(q, k, v, m), atol=tol, rtol=tol)


def test_step_inputs_through_one_pinned_copy_equal_the_cpu_ones(llama_dir):
    """The step's integer inputs go to the GPU in one pinned non_blocking copy; what arrives (and
    the mask and rotary tables built from it) equals the same step built on the CPU."""
    from tests.support.steps import capture_runners, fields, mixed_chunks

    with capture_runners() as runners:
        gpu = LLM(str(llama_dir), device="cuda", max_model_len=64, max_num_seqs=4)
        cpu = LLM(str(llama_dir), max_model_len=64, max_num_seqs=4)
    try:
        with torch.inference_mode():
            got = fields(runners[0]._step_inputs(mixed_chunks()))
            want = fields(runners[1]._step_inputs(mixed_chunks()))
        for name, w in want.items():
            if isinstance(w, torch.Tensor):
                assert got[name].is_cuda, name
                torch.testing.assert_close(got[name].cpu(), w, atol=1e-6, rtol=0, msg=name)
            else:
                assert got[name] == w, name
    finally:
        gpu.close()
        cpu.close()


def test_device_memory_stays_within_the_budget(mid_model):
    """On a GPU the budget bounds what the engine allocates on the device (torch.cuda.max_memory_allocated)
    through loading, a prompt and decoding: resident blocks, stream buffers, KV pool, workspace."""
    budget = budget_for(mid_model, resident=2, dtype="bfloat16")
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(str(mid_model), device="cuda", max_model_len=128, max_num_seqs=2, max_device_memory=budget)
    try:
        assert llm.plan.streamed_blocks and llm.plan.device_bytes <= budget
        out = llm.generate(["The history of the river valley"] * 2, SamplingParams(max_tokens=16, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 16 for o in out)
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= budget, f"peak {peak / 2**20:.1f} MiB allocated over a budget of {budget / 2**20:.1f} MiB"
    finally:
        llm.close()
