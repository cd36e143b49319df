"""Per-tensor-group placement (issue #38): a device budget smaller than the model keeps the attention, norms
and router of every layer (and the KV pool) on the device and moves MLPs / routed experts off it, the largest
first, instead of streaming whole blocks. Plans of tiny configs (transformers' own config classes), no weights."""

from __future__ import annotations

import pytest
import torch

from engine.arch import config_from_hf
from engine.loader import tensor_groups
from engine.placement import block_groups, group_kind, place_groups
from engine.planner import PlanError, PlanInputs, plan_memory
from tests.support import models, moe_models

KiB = 1 << 10
GLOBALS, WORKSPACE = 64 * KiB, 16 * KiB
KV_PER_TOKEN, MAX_LEN = 256, 64  # a KV pool of 2 x 64 tokens: 32 KiB


def config(arch: str):
    if arch in moe_models.MOE_ARCHS:
        hf = moe_models.make_config(arch)
    else:
        hf = models.make_config(arch)
    return config_from_hf(hf, hf.architectures[0], torch.float32)


def inputs(cfg, budget: int | None, **kw) -> PlanInputs:
    groups = tensor_groups(cfg, torch.float32)
    block = max(sum(g.nbytes for g in groups if g.layer == i) for i in range(cfg.num_layers))
    return PlanInputs(num_layers=cfg.num_layers, block_bytes=block, global_bytes=GLOBALS,
                      kv_bytes_per_token=KV_PER_TOKEN, workspace_bytes=WORKSPACE, budget=budget,
                      max_model_len=MAX_LEN, max_num_seqs=2, tensor_groups=groups, **kw)


FIXED = GLOBALS + WORKSPACE + 2 * MAX_LEN * KV_PER_TOKEN  # what the budget holds before any weight


def bytes_of(cfg, kind: str, layer: int | None = None) -> int:
    return sum(g.nbytes for g in tensor_groups(cfg, torch.float32)
               if g.kind == kind and (layer is None or g.layer == layer))


@pytest.mark.parametrize("short, kind", [("wq", "attention"), ("wqkv", "attention"), ("bo", "attention"),
                                         ("sinks", "attention"), ("wkv_a", "attention"), ("attn_norm", "norms"),
                                         ("q_norm", "norms"), ("kv_a_norm", "norms"), ("router", "router"),
                                         ("router_bias", "router"), ("w_gate_up", "mlp"), ("w_down", "mlp"),
                                         ("shared.w_up", "mlp"), ("shared_gate", "mlp"),
                                         ("experts.7.w_down_t", "experts")])
def test_each_tensor_falls_in_one_group(short, kind):
    assert group_kind(short) == kind


def test_a_block_s_groups_add_up_to_the_block():
    cfg = config("qwen2_moe")  # a shared expert beside the routed ones, every second block sparse
    for layer in range(cfg.num_layers):
        shapes = cfg.block_shapes(layer)
        groups = block_groups(layer, shapes, 4, cfg.hidden_size, cfg.moe.top_k if cfg.is_moe_layer(layer) else 0)
        assert sum(g.params for g in groups) == sum(torch.Size(s).numel() for s in shapes.values())
        experts = [g for g in groups if g.kind == "experts"]
        assert [(g.experts_total, g.experts_active) for g in experts] == ([(8, 2)] if cfg.is_moe_layer(layer) else [])


def test_a_budget_below_the_model_moves_mlps_off_and_keeps_attention_everywhere():
    cfg = config("llama")  # 5 layers; attention + norms 49.5 KiB, MLP 96 KiB each
    stay, mlp = bytes_of(cfg, "attention") + bytes_of(cfg, "norms"), bytes_of(cfg, "mlp", 0)
    budget = FIXED + stay + 2 * mlp + 2 * mlp + mlp // 2  # two stream buffers and two resident MLPs
    plan = plan_memory(inputs(cfg, budget))
    placed = plan.group_placement
    assert placed is not None and placed.stream_buffer_bytes == 2 * mlp
    assert sorted(placed.off_device) == [(1, "mlp"), (3, "mlp"), (4, "mlp")]  # resident MLPs spread: 0 and 2
    assert all(not placed.is_off_device(i, k) for i in range(5) for k in ("attention", "norms"))
    assert plan.resident_blocks == [0, 2] and plan.streamed_blocks == [1, 3, 4]
    assert plan.device_bytes == FIXED + stay + 2 * mlp + 2 * mlp <= budget
    assert plan.streamed_bytes_per_step == 3 * mlp  # the most: every off-device MLP streamed
    text = plan.describe()
    assert "tensor groups: norms, attention of all 5 layers on the device" in text
    assert "3 mlp (288.00 KiB, largest first)" in text and "off-device groups: 1:mlp, 3:mlp, 4:mlp" in text
    assert "blocks wholly on the device: 2/5  with a group off it: 3/5" in text


def test_the_cpu_policy_needs_no_stream_buffers_so_more_stays_on_the_device():
    cfg = config("llama")
    stay, mlp = bytes_of(cfg, "attention") + bytes_of(cfg, "norms"), bytes_of(cfg, "mlp", 0)
    budget = FIXED + stay + 2 * mlp + 2 * mlp + mlp // 2
    plan = plan_memory(inputs(cfg, budget, offload_streams=False))
    assert plan.group_placement.stream_buffer_bytes == 0
    assert len(plan.group_placement.off_device) == 1  # the buffers' room holds two more MLPs
    assert plan.device_bytes <= budget


def test_a_budget_that_holds_the_model_places_no_group_off():
    cfg = config("llama")
    plan = plan_memory(inputs(cfg, FIXED + 5 * (bytes_of(cfg, "attention", 0) + bytes_of(cfg, "norms", 0)
                                                + bytes_of(cfg, "mlp", 0))))
    assert plan.group_placement is None and plan.streamed_blocks == []


def test_the_largest_groups_leave_first():
    """Qwen3-MoE's first block keeps a dense MLP (72 KiB); the others hold 8 experts (192 KiB): experts leave
    the device before the dense MLP does, and equal ones stay spread over the layers. (The cpu policy, so
    no stream buffers: with them, a model this small would gain nothing from taking one group off.)"""
    cfg = config("qwen3_moe")
    stay = sum(bytes_of(cfg, k) for k in ("attention", "norms", "router"))
    experts, dense = bytes_of(cfg, "experts", 1), bytes_of(cfg, "mlp", 0)
    assert (experts, dense) == (192 * KiB, 72 * KiB)

    def off(budget):
        plan = plan_memory(inputs(cfg, budget, offload_streams=False))
        assert plan.device_bytes <= budget
        return plan, sorted(plan.group_placement.off_device)

    one_off = FIXED + stay + dense + 2 * experts
    # Equal groups kept on the device follow the planner's spread of resident blocks (_spread).
    assert off(one_off)[1] == [(3, "experts")]
    assert off(one_off - 1)[1] == [(2, "experts"), (3, "experts")]
    all_experts_off = FIXED + stay + dense
    assert off(all_experts_off)[1] == [(1, "experts"), (2, "experts"), (3, "experts")]
    plan, groups = off(all_experts_off - 1)  # the dense MLP goes last
    assert groups == [(0, "mlp"), (1, "experts"), (2, "experts"), (3, "experts")]
    assert "1 mlp, 3 experts" in plan.describe() and "norms, attention, router of all 4 layers" in plan.describe()


def test_a_heterogeneous_model_that_fits_by_its_groups_keeps_them_all():
    """Blocks of different sizes: the planner's whole-block check (the largest block x layers) overcounts;
    the groups' own sum fits, so nothing leaves the device."""
    cfg = config("qwen3_moe")
    total = sum(g.nbytes for g in tensor_groups(cfg, torch.float32))
    plan = plan_memory(inputs(cfg, FIXED + total))
    assert plan.group_placement is not None and not plan.group_placement.off_device
    assert plan.streamed_blocks == [] and plan.device_bytes == FIXED + total


def test_when_attention_everywhere_does_not_fit_blocks_stream_whole():
    """Two whole-block stream buffers can be smaller than every layer's attention with two MLP buffers: then
    the plan streams whole blocks, as before, and says why."""
    cfg = config("llama")
    block = inputs(cfg, None).block_bytes
    plan = plan_memory(inputs(cfg, FIXED + 2 * block + block // 2))
    assert plan.group_placement is None and plan.resident_blocks == [] and len(plan.streamed_blocks) == 5
    (note,) = [n for n in plan.notes if "blocks stream whole" in n]
    assert "the buffers off-device groups stream through" in note  # what does not fit beside the attention


def test_place_groups_returns_none_when_what_must_stay_does_not_fit():
    groups = block_groups(0, {"wq": (64, 64), "w_up": (128, 64)}, 4, 64)
    assert place_groups(groups, 64 * 64 * 4 - 1, 1, stream_buffers=False) is None
    only = place_groups(groups, 64 * 64 * 4, 1, stream_buffers=False)
    assert only is not None and only.off_device == {(0, "mlp")} and only.device_bytes == 64 * 64 * 4


def test_the_smallest_budget_is_what_must_stay_with_everything_else_off():
    """Below whole-block streaming's two buffers, per-group placement still serves (the cpu policy: no buffers);
    below what must stay in every layer, the refusal says what that is."""
    cfg = config("qwen3_moe")
    stay = sum(bytes_of(cfg, k) for k in ("attention", "norms", "router"))
    smallest = inputs(cfg, None, offload_streams=False).min_budget()
    assert smallest == GLOBALS + WORKSPACE + MAX_LEN * KV_PER_TOKEN + stay  # one sequence's KV
    plan = plan_memory(inputs(cfg, smallest, offload_streams=False))
    assert len(plan.group_placement.off_device) == 4 and plan.device_bytes <= smallest
    with pytest.raises(PlanError, match=r"the attention, norms and router of every layer \(\d+\.\d+ KiB\)"):
        plan_memory(inputs(cfg, smallest - 1, offload_streams=False))


def test_stream_buffers_leave_the_expert_cache_its_slots_beside_the_largest_mlp():
    """Streamed MLPs and the device's expert cache share the stream buffers: when an MLP is the largest group
    that may leave the device, the buffers still hold prefetch depth + 1 experts beside that MLP's buffers."""
    from engine.placement import TensorGroup

    must = tuple(TensorGroup(i, "attention", 40, 10) for i in range(5))
    mlps = tuple(TensorGroup(i, "mlp", 1000, 250) for i in range(4))  # dense blocks' MLPs, the largest groups
    experts = TensorGroup(4, "experts", 800, 200, experts_total=8, experts_active=2)  # 100 bytes an expert
    budget = 200 + 2 * (1000 + 100) + 1000  # the must-stay groups, the buffers, and one MLP
    placed = place_groups((*must, *mlps, experts), budget, prefetch_depth=1, stream_buffers=True)
    assert placed is not None and placed.device_bytes <= budget
    assert placed.stream_buffer_bytes == 2 * (1000 + 100)  # two MLP buffers and two expert slots
    assert placed.off_device == {(i, "mlp") for i in range(4)}  # the largest first: the experts stay
    dense = place_groups((*must, *mlps), budget, prefetch_depth=1, stream_buffers=True)
    assert dense is not None and dense.stream_buffer_bytes == 2 * 1000  # no experts: no slots for them


def test_a_group_resident_in_another_form_than_it_moves_counts_each_where_it_applies():
    """A GGUF file's MLP in exact fp32 mode: resident it is dequantized (device_bytes), off the device it moves as
    its packed bytes (nbytes). Fitting the device counts the former; the stream buffers and the bytes a step
    streams, the latter. Without resident_nbytes a group is one size (block_groups from compute-dtype shapes)."""
    from engine.placement import TensorGroup

    must = tuple(TensorGroup(i, "attention", 40, 10) for i in range(3))
    mlps = tuple(TensorGroup(i, "mlp", 100, 800, resident_nbytes=3200) for i in range(3))  # Q4 vs fp32
    assert [g.device_bytes for g in mlps] == [3200] * 3 and must[0].device_bytes == 40
    budget = 120 + 2 * 100 + 2 * 3200  # the must-stay groups, two stream buffers of a packed MLP, two MLPs resident
    placed = place_groups((*must, *mlps), budget, prefetch_depth=1, stream_buffers=True)
    assert placed is not None and len(placed.off_device) == 1 and placed.device_bytes == budget
    assert placed.stream_buffer_bytes == 2 * 100 and placed.off_device_bytes == 100
    assert place_groups((*must, *mlps), budget - 1, prefetch_depth=1, stream_buffers=True).off_device_bytes == 200
    groups = block_groups(0, {"wq": (64, 64), "w_up": (128, 64)}, 4, 64, nbytes={"mlp": (4608, 32768)})
    assert [(g.kind, g.nbytes, g.device_bytes) for g in groups] == [("attention", 16384, 16384),
                                                                    ("mlp", 4608, 32768)]
