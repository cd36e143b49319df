"""Tiny GGUF files written with gguf.GGUFWriter from the random transformers checkpoints of
tests/support/models.py, the way llama.cpp's converter writes them (names, llama's Q/K row permutation,
tokenizer and chat template in the metadata), with the 2-D weights in a chosen GGML type.

Types gguf-py can quantize (legacy types, F16, BF16) quantize the model's own weights; for k-quants
(which gguf-py only dequantizes) the blocks are random codes with small scales, so the file is a
different but equally valid model. Either way the reference is transformers loading the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter, quants

from engine import SamplingParams
from engine.demo import build_random_model
from engine.weights.formats.gguf_file import BLOCK_NAMES, GLOBAL_NAMES
from tests.support.models import _COMMON, build, make_config
from tests.support.reference import PROMPT

QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}
_HF_BLOCK = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
             "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
             "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
# Gemma's four block norms, Hugging Face names (its post_attention_layernorm follows attention)
_HF_GEMMA = {"post_attn_norm": "post_attention_layernorm.weight", "mlp_norm": "pre_feedforward_layernorm.weight",
             "post_mlp_norm": "post_feedforward_layernorm.weight"}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, bytes_per_row) of valid GGML blocks: random codes, small finite fp16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    small = lambda lo, hi: rng.uniform(lo, hi, size=(b.shape[0], 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    # Scales so that |w| stays below ~0.1 like a trained model's (code ranges: Q6_K sub-scale
    # 128 x code 32, Q4_K/Q5_K sub-scale 63 x code 15/31).
    if qtype == Q.Q6_K:
        b[:, 208:210] = small(1e-5, 2.5e-5)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        b[:, 0:2], b[:, 2:4] = small(2e-5, 6e-5), small(2e-5, 6e-5)
    else:
        b[:, 0:2] = small(1e-3, 4e-3)
        if qtype in (Q.Q4_1, Q.Q5_1):
            b[:, 2:4] = small(-0.05, -0.01)
    return b.reshape(rows, -1)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotary halves -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(w: GGUFWriter, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[cfg["bos_token"]])
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_pad_token_id(vocab[cfg["pad_token"]])
    w.add_add_bos_token(False)
    template = folder / "chat_template.jinja"  # transformers 5 saves it beside the tokenizer
    chat_template = template.read_text() if template.exists() else cfg.get("chat_template")
    if chat_template:
        w.add_chat_template(chat_template)


def write_gguf(hf_folder: Path, out: Path, qtype: Q = Q.Q8_0, split_max_tensors: int = 0,
               types: dict[str, Q] | None = None) -> Path:
    """Write the checkpoint in hf_folder as a GGUF file; 2-D weights in `qtype` (or types[gguf_name])."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    sd = load_file(str(hf_folder / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: a table per layer type; the file holds the global one
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    gemma = arch.startswith("gemma")
    if gemma:
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(1)
    _add_tokenizer(w, hf_folder)

    hf_block = {**_HF_BLOCK, **(_HF_GEMMA if gemma else {})}
    names = {f"model.layers.{i}.{hf_block[k]}": f"blk.{i}.{v}"
             for i in range(cfg["num_hidden_layers"]) for k, v in BLOCK_NAMES.items() if k in hf_block}
    names.update({"model.embed_tokens.weight": GLOBAL_NAMES["embed"], "model.norm.weight": GLOBAL_NAMES["norm"],
                  "lm_head.weight": GLOBAL_NAMES["lm_head"]})
    for seed, (hf_name, t) in enumerate(sorted(sd.items())):
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        name = names[hf_name]
        data = t.float().numpy()
        if gemma and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        if arch == "llama" and name.endswith("attn_q.weight"):
            data = llama_permute(data, heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            data = llama_permute(data, kv_heads)
        ty = (types or {}).get(name, qtype) if data.ndim == 2 else Q.F32
        if ty == Q.F32:
            w.add_tensor(name, data)
        elif ty in QUANTIZABLE:
            packed = quants.quantize(data, ty)
            w.add_tensor(name, packed, raw_dtype=ty if packed.dtype == np.uint8 else None)
        else:
            w.add_tensor(name, random_blocks(ty, *data.shape, seed=seed), raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split_max_tensors else sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))[0]


def hf_gguf_model(path: Path):
    """transformers' own GGUF loader (dequantizes every tensor to fp32): the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def reference_from_gguf_tensors(path: Path):
    """A faster reference for large vocabularies: transformers' model class and config (read from
    the GGUF metadata by transformers), weights dequantized by gguf-py's numpy reference, llama's
    Q/K rows un-permuted by transformers' own function. It skips only transformers' slow GGUF field
    parser (minutes for SmolLM2's 49k-token vocabulary on a busy machine)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from engine.weights import config_folder
    from engine.weights.formats.gguf_file import GGUFIndex, ggml_type

    cfg = AutoConfig.from_pretrained(config_folder(path))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf_names = {f"blk.{i}.{v}": f"model.layers.{i}.{_HF_BLOCK[k]}"
                for i in range(cfg.num_hidden_layers) for k, v in BLOCK_NAMES.items() if k in _HF_BLOCK}
    hf_names.update({GLOBAL_NAMES["embed"]: "model.embed_tokens.weight", GLOBAL_NAMES["norm"]: "model.norm.weight",
                     GLOBAL_NAMES["lm_head"]: "lm_head.weight"})
    permute = LlamaTensorProcessor(config={"num_attention_heads": cfg.num_attention_heads,
                                           "num_key_value_heads": cfg.num_key_value_heads})
    index = GGUFIndex(path)
    sd = {}
    try:
        for name, t in index.entries.items():
            rows = index.raw(name).numpy().reshape(*t.shape[:-1], -1)  # (rows..., bytes per row)
            w = quants.dequantize(rows, ggml_type(t)).reshape(t.shape)
            if index.architecture == "llama":
                w = permute.process(w, name).weights
            # A copy: F32 tensors come back as views of the mapping, which close() unmaps.
            sd[hf_names[name]] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    finally:
        index.close()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def tiny_gguf(root, arch: str, qtype: Q):
    """A tiny random model of `arch` as GGUF. K-quant rows are 256-weight super-blocks, so those
    models are wider (hidden 256, MLP 512) and shallower (4 blocks); so are the Qwen3 ones, whose
    head_dim transformers' GGUF loader does not read (it assumes Qwen3's 128)."""
    wide = qtype in K_QUANTS or arch == "qwen3"
    folder = root / (f"{arch}-wide" if wide else arch)
    if not folder.exists():
        if wide:
            base = make_config(arch)
            heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128) if arch == "qwen3" else {}
            cfg = type(base)(**{**_COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                                **heads}, tie_word_embeddings=base.tie_word_embeddings,
                             architectures=base.architectures)
            build_random_model(folder, cfg, seed=7)
        else:
            build(folder, arch)
    path = root / f"{folder.name}-{qtype.name}.gguf"
    return path if path.exists() else write_gguf(folder, path, qtype)


def tiny_moe_gguf(root) -> Path:
    """A mixture of experts as llama.cpp's converter writes it (Q8_0: the int8 kernels' type): DeepSeek-V3's tiny one
    (tests/support/families.py), a dense first block, then blocks of 8 routed experts (2 a token, stacked per block
    in ffn_*_exps) and a shared one. Skips where the converter is not unpacked (tests/support/llama_cpp_convert.py)."""
    import pytest

    from tests.support.families import build as build_family
    from tests.support.llama_cpp_convert import convert, llama_cpp_root

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    path = Path(root) / "tiny-deepseek_v3-q8.gguf"
    return path if path.exists() else convert(build_family(Path(root) / "deepseek_v3-hf", "deepseek_v3"), path, "q8_0")


SHORT = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)


def greedy_tokens(llm, n=12):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT, PROMPT[3:]], params)]


def experts_to_mxfp4(src: Path, dst: Path) -> Path:
    """A copy of GGUF file src with its expert weights (blk.*.ffn_{gate,up,down}_exps.weight) stored as MXFP4
    (gguf-py's quantizer), every other tensor and every metadata key as they were: the file llama.cpp's converter
    writes from GPT-OSS's released MXFP4 checkpoint, made from a tiny one."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(src)
    w = GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")):
            w.add_tensor(t.name, quants.quantize(data.astype(np.float32), Q.MXFP4), raw_dtype=Q.MXFP4)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type if t.tensor_type not in (Q.F32, Q.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def with_kv_b_unsplit(src: Path, dst: Path) -> Path:
    """A deepseek2 file from llama.cpp's converter rewritten as the converter wrote them before it split kv_b:
    one attn_kv_b per block (each head's K rows, then its V rows, as Hugging Face's kv_b_proj), the per-head
    widths as key_length / value_length and no *_mla keys. Plain (F32/F16) tensors only."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    renamed = {f"{arch}.attention.key_length": f"{arch}.attention.key_length_mla",
               f"{arch}.attention.value_length": f"{arch}.attention.value_length_mla"}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.endswith("_mla"):
            continue
        value = r.fields[renamed[name]].contents() if name in renamed else f.contents()
        kind = f.types[0]
        w.add_key_value(name, value, kind, sub_type=f.types[-1] if kind == GGUFValueType.ARRAY else None)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if t.name.endswith("attn_v_b.weight"):
            continue
        if t.name.endswith("attn_k_b.weight"):
            k_b = torch.from_numpy(np.array(t.data))  # (heads, kv_lora_rank, qk_nope)
            v_b = torch.from_numpy(np.array(tensors[t.name.replace("attn_k_b", "attn_v_b")].data))  # (heads, v, rank)
            kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])  # (heads * (nope + v), rank)
            w.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), kv_b.numpy().copy())
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
