"""Issue #38 for mixtures of experts, on the simulated device: a budget below the model places routed experts (and,
when short enough, shared experts and dense MLPs) off the device (LAYERSTREAM_PLACEMENT=groups), and each step,
per MoE block, computes the chosen experts on the CPU from host weights (only the hidden states and the routing
cross the link) or streams only those experts into the device expert cache, as --cpu-offload-policy and the
measured speeds decide from the router's tokens per expert. Greedy tokens are those of the all-resident model (fp32)
for every policy; telemetry counts each path."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.placement import MeasuredSpeeds, PathPolicy, StepShape, TensorGroup
from tests.support import moe_models
from tests.support.reference import PROMPT

HIDDEN_BYTES = 64 * 4  # the tiny MoEs' hidden state in fp32
TOP_K = 2
EXPERT_PARAMS = 3 * 64 * 32  # one routed expert: gate, up (32 x 64) and down (64 x 32)
EXPERT_BYTES = 4 * EXPERT_PARAMS  # (GPT-OSS's adds its biases)
PROMPTS = [list(PROMPT), list(PROMPT[:5]), [7, 300, 12, 45, 2, 99, 101]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TOKENS = sum(map(len, PROMPTS)) + 3 * 11  # every token a step computes: the prompts, then 11 decode steps of 3
# The dense test's speeds: an expert streams from 4 rows on (checked below), so the prefill step streams and
# decode steps of 3 sequences (at most 3 rows per expert) compute on the CPU.
SPEEDS = MeasuredSpeeds(link_gbps=1, cpu_gbps=100, cpu_flops=1.75e9, device_flops=1e12)
# arch -> bytes the budget falls short of keeping every group on the device: Mixtral's experts leave (one block's
# under "cpu", three with the stream buffers); Qwen2-MoE's every MLP, shared expert and routed experts leave under
# the policies that stream (two blocks' routed experts under "cpu"). GPT-OSS: its biased experts, clamped SwiGLU.
SHORT = {"mixtral": 100_000, "qwen2_moe": 200_000, "gpt_oss": 150_000}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (folder, the all-resident model's greedy tokens, the budget)."""
    root = tmp_path_factory.mktemp("offload-moe")
    out = {}
    for arch, short in SHORT.items():
        folder = moe_models.build(root / arch, arch)
        llm = LLM(str(folder), max_model_len=128, max_num_seqs=3, show_progress=False)
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        finally:
            llm.close()
        out[arch] = folder, tokens, moe_models.group_budget(folder, short)
    return out


@pytest.fixture
def groups(monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    monkeypatch.setenv("LAYERSTREAM_SIM_GBPS", "50")  # fast enough that the test does not wait on it


def test_the_pinned_speeds_decide_by_tokens_per_expert():
    experts = TensorGroup(1, "experts", 8 * EXPERT_BYTES, 8 * EXPERT_PARAMS, HIDDEN_BYTES, experts_total=8,
                          experts_active=TOP_K)
    policy = PathPolicy("auto", SPEEDS)
    assert policy.rows_threshold(experts) == 4  # rows per expert
    assert policy.threshold(experts) == 16  # tokens, spread over 8 experts 2 at a time: 4 x 8 / 2
    # The router's count decides where it is given: a 6-token step whose busiest expert gets 4 rows streams.
    assert policy.path(experts, StepShape(6, tokens_per_expert=4)) == "stream"
    assert policy.path(experts, StepShape(6, tokens_per_expert=3)) == "cpu"
    assert policy.path(experts, StepShape(15)) == "cpu" and policy.path(experts, StepShape(16)) == "stream"


def link_bytes_per_token(off: frozenset) -> int:
    """Bytes one token moves across the link for the off-device groups the CPU computes: an MLP (or shared expert)
    its hidden state both ways; routed experts the normed hidden state, its top-k ids (int64) and weights (fp32)
    there, their sum back (the shared expert's output stays on the device: it is added there, after them)."""
    return sum(2 * HIDDEN_BYTES if kind == "mlp" else 2 * HIDDEN_BYTES + TOP_K * (8 + 4) for _, kind in off)


@pytest.mark.parametrize("policy", ["cpu", "stream", "auto", "auto-live"])
@pytest.mark.parametrize("arch", sorted(SHORT))
def test_tokens_are_the_resident_model_s_for_every_policy(models, groups, arch, policy):
    """auto: speeds pinned (both paths are taken); auto-live: measured at start-up, refreshed as steps run."""
    folder, ref_tokens, budget = models[arch]
    llm = LLM(str(folder), transport="simulated", cpu_offload_policy=policy.removesuffix("-live"), max_model_len=128,
              max_num_seqs=3, max_device_memory=budget, show_progress=False)
    try:
        placed = llm.plan.group_placement
        assert placed is not None and llm.plan.device_bytes <= budget, llm.plan.describe()
        off = placed.off_device
        assert {k for _, k in off} >= {"experts"}, llm.plan.describe()
        if arch == "qwen2_moe" and policy != "cpu":  # shared experts (the sparse blocks' "mlp") off too
            assert {(1, "mlp"), (3, "mlp"), (1, "experts"), (3, "experts")} <= off, llm.plan.describe()
        if policy == "auto":
            llm.engine.set_measured_speeds(SPEEDS)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert tokens == ref_tokens
        t = llm.telemetry()
        stats, total = t.offload, t.total
        assert stats.groups_cpu + stats.groups_stream == len(off) * t.steps
        # What streamed is the off-device groups (every block's on-device groups stay resident): the MLPs whole,
        # of the routed experts only the cache's misses.
        assert total.bytes_streamed == stats.bytes_stream
        expert_bytes = {g.nbytes // g.experts_total for g in placed.off_device_groups if g.kind == "experts"}
        assert expert_bytes == {EXPERT_BYTES + (4 * (64 + 2 * 32) if arch == "gpt_oss" else 0)}
        assert total.expert_bytes == total.expert_misses * expert_bytes.pop()
        if policy == "cpu":
            assert stats.steps_stream == 0 and stats.tokens_cpu == TOKENS and total.expert_bytes == 0
            assert stats.bytes_cpu == TOKENS * link_bytes_per_token(off)
        elif policy == "stream":
            assert stats.steps_cpu == 0 and stats.tokens_stream == TOKENS
            # Only the experts the tokens chose moved, and the device cache served the hot ones without a copy.
            routed = sum(1 for _, k in off if k == "experts")
            assert total.expert_hits > 0 and total.expert_misses > 0
            assert total.expert_bytes < routed * t.steps * 8 * EXPERT_BYTES // 4
        elif policy == "auto":  # the prefill step streamed, decode steps of 3 sequences computed on the CPU
            assert stats.steps_cpu > 0 and stats.steps_stream > 0
        if policy.startswith("auto"):
            assert stats.tokens_cpu + stats.tokens_stream >= TOKENS
    finally:
        llm.close()


def test_a_qwen3_moe_s_dense_block_and_routed_experts_off_the_device(tmp_path, groups):
    """Qwen3-MoE: a dense first block (its MLP a dense group) before renormalised top-k blocks, every group off."""
    folder = moe_models.build(tmp_path / "qwen3_moe", "qwen3_moe")
    ref = LLM(str(folder), max_model_len=128, max_num_seqs=3, show_progress=False, transport="simulated")
    try:
        expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS)]
    finally:
        ref.close()
    llm = LLM(str(folder), transport="simulated", cpu_offload_policy="auto", max_model_len=128, max_num_seqs=3,
              max_device_memory=moe_models.group_budget(folder, 200_000), show_progress=False)
    try:
        off = llm.plan.group_placement.off_device
        assert {(0, "mlp"), (3, "experts")} <= off, llm.plan.describe()
        llm.engine.set_measured_speeds(SPEEDS)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
        stats = llm.telemetry().offload
        assert stats.steps_cpu > 0 and stats.steps_stream > 0
    finally:
        llm.close()
