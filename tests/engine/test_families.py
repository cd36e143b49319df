"""Every family beyond Llama's block against transformers in fp32, on tiny random checkpoints made with
transformers' own config classes (norms and biases perturbed): prompt logits, greedy tokens identical and
the chosen tokens' logprobs within 1e-3, with every block resident, with most blocks streamed, and with
the streamed blocks read from disk each step. Prompts run past every sliding window.

A family joins by a row in tests/support/families.py (docs/usage/adding-a-family.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.arch import ModelConfig, load_model_config
from engine.demo import build_random_model
from engine.errors import UnsupportedModelError
from tests.support.families import (COMMON, FAMILY_ARCHS, LONGROPE_AFTER, WINDOW, build, build_gpt_oss_for_gguf,
                                    sharpen_attention)
from tests.support.reference import budget_for
from tests.support.reference import ATOL, RTOL, prompt_logits, stream_all_but_one_budget

PROMPT = [5, 17, 99, 3, 250, 42, 7, 311, 128, 64, 9, 400, 77, 23]
NEW_TOKENS = 24
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: build(root / arch, arch) for arch in FAMILY_ARCHS}


@pytest.fixture(scope="module")
def references(family_dirs):
    """arch -> (greedy tokens, prompt logits (prompt, vocab), chosen-token logprobs) from transformers, fp32."""
    out = {}
    for arch, folder in family_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = list(PROMPT)
        with torch.no_grad():
            prompt = model(torch.tensor([PROMPT])).logits[0]
            # A plain greedy loop without a cache: each token from the whole sequence, as generate() without
            # its EOS handling (the engine side runs with ignore_eos).
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            full = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        tokens = ids[len(PROMPT):]
        logprobs = [float(full[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]
        out[arch] = tokens, prompt, logprobs
    return out


LIMITS = dict(max_model_len=128, max_num_seqs=2)


def _engine_kwargs(folder, mode: str) -> dict:
    if mode == "resident":
        return {}
    # A mixture of experts (GPT-OSS) streams whole blocks here, its experts inside them; streaming each expert
    # by itself is tests/weights/test_moe.py's.
    whole = {"expert_streaming": False} if load_model_config(folder).moe is not None else {}
    if mode == "streamed":  # one block resident, the rest streamed through memory
        llm = LLM(str(folder), **LIMITS)
        llm.close()
        return {"max_device_memory": stream_all_but_one_budget(llm), **whole}
    if mode == "disk":  # every streamed block read from the file each step
        return {"max_device_memory": budget_for(folder, 1, 1, **LIMITS), "transport": "disk", **whole}
    raise ValueError(mode)


@pytest.mark.parametrize("mode", ["resident", "streamed", "disk"])
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_matches_transformers(family_dirs, references, arch, mode):
    folder = family_dirs[arch]
    ref_tokens, ref_prompt_logits, ref_logprobs = references[arch]
    llm = LLM(str(folder), **LIMITS, **_engine_kwargs(folder, mode))
    try:
        plan = llm.plan
        if mode != "resident":
            assert len(plan.streamed_blocks) >= llm.engine.model.cfg.num_layers - 1, plan.describe()
        if mode == "disk":
            assert plan.disk_blocks == plan.streamed_blocks
        # The engine scores each prefix by itself: LongRoPE rotates one no longer than its original context
        # by the short table, where the reference's one pass over the whole prompt took the long one.
        first = LONGROPE_AFTER if llm.engine.model.cfg.rope_long_inv_freq else 0
        torch.testing.assert_close(prompt_logits(llm, PROMPT)[first:], ref_prompt_logits[first:], atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        out = llm.generate([PROMPT], params)[0].outputs[0]
        assert out.token_ids == ref_tokens
        got = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, ref_logprobs)) < LOGPROB_TOL, (got, ref_logprobs)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_family_batched_with_a_shorter_prompt(family_dirs, references, arch):
    """Continuous batching: beside a shorter prompt (its decode steps padded into the longer one's chunk
    and the reverse), the long prompt's greedy tokens are the reference's, the short one's its own alone."""
    llm = LLM(str(family_dirs[arch]), **LIMITS)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        short = PROMPT[3:8]
        alone = llm.generate([short], params)[0].outputs[0].token_ids
        both = [r.outputs[0].token_ids for r in llm.generate([PROMPT, short], params)]
        assert both == [references[arch][0], alone]
    finally:
        llm.close()


def test_longrope_switches_tables_as_a_sequence_grows_past_the_original_context(family_dirs):
    """A prompt shorter than the original context whose generation runs past it: transformers with its KV cache
    rotates each forward pass by the table its length picks (the cached keys keep theirs); so does the engine,
    batched beside a prompt already past it, tokens identical and logprobs within 1e-3."""
    folder = family_dirs["phi4mini"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    short = PROMPT[:5]
    assert len(short) < LONGROPE_AFTER < len(PROMPT)
    want = {}
    for prompt in (short, PROMPT):
        ids, lps, past = list(prompt), [], None
        with torch.no_grad():
            feed = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                out = model(feed, past_key_values=past, use_cache=True)
                past, logp = out.past_key_values, torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                ids.append(int(logp.argmax()))
                lps.append(float(logp[ids[-1]]))
                feed = torch.tensor([[ids[-1]]])
        want[tuple(prompt)] = ids[len(prompt):], lps
    llm = LLM(str(folder), **LIMITS)
    try:
        cfg = llm.engine.model.cfg
        assert cfg.rope_long_after == LONGROPE_AFTER and cfg.rope_long_inv_freq != cfg.rope_inv_freq
        assert not llm.engine.scheduler.blocks.enable_prefix_caching  # cached K of one table must not serve the other
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        for prompt, out in zip((short, PROMPT), llm.generate([short, PROMPT], params)):
            tokens, lps = want[tuple(prompt)]
            assert out.outputs[0].token_ids == tokens
            assert max(abs(a.logprob - b) for a, b in zip(out.outputs[0].logprobs, lps)) < LOGPROB_TOL
    finally:
        llm.close()


def test_gemma3_layers_see_only_their_window(family_dirs):
    """The config the engine reads: which blocks slide, which RoPE table each uses, the family's numbers."""
    from engine.arch import load_model_config

    cfg = load_model_config(family_dirs["gemma3"])
    kinds = [cfg.layer_attention(i) for i in range(cfg.num_layers)]
    assert [k.window for k in kinds] == [WINDOW, WINDOW, None] * 2
    assert [k.rope for k in kinds] == ["local", "local", "global"] * 2
    assert cfg.attn_scale == pytest.approx(24 ** -0.5) and cfg.embed_scale == pytest.approx(8.0)
    assert cfg.norm_offset == 1.0 and cfg.family.activation == "gelu_tanh"


def test_gpt_oss_config_and_what_moves_its_reference(family_dirs):
    """GPT-OSS as the engine reads it (alternating windows, YaRN's table and scale, biases, sinks, the experts' and
    router's rows), and every feature the tiny checkpoint's transformers logits depend on by far more than the
    tolerance, so that the exact tests above hold the engine to each: attention sinks, the SwiGLU clamp and its
    alpha, the router's and the experts' biases, the sliding window."""
    import math

    from engine.arch import load_model_config

    folder = family_dirs["gpt_oss"]
    cfg = load_model_config(folder)
    assert [cfg.layer_attention(i).window for i in range(cfg.num_layers)] == [WINDOW, None] * 3
    assert cfg.rope_attention_scaling == pytest.approx(0.1 * math.log(32.0) + 1.0)  # YaRN's attention factor
    assert cfg.qkv_bias and cfg.o_bias and cfg.family.attn_sinks and cfg.family.router == "topk_softmax"
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.expert_mlp, m.swiglu_limit) == (4, 2, "clamped_swiglu", 0.15)
    assert m.sparse_layers == tuple(range(cfg.num_layers)) and m.swiglu_alpha == pytest.approx(1.702)

    def logits(edit=None) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            for layer in model.model.layers if edit else ():
                edit(model, layer)
            return model(torch.tensor([PROMPT])).logits[0]

    base = logits()
    edits = {
        "sinks": lambda _m, layer: layer.self_attn.sinks.fill_(float("-inf")),  # exp(-inf) = 0: no sink
        "swiglu_limit": lambda _m, layer: setattr(layer.mlp.experts, "limit", float("inf")),
        "swiglu_alpha": lambda _m, layer: setattr(layer.mlp.experts, "alpha", 1.0),
        "router_bias": lambda _m, layer: layer.mlp.router.bias.zero_(),
        "expert_biases": lambda _m, layer: (layer.mlp.experts.gate_up_proj_bias.zero_(),
                                            layer.mlp.experts.down_proj_bias.zero_()),
        "window": lambda model, _l: setattr(model.config, "layer_types", ["full_attention"] * cfg.num_layers),
    }
    for name, edit in edits.items():
        assert (logits(edit) - base).abs().max() > 10 * ATOL, name


def test_gpt_oss_keeps_its_sinks_in_bf16(family_dirs):
    """bf16 on the CPU: the paths a 16-bit step may take (the token-by-token C++ decode attention, the bf16 matmul
    attention, the fused block) have no sink term, so GPT-OSS's attention stays on the eager path. The logprobs of
    the tokens the engine chose, prefill and decode steps, are off transformers' fp32 ones on that same sequence by
    a small share of what dropping the sinks moves them (held to the engine's own sequence: bf16 may pick another
    token where two are close)."""
    folder = family_dirs["gpt_oss"]
    llm = LLM(str(folder), dtype="bfloat16", **LIMITS)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        out = llm.generate([PROMPT], params)[0].outputs[0]
    finally:
        llm.close()
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def chosen_logprobs() -> torch.Tensor:
        with torch.no_grad():
            full = torch.log_softmax(model(torch.tensor([PROMPT + out.token_ids])).logits[0], dim=-1)
        rows = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(out.token_ids))
        return full[rows, torch.tensor(out.token_ids)]  # (new tokens,)

    want = chosen_logprobs()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    gap = (chosen_logprobs() - want).abs().max()
    assert (got - want).abs().max() < 0.25 * gap, ((got - want).abs().max(), gap)


def test_gpt_oss_mxfp4_safetensors_are_a_clear_error(family_dirs, tmp_path):
    """The released GPT-OSS checkpoints keep their experts as MXFP4 blocks and scales: refused by name, with the
    way out, before any tensor is read."""
    import json

    from engine.arch import load_model_config

    cfg = json.loads((family_dirs["gpt_oss"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"MXFP4 experts .*'mxfp4'.* dequantize them to bf16"):
        load_model_config(tmp_path)


def test_unsupported_architecture_names_it_and_lists_the_supported(tmp_path):
    import json

    from engine.arch import SUPPORTED_ARCHITECTURES, load_model_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(UnsupportedModelError) as e:
        load_model_config(tmp_path)
    assert "FalconForCausalLM" in str(e.value)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "su"}])
def test_unimplemented_rope_type_is_a_clear_error(rope):
    from transformers import LlamaConfig

    from engine.arch import config_from_hf

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                     vocab_size=512)
    hf.rope_parameters = {"rope_theta": 10000.0, **rope}  # set after: the config class would validate it
    with pytest.raises(UnsupportedModelError, match=f"rope type '{rope['rope_type']}' is not supported"):
        config_from_hf(hf, "LlamaForCausalLM", torch.float32)


def test_family_table_has_no_unknown_norms():
    """A ModelConfig of any family asks its checkpoint for exactly the family's norms."""
    from engine.arch import FAMILIES

    for arch, fam in FAMILIES.items():
        cfg = ModelConfig(architecture=arch, vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=8,
                          tie_word_embeddings=True, qkv_bias=False, qk_norm=False, checkpoint_dtype=torch.float32)
        assert {n for n in cfg.block_shapes() if n.endswith("norm")} == set(fam.norms), arch


# -- GGUF: the same families written the way llama.cpp's converter writes them ------------------------

GGUF_FAMILIES = ["gemma3", "gemma2"]


def gguf_source_config(arch: str):
    """A checkpoint whose GGUF transformers' reader sees as it is: head_dim 256 (the file has no
    query_pre_attn_scalar; transformers assumes 256, llama.cpp uses head_dim), the layer pattern and RoPE
    tables llama.cpp assumes (Gemma 3: 5 local : 1 global, local base 10k), Gemma 2's usual soft-caps."""
    from transformers import Gemma2Config, Gemma3TextConfig

    common = {**COMMON, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": WINDOW}
    if arch == "gemma3":
        return Gemma3TextConfig(**common, architectures=["Gemma3ForCausalLM"])
    return Gemma2Config(**common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        architectures=["Gemma2ForCausalLM"])


@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_gemma_gguf_matches_transformers(tmp_path, arch, streaming):
    """Names, the stored 1 + w norms, the window and Gemma's scales from a GGUF file (Q8_0 blocks), against
    transformers' own GGUF loader, in fp32."""
    from gguf import GGMLQuantizationType as Q

    from tests.support.gguf_models import hf_gguf_model, write_gguf
    from tests.support.reference import greedy_with

    folder = build_random_model(tmp_path / "hf", gguf_source_config(arch), seed=7, adjust=sharpen_attention)
    path = write_gguf(folder, tmp_path / f"tiny-{arch}.gguf", Q.Q8_0)
    ref_tokens, ref_logits = greedy_with(hf_gguf_model(path), PROMPT, 16)
    kwargs = dict(dtype="float32", **LIMITS)
    if streaming:
        llm = LLM(str(path), **kwargs)
        llm.close()
        kwargs["max_device_memory"] = stream_all_but_one_budget(llm)
    llm = LLM(str(path), **kwargs)
    try:
        assert llm.engine.model.cfg.norm_offset == 0.0  # the file holds 1 + w
        if streaming:
            assert len(llm.plan.streamed_blocks) == llm.engine.model.cfg.num_layers - 1
        torch.testing.assert_close(prompt_logits(llm, PROMPT), ref_logits, atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
    finally:
        llm.close()


# -- GGUF from llama.cpp's own converter ------------------------------------------------------------

def converter_source(folder, arch: str):
    """The tiny checkpoint of `arch` as llama.cpp can represent it: SmolLM3 with llama.cpp's fixed NoPE layers
    (every 4th) and no window; GPT-OSS with llama.cpp's SwiGLU limit; every other family as its test row."""
    if arch == "gpt_oss":
        return build_gpt_oss_for_gguf(folder)
    if arch != "smollm3":
        return build(folder, arch)
    from transformers import SmolLM3Config

    cfg = SmolLM3Config(**COMMON, no_rope_layer_interval=4, architectures=["SmolLM3ForCausalLM"])
    return build_random_model(folder, cfg, seed=11, adjust=sharpen_attention)


@pytest.mark.parametrize("arch", ["phi3", "phi4mini", "olmo2", "granite", "smollm3", "glm4", "gpt_oss",
                                  "deepseek_v3", "deepseek_v2"])
def test_gguf_from_llama_cpp_converter_matches_transformers(tmp_path, arch):
    """llama.cpp's convert_hf_to_gguf.py of each tiny family (F32: the same weights), served from the file: its
    tensor names (Phi-3's stacked qkv and gate/up, GPT-OSS's stacked experts with gate and up split, DeepSeek's kv_b
    split in two and experts stacked), Q/K rows it permutes (Granite, SmolLM3), the config from its metadata
    (Granite's multipliers, GLM-4's rotary dims, Phi-3's window and LongRoPE factor tensors, GPT-OSS's experts,
    window and YaRN, DeepSeek's latent shapes, router and YaRN mscale, which transformers' GGUF reader does not
    read or does not know), held to transformers on the original checkpoint."""
    from engine.arch import load_model_config
    from tests.support.llama_cpp_convert import convert, llama_cpp_root
    from tests.support.reference import greedy_with

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    folder = converter_source(tmp_path / "hf", arch)
    path = convert(folder, tmp_path / f"tiny-{arch}.gguf", "f32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref_tokens, ref_logits = greedy_with(model, PROMPT, 16)
    llm = LLM(str(path), dtype="float32", **LIMITS)
    try:
        cfg, want = llm.engine.model.cfg, load_model_config(folder)
        for field in ("architecture", "sliding_window", "rope_long_after", "nope_layers", "head_dim", "o_bias",
                      "qkv_bias", "tie_word_embeddings"):
            assert getattr(cfg, field) == getattr(want, field), field
        for field in ("attn_scale", "embed_scale", "residual_scale", "logits_divisor"):
            got, wanted = getattr(cfg, field), getattr(want, field)
            assert got == (None if wanted is None else pytest.approx(wanted, rel=1e-6)), field
        for field in ("rope_inv_freq", "rope_long_inv_freq"):
            torch.testing.assert_close(torch.tensor(getattr(cfg, field)), torch.tensor(getattr(want, field)))
        assert cfg.rope_attention_scaling == pytest.approx(want.rope_attention_scaling, rel=1e-6)
        if cfg.mla is not None:  # the file's split kv_b, its router and latent shapes
            assert cfg.mla.kv_b_split and dataclasses.replace(cfg.mla, kv_b_split=False) == want.mla
            assert dataclasses.replace(cfg.moe, routed_scaling_factor=want.moe.routed_scaling_factor) == want.moe
            assert cfg.moe.routed_scaling_factor == pytest.approx(want.moe.routed_scaling_factor, rel=1e-6)
        elif want.moe is not None:  # GPT-OSS: the file holds gate and up apart, (out, in)
            assert cfg.moe == dataclasses.replace(want.moe, gate_up_interleaved=False), cfg.moe
            assert cfg.layer_windows == want.layer_windows and cfg.family == want.family
        first = LONGROPE_AFTER if cfg.rope_long_inv_freq else 0  # as in test_family_matches_transformers
        torch.testing.assert_close(prompt_logits(llm, PROMPT)[first:], ref_logits[first:], atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
    finally:
        llm.close()


@pytest.mark.parametrize("transport", ["auto", "disk"])
def test_gpt_oss_gguf_experts_stream_one_by_one(tmp_path_factory, transport):
    """A GPT-OSS GGUF from llama.cpp's converter (F32) under a budget that streams its experts: each expert's slice
    of the stacked *_exps tensors is read by itself (from the page cache, or by byte range off the disk) into a
    cache of a few slots, and the outputs stay transformers'."""
    from tests.support.llama_cpp_convert import convert, llama_cpp_root
    from tests.support.moe_models import expert_budget
    from tests.support.reference import greedy_with

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    root = tmp_path_factory.getbasetemp() / "gpt-oss-gguf-f32"
    path = root / "tiny-gpt-oss.gguf"
    if not path.exists():
        convert(build_gpt_oss_for_gguf(root / "hf"), path, "f32")
    budget = expert_budget(path, slots=5, max_num_seqs=LIMITS["max_num_seqs"], dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    ref_tokens, ref_logits = greedy_with(model, PROMPT, 16)
    llm = LLM(str(path), dtype="float32", max_device_memory=budget, transport=transport, **LIMITS)
    try:
        cfg = llm.engine.model.cfg
        assert llm.plan.expert_streaming and llm.plan.expert_slots < cfg.moe.num_experts * cfg.num_layers
        torch.testing.assert_close(prompt_logits(llm, PROMPT), ref_logits, atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
        assert llm.telemetry().total.expert_misses > cfg.moe.num_experts  # experts were evicted and read again
    finally:
        llm.close()


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """(checkpoint, GGUF file) of GPT-OSS with MXFP4 experts, as llama.cpp's converter writes the released
    checkpoint: a tiny checkpoint whose experts lie on MXFP4's grid, converted, its expert tensors then stored as
    MXFP4 blocks (gguf-py's quantizer)."""
    from gguf import GGMLQuantizationType as Q, GGUFReader

    from tests.support.gguf_models import experts_to_mxfp4
    from tests.support.llama_cpp_convert import convert, llama_cpp_root

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    folder = build_gpt_oss_for_gguf(root / "hf", mxfp4=True)
    path = experts_to_mxfp4(convert(folder, root / "tiny-gpt-oss-f32.gguf", "f32"), root / "tiny-mxfp4.gguf")
    stored = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert stored["blk.0.ffn_gate_exps.weight"] == stored["blk.5.ffn_down_exps.weight"] == Q.MXFP4
    return folder, path


def _mxfp4_llm(path, dtype: str, streaming: bool) -> LLM:
    kwargs = dict(dtype=dtype, **LIMITS)
    if streaming:
        llm = LLM(str(path), **kwargs)
        llm.close()
        kwargs["max_device_memory"] = stream_all_but_one_budget(llm)
    llm = LLM(str(path), **kwargs)
    if streaming:
        assert len(llm.plan.streamed_blocks) == llm.engine.model.cfg.num_layers - 1
    return llm


@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streamed"])
def test_gpt_oss_mxfp4_gguf_matches_transformers(gpt_oss_mxfp4, streaming):
    """GGUF MXFP4 experts served in fp32 (each MXFP4 tensor dequantized exactly: at load when resident, per use
    when streamed, experts inside their blocks), held to transformers on the checkpoint they were made from."""
    from tests.support.reference import greedy_with

    folder, path = gpt_oss_mxfp4
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref_tokens, ref_logits = greedy_with(model, PROMPT, 16)
    llm = _mxfp4_llm(path, "float32", streaming)
    try:
        torch.testing.assert_close(prompt_logits(llm, PROMPT), ref_logits, atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
    finally:
        llm.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["resident", "streamed"])
def test_gpt_oss_mxfp4_gguf_in_the_fast_mode(gpt_oss_mxfp4, streaming):
    """bf16: no kernel takes MXFP4 (nor the C++ repack), so resident experts are requantized to int8 by the torch
    code at load and streamed ones dequantized at each use; the prompt logits stay within bf16's and int8's
    error of the exact mode's."""
    _folder, path = gpt_oss_mxfp4
    exact = _mxfp4_llm(path, "float32", False)
    try:
        want = prompt_logits(exact, PROMPT)
    finally:
        exact.close()
    llm = _mxfp4_llm(path, "bfloat16", streaming)
    try:
        got = prompt_logits(llm, PROMPT).float()
        assert (got - want).abs().max() < 0.05 * want.abs().max()
    finally:
        llm.close()


@pytest.mark.parametrize("kv_dtype,share", [("int8", 0.02), ("int4", 0.25)])
def test_gpt_oss_sinks_over_a_quantized_kv_cache(tmp_path_factory, kv_dtype, share):
    """A quantized KV cache is refused beside sliding-window layers (test_kv_groups); a GPT-OSS whose layers are all
    full takes one, and its attention keeps the sinks there too (the eager path over the dequantized cache; the
    kv_attention kernel has no sink term): prompt logits off transformers' by a small share of what dropping the
    sinks moves them, and the same greedy tokens."""
    from transformers import GptOssConfig

    from tests.support.families import gpt_oss_settings, sharpen_gpt_oss
    from tests.support.reference import greedy_with

    folder = tmp_path_factory.getbasetemp() / "gpt-oss-full-attention"
    if not (folder / "config.json").exists():
        cfg = GptOssConfig(**gpt_oss_settings(), num_local_experts=4, num_experts_per_tok=2,
                           layer_types=["full_attention"] * COMMON["num_hidden_layers"])
        build_random_model(folder, cfg, seed=5, adjust=sharpen_gpt_oss)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref_tokens, ref_logits = greedy_with(model, PROMPT, 12)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        without_sinks = model(torch.tensor([PROMPT])).logits[0]
    llm = LLM(str(folder), kv_cache_dtype=kv_dtype, **LIMITS)
    try:
        err = (prompt_logits(llm, PROMPT) - ref_logits).abs().max()
        assert err < share * (without_sinks - ref_logits).abs().max(), err
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
    finally:
        llm.close()


# -- DeepSeek-V2/V3: multi-head latent attention and DeepSeek's router ---------------------------------

@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_caches_the_latent_and_reads_its_config(family_dirs, arch):
    """The plan counts per token and layer the latent and the rotary key (kv_lora_rank + qk_rope_head_dim
    values, one cached head), not heads x (qk_head_dim + v_head_dim); the softmax scale (YaRN's mscale folded
    in), the rotary table's attention factor and the router's numbers are transformers'."""
    folder = family_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = model.config
    llm = LLM(str(folder), **LIMITS)
    try:
        cfg, plan = llm.engine.model.cfg, llm.plan
        latent = hf.kv_lora_rank + hf.qk_rope_head_dim
        assert cfg.kv_cache_dims == (1, latent, 0)
        ((per_token, window),) = plan.kv_groups
        assert per_token == hf.num_hidden_layers * latent * 4 and window is None  # fp32
        full = hf.num_hidden_layers * hf.num_attention_heads * (hf.qk_nope_head_dim + hf.qk_rope_head_dim
                                                                  + hf.v_head_dim) * 4
        assert per_token * 3 < full  # 40 values a layer against 4 heads x 36
        assert plan.kv_cache_bytes == plan.num_kv_blocks * plan.kv_block_size * per_token
        assert f"{latent} values per layer" in plan.describe()
        attn = model.model.layers[0].self_attn
        assert cfg.attn_scale == pytest.approx(attn.scaling, rel=1e-12) and attn.scaling != attn.qk_head_dim ** -0.5
        assert cfg.rope_attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling, rel=1e-6)
        assert (cfg.mla.q_lora_rank, cfg.mla.v_head_dim) == (hf.q_lora_rank, hf.v_head_dim)
        m = cfg.moe
        assert m.sparse_layers == tuple(range(1, hf.num_hidden_layers))  # first_k_dense_replace=1
        assert (m.num_experts, m.top_k, m.n_group, m.topk_group) == ((8, 2, 4, 2) if arch == "deepseek_v3"
                                                                     else (8, 3, 2, 1))
        assert m.routed_scaling_factor == hf.routed_scaling_factor != 1.0
        assert m.shared_mlp_intermediate_size == hf.moe_intermediate_size * hf.n_shared_experts
        v3 = arch == "deepseek_v3"
        assert (m.scoring, m.topk_method, m.norm_topk_prob) == (("sigmoid", "noaux_tc", True) if v3
                                                                else ("softmax", "group_limited_greedy", False))
        assert ("router_bias" in cfg.block_shapes(1)) == v3 and "router" not in cfg.block_shapes(0)
    finally:
        llm.close()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_deepseek_quantized_latent_cache_is_a_clear_error(family_dirs, kv_dtype):
    with pytest.raises(UnsupportedModelError, match=rf"--kv-cache-dtype {kv_dtype} is not supported for multi-head "
                                                    r"latent attention \(DeepseekV3ForCausalLM.*--kv-cache-dtype auto"):
        LLM(str(family_dirs["deepseek_v3"]), kv_cache_dtype=kv_dtype, **LIMITS)


def test_deepseek_router_settings_it_does_not_implement_name_themselves():
    from engine.arch import config_from_hf
    from tests.support.families import deepseek_config

    hf = deepseek_config("deepseek_v2")
    hf.norm_topk_prob = True  # DeepSeek's V2 code renormalises, transformers' V2 router does not
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob=True"):
        config_from_hf(hf, "DeepseekV2ForCausalLM", torch.float32)
    hf = deepseek_config("deepseek_v2")
    hf.topk_method = "noaux_tc"
    with pytest.raises(UnsupportedModelError, match="topk_method 'noaux_tc'"):
        config_from_hf(hf, "DeepseekV2ForCausalLM", torch.float32)
    hf = deepseek_config("deepseek_v2")
    hf.n_group = 3  # 8 experts do not split into 3 groups
    with pytest.raises(UnsupportedModelError, match="n_group 3"):
        config_from_hf(hf, "DeepseekV2ForCausalLM", torch.float32)


def test_deepseek_q8_gguf_streams_as_it_runs_resident(tmp_path):
    """A Q8_0 deepseek2 file from llama.cpp's converter in bf16: the split kv_b's per-head stacks (attn_v_b is
    Q8_0) unpacked to the compute dtype, the 2-D weights packed, the stacked experts sliced; streamed (one block
    resident, blocks read whole) exactly as resident, and near transformers (Q8_0's rounding)."""
    from tests.support.llama_cpp_convert import convert, llama_cpp_root
    from tests.support.reference import greedy_with

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    folder = build(tmp_path / "hf", "deepseek_v3")
    path = convert(folder, tmp_path / "tiny-deepseek_v3-q8.gguf", "q8_0")
    _, ref_logits = greedy_with(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), PROMPT, 0)
    kwargs = dict(dtype="bfloat16", **LIMITS)
    resident = LLM(str(path), **kwargs)
    streamed = LLM(str(path), max_device_memory=budget_for(path, 1, 1, dtype="bfloat16", **LIMITS),
                   expert_streaming=False, **kwargs)
    try:
        assert len(streamed.plan.streamed_blocks) == streamed.engine.model.cfg.num_layers - 1
        logits = prompt_logits(resident, PROMPT)
        torch.testing.assert_close(prompt_logits(streamed, PROMPT), logits, atol=0, rtol=0)
        assert (logits.float() - ref_logits).abs().max() < 0.05
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert (streamed.generate([PROMPT], params)[0].outputs[0].token_ids
                == resident.generate([PROMPT], params)[0].outputs[0].token_ids)
    finally:
        resident.close()
        streamed.close()


def test_deepseek_gguf_with_kv_b_whole_matches_transformers(tmp_path):
    """A deepseek2 file as llama.cpp's converter wrote them before splitting kv_b (attn_kv_b whole, the per-head
    widths in key_length / value_length) reads as the split one does and matches transformers."""
    from tests.support.gguf_models import with_kv_b_unsplit
    from tests.support.llama_cpp_convert import convert, llama_cpp_root
    from tests.support.reference import greedy_with

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    folder = build(tmp_path / "hf", "deepseek_v3")
    path = with_kv_b_unsplit(convert(folder, tmp_path / "split.gguf", "f32"), tmp_path / "tiny-deepseek-kv-b.gguf")
    ref_tokens, ref_logits = greedy_with(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                                         PROMPT, 8)
    llm = LLM(str(path), dtype="float32", **LIMITS)
    try:
        cfg, want = llm.engine.model.cfg, load_model_config(folder)
        assert not cfg.mla.kv_b_split and dataclasses.replace(cfg.mla, rope_interleaved=True) == want.mla
        torch.testing.assert_close(prompt_logits(llm, PROMPT), ref_logits, atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
    finally:
        llm.close()


def test_deepseek_v3_rotating_halves_matches_transformers(tmp_path):
    """DeepSeek-V3 with rope_interleave=False: its rotary dims rotate as halves (rotate_half), not pairs."""
    from tests.support.families import deepseek_config, sharpen_deepseek
    from tests.support.reference import greedy_with

    cfg = deepseek_config("deepseek_v3")
    cfg.rope_interleave = False
    folder = build_random_model(tmp_path / "hf", cfg, seed=5, adjust=sharpen_deepseek)
    ref_tokens, ref_logits = greedy_with(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                                         PROMPT, 8)
    llm = LLM(str(folder), **LIMITS)
    try:
        assert not llm.engine.model.cfg.mla.rope_interleaved
        torch.testing.assert_close(prompt_logits(llm, PROMPT), ref_logits, atol=ATOL, rtol=RTOL)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == ref_tokens
    finally:
        llm.close()
