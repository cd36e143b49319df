"""A GGUF file as a layerstream checkpoint: config, tensor names, and the compute form of each weight.

- Config, tokenizer and chat template come from the file's metadata through transformers
  (`AutoConfig` / `AutoTokenizer.from_pretrained(folder, gguf_file=...)`).
- llama.cpp's converter names tensors `blk.{i}.attn_q.weight` ... and, for the llama architecture,
  permutes the rows of Q and K (rotary pairs interleaved instead of split in halves). Rows of a
  GGML tensor are independent runs of blocks, so the permutation is undone on the packed rows.
- `PackedFormat` decides what a weight becomes for compute:
    exact (float32): dense fp32, dequantized bit-exactly (once at load for resident blocks,
                     at each use for streamed ones) - the reference mode;
    fast (bf16/fp16): Q4_0/Q4_1/Q4_K repacked for aten's int4 kernel (codes kept), other quantized
                     types requantized at load to per-row int8 for aten's int8 kernel; streamed
                     blocks keep their GGML bytes and are dequantized to the compute dtype on use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from ..arch import ModelConfig, UnsupportedModelError, config_from_hf
from ..errors import CheckpointError
from .dequant import dequantize
from .gguf_file import FLOAT_TYPES, GGUFIndex, GGUFTensor
from .packed import INT4_TYPES, GGUFWeight, Int4Weight, Int8Weight

log = logging.getLogger("layerstream")

# transformers' model_type for the file -> the architecture the engine runs
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
# GGUF architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel and its subclasses)
PERMUTED_ARCHITECTURES = {"llama", "mistral"}

BLOCK_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
}
GLOBAL_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def metadata_folder(path: Path) -> Path:
    """A folder with the transformers config and tokenizer that the GGUF metadata describes.

    transformers reads them with gguf-py's GGUFReader, which takes seconds for a real vocabulary
    (40-130 s for SmolLM2 on a busy 2-core machine), twice (config, tokenizer). So the first load
    saves them under the layerstream cache, keyed by a hash of the file's header (metadata and
    tensor table: the same file anywhere hits the same entry), and later loads read that folder.
    Nothing is written beside the model file.
    """
    import os

    from ..demo import cache_root
    from .gguf_file import GGUFFile

    first = GGUFFile(path)
    try:
        header = first.header_sha256()[:20]
    finally:
        first.close()
    folder = cache_root() / "gguf-metadata" / f"{path.stem}-{header}"
    if (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    from transformers import AutoConfig, AutoTokenizer

    log.info("%s: reading config and tokenizer from the GGUF metadata (once; cached in %s)", path, folder)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another process saved the same entry first
    return folder


def load_gguf_config(index: GGUFIndex) -> ModelConfig:
    arch = index.architecture
    if arch not in MODEL_TYPES:
        raise UnsupportedModelError(f"{index.path}: GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(sorted(MODEL_TYPES))}")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(metadata_folder(index.path))
    hf.architectures = [MODEL_TYPES.get(hf.model_type, MODEL_TYPES[arch])]
    # GGUF holds packed blocks; the compute dtype is chosen by PackedFormat (bf16 unless float32).
    return config_from_hf(hf, hf.architectures[0], torch.bfloat16)


def _unpermute_rows(heads: int, rows: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's `permute(w, n_head)`: (rows,) int64."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


class GGUFBlockSource:
    """Names, packed bytes and row permutations of each block of a GGUF model."""

    def __init__(self, index: GGUFIndex, cfg: ModelConfig):
        self.index = index
        self.cfg = cfg
        self._names = [{k: f"blk.{i}.{BLOCK_NAMES[k]}" for k in cfg.block_shapes()} for i in range(cfg.num_layers)]
        self.perms: dict[str, torch.Tensor] = {}
        if index.architecture in PERMUTED_ARCHITECTURES:
            self.perms = {"wq": _unpermute_rows(cfg.num_heads, cfg.num_heads * cfg.head_dim),
                          "wk": _unpermute_rows(cfg.num_kv_heads, cfg.num_kv_heads * cfg.head_dim)}

    def names(self, block: int) -> dict[str, str]:
        return self._names[block]

    def tensors(self, block: int) -> dict[str, GGUFTensor]:
        return {k: self.index.entry(n) for k, n in self._names[block].items()}

    def raw(self, short: str, name: str) -> torch.Tensor:
        """The tensor's bytes in engine row order: a zero-copy view unless rows must be unpermuted."""
        raw = self.index.raw(name)  # (rows, bytes_per_row) uint8
        perm = self.perms.get(short)
        return raw if perm is None else raw[perm]

    def nbytes(self, block: int) -> int:
        return sum(t.nbytes for t in self.tensors(block).values())

    def advise(self, block: int, advice: int) -> None:
        self.index.advise(list(self._names[block].values()), advice)


def validate_gguf(cfg: ModelConfig, index: GGUFIndex) -> None:
    """Every tensor the architecture needs is present with its expected shape."""
    expected = {GLOBAL_NAMES["embed"]: (cfg.vocab_size, cfg.hidden_size), GLOBAL_NAMES["norm"]: (cfg.hidden_size,)}
    if GLOBAL_NAMES["lm_head"] in index or not cfg.tie_word_embeddings:
        expected[GLOBAL_NAMES["lm_head"]] = (cfg.vocab_size, cfg.hidden_size)
    shapes = cfg.block_shapes()
    for i in range(cfg.num_layers):
        for short in shapes:
            expected[f"blk.{i}.{BLOCK_NAMES[short]}"] = shapes[short]
    for name, shape in expected.items():
        if name not in index:
            raise CheckpointError(f"{index.path}: tensor {name!r} is missing from the GGUF file")
        t = index.entry(name)
        if t.shape != shape:
            raise CheckpointError(f"{t.path}: tensor {name!r} ({t.qtype.name}) has shape {list(t.shape)}, "
                                  f"expected {list(shape)}")


@dataclass(frozen=True)
class PackedFormat:
    """What each GGUF tensor becomes for compute (see the module docstring)."""

    dtype: torch.dtype

    @property
    def exact(self) -> bool:
        return self.dtype == torch.float32

    def resident(self, t: GGUFTensor, raw: torch.Tensor):
        if t.qtype in FLOAT_TYPES:
            return raw.view(FLOAT_TYPES[t.qtype]).reshape(t.shape).to(self.dtype, copy=True)
        if self.exact or len(t.shape) == 1:
            return dequantize(raw, t.qtype, t.shape).to(self.dtype)
        if t.qtype in INT4_TYPES:
            from .packed import int4_from_gguf

            return int4_from_gguf(raw, t.qtype, t.shape, self.dtype)
        return Int8Weight.quantize(dequantize(raw, t.qtype, t.shape), self.dtype)

    def resident_bytes(self, t: GGUFTensor) -> int:
        numel = t.numel
        if t.qtype in FLOAT_TYPES or self.exact or len(t.shape) == 1:
            return numel * self.dtype.itemsize
        scale = self.dtype.itemsize
        if t.qtype in INT4_TYPES:
            return numel // 2 + numel // 32 * 2 * scale
        return numel + t.shape[0] * scale

    def streamed(self, t: GGUFTensor, raw: torch.Tensor):
        if t.qtype in FLOAT_TYPES:
            v = raw.view(FLOAT_TYPES[t.qtype]).reshape(t.shape)
            return v if v.dtype == self.dtype else v.to(self.dtype)
        if len(t.shape) == 1:
            return dequantize(raw, t.qtype, t.shape).to(self.dtype)
        return GGUFWeight(raw, t.qtype, t.shape, self.dtype)

    def embedding(self, t: GGUFTensor, raw: torch.Tensor):
        """The token table is only gathered from: it stays packed (or a view) and rows are unpacked on lookup."""
        if t.qtype in FLOAT_TYPES:
            return raw.view(FLOAT_TYPES[t.qtype]).reshape(t.shape)
        return GGUFWeight(raw, t.qtype, t.shape, self.dtype)
