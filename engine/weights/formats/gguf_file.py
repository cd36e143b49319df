"""Memory-mapped GGUF reading: metadata, a validated tensor table, zero-copy byte ranges.

A GGUF file is a header (magic, version, counts), key/value metadata, a table of tensor infos
(name, dims, ggml type, offset) and, after padding to `general.alignment`, the tensor data. The
header is parsed here rather than with `gguf.GGUFReader`: that reader turns every metadata string
(~100k tokenizer entries) into numpy objects (2.6 s for a 98 MB file on this machine) and reports a
truncated or corrupt file as whatever numpy error it hits. Here every count, length and byte range
is checked against the file, and an error names the file, the tensor and the type.

Split models (`name-00001-of-00003.gguf`) are one `GGUFIndex` over all their files; metadata comes
from the first, tensors from all, and a missing or duplicated split is an error.

`GGUFIndex` is the GGUF CheckpointReader (reader.py): tensors are `TensorInfo` records whose quant
type is the GGML type's name ("Q4_K"), or whose dtype is set for F32/F16/BF16 tensors. It also knows
llama.cpp's tensor names (`blk.{i}.attn_q.weight` ...) and that its converter permutes the rows of Q
and K for llama-family files (rotary pairs interleaved instead of split in halves): `row_order`
gives the rows that undo it. Rows of a GGML tensor are independent runs of blocks, so the
permutation is undone on the packed rows, by whoever hands them to compute.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...arch import ModelConfig
from .reader import CheckpointError, CheckpointReader, TensorInfo, split_stacked
from .views import map_file
from ..packed.dequant import SUPPORTED_TYPES
from .safetensors_index import PAGE_SIZE

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 24  # tensors / metadata keys / array items: far beyond any real model
MAX_DIMS = 4  # GGML_MAX_DIMS

# metadata value type -> struct format (GGUFValueType numbering)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
               GGMLQuantizationType.BF16: torch.bfloat16}
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


# GGUF architectures whose Q/K rows llama.cpp's converter permutes (LlamaModel and its subclasses)
PERMUTED_ARCHITECTURES = {"llama", "mistral", "granite", "smollm3"}
# llama.cpp's tensor names: the model math's short name -> suffix under blk.{i}, and the globals
BLOCK_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bo": "attn_output.bias", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
    "post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight",
    # stacked q/k/v and gate/up (Phi-3): llama.cpp keeps them stacked, gate/up under ffn_up
    "wqkv": "attn_qkv.weight", "bqkv": "attn_qkv.bias", "w_gate_up": "ffn_up.weight",
    # GPT-OSS: attention sinks, the biased router
    "sinks": "attn_sinks.weight", "router": "ffn_gate_inp.weight", "router_bias": "ffn_gate_inp.bias",
    # DeepSeek's latent attention (deepseek2: kv_b split into attn_k_b / attn_v_b) and shared experts
    "wq_a": "attn_q_a.weight", "bq_a": "attn_q_a.bias", "q_a_norm": "attn_q_a_norm.weight", "wq_b": "attn_q_b.weight",
    "wkv_a": "attn_kv_a_mqa.weight", "bkv_a": "attn_kv_a_mqa.bias", "kv_a_norm": "attn_kv_a_norm.weight",
    "wkv_b": "attn_kv_b.weight", "wk_b": "attn_k_b.weight", "wv_b": "attn_v_b.weight",
    "shared.w_gate": "ffn_gate_shexp.weight", "shared.w_up": "ffn_up_shexp.weight",
    "shared.w_down": "ffn_down_shexp.weight",
}
# Architectures whose names differ from BLOCK_NAMES: GPT-OSS's MLP input norm is its post_attention_norm;
# DeepSeek-V3's router bias is its correction bias (exp_probs_b), not a bias of the router's product.
FAMILY_BLOCK_NAMES = {"gpt-oss": {"mlp_norm": "post_attention_norm.weight"},
                      "deepseek2": {"router_bias": "exp_probs_b.bias"}}
# A block's routed experts, stacked by llama.cpp (expert first in torch's order): one expert's short name ->
# the stacked tensor under blk.{i}; each expert's slice is indexed as "<name>[e]" (reader.split_stacked).
STACKED_EXPERT_NAMES = {"w_gate": "ffn_gate_exps.weight", "w_up": "ffn_up_exps.weight",
                        "w_down": "ffn_down_exps.weight", "b_gate": "ffn_gate_exps.bias",
                        "b_up": "ffn_up_exps.bias", "b_down": "ffn_down_exps.bias"}
# LongRoPE's per-frequency factors, which llama.cpp's converter stores as tensors (Phi-3)
ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
GLOBAL_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def ggml_type(t: TensorInfo) -> GGMLQuantizationType:
    """The GGML type a GGUF tensor is stored in (its quant type, or F32/F16/BF16 for a plain one)."""
    if t.quant is not None:
        return GGMLQuantizationType[t.quant]
    return next(q for q, d in FLOAT_TYPES.items() if d == t.dtype)


def unpermute_rows(heads: int, rows: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's `permute(w, n_head)`: (rows,) int64."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


_U64 = struct.Struct("<Q")


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise CheckpointError(f"{self.path}: file ends inside the header while reading {what} "
                                  f"(at byte {self.pos}, {self.size} bytes in the file); truncated or corrupt")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, limit: int = MAX_COUNT) -> int:
        n = self.scalar("<Q", what)
        if n > limit:
            raise CheckpointError(f"{self.path}: {what} is {n}, more than the {limit} allowed; corrupt file")
        return n

    def string(self, what: str) -> str:
        raw = self.take(self.count(f"length of {what}", self.size), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8 ({e}); corrupt file") from e

    def strings(self, n: int, what: str) -> list[str]:
        """n strings in a row: string() unrolled, since a tokenizer's vocabulary and merges are hundreds
        of thousands of them, read at every load."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = _U64.unpack_from
        try:
            for _ in range(n):
                end = pos + 8 + length(buf, pos)[0]
                if end > size:
                    break
                out.append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except struct.error:
            pass  # the length itself runs past the end: reported below
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} holds a string that is not UTF-8 ({e}); corrupt file") from e
        self.pos = pos
        if len(out) < n:
            raise CheckpointError(f"{self.path}: file ends inside the header while reading {what} "
                                  f"(at byte {pos}, {size} bytes in the file); truncated or corrupt")
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            item_type = self.scalar("<I", f"item type of {what}")
            n = self.count(f"length of {what}")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                raw = self.take(n * struct.calcsize(fmt), what)
                return list(struct.unpack(f"<{n}{fmt[1]}", raw))
            if item_type == _STRING:
                return self.strings(n, what)
            return [self.value(item_type, what) for _ in range(n)]
        raise CheckpointError(f"{self.path}: {what} has unknown value type {vtype}; corrupt file")


# The last file's parsed header (metadata, tensor table, data start), by its identity on disk: a load
# opens the file twice (its config folder, then the reader), and a tokenizer's vocabulary in the
# metadata is hundreds of thousands of values to parse. Readers must not change what they are given.
_last_parsed: dict[tuple[int, int, int, int], tuple[dict, dict[str, TensorInfo], int]] = {}


class GGUFFile:
    """One mapped .gguf file with a validated header and tensor table."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open: {e.strerror}") from e
        try:
            self.file_size = os.fstat(self._fd).st_size
            if self.file_size < 24:
                raise CheckpointError(f"{self.path}: file is {self.file_size} bytes, too short for a GGUF header")
            self._map = map_file(self._fd)
            st = os.fstat(self._fd)
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            parsed = _last_parsed.get(key)
            if parsed is None:
                parsed = self._parse()
                _last_parsed.clear()
                _last_parsed[key] = parsed
            self.metadata, self.tensors, self.data_start = parsed
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> tuple[dict, dict[str, TensorInfo], int]:
        cur = _Cursor(self._map, self.path)
        if cur.take(4, "magic") != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (magic bytes are {bytes(self._map[:4])!r})")
        version = cur.scalar("<I", "version")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise CheckpointError(f"{self.path}: GGUF version {version}{hint} is not supported (2 and 3 are)")
        n_tensors = cur.count("tensor count")
        n_kv = cur.count("metadata key count")
        metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key")
            vtype = cur.scalar("<I", f"type of metadata {key!r}")
            metadata[key] = cur.value(vtype, f"metadata {key!r}")
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        infos = []
        for _ in range(n_tensors):
            name = cur.string("a tensor name")
            n_dims = cur.scalar("<I", f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise CheckpointError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            ne = [cur.scalar("<Q", f"dimensions of tensor {name!r}") for _ in range(n_dims)]
            raw_type = cur.scalar("<I", f"type of tensor {name!r}")
            offset = cur.scalar("<Q", f"offset of tensor {name!r}")
            infos.append((name, ne, raw_type, offset))
        data_start = -(-cur.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, ne, raw_type, offset in infos:
            if name in tensors:
                raise CheckpointError(f"{self.path}: tensor {name!r} appears twice")
            tensors[name] = self._tensor(name, ne, raw_type, offset, data_start, alignment)
        spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.nbytes)
        for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise CheckpointError(f"{self.path}: tensors {n0!r} and {n1!r} overlap")
        return metadata, tensors, data_start

    def _tensor(self, name: str, ne: list[int], raw_type: int, offset: int, data_start: int,
                alignment: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise CheckpointError(f"{where}: unknown GGML type {raw_type}; corrupt file or a newer format") from None
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(f"{where}: type {qtype.name} is not supported "
                                  f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
        block, size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise CheckpointError(f"{where} ({qtype.name}): row length {ne[0]} is not a multiple of the "
                                  f"{block}-weight block")
        nbytes = ne[0] // block * size
        for d in ne[1:]:
            nbytes *= d
        if offset % alignment:
            raise CheckpointError(f"{where} ({qtype.name}): offset {offset} is not {alignment}-byte aligned")
        start = data_start + offset
        if start + nbytes > self.file_size:
            raise CheckpointError(f"{where} ({qtype.name}): data ends at byte {start + nbytes} but the file "
                                  f"has {self.file_size} bytes (truncated or corrupt file)")
        dtype = FLOAT_TYPES.get(qtype)
        return TensorInfo(name, self.path, dtype, tuple(reversed(ne)), start, start + nbytes,
                          quant=None if dtype is not None else qtype.name)

    def header_sha256(self) -> str:
        """Digest of everything before the tensor data: metadata and tensor table."""
        import hashlib

        return hashlib.sha256(self._map[:self.data_start]).hexdigest()

    def raw(self, t: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a zero-copy (nbytes,) uint8 view (no disk read here)."""
        if t.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=t.nbytes, offset=t.start)

    def advise(self, start: int, end: int, advice: int) -> None:
        """madvise over [start, end) widened to whole pages; advice the kernel refuses is ignored."""
        if end <= start:
            return
        lo = start - start % PAGE_SIZE
        try:
            self._map.madvise(advice, lo, end - lo)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # tensors still view the mapping; it is unmapped when they are collected
        os.close(self._fd)


def split_paths(path: Path) -> list[Path]:
    """All files of a split model given any one of them (or [path] for a single file)."""
    m = _SPLIT_RE.match(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise CheckpointError(f"{path}: split model is missing {', '.join(missing)}")
    return paths


def find_gguf(folder: Path) -> Path:
    """The one GGUF model in a folder (the first split of a split model)."""
    files = sorted(folder.glob("*.gguf"))
    firsts = [p for p in files if (m := _SPLIT_RE.match(p.name)) is None or int(m.group("no")) == 1]
    if len(firsts) != 1:
        found = ", ".join(p.name for p in firsts) or "none"
        raise CheckpointError(f"{folder}: expected exactly one GGUF model, found {found}; pass the file itself")
    return firsts[0]


class GGUFIndex(CheckpointReader):
    """name -> tensor over every file of a (possibly split) GGUF model, built once and validated."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path
        self.folder = path
        self._files: dict[Path, GGUFFile] = {}
        self.entries: dict[str, TensorInfo] = {}
        try:
            for p in split_paths(path):
                f = GGUFFile(p)
                self._files[p] = f
                for name, t in f.tensors.items():
                    if name in self.entries:
                        raise CheckpointError(f"{p}: tensor {name!r} is also in {self.entries[name].path.name}")
                    self.entries[name] = t
            first = next(iter(self._files.values()))
            self.metadata = first.metadata
            count = self.metadata.get("split.count")
            if count is not None and count != len(self._files):
                raise CheckpointError(f"{path}: metadata says split.count = {count} but {len(self._files)} "
                                      "file(s) match its name")
            expected = self.metadata.get("split.tensors.count")
            if expected is not None and expected != len(self.entries):
                raise CheckpointError(f"{path}: split.tensors.count = {expected} but the files hold "
                                      f"{len(self.entries)} tensors")
            self.header_digest = first.header_sha256()
            self.entries = split_stacked(self.entries, tuple(STACKED_EXPERT_NAMES.values()))
            self._block_names = {**BLOCK_NAMES, **FAMILY_BLOCK_NAMES.get(self.architecture, {})}
        except BaseException:
            self.close()
            raise

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def view(self, name: str) -> torch.Tensor:
        t = self.tensor(name)
        if t.dtype is None:
            raise CheckpointError(f"{t.path}: tensor {name!r} is packed ({t.quant}); read it with raw()")
        return self.raw(name).view(t.dtype).reshape(t.shape)  # GGUF data is aligned: zero copy

    def block_tensor_name(self, layer: int, short: str) -> str:
        if short.startswith("experts."):
            _, e, part = short.split(".")
            return f"blk.{layer}.{STACKED_EXPERT_NAMES[part]}[{e}]"
        return f"blk.{layer}.{self._block_names[short]}"

    def global_tensor_name(self, short: str) -> str:
        return GLOBAL_NAMES[short]

    def row_order(self, name: str) -> torch.Tensor | None:
        if self.architecture not in PERMUTED_ARCHITECTURES:
            return None
        key = {BLOCK_NAMES["wq"]: "head_count", BLOCK_NAMES["wk"]: "head_count_kv"}.get(name.split(".", 2)[-1])
        if key is None or not name.startswith("blk."):
            return None
        heads = self.metadata.get(f"{self.architecture}.attention.{key}")
        if key == "head_count_kv" and heads is None:
            heads = self.metadata.get(f"{self.architecture}.attention.head_count")
        if not isinstance(heads, int) or heads <= 0:
            raise CheckpointError(f"{self.path}: metadata {self.architecture}.attention.{key} is {heads!r}; "
                                  "needed to undo the Q/K row permutation")
        return unpermute_rows(heads, self.tensor(name).shape[0])

    def model_config(self) -> ModelConfig:
        from .gguf_config import load_gguf_config

        factors = {n: self.view(n).float().tolist() for n in ROPE_FACTOR_TENSORS if n in self.entries}
        return load_gguf_config(self.path, self.architecture, self.header_digest, self.metadata, factors,
                                frozenset(self.entries))
