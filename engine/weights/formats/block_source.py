"""The checkpoint as the model math sees it: block i's tensors and the globals, by short name.

Built once per load over any CheckpointReader: every name is resolved through the reader's naming and
every tensor checked (present, the shape the architecture expects) before anything else happens, so a
damaged checkpoint fails at start-up with the file and tensor named. Transports read blocks only
through this class, never through the reader or the model config.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...arch import ModelConfig
from ...errors import CheckpointError
from .reader import CheckpointReader, TensorInfo
from .views import byte_rows


@dataclass(frozen=True)
class WeightSizes:
    """Byte counts the planner needs, for one compute dtype."""

    block_bytes: int  # one block in the compute dtype (what a device buffer holds)
    global_bytes: int  # embeddings + final norm + head in the compute dtype
    checkpoint_block_bytes: int  # one block as stored (what a disk read moves)
    checkpoint_bytes: int  # every tensor of the checkpoint as stored
    # What one streamed block moves when that differs from block_bytes: a packed block (GGUF)
    # streams its stored bytes and is unpacked by the compute that uses it.
    streamed_block_bytes: int | None = None
    # Mixtures of experts: the same for a block without its routed experts, and for one expert.
    dense_block_bytes: int = 0
    dense_checkpoint_block_bytes: int = 0
    expert_bytes: int = 0  # one routed expert in the compute dtype (every expert has the same shapes)
    checkpoint_expert_bytes: int = 0
    num_experts_total: int = 0  # routed experts over all blocks


class BlockSource:
    def __init__(self, reader: CheckpointReader, cfg: ModelConfig):
        self._reader = reader
        self.num_blocks = cfg.num_layers
        layer_shapes = [cfg.block_shapes(i) for i in range(cfg.num_layers)]
        self._names = [{short: reader.block_tensor_name(i, short) for short in shapes}
                       for i, shapes in enumerate(layer_shapes)]
        glob = cfg.global_shapes()
        if "lm_head" not in glob and reader.global_tensor_name("lm_head") in reader:
            glob["lm_head"] = glob["embed"]  # tied, but the checkpoint stores a head anyway: use it
        self._global_names = {short: reader.global_tensor_name(short) for short in glob}
        expected = {self._global_names[s]: shape for s, shape in glob.items()}
        for names, shapes in zip(self._names, layer_shapes):
            expected.update({names[s]: shape for s, shape in shapes.items()})
        for name, shape in expected.items():
            if name not in reader:
                raise CheckpointError(f"{reader.folder}: tensor {name!r} is missing from the checkpoint")
            info = reader.tensor(name)
            if info.shape != shape:
                raise CheckpointError(
                    f"{info.path}: tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        self._tensors = [{s: reader.tensor(n) for s, n in names.items()} for names in self._names]
        self._globals = {short: reader.tensor(n) for short, n in self._global_names.items()}
        # Row orders depend on the tensor's role, not its block: found once, from block 0.
        self._row_orders = {s: reader.row_order(n) for s, n in self._names[0].items()} if self._names else {}
        self.packed = any(i.quant is not None for t in self._tensors + [self._globals] for i in t.values())
        # block -> expert -> {"w_gate", "w_up", "w_down" (MoEConfig.expert_shapes): entry}: each expert its own
        # streaming unit
        self._experts: list[dict[int, dict[str, TensorInfo]]] = [{} for _ in range(self.num_blocks)]
        for b, tensors in enumerate(self._tensors):
            for short, info in tensors.items():
                if short.startswith("experts."):
                    _, e, part = short.split(".")
                    self._experts[b].setdefault(int(e), {})[part] = info

    def without_experts(self) -> "BlockSource":
        """The same source whose blocks leave out their routed experts (the expert tier moves those)."""
        dense = copy.copy(self)
        dense._names = [{s: n for s, n in names.items() if not s.startswith("experts.")} for names in self._names]
        dense._tensors = [{s: t for s, t in ts.items() if not s.startswith("experts.")} for ts in self._tensors]
        return dense

    def select(self, keep: Callable[[int, str], bool]) -> "BlockSource":
        """The same source whose blocks hold only the tensors keep(block, short name) accepts: a block's
        tensor groups on the device apart from those placed off it (engine.placement), each its own source."""
        part = copy.copy(self)
        part._names = [{s: n for s, n in names.items() if keep(b, s)} for b, names in enumerate(self._names)]
        part._tensors = [{s: t for s, t in ts.items() if keep(b, s)} for b, ts in enumerate(self._tensors)]
        return part

    def expert_blocks(self) -> list[int]:
        return [b for b in range(self.num_blocks) if self._experts[b]]

    def num_experts(self, block: int) -> int:
        return len(self._experts[block])

    def expert_tensors(self, block: int, expert: int) -> dict[str, TensorInfo]:
        """One expert's tensors by short name ("w_gate", "w_up", "w_down", or GPT-OSS's): where its bytes lie."""
        return self._experts[block][expert]

    def advise_expert(self, block: int, expert: int, advice: int) -> None:
        """madvise one expert's mapped pages (MADV_POPULATE_READ: fault them in ahead of compute)."""
        self._reader.advise([t.name for t in self._experts[block][expert].values()], advice)

    def expert_views(self, block: int, expert: int) -> dict[str, torch.Tensor]:
        """Zero-copy views of one expert's tensors in their storage dtype."""
        return {k: self._reader.view(t.name) for k, t in self._experts[block][expert].items()}

    def expert_stored(self, block: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's tensors as stored, zero-copy: plain ones as typed views, packed ones (GGUF) as their rows
        of bytes, (rows..., bytes per row) uint8 (an expert's rows are never stored permuted)."""
        return {k: self._reader.view(t.name) if t.quant is None else byte_rows(self._reader.raw(t.name), t.shape)
                for k, t in self._experts[block][expert].items()}

    @property
    def files(self) -> list[Path]:
        return self._reader.files

    def tensors(self, block: int) -> dict[str, TensorInfo]:
        return self._tensors[block]

    def shapes(self, block: int) -> dict[str, tuple[int, ...]]:
        return {short: info.shape for short, info in self._tensors[block].items()}

    def views(self, block: int) -> dict[str, torch.Tensor]:
        """Views of the block's tensors in their storage dtype, in the engine's row order: zero-copy, but for
        a format that stores the rows permuted (a gather of Q and K: a 16/32-bit llama-family GGUF)."""
        return {short: self.reorder(short, self._reader.view(name)) for short, name in self._names[block].items()}

    def nbytes(self, block: int) -> int:
        """The block's bytes as stored in the checkpoint."""
        return sum(info.nbytes for info in self._tensors[block].values())

    def compute_bytes(self, block: int, dtype: torch.dtype) -> int:
        """The block's bytes once converted to `dtype`: what a transport hands to compute."""
        return sum(info.numel for info in self._tensors[block].values()) * dtype.itemsize

    def rows(self, block: int, short: str) -> torch.Tensor:
        """A tensor's stored bytes as (rows..., bytes per row) uint8 in the engine's row order: a
        zero-copy view, unless the format stores the rows permuted (then a gather, of Q and K only)."""
        info = self._tensors[block][short]
        return self.reorder(short, byte_rows(self._reader.raw(info.name), info.shape))

    def stored_rows(self, block: int) -> dict[str, torch.Tensor]:
        """The block's tensors' stored bytes as (rows..., bytes per row) uint8 in the order the file
        stores the rows (row_order() gives the engine's): zero-copy views of the mapping."""
        return {short: byte_rows(self._reader.raw(info.name), info.shape)
                for short, info in self._tensors[block].items()}

    def row_order(self, short: str) -> torch.Tensor | None:
        """Rows to take from a stored block tensor for the engine's row order, (rows,) int64, or None
        when it is stored in that order (every tensor but llama-family GGUF's Q and K)."""
        return self._row_orders.get(short)

    def reorder(self, short: str, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows of a block tensor (from the mapping or a disk read) in the engine's row order."""
        order = self._row_orders.get(short)
        return rows if order is None else rows[order]

    def stored(self, block: int) -> dict[str, torch.Tensor]:
        """The block's tensors as stored, in engine row order: plain ones as typed views, packed ones as their
        rows of bytes (rows()); zero-copy but for rows stored permuted (Q and K of llama-family GGUF)."""
        return {short: self.reorder(short, self._reader.view(info.name)) if info.quant is None
                else self.rows(block, short) for short, info in self._tensors[block].items()}

    def streamed_bytes(self, block: int, dtype: torch.dtype) -> int:
        """What streaming the block moves: packed tensors as stored, plain ones in the compute dtype."""
        return sum(info.nbytes if info.quant is not None else info.numel * dtype.itemsize
                   for info in self._tensors[block].values())

    def global_infos(self) -> dict[str, TensorInfo]:
        """"embed", "norm" and, when the checkpoint has one, "lm_head"."""
        return dict(self._globals)

    def global_rows(self, short: str) -> torch.Tensor:
        info = self._globals[short]
        return byte_rows(self._reader.raw(info.name), info.shape)

    def advise(self, block: int, advice: int) -> None:
        self._reader.advise(list(self._names[block].values()), advice)

    def global_views(self) -> dict[str, torch.Tensor]:
        """"embed", "norm" and, when the checkpoint has one, "lm_head": zero-copy views."""
        return {short: self._reader.view(name) for short, name in self._global_names.items()}

    def sizes(self, dtype: torch.dtype) -> WeightSizes:
        glob = list(self._globals.values())
        dense = self.without_experts()
        blocks = range(self.num_blocks)
        one_expert = next((ex[0] for ex in self._experts if ex), {})
        return WeightSizes(
            block_bytes=max((self.compute_bytes(b, dtype) for b in blocks), default=0),
            global_bytes=sum(i.numel for i in glob) * dtype.itemsize,
            checkpoint_block_bytes=max((self.nbytes(b) for b in blocks), default=0),
            checkpoint_bytes=self._reader.total_bytes(),
            dense_block_bytes=max((dense.compute_bytes(b, dtype) for b in blocks), default=0),
            dense_checkpoint_block_bytes=max((dense.nbytes(b) for b in blocks), default=0),
            expert_bytes=sum(t.numel for t in one_expert.values()) * dtype.itemsize,
            checkpoint_expert_bytes=sum(t.nbytes for t in one_expert.values()),
            num_experts_total=sum(len(ex) for ex in self._experts),
        )
