"""The off-device tier (engine/weights/offload.py, issue #38) over the CUDA transport, replayed on CPU by the
recording runtime: MLPs streamed to the device on demand keep the copy-stream / event protocol that streamed
blocks keep (check_protocol), and greedy tokens stay the resident model's (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.placement import MeasuredSpeeds
from tests.support.cuda_replay import (RecordingRuntime, capture_cuda_transports, check_activations, check_protocol,
                                       record_activation_links, record_cuda_experts)
from tests.support.reference import PROMPT

MLP_BYTES = 4 * 3 * 64 * 128  # the tiny Llama's MLP in fp32
KW = dict(max_model_len=128, max_num_seqs=3)
PROMPTS = [list(PROMPT), list(PROMPT[:5]), [7, 300, 12, 45, 2, 99, 101]]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# The tiny MLP streams from 4 tokens a step on (tests/engine/test_cpu_offload.py checks the threshold).
SPEEDS = MeasuredSpeeds(link_gbps=1, cpu_gbps=100, cpu_flops=1.75e9, device_flops=1e12)


@pytest.fixture
def recording_cuda(monkeypatch):
    import engine.weights.transports.cuda as ct

    monkeypatch.setattr(ct, "CudaRuntime", RecordingRuntime)
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    return capture_cuda_transports(monkeypatch), record_activation_links(monkeypatch)


@pytest.mark.parametrize("policy, depth", [("stream", 1), ("stream", 2), ("auto", 1)])
def test_streamed_mlps_keep_the_cuda_protocol_and_the_tokens(llama_dir, recording_cuda, monkeypatch, policy, depth):
    """The next off-device MLPs of a step are copied while one computes (up to the prefetch depth): the replayed
    protocol proves no copy lands in a buffer a kernel may still read, nor a kernel reads one before its copy."""
    monkeypatch.delenv("LAYERSTREAM_PLACEMENT")
    ref = LLM(str(llama_dir), **KW)
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    try:
        expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS)]
        budget = ref.plan.device_bytes - MLP_BYTES // 2
    finally:
        ref.close()
    llm = LLM(str(llama_dir), device="cpu", transport="cuda", max_device_memory=budget, max_host_memory="8GiB",
              cpu_offload_policy=policy, prefetch_depth=depth, **KW)
    try:
        # depth + 1 MLP buffers come out of the budget too: 3 MLPs off at depth 1, 4 at depth 2.
        assert len(llm.plan.group_placement.off_device) == depth + 2, llm.plan.describe()
        # Two transports: the blocks' on-device groups (all resident, nothing streamed) and the off-device MLPs.
        transports, (activations,) = recording_cuda
        main, link = transports[-2:]
        if policy == "auto":
            llm.engine.set_measured_speeds(SPEEDS)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == expected
        stats = llm.telemetry().offload
        copies = check_protocol(link, link.rt.log)
        assert copies >= stats.groups_stream > 0  # every streamed MLP went through the copy stream
        assert check_protocol(main, main.rt.log) == 0
        # The MLPs the CPU computed: their input and output crossed in pinned staging, ordered by events.
        assert check_activations(activations, activations.rt.log) == (stats.groups_cpu, stats.groups_cpu)
        if policy == "auto":
            assert stats.groups_cpu > 0
    finally:
        llm.close()


def _qwen2_moe_and_its_tokens(tmp_path):
    """A tiny Qwen2-MoE checkpoint (tests/support/moe_models) and its all-resident greedy tokens."""
    from tests.support import moe_models

    folder = moe_models.build(tmp_path / "qwen2_moe", "qwen2_moe")
    ref = LLM(str(folder), show_progress=False, **KW)
    try:
        return folder, [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS)]
    finally:
        ref.close()


@pytest.fixture
def recording_cuda_experts(monkeypatch):
    """(expert slots made, block transports made, activation links made) on the recording runtime (cuda_replay)."""
    return (*record_cuda_experts(monkeypatch), record_activation_links(monkeypatch))


@pytest.mark.parametrize("policy", ["stream", "auto"])
def test_streamed_experts_keep_the_cuda_protocol_and_the_tokens(tmp_path, recording_cuda_experts, monkeypatch, policy):
    """A Qwen2-MoE with every MLP, shared expert and routed expert off the device: MLPs stream through the offload
    transport, the chosen routed experts into the expert cache's device slots; both protocols hold for every copy,
    and greedy tokens stay the resident model's (fp32)."""
    from tests.support import moe_models

    folder, expected = _qwen2_moe_and_its_tokens(tmp_path)
    budget = moe_models.group_budget(folder, 200_000)
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    llm = LLM(str(folder), device="cpu", transport="cuda", max_device_memory=budget, max_host_memory="8GiB",
              cpu_offload_policy=policy, show_progress=False, **KW)
    try:
        off = llm.plan.group_placement.off_device
        assert {(1, "mlp"), (1, "experts"), (3, "mlp"), (3, "experts")} <= off, llm.plan.describe()
        made, (main, link), (activations,) = recording_cuda_experts
        (slots,) = made
        if policy == "auto":
            llm.engine.set_measured_speeds(SPEEDS)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == expected
        t = llm.telemetry()
        stats, total = t.offload, t.total
        assert check_protocol(main, main.rt.log) == 0
        mlp_copies = check_protocol(link, link.rt.log)
        if policy == "stream":  # every step streamed every group: its MLPs through the link
            assert mlp_copies >= stats.groups_stream - sum(1 for _, k in off if k == "experts") * stats.steps_stream > 0
        assert mlp_copies > 0
        copies = check_protocol(slots, slots.rt.log)
        assert copies * slots.nbytes == total.expert_bytes > 0  # every expert fill is one copy into a slot
        # What the CPU computed (shared experts: one tensor there; routed experts: three) crossed in pinned staging.
        d2h, h2d = check_activations(activations, activations.rt.log)
        assert h2d == stats.groups_cpu
        if policy == "auto":
            assert stats.groups_cpu > 0 and d2h > h2d
        else:
            assert d2h == 0
    finally:
        llm.close()


@pytest.mark.parametrize("shared", ["resident", "streamed"])
def test_routed_experts_on_the_cpu_overlap_the_device_s_shared_expert(tmp_path, recording_cuda_experts, monkeypatch,
                                                                      shared):
    """Qwen2-MoE, its routed experts computed on the CPU and its shared experts on the device (resident under
    --cpu-offload-policy cpu; or off it and streamed, the policy choosing so per group): each crossing's inputs
    (hidden states, ids, gates) go device -> host on the copy stream, the shared expert's kernels are enqueued after
    that copy and before the host waits for it (the device computes them while the CPU computes the routed experts),
    and the sum comes back in pinned staging; greedy tokens stay the resident model's (fp32), whose sum (routed
    experts, then the shared expert: transformers' order) is the same."""
    from engine import model as M
    from engine.placement import PathPolicy
    from tests.support import moe_models

    folder, expected = _qwen2_moe_and_its_tokens(tmp_path)
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    if shared == "streamed":  # what auto chooses for a step whose tokens are many but spread thin over the experts
        monkeypatch.setattr(PathPolicy, "path", lambda self, group, step: "cpu" if group.kind == "experts" else "stream")
    llm = LLM(str(folder), device="cpu", transport="cuda", max_device_memory=moe_models.group_budget(folder, 200_000),
              max_host_memory="8GiB", cpu_offload_policy="cpu" if shared == "resident" else "auto",
              show_progress=False, **KW)
    try:
        off = llm.plan.group_placement.off_device
        if shared == "resident":
            assert off == {(1, "experts"), (3, "experts")}, llm.plan.describe()
        else:  # the dense blocks' MLPs too: they stream with the shared experts
            assert {(1, "mlp"), (3, "mlp"), (1, "experts"), (3, "experts")} <= off, llm.plan.describe()
        _, transports, (activations,) = recording_cuda_experts  # the blocks' transport, then the shared experts'
        log = activations.rt.log
        shared_expert = M.shared_expert

        def marked(h, w):  # where, among the link's calls, the device's shared expert was enqueued
            log.append(("shared_expert", "compute", None, None))
            return shared_expert(h, w)

        monkeypatch.setattr(M, "shared_expert", marked)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == expected
        stats = llm.telemetry().offload
        assert stats.groups_cpu == 2 * stats.steps_cpu > 0
        assert stats.groups_stream == (len(off) - 2) * stats.steps_stream
        if shared == "streamed":
            main, link = transports
            assert check_protocol(link, link.rt.log) == stats.groups_stream
        assert sum(1 for e in log if e[0] == "shared_expert") == stats.groups_cpu
        calls = [e for e in log if e[0] != "shared_expert"]
        assert check_activations(activations, calls) == (3 * stats.groups_cpu, stats.groups_cpu)
        landed = activations._down_landed
        for i, e in enumerate(log):
            if e[0] == "shared_expert":  # after the inputs' copy was issued, before the host waits for it
                before = [x[0] for x in log[:i] if x[2] is landed]
                after = [x[0] for x in log[i:] if x[2] is landed]
                assert before[-1] == "record" and after[0] == "host_wait", log[max(0, i - 6):i + 6]
    finally:
        llm.close()


@pytest.mark.parametrize("dtype, policy", [("float32", "stream"), ("float32", "auto"), ("auto", "cpu")])
def test_a_gguf_file_s_mlps_keep_the_cuda_protocol_and_the_tokens(tmp_path, recording_cuda, monkeypatch, dtype,
                                                                  policy):
    """A Q4_0 GGUF with MLPs off the device of the CUDA transport (replayed): streamed, they cross as a streamed
    GGUF block does (its GGML bytes into the device ring, GGUFWeight there) under the same protocol; on the CPU the
    packed kernels compute them (fast mode: from the prepacked entry; exact: the file's blocks). Greedy tokens
    are the all-resident run's in the same mode (streamed GGUFWeight products match it in exact mode only)."""
    from gguf import GGMLQuantizationType as Q

    from engine import kernels
    from engine.weights.packed.weights import Int4Weight
    from tests.support.gguf_models import SHORT, greedy_tokens, tiny_gguf

    if dtype == "auto" and kernels.int4_backend() != "vnni":
        pytest.skip("no VNNI kernels here: fast mode has no prepacked entry")
    path = tiny_gguf(tmp_path, "llama", Q.Q4_0)
    monkeypatch.delenv("LAYERSTREAM_PLACEMENT")
    kw = dict(dtype=dtype, device="cpu", transport="cuda", max_host_memory="8GiB", **SHORT)
    ref = LLM(str(path), **kw)
    try:
        expected, fits = greedy_tokens(ref), ref.plan.device_bytes
    finally:
        ref.close()
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    llm = LLM(str(path), max_device_memory=fits - 6912, cpu_offload_policy=policy, **kw)
    try:
        off = llm.plan.group_placement.off_device_groups
        assert off and {g.kind for g in off} == {"mlp"}, llm.plan.describe()
        packed = off[0].nbytes
        assert packed * 8 == 4.5 * 3 * 64 * 128  # the MLP's GGML bytes: what it streams as
        if policy == "auto":
            llm.engine.set_measured_speeds(MeasuredSpeeds(link_gbps=0.25, cpu_gbps=100, cpu_flops=3.5e9,
                                                          device_flops=1e12))
        if dtype == "auto":
            host = llm.engine.model.weights.offloaded(off[0].layer, "cpu")
            assert {type(w) for w in host.values()} == {Int4Weight}
        assert greedy_tokens(llm) == expected
        stats, total = llm.telemetry().offload, llm.telemetry().total
        main, link = recording_cuda[0][-2:]  # the all-resident run built one before them
        assert check_protocol(main, main.rt.log) == 0
        if policy != "cpu":
            assert check_protocol(link, link.rt.log) >= stats.groups_stream > 0
            assert total.bytes_streamed == stats.bytes_stream == stats.groups_stream * packed
        if policy == "auto":
            assert stats.groups_cpu > 0
        if policy == "cpu":
            assert stats.groups_stream == 0 and stats.groups_cpu > 0
    finally:
        llm.close()


@pytest.mark.parametrize("dtype, policy", [("float32", "stream"), ("float32", "auto"), ("auto", "cpu")])
def test_a_gguf_file_s_routed_experts_keep_the_cuda_protocol_and_the_tokens(tmp_path, recording_cuda_experts,
                                                                            monkeypatch, dtype, policy):
    """A mixture-of-experts GGUF (DeepSeek-V3's tiny one from llama.cpp's converter, Q8_0) with routed experts off
    the device of the CUDA transport (replayed): streamed, only the chosen experts' GGML bytes fill the expert
    cache's device slots (GGUFWeight there, as a streamed GGUF block is computed), under the slots' protocol; on the
    CPU the packed kernels compute them, their activations crossing in pinned staging. Greedy tokens are the
    all-resident run's in the same mode (streamed GGUFWeight products match it in exact mode only)."""
    from engine import kernels
    from tests.support.families import build
    from tests.support.llama_cpp_convert import convert, llama_cpp_root

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    if dtype == "auto" and kernels.int4_backend() != "vnni":
        pytest.skip("no VNNI kernels here: fast mode's CPU path computes another way")
    path = convert(build(tmp_path / "hf", "deepseek_v3"), tmp_path / "tiny-deepseek_v3-q8.gguf", "q8_0")
    expert_bytes = 34 * 3 * 64 * 32 // 32  # one expert's Q8_0 bytes: 34 a block of 32 weights
    kw = dict(dtype=dtype, device="cpu", transport="cuda", max_host_memory="8GiB", show_progress=False, **KW)
    ref = LLM(str(path), **kw)
    try:
        expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS)]
        fits = ref.plan.device_bytes
    finally:
        ref.close()
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    # short of about two blocks' routed experts as they stay on the device (fp32 in exact mode, Q8_0 in fast mode)
    llm = LLM(str(path), max_device_memory=fits - 2 * 8 * (4 * 3 * 64 * 32 if dtype == "float32" else expert_bytes),
              cpu_offload_policy=policy, **kw)
    try:
        off = llm.plan.group_placement.off_device
        assert {k for _, k in off} >= {"experts"}, llm.plan.describe()
        made, _, (activations,) = recording_cuda_experts
        if policy == "auto":
            llm.engine.set_measured_speeds(MeasuredSpeeds(link_gbps=0.25, cpu_gbps=100, cpu_flops=2e9,
                                                          device_flops=1e12))
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == expected
        t = llm.telemetry()
        stats, total = t.offload, t.total
        d2h, h2d = check_activations(activations, activations.rt.log)
        assert h2d == stats.groups_cpu
        if policy == "cpu":
            assert not made and stats.groups_stream == 0 and stats.groups_cpu > 0
            return
        (slots,) = made
        assert slots.packed is not None  # the slots hold GGML bytes
        copies = check_protocol(slots, slots.rt.log)
        assert copies * expert_bytes == total.expert_bytes > 0  # every fill one copy of one expert's packed bytes
        # what compute read from a slot: GGUFWeight over its bytes
        block = min(b for b, k in off if k == "experts")
        (group,) = list(llm.engine.model.weights.offloaded_experts(block, [0, 5], "stream"))
        assert {type(w).__name__ for e in group.values() for w in e.values()} == {"GGUFWeight"}
        assert all(w.data.untyped_storage().data_ptr() == slots._dev[0].untyped_storage().data_ptr()
                   for e in group.values() for w in e.values())
        if policy == "auto":
            assert stats.groups_cpu > 0 and stats.groups_stream > 0
    finally:
        llm.close()


def test_packed_expert_slots_fit_every_block_s_types():
    """llama.cpp's mixes store one block's experts in another type than the next's (Q4_K_M keeps some ffn_down_exps
    in Q6_K): a slot's room for each tensor is the largest of any block's, and an expert staged into it is read back
    with its own type and shape, the same values as its stored bytes dequantized; plain tensors (biases) in the
    compute dtype."""
    from pathlib import Path

    from gguf import GGMLQuantizationType as Q

    from engine.weights.experts.packed import PackedExperts
    from engine.weights.formats.reader import TensorInfo
    from engine.weights.packed.dequant import dequantize
    from tests.support.gguf_models import random_blocks

    shapes = {"w_up": (32, 256), "w_down": (256, 256)}
    types = {0: {"w_up": Q.Q8_0, "w_down": Q.Q6_K}, 1: {"w_up": Q.Q8_0, "w_down": Q.Q8_0}}
    stored = {(b, e): {k: torch.from_numpy(random_blocks(q, *shapes[k], seed=10 * b + e + len(k)))
                       for k, q in types[b].items()} | {"b_up": torch.randn(32)}
              for b in types for e in range(2)}

    class Source:  # the three BlockSource methods the slots read
        def expert_blocks(self):
            return list(types)

        def num_experts(self, block):
            return 2

        def expert_tensors(self, block, expert):
            rows = stored[(block, expert)]
            out = {k: TensorInfo(k, Path("x"), None, shapes[k], 0, rows[k].numel(), q.name)
                   for k, q in types[block].items()}
            return out | {"b_up": TensorInfo("b_up", Path("x"), torch.float32, (32,), 0, 128)}

    packed = PackedExperts(Source(), torch.float32)
    assert packed.specs["w_down"] == ((stored[(1, 0)]["w_down"].numel(),), torch.uint8)  # Q8_0's, the larger
    assert packed.specs["w_up"] == ((stored[(0, 0)]["w_up"].numel(),), torch.uint8)
    assert packed.specs["b_up"] == ((32,), torch.float32)
    room = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in packed.specs.items()}
    for key in [(1, 1), (0, 1), (1, 0)]:  # a slot reused by experts of either block: Q6_K's bytes fill part of it
        packed.stage(stored[key], room)
        weights = packed.weights(key, room)
        assert packed.nbytes(key) == sum(t.nbytes for k, t in stored[key].items() if k != "b_up") + 32 * 4
        for k, q in types[key[0]].items():
            assert weights[k].qtype == q and weights[k].shape == shapes[k]
            assert weights[k].data.untyped_storage().data_ptr() == room[k].untyped_storage().data_ptr()
            assert torch.equal(weights[k].dense(), dequantize(stored[key][k], q, shapes[k]))
        assert torch.equal(weights["b_up"], stored[key]["b_up"])
