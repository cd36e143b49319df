"""Memory-mapped safetensors reading: one validated index of every tensor in a checkpoint.

`WeightIndex` is the safetensors CheckpointReader (see reader.py) with Hugging Face's tensor names.

Each file's header is parsed once; a tensor is then a (file, byte range, dtype, shape) entry and a
zero-copy view into a private mapping of the file. Nothing is read from disk until a view's pages
are touched, which is what lets the streamer decide when (and whether) bytes come in.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path

import torch

from ...arch import ModelConfig, load_model_config
from .reader import CheckpointError, CheckpointReader, TensorInfo, split_stacked
from .views import close_mapping, map_file, typed_view

# The largest header we accept: real checkpoints stay well under a few MB; anything bigger is a
# corrupt length field, and reading it would allocate whatever garbage it says.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
PAGE_SIZE = mmap.PAGESIZE
# Linux >= 5.14: fault pages into the page tables without copying (not exported by Python 3.11).
MADV_POPULATE_READ = 22


# Hugging Face's names: the model math's short name of a block tensor -> suffix under model.layers.{i}.
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bo": "self_attn.o_proj.bias",
    # Mixtures of experts (Qwen2/3-MoE, OLMoE spelling; Mixtral's is MIXTRAL_MOE_TENSORS)
    "router": "mlp.gate.weight",
    "shared.w_gate": "mlp.shared_expert.gate_proj.weight",
    "shared.w_up": "mlp.shared_expert.up_proj.weight",
    "shared.w_down": "mlp.shared_expert.down_proj.weight",
    "shared_gate": "mlp.shared_expert_gate.weight",
    # stored stacked (Phi-3, GLM-4)
    "wqkv": "self_attn.qkv_proj.weight",
    "bqkv": "self_attn.qkv_proj.bias",
    "w_gate_up": "mlp.gate_up_proj.weight",
    "sinks": "self_attn.sinks",  # GPT-OSS's attention sinks, one logit per query head
    "router_bias": "mlp.router.bias",
}
EXPERT_TENSORS = {"w_gate": "mlp.experts.{e}.gate_proj.weight", "w_up": "mlp.experts.{e}.up_proj.weight",
                  "w_down": "mlp.experts.{e}.down_proj.weight"}
MIXTRAL_MOE_TENSORS = {"router": "block_sparse_moe.gate.weight"}
MIXTRAL_EXPERT_TENSORS = {"w_gate": "block_sparse_moe.experts.{e}.w1.weight",
                          "w_up": "block_sparse_moe.experts.{e}.w3.weight",
                          "w_down": "block_sparse_moe.experts.{e}.w2.weight"}
# GPT-OSS stores each block's experts stacked, one tensor per kind with the expert first: expert e's slice is one
# contiguous byte range, indexed here as a tensor of its own named "<stacked name>[e]" (reader.split_stacked),
# so that every expert is still its own streaming unit.
STACKED_EXPERT_TENSORS = {"w_gate_up_t": "mlp.experts.gate_up_proj", "b_gate_up": "mlp.experts.gate_up_proj_bias",
                          "w_down_t": "mlp.experts.down_proj", "b_down": "mlp.experts.down_proj_bias"}
GLOBAL_TENSORS = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
# Families whose block norms Hugging Face names otherwise: "post_attention_layernorm" is Llama's MLP input
# norm but Gemma's attention output norm. config.json architecture -> the names that differ from BLOCK_TENSORS.
_SANDWICH_NORMS = {"post_attn_norm": "post_attention_layernorm.weight", "mlp_norm": "pre_feedforward_layernorm.weight",
                   "post_mlp_norm": "post_feedforward_layernorm.weight"}
# DeepSeek-V2/V3: latent attention's projections, the router's correction bias, the shared experts' MLP.
_DEEPSEEK = {"wq_a": "self_attn.q_a_proj.weight", "bq_a": "self_attn.q_a_proj.bias",
             "q_a_norm": "self_attn.q_a_layernorm.weight", "wq_b": "self_attn.q_b_proj.weight",
             "wkv_a": "self_attn.kv_a_proj_with_mqa.weight", "bkv_a": "self_attn.kv_a_proj_with_mqa.bias",
             "kv_a_norm": "self_attn.kv_a_layernorm.weight", "wkv_b": "self_attn.kv_b_proj.weight",
             "router_bias": "mlp.gate.e_score_correction_bias", "shared.w_gate": "mlp.shared_experts.gate_proj.weight",
             "shared.w_up": "mlp.shared_experts.up_proj.weight",
             "shared.w_down": "mlp.shared_experts.down_proj.weight"}
FAMILY_TENSORS = {
    "Gemma2ForCausalLM": _SANDWICH_NORMS,
    "Gemma3ForCausalLM": _SANDWICH_NORMS,
    "Olmo2ForCausalLM": {"post_attn_norm": "post_attention_layernorm.weight",
                         "post_mlp_norm": "post_feedforward_layernorm.weight"},
    "Glm4ForCausalLM": {"post_attn_norm": "post_self_attn_layernorm.weight",
                        "mlp_norm": "post_attention_layernorm.weight", "post_mlp_norm": "post_mlp_layernorm.weight"},
    "GptOssForCausalLM": {"router": "mlp.router.weight"},
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
}


class SafetensorsFile:
    """One mapped .safetensors file with a validated header. `dtypes`: the storage dtypes accepted
    (a model's floating-point ones by default; the quantization cache adds its integer codes)."""

    def __init__(self, path: Path, dtypes: dict[str, torch.dtype] | None = None):
        self.path = Path(path)
        self.dtypes = DTYPES if dtypes is None else dtypes
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open: {e.strerror}") from e
        self._map = None
        try:
            self.file_size = os.fstat(self._fd).st_size
            self.entries = self._read_header()
            self._map = map_file(self._fd) if self.file_size else None
        except BaseException:
            self.close()  # a bad header: release the descriptor before the error propagates
            raise

    def _read_header(self) -> dict[str, TensorInfo]:
        if self.file_size < 8:
            raise CheckpointError(f"{self.path}: file is {self.file_size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > self.file_size:
            raise CheckpointError(
                f"{self.path}: header length {header_len} does not fit the file ({self.file_size} bytes); "
                "the file is truncated or not safetensors"
            )
        raw = os.pread(self._fd, header_len, 8)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        header.pop("__metadata__", None)
        data_start = 8 + header_len
        data_len = self.file_size - data_start
        entries: dict[str, TensorInfo] = {}
        for name, info in header.items():
            entries[name] = self._entry(name, info, data_start, data_len)
        spans = sorted((e.start, e.end, e.name) for e in entries.values() if e.nbytes)
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise CheckpointError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")
        return entries

    def _entry(self, name: str, info: object, data_start: int, data_len: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{where}: header entry lacks dtype/shape/data_offsets")
        dtype = self.dtypes.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(
                f"{where}: dtype {info['dtype']!r} is not supported (supported: {', '.join(self.dtypes)})"
            )
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{where}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{where}: bad data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise CheckpointError(f"{where}: data_offsets {offsets} are not an increasing range")
        if end > data_len:
            raise CheckpointError(
                f"{where}: data ends at byte {end} but the file holds only {data_len} data bytes "
                "(truncated or corrupt file)"
            )
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: holds {end - begin} bytes but shape {shape} x {info['dtype']} needs {expected}"
            )
        return TensorInfo(name, self.path, dtype, tuple(shape), data_start + begin, data_start + end)

    def raw(self, entry: TensorInfo) -> torch.Tensor:
        """The entry's bytes, zero-copy: (nbytes,) uint8 over the mapping (no disk read happens here)."""
        if entry.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)

    def view(self, entry: TensorInfo) -> torch.Tensor:
        """A zero-copy tensor over the mapped bytes (no disk read happens here)."""
        return typed_view(self.raw(entry), entry.start, entry.dtype, entry.shape)

    def advise(self, start: int, end: int, advice: int) -> None:
        """madvise over [start, end) widened to whole pages; advice the kernel refuses is ignored."""
        if self._map is None or end <= start:
            return
        lo = start - start % PAGE_SIZE
        try:
            self._map.madvise(advice, lo, end - lo)
        except (OSError, ValueError):
            pass  # an older kernel without POPULATE_READ: prefetch degrades to on-demand faults

    def close(self) -> None:
        """Unmap and close the file; closing again does nothing."""
        close_mapping(self._map, self._fd)
        self._map, self._fd = None, -1


def _architecture(folder: Path) -> str | None:
    """The first architecture config.json names (it decides tensor names), or None without one."""
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or [None]
    except (OSError, json.JSONDecodeError, AttributeError):
        return None  # reading the config (model_config) reports what is wrong with it
    return archs[0]


class WeightIndex(CheckpointReader):
    """name -> entry over every shard of a model folder, built once and validated."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._files: dict[Path, SafetensorsFile] = {}
        self.entries: dict[str, TensorInfo] = {}
        index_path = self.folder / "model.safetensors.index.json"
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
            shard_names = sorted(set(weight_map.values()))
        elif (self.folder / "model.safetensors").exists():
            weight_map, shard_names = None, ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.folder}: no model.safetensors or model.safetensors.index.json")
        try:
            for shard in shard_names:
                path = self.folder / shard
                if not path.exists():
                    raise CheckpointError(f"{path}: shard named in the index is missing")
                f = SafetensorsFile(path)
                self._files[path] = f
                for name, entry in f.entries.items():
                    if name in self.entries:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} is also in {self.entries[name].path.name}"
                        )
                    self.entries[name] = entry
            # Mixtral keeps its mixture under block_sparse_moe (w1/w3/w2); every other family under mlp.
            self._mixtral_spelling = any(".block_sparse_moe." in n for n in self.entries)
            self._block_tensors = {**BLOCK_TENSORS, **FAMILY_TENSORS.get(_architecture(self.folder), {})}
            if weight_map is not None:
                for name, shard in weight_map.items():
                    if name not in self.entries:
                        raise CheckpointError(f"{self.folder / shard}: tensor {name!r} listed in the index is missing")
            self.entries = split_stacked(self.entries, tuple(STACKED_EXPERT_TENSORS.values()))
        except BaseException:
            self.close()  # shards opened before the bad one: their descriptors and mappings
            raise

    def view(self, name: str) -> torch.Tensor:
        e = self.tensor(name)
        return self._files[e.path].view(e)

    def model_config(self) -> ModelConfig:
        return load_model_config(self.folder)

    def block_tensor_name(self, layer: int, short: str) -> str:
        prefix = f"model.layers.{layer}."
        mixtral = self._mixtral_spelling
        if short.startswith("experts."):
            _, e, part = short.split(".")
            if part in STACKED_EXPERT_TENSORS:
                return f"{prefix}{STACKED_EXPERT_TENSORS[part]}[{e}]"
            return prefix + (MIXTRAL_EXPERT_TENSORS if mixtral else EXPERT_TENSORS)[part].format(e=e)
        if mixtral and short in MIXTRAL_MOE_TENSORS:
            return prefix + MIXTRAL_MOE_TENSORS[short]
        return prefix + self._block_tensors[short]

    def global_tensor_name(self, short: str) -> str:
        return GLOBAL_TENSORS[short]
