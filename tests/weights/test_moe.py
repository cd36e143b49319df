"""Mixture-of-experts models against transformers on the same weights (fp32): logits within 1e-4 and
identical greedy tokens, all-resident and streamed; batches whose sequences route differently;
damaged expert tensors."""

import dataclasses
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.arch import UnsupportedModelError, load_model_config
from engine.weights import CheckpointError
from tests.support.moe_models import MOE_ARCHS, NUM_EXPERTS, build, expert_budget
from tests.support.cuda_replay import record_cuda_experts
from tests.support.checkpoints import edited_header
from tests.support.reference import ATOL, RTOL, PROMPT, greedy_with, prompt_logits

# Three prompts whose tokens the first sparse block sends to different experts (checked below).
PROMPTS = [PROMPT, [301, 2, 77, 140, 9, 500], [64, 64, 12, 480, 33, 250, 251, 19, 3]]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: build(root / arch, arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def references(moe_dirs):
    """arch -> [(greedy tokens, prompt logits) per prompt] and the experts each prompt's last token
    chose in the first sparse block, from transformers."""
    out = {}
    for arch, folder in moe_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        first_sparse = load_model_config(folder).moe.sparse_layers[0]
        chosen = []
        mlp = model.model.layers[first_sparse].mlp
        router = mlp.router if hasattr(mlp, "router") else mlp.gate  # GPT-OSS: router, returning (logits, scores, ids)
        hook = router.register_forward_hook(lambda _m, _i, o: chosen.append(o[2][-1].tolist()))
        with torch.no_grad():
            for p in PROMPTS:
                model(torch.tensor([p]))
        hook.remove()
        out[arch] = ([greedy_with(model, p, 12) for p in PROMPTS], chosen)
    return out


def check_against_reference(llm, reference):
    """Prompt logits of the first prompt, then all prompts decoded greedily in one batch."""
    per_prompt, _chosen = reference
    torch.testing.assert_close(prompt_logits(llm, PROMPT), per_prompt[0][1], atol=ATOL, rtol=RTOL)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in per_prompt]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_config(moe_dirs, arch):
    cfg = load_model_config(moe_dirs[arch])
    m = cfg.moe
    assert (m.num_experts, m.top_k) == (NUM_EXPERTS, 2)
    # qwen3_moe: mlp_only_layers=[0]; qwen2_moe: decoder_sparse_step=2 (blocks 1 and 3)
    expected = {"qwen3_moe": (1, 2, 3), "qwen2_moe": (1, 3)}.get(arch, (0, 1, 2, 3))
    assert m.sparse_layers == expected
    assert m.norm_topk_prob == (arch in ("qwen3_moe", "mixtral"))
    assert bool(m.shared_expert_intermediate_size) == (arch == "qwen2_moe")
    want = {"olmoe": (True, True, 0.2), "gpt_oss": (True, False, None)}.get(arch, (False, False, None))
    assert (cfg.o_bias, cfg.qk_norm_whole, cfg.clip_qkv) == want
    if arch == "gpt_oss":  # the clamped SwiGLU's numbers, the biased top-k-then-softmax router, sinks
        assert (m.expert_mlp, m.swiglu_alpha, m.swiglu_limit) == ("clamped_swiglu", pytest.approx(1.702), 0.15)
        assert cfg.family.router == "topk_softmax" and {"sinks", "router_bias"} <= set(cfg.block_shapes(0))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_prompts_route_differently(references, arch):
    """The batch tests below mean something only if the prompts' tokens go to different experts."""
    chosen = references[arch][1]
    assert len({tuple(sorted(c)) for c in chosen}) > 1, chosen


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_resident_matches_transformers(moe_dirs, references, arch):
    llm = LLM(str(moe_dirs[arch]), max_model_len=128, max_num_seqs=4, show_progress=False)
    try:
        assert llm.plan.streamed_blocks == []
        check_against_reference(llm, references[arch])
    finally:
        llm.close()


def test_whole_block_streaming_matches_transformers(moe_dirs, references):
    """Blocks streamed whole (experts inside them: expert_streaming off), one kept resident."""
    arch = "qwen2_moe"  # dense and sparse blocks, shared expert
    probe = LLM(str(moe_dirs[arch]), max_model_len=128, max_num_seqs=4, show_progress=False)
    budget = probe.plan.budget_keeping(resident=1)
    probe.close()
    llm = LLM(str(moe_dirs[arch]), max_model_len=128, max_num_seqs=4, max_device_memory=budget,
              show_progress=False, expert_streaming=False)
    try:
        assert len(llm.plan.streamed_blocks) == 3 and not llm.plan.expert_streaming
        check_against_reference(llm, references[arch])
    finally:
        llm.close()


@pytest.fixture
def damaged(moe_dirs, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(moe_dirs["mixtral"], dst)
    return dst


def test_missing_expert_tensor(damaged):
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    with edited_header(damaged / "model.safetensors") as header:
        del header[name]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing from the checkpoint"):
        LLM(str(damaged), max_model_len=64, max_num_seqs=1, show_progress=False)


def test_misshapen_expert_tensor(damaged):
    name = "model.layers.1.block_sparse_moe.experts.7.w2.weight"
    with edited_header(damaged / "model.safetensors") as header:
        rows, cols = header[name]["shape"]
        header[name]["shape"] = [cols, rows]  # same bytes, transposed: only the shape check sees it
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[{cols}, {rows}\], expected \[{rows}, {cols}\]"):
        LLM(str(damaged), max_model_len=64, max_num_seqs=1, show_progress=False)


def test_missing_router(damaged):
    name = "model.layers.0.block_sparse_moe.gate.weight"
    with edited_header(damaged / "model.safetensors") as header:
        del header[name]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing"):
        LLM(str(damaged), max_model_len=64, max_num_seqs=1, show_progress=False)


def test_quantization_refused_for_moe(moe_dirs):
    with pytest.raises(UnsupportedModelError, match="quantization .* mixture-of-experts"):
        LLM(str(moe_dirs["mixtral"]), max_model_len=64, max_num_seqs=1, quantization="int8", show_progress=False)


# -- expert-granular streaming ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_cache_smaller_than_a_block_matches_transformers(moe_dirs, references, arch):
    """4 expert slots for 8 experts per block: every step evicts; a batched prefill chooses more experts
    in one block than the cache holds, so they are computed group by group."""
    folder = moe_dirs[arch]
    llm = LLM(str(folder), max_model_len=128, max_num_seqs=4, show_progress=False,
              max_device_memory=expert_budget(folder, slots=4))
    try:
        plan = llm.plan
        assert plan.expert_slots == 4 < NUM_EXPERTS
        assert plan.resident_blocks == [] and "expert cache: 4/" in plan.describe()
        check_against_reference(llm, references[arch])
        t = llm.telemetry()
        assert t.plan.expert_cache_slots == 4
        assert t.total.expert_misses > 4 and t.total.expert_hits > 0  # evictions happened, hits too
        cfg = llm.engine.model.cfg
        one_expert = sum(math.prod(s) for s in cfg.moe.expert_shapes(cfg.hidden_size).values()) * 4  # fp32
        assert t.total.expert_bytes % one_expert == 0 and t.total.expert_bytes >= t.total.expert_misses * one_expert
        assert 0 < t.total.prefetch_accuracy <= 1
    finally:
        llm.close()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V2/V3's tiny checkpoints (tests/support/families.py: latent attention, shared experts, a dense
    first block, group-limited routing, V3's correction bias) and transformers' greedy tokens and prompt
    logits for PROMPTS."""
    from tests.support.families import build as build_family

    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for arch in ("deepseek_v3", "deepseek_v2"):
        folder = build_family(root / arch, arch)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        out[arch] = folder, ([greedy_with(model, p, 12) for p in PROMPTS], None)
    return out


@pytest.mark.parametrize("arch,slots", [("deepseek_v3", 4), ("deepseek_v2", 6)])
def test_deepseek_expert_streaming_matches_transformers(deepseek, arch, slots):
    """DeepSeek through the expert tier: fewer slots than a block's 8 experts (V2's 3 experts a token need
    6 at least), so every step evicts; blocks streamed without their experts, the guesser routing with V3's
    correction bias; the shared experts and the dense first block stream with the blocks."""
    folder, reference = deepseek[arch]
    llm = LLM(str(folder), max_model_len=128, max_num_seqs=4, show_progress=False,
              max_device_memory=expert_budget(folder, slots=slots))
    try:
        assert llm.plan.expert_slots == slots and llm.plan.resident_blocks == [], llm.plan.describe()
        check_against_reference(llm, reference)
        total = llm.telemetry().total
        assert total.expert_misses > 4 and total.expert_hits > 0
    finally:
        llm.close()


# GPT-OSS: each expert a slice of a stacked tensor. Its experts are small beside its blocks: with more slots
# the plan would keep a block resident instead.
@pytest.mark.parametrize("arch,slots", [("qwen2_moe", 6), ("gpt_oss", 3)])
@pytest.mark.parametrize("transport", ["disk", "simulated"])
def test_expert_tiers_match_transformers(moe_dirs, references, transport, arch, slots, monkeypatch):
    """Experts read by byte range off the disk (O_DIRECT), or from the page cache behind the simulated link."""
    monkeypatch.setenv("LAYERSTREAM_SIM_GBPS", "0")
    folder = moe_dirs[arch]
    llm = LLM(str(folder), max_model_len=128, max_num_seqs=4, show_progress=False, transport=transport,
              max_device_memory=expert_budget(folder, slots=slots))
    try:
        # at least the slots asked for (GPT-OSS's plan finds room for one more), fewer than a block's experts
        assert slots <= llm.plan.expert_slots < NUM_EXPERTS and llm.plan.resident_blocks == []
        check_against_reference(llm, references[arch])
        total = llm.telemetry().total
        if transport == "disk":
            assert total.disk_bytes_read >= total.expert_bytes > 0
    finally:
        llm.close()


def test_expert_streaming_moves_fewer_bytes_than_whole_blocks(moe_dirs):
    """Same budget, same greedy tokens; the flag off streams blocks whole (experts inside)."""
    folder = moe_dirs["mixtral"]
    budget = expert_budget(folder, slots=12)
    runs = {}
    for granular in (True, False):
        llm = LLM(str(folder), max_model_len=128, max_num_seqs=4, show_progress=False, max_device_memory=budget,
                  expert_streaming=granular)
        try:
            assert llm.plan.expert_streaming == granular
            before = llm.telemetry().total
            out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            moved = llm.telemetry().total.since(before).bytes_streamed
            runs[granular] = (out[0].outputs[0].token_ids, moved)
        finally:
            llm.close()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] * 2 < runs[False][1], runs


# -- expert-granular streaming through the CUDA transport, replayed on CPU -----------------------------

@pytest.fixture
def recording_cuda_experts(monkeypatch):
    """(expert slots made, block transports made) on the recording runtime: cuda_replay.record_cuda_experts."""
    return record_cuda_experts(monkeypatch)


def _protocol_counts(slots) -> tuple[int, int]:
    """(compute-stream waits on a slot's ready event, frees recorded on the compute stream)."""
    ready, freed = {id(e) for e in slots._ready}, {id(e) for e in slots._freed}
    log = slots.rt.log
    waits = sum(1 for kind, stream, obj, _ in log if kind == "wait" and stream == "compute" and id(obj) in ready)
    frees = sum(1 for kind, stream, obj, _ in log if kind == "record" and stream == "compute" and id(obj) in freed)
    return waits, frees


@pytest.mark.parametrize("arch,tier", [("qwen2_moe", "host"), ("mixtral", "host"), ("mixtral", "disk"),
                                       ("gpt_oss", "host")])
def test_cuda_expert_slots_replayed_on_cpu(moe_dirs, references, recording_cuda_experts, arch, tier):
    """Expert-granular streaming on the GPU path, on CPU: experts staged in pinned memory (from the page
    cache, or read with O_DIRECT when host memory sends the blocks to the disk tier), copied into device
    slots on the copy stream, computed from views of the slots; 4 slots for 8 experts per block, so every
    step evicts. Outputs are transformers' (and the CPU expert tier's); the event protocol holds for
    every copy (compute waits for a slot's copy, no copy into a slot compute still reads), and compute
    waited for and freed every expert it used."""
    from tests.support.cuda_replay import check_protocol

    folder = moe_dirs[arch]
    made, transports = recording_cuda_experts
    budget = expert_budget(folder, slots=4)
    # 400 kB of host memory leaves every block of the tiny Mixtral on the disk tier (checked below)
    host = {"max_host_memory": 400_000} if tier == "disk" else {}
    llm = LLM(str(folder), transport="cuda", max_model_len=128, max_num_seqs=4, show_progress=False,
              max_device_memory=budget, **host)
    cpu = LLM(str(folder), max_model_len=128, max_num_seqs=4, show_progress=False, max_device_memory=budget)
    try:
        assert llm.plan.expert_slots == 4 and llm.plan.resident_blocks == [], llm.plan.describe()
        assert bool(llm.plan.disk_blocks) == (tier == "disk"), llm.plan.describe()
        (slots,) = made
        assert slots.count == 4 and slots.host_bytes > 0
        check_against_reference(llm, references[arch])
        torch.testing.assert_close(prompt_logits(llm, PROMPTS[1]), prompt_logits(cpu, PROMPTS[1]), atol=1e-6, rtol=1e-6)
        t = llm.telemetry()
        total = t.total
        assert total.expert_misses > 4 and total.expert_hits > 0
        assert t.pinned_host_bytes >= slots.host_bytes
        if tier == "disk":  # experts came off the disk by byte range, not through the page cache
            assert total.disk_bytes_read >= total.expert_bytes and total.disk_tier_bytes >= total.expert_bytes
        else:
            assert total.disk_bytes_read == 0
        copies = check_protocol(slots, slots.rt.log)
        assert copies * slots.nbytes == total.expert_bytes > 0  # every fill is one copy into a slot
        waits, frees = _protocol_counts(slots)
        assert waits == frees == total.expert_hits + total.expert_misses
        assert check_protocol(transports[0], transports[0].rt.log) >= total.blocks_streamed > 0
    finally:
        llm.close()
        cpu.close()


@pytest.mark.parametrize("event", ["freed", "ready"])
def test_expert_protocol_check_catches_a_broken_protocol(moe_dirs, recording_cuda_experts, event):
    """The check is not vacuous: without the free events a slot is refilled while compute may still read
    it; without the ready events compute reads a slot whose copy it did not wait for."""
    from tests.support.cuda_replay import check_protocol

    folder = moe_dirs["mixtral"]
    made, _ = recording_cuda_experts
    llm = LLM(str(folder), transport="cuda", max_model_len=128, max_num_seqs=4, show_progress=False,
              max_device_memory=expert_budget(folder, slots=4))
    try:
        slots = made[0]
        broken = {id(e) for e in getattr(slots, f"_{event}")}
        slots.rt.skip_record = lambda e: id(e) in broken
        llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        message = "while a block in it was not retired" if event == "freed" else "does not wait for its copy"
        with pytest.raises(AssertionError, match=message):
            check_protocol(slots, slots.rt.log)
    finally:
        llm.close()


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "gpt_oss"])
def test_expert_streaming_on_a_gpu(moe_dirs, references, arch):
    """On a real GPU (fp32, TF32 off): 4 expert slots in device memory for 8 experts per block, every
    step evicting; logits within 1e-4 of transformers and the same greedy tokens for a batch that routes
    differently; the telemetry shows the expert traffic."""
    folder = moe_dirs[arch]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    llm = LLM(str(folder), device="cuda", max_model_len=128, max_num_seqs=4, show_progress=False,
              max_device_memory=expert_budget(folder, slots=4, device="cuda"))
    try:
        assert llm.plan.expert_slots == 4, llm.plan.describe()
        per_prompt, _ = references[arch]
        torch.testing.assert_close(prompt_logits(llm, PROMPT).float().cpu(), per_prompt[0][1], atol=ATOL, rtol=RTOL)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in per_prompt]
        total = llm.telemetry().total
        assert total.expert_misses > 4 and total.expert_bytes > 0
    finally:
        llm.close()
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_bench_moe_measures_the_page_cache_share(tmp_path):
    """layerstream.bench.moe reports how much of the checkpoint was in the page cache around a timed round: the
    measurement sees pages read in and pages dropped (on a file system that can drop them)."""
    import os

    from layerstream.bench.moe import page_cache_share

    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4 << 20))
    os.sync()  # dirty pages cannot be dropped
    f.read_bytes()
    assert page_cache_share(tmp_path) == 1.0
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    dropped = page_cache_share(tmp_path)
    if dropped == 1.0:
        pytest.skip("this file system keeps the pages (tmpfs?)")
    assert dropped < 0.5
    f.read_bytes()
    assert page_cache_share(tmp_path) == 1.0


def test_expert_slots_convert_a_bf16_checkpoint(tmp_path):
    """A bf16 checkpoint computed in fp32: experts cannot be served as views of the page cache, so each
    fill converts into a slot buffer; the result is the all-resident fp32 run's (converted at load)."""
    folder = build(tmp_path / "bf16", "mixtral", dtype=torch.bfloat16)
    kw = dict(max_model_len=128, max_num_seqs=4, show_progress=False, dtype="float32")
    streamed = LLM(str(folder), max_device_memory=expert_budget(folder, slots=4, dtype="float32"), **kw)
    resident = LLM(str(folder), **kw)
    try:
        assert streamed.plan.expert_slots == 4 and resident.plan.streamed_blocks == []
        torch.testing.assert_close(prompt_logits(streamed, PROMPT), prompt_logits(resident, PROMPT),
                                   atol=1e-6, rtol=1e-6)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert ([o.outputs[0].token_ids for o in streamed.generate(PROMPTS[:2], params)]
                == [o.outputs[0].token_ids for o in resident.generate(PROMPTS[:2], params)])
        total = streamed.telemetry().total
        assert total.expert_misses > 4 and total.expert_bytes % (4 * 3 * 64 * 32) == 0  # fp32 bytes moved
    finally:
        streamed.close()
        resident.close()


@pytest.mark.parametrize("arch,method", [("deepseek_v3", "noaux_tc"), ("deepseek_v2", "greedy"),
                                         ("deepseek_v2", "group_limited_greedy")])
def test_deepseek_router_matches_transformers(arch, method):
    """engine.model.router_topk against transformers' own DeepSeek router modules on random hidden states: the
    same experts and weights for every token (V3: sigmoid, correction bias, groups by their two best, renormalised
    and scaled; V2: softmax, greedy or within the best group by its best score, scaled)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.arch import config_from_hf
    from engine.model import router_topk
    from tests.support.families import deepseek_config

    hf = deepseek_config(arch)
    if arch == "deepseek_v2":
        hf.topk_method = method
    router = (DeepseekV3TopkRouter if arch == "deepseek_v3" else DeepseekV2TopkRouter)(hf)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if arch == "deepseek_v3":
            router.e_score_correction_bias.copy_(torch.randn(hf.n_routed_experts, generator=g) * 0.3)
    cfg = config_from_hf(hf, hf.architectures[0], torch.float32)
    m = cfg.moe
    assert m.topk_method == method
    h = torch.randn(64, hf.hidden_size, generator=g)
    with torch.no_grad():
        _, want_w, want_ids = router(h)
    w = {"router": router.weight.detach()}
    if arch == "deepseek_v3":
        w["router_bias"] = router.e_score_correction_bias
    ids, weights = router_topk(h, w, cfg)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order), atol=1e-6, rtol=1e-6)
    if method != "greedy":  # the group limit or the bias changes some token's choice: the test can tell
        plain = dataclasses.replace(cfg, moe=dataclasses.replace(m, topk_method="greedy"))
        assert not torch.equal(router_topk(h, w, plain)[0].sort(dim=-1).values, ids.sort(dim=-1).values)
