"""A model's weights as the rest of the engine sees them: a validated checkpoint before planning, and
the weights opened for a frozen plan afterwards (globals placed, blocks acquired and released).

This is the package's facade; engine code outside engine/weights uses nothing else (see __init__).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F

from ..arch import ModelConfig, expert_key
from ..errors import CheckpointError
from ..placement import group_kind
from ..planner import HostTiering, MemoryPlan
from .transports.bandwidth import LinkSpeeds
from .formats.reader import CheckpointReader
from .formats.open import open_checkpoint
from .formats.block_source import BlockSource, WeightSizes
from .transports.streamer import BlockStreamer, StreamStats
from .packed.compute_form import PackedFormat
from .packed.prepacked import MARKER as PREPACKED_MARKER
from .packed.prepacked import PrepackedLayout, entry_available, prepack_layout
from .transports.activations import ActivationLink
from .transports.tiers import host_tiering, make_activation_link, make_expert_tier, make_transport, resolve
from .offload import OffloadTier
from .transports.base import Transport, to_compute
from .transports.cpu import CpuTransport
from .transports.resident_copy import copied

if TYPE_CHECKING:
    from .experts.tier import ExpertTier, Router
    from .self_draft import SelfDraftWeights

log = logging.getLogger("layerstream")


class ModelCheckpoint:
    """A checkpoint opened through its format's reader and checked against the model config: every
    tensor the architecture needs is present with its shape. The config is the one the checkpoint's
    format records (config.json, GGUF metadata) unless given. Owns the reader (file descriptors,
    mappings) until close()."""

    def __init__(self, path: str | Path, cfg: ModelConfig | None = None):
        self.path = Path(path)
        self._reader: CheckpointReader = open_checkpoint(self.path)
        try:
            self.cfg = cfg if cfg is not None else self._reader.model_config()
            self.source = BlockSource(self._reader, self.cfg)
        except BaseException:
            self._reader.close()
            raise
        self._prepacked: dict[tuple[torch.dtype, str], tuple[PrepackedLayout | None, str | None]] = {}

    @property
    def packed(self) -> bool:
        """The checkpoint stores packed (quantized) tensors: blocks stream as packed bytes."""
        return self.source.packed

    def sizes(self, dtype: torch.dtype, quantization: str | None = None,
              device: torch.device = torch.device("cpu")) -> WeightSizes:
        """Bytes the planner needs in compute dtype `dtype` on `device`. A packed checkpoint's blocks count
        in their resident compute form and stream as stored; quantization (int8 | int4): blocks and
        head as quantized at load (packed/quantize.py), streamed as such."""
        if self.packed:
            if quantization:
                raise ValueError(f"{self.path}: quantization={quantization!r} applies to bf16/fp16/fp32 "
                                 "checkpoints; this one is already quantized")
            return self._packed_sizes(PackedFormat(dtype, device))
        sizes = self.source.sizes(dtype)
        if quantization:
            from .packed.quantize import quantized_plan_bytes

            block, glob = quantized_plan_bytes(self.cfg, self.source.global_views()["embed"].nbytes,
                                               quantization, dtype)
            sizes = dataclasses.replace(sizes, block_bytes=block, global_bytes=glob)
        return sizes

    def _packed_sizes(self, fmt: PackedFormat) -> WeightSizes:
        src = self.source
        glob = src.global_infos()
        head = glob.get("lm_head", glob["embed"])
        sizes = WeightSizes(
            block_bytes=max((sum(fmt.resident_bytes(t) for t in src.tensors(b).values())
                             for b in range(src.num_blocks)), default=0),
            # The token table stays packed (only looked-up rows are unpacked); the head is resident.
            global_bytes=(fmt.embedding_bytes(glob["embed"]) + fmt.resident_bytes(glob["norm"])
                          + fmt.resident_bytes(head)),
            checkpoint_block_bytes=max((src.nbytes(b) for b in range(src.num_blocks)), default=0),
            checkpoint_bytes=self._reader.total_bytes(),
            streamed_block_bytes=max((src.streamed_bytes(b, fmt.dtype) for b in range(src.num_blocks)), default=0),
        )
        layout = self.prepacked_layout(fmt.dtype, fmt.device)
        if layout is None:
            return sizes
        # Blocks come from the prepacked entry: a streamed block maps or reads its bytes there (whole
        # pages), and what is mapped is the entry's blocks plus the GGUF file's globals.
        sizes = dataclasses.replace(
            sizes, streamed_block_bytes=layout.max_block_bytes, checkpoint_block_bytes=layout.max_block_bytes,
            checkpoint_bytes=layout.file_bytes + sum(t.nbytes for t in glob.values()))
        if not src.expert_blocks() or not entry_available(layout):
            return sizes
        # A mixture's routed experts stream one by one from the entry (the expert tier maps each expert's parts
        # there): blocks count without them, on the device in their resident form and streamed as the entry's
        # parts of their other weights; an expert counts its parts in the entry (what group_bytes prices at). Where
        # the entry cannot be built (a read-only or full cache) nothing prices an expert: MoE blocks stream whole.
        dense = src.without_experts()
        return dataclasses.replace(
            sizes, dense_block_bytes=max(sum(fmt.resident_bytes(t) for t in dense.tensors(b).values())
                                         for b in range(src.num_blocks)),
            dense_checkpoint_block_bytes=layout.dense_bytes, expert_bytes=layout.expert_bytes,
            checkpoint_expert_bytes=layout.expert_bytes,
            num_experts_total=sum(src.num_experts(b) for b in src.expert_blocks()))

    def group_bytes(self, dtype: torch.dtype, device: torch.device = torch.device("cpu")
                    ) -> list[dict[str, tuple[int, int]]] | None:
        """Per block, each tensor group's (bytes read and moved, bytes on the device while it stays there) by
        kind (engine.placement.group_kind), for a packed checkpoint, whose groups are not in the compute dtype;
        None for a plain one. Read and moved: from the prepacked entry, the group's weights' parts there (the CPU
        computes from them where they lie, the simulated link moves them), else what a streamed block's tensors
        move (GGML bytes). On the device: the resident compute form, as sizes() counts a resident block
        (PackedFormat.resident_bytes: GGML bytes on a GPU, fp32 in exact mode)."""
        if not self.packed:
            return None
        layout = self.prepacked_layout(dtype, device)
        fmt = PackedFormat(dtype, device)
        out = []
        for b in range(self.source.num_blocks):
            moved: dict[str, int] = {}
            resident: dict[str, int] = {}
            for short, t in self.source.tensors(b).items():
                kind = group_kind(short)
                resident[kind] = resident.get(kind, 0) + fmt.resident_bytes(t)
                if layout is None:
                    moved[kind] = moved.get(kind, 0) + (t.nbytes if t.quant is not None else t.numel * dtype.itemsize)
            if layout is not None:
                for w in layout.blocks[b].weights:  # stacked weights ("wqkv", "w_gate_up") stay in one group
                    moved[group_kind(w.name)] = moved.get(group_kind(w.name), 0) + sum(p.nbytes for p in w.parts)
            out.append({kind: (moved[kind], resident[kind]) for kind in resident})
        return out

    def prepacked_layout(self, dtype: torch.dtype,
                         device: torch.device = torch.device("cpu")) -> PrepackedLayout | None:
        """Where this GGUF checkpoint's blocks lie in its prepacked cache entry (packed/prepacked.py), or None
        where they are computed from the GGUF file itself (see prepack_refusal)."""
        return self._prepack(dtype, device)[0]

    def prepack_refusal(self, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> str | None:
        """Why this checkpoint has no prepacked entry in `dtype` on `device`, or None when it has."""
        return self._prepack(dtype, device)[1]

    def _prepack(self, dtype: torch.dtype, device: torch.device) -> tuple[PrepackedLayout | None, str | None]:
        key = (dtype, device.type)
        if key not in self._prepacked:
            self._prepacked[key] = prepack_layout(self.source, PackedFormat(dtype, device))
        return self._prepacked[key]

    def prepack_pending(self, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> int:
        """Blocks a load in `dtype` will prepack first (none once the cache entry exists)."""
        layout = self.prepacked_layout(dtype, device) if self.packed else None
        return 0 if layout is None or (layout.folder / PREPACKED_MARKER).exists() else len(layout.blocks)

    def convert(self, dtype: torch.dtype, quantization: str | None = None,
                on_progress: Callable[[int], None] | None = None) -> "ConvertedEntry":
        """Build this checkpoint's cache entry now, as a load would (`layerstream convert`): the prepacked
        blocks of a GGUF file, or a safetensors checkpoint's blocks quantized to `quantization`.
        ValueError where neither applies."""
        if quantization:
            if self.packed:
                raise ValueError(f"{self.path}: quantization={quantization!r} applies to bf16/fp16/fp32 "
                                 "checkpoints; this one is already quantized")
            from .packed.quant_cache import QuantizedBlocks

            store = QuantizedBlocks(self.source, quantization, dtype, on_progress=on_progress)
            store.close()
            return ConvertedEntry(store.folder, store.built, f"blocks quantized to {quantization}")
        if not self.packed:
            raise ValueError(f"{self.path}: a safetensors checkpoint is read as it is stored; there is nothing to "
                             "convert unless it is quantized at load (--quantization int4|int8)")
        layout, why = self._prepack(dtype, torch.device("cpu"))
        if layout is None:
            raise ValueError(f"{self.path}: no prepacked form in {str(dtype).replace('torch.', '')}: {why}")
        from .packed.prepacked import PrepackedBlocks

        store = PrepackedBlocks(self.source, layout, on_progress)
        store.close()
        return ConvertedEntry(store.folder, store.built, "GGUF blocks prepacked for the CPU kernels")

    def converts(self, dtype: torch.dtype) -> bool:
        """Streamed blocks are converted to `dtype` on the host (buffers beyond the mapped file)."""
        return not self.packed and self.cfg.checkpoint_dtype != dtype

    def describe(self, dtype: torch.dtype) -> str | None:
        """A line on how the stored tensors are computed, for packed checkpoints."""
        if not self.packed:
            return None
        types = sorted({t.quant or str(t.dtype).replace("torch.", "")
                        for b in range(self.source.num_blocks) for t in self.source.tensors(b).values()})
        return (f"stored tensor types {', '.join(types)}; compute "
                + ("exact fp32 dequantization" if PackedFormat(dtype).exact else f"packed kernels in {dtype}"))

    def self_draft_sizes(self, dtype: torch.dtype) -> tuple[int, int]:
        """(bytes of one block's self-draft copy, of the self-draft's head copy): see self_draft.py.
        A packed checkpoint's blocks already are low-bit: its copies would be as large as the blocks."""
        if self.packed:
            return self.sizes(dtype).block_bytes, 0
        from .self_draft import SELF_DRAFT_QUANTIZATION
        from .packed.quantize import quantized_bytes

        return (self.sizes(dtype, SELF_DRAFT_QUANTIZATION).block_bytes,
                quantized_bytes((self.cfg.vocab_size, self.cfg.hidden_size), "int8", dtype))

    def host_tiering(self, transport: str, device: torch.device, dtype: torch.dtype,
                     depth: int, quantization: str | None = None) -> HostTiering | None:
        """How planning may split streamed blocks between host memory and disk for this transport.
        Blocks quantized at load stream from the quantization cache's mapping: no disk tier."""
        if quantization:
            return None
        # Blocks from the prepacked entry are read into the stream buffers themselves (no staging besides).
        staged = self.packed and self.prepacked_layout(dtype, device) is None
        return host_tiering(transport, device, self.sizes(dtype, device=device), depth,
                            converts=self.converts(dtype), packed=staged)

    def stream_files(self, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> list[Path]:
        """The files streamed blocks are read from in `dtype` on `device`: the prepacked entry's blocks
        where a GGUF file has one, else the checkpoint's own files (for benchmarks: the disk the tier reads)."""
        layout = self.prepacked_layout(dtype, device) if self.packed else None
        if layout is not None:
            from .packed.prepacked import DATA

            return [layout.folder / DATA]
        return list(self._reader.files)

    def measure_disk(self) -> tuple[float | None, str | None]:
        """(GB/s of the disk holding the checkpoint, None) or (None, why it could not be measured);
        cached per file system, so only the first start on a machine pays for the read."""
        from .transports.disk_bandwidth import disk_bandwidth

        try:
            return disk_bandwidth(self._reader.files).gbps, None
        except (OSError, ValueError) as e:
            return None, f"disk bandwidth not measured: {e}"

    def time_disk_reads(self, blocks: list[int]) -> tuple[int, float]:
        """Read these blocks once the way the disk tier does (O_DIRECT, same request size and depth):
        (bytes read, seconds). For benchmarks: the disk's speed for this access pattern right now."""
        import time

        from .transports.disk_reader import DiskReader, StagingBuffer, plan_reads

        plans = [plan_reads(self.source.tensors(b)) for b in blocks]
        reader = DiskReader(self._reader.files)
        try:
            buf = StagingBuffer(max(p.buffer_bytes for p in plans))
            t0 = time.perf_counter()
            n = sum(reader.read(p, buf) for p in plans)
            return n, time.perf_counter() - t0
        finally:
            reader.close()

    def close(self) -> None:
        self._reader.close()


@dataclass(frozen=True)
class ConvertedEntry:
    """A checkpoint's cache entry, as ModelCheckpoint.convert left it."""

    folder: Path
    built: bool  # False: it was there already (and checked)
    what: str  # what it holds, in words


@dataclass(frozen=True)
class PlacedGlobals:
    """Embeddings, final norm and head on the compute device. The embedding table may stay a
    zero-copy view of the mapped file in the checkpoint's dtype (CPU, separate head): only a few
    rows are gathered per step, and embed() casts the gathered rows (the same elementwise cast,
    after the lookup instead of before: exact)."""

    embed_table: torch.Tensor  # (vocab, hidden), or a packed table (GGUF) that unpacks looked-up rows
    norm: torch.Tensor  # (hidden,)
    head: torch.Tensor  # (vocab, hidden); the embedding table itself when tied; or a packed weight
    dtype: torch.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) int64 -> (tokens, hidden) in the compute dtype."""
        table = self.embed_table
        if isinstance(table, torch.Tensor):
            return F.embedding(input_ids, table).to(self.dtype)  # (tokens, hidden)
        return table.embedding(input_ids).to(self.dtype)  # packed: only the looked-up rows are unpacked


@dataclass(frozen=True)
class WeightsTelemetry:
    """What the weights did so far, for the engine's telemetry snapshot."""

    transport_name: str  # the transport's class, e.g. "CpuTransport"
    stream: StreamStats  # cumulative since load
    links: LinkSpeeds
    pinned_host_bytes: int  # page-locked host memory held (CUDA staging / pinned cache)
    buffer_sets: int  # host conversion buffer sets allocated (stays <= prefetch depth + 1)
    blocks_converted: int  # streamed blocks converted to the compute dtype on the host
    pinned_cache: bool  # CUDA: streamed blocks pinned once in host memory instead of staged per step
    resident_copies: int = 0  # resident blocks, and the head, copied out of their mapping (--resident-weights)
    resident_copies_in_huge_pages: int = 0  # of them, collapsed into huge pages so far


class ModelWeights:
    """The weights opened for a frozen plan: resident blocks materialised, globals placed, streamed
    blocks flowing through one transport chosen for the plan's tiers (tiers.make_transport)."""

    def __init__(self, checkpoint: ModelCheckpoint, plan: MemoryPlan, dtype: torch.dtype, device: torch.device,
                 transport: str = "auto", pin_host_memory: bool = False, host_budget: int | None = None,
                 disk_gbps: float | None = None, on_progress: Callable[[int], None] | None = None,
                 quantization: str | None = None, resident_weights: str = "auto"):
        """resident_weights: auto | copy | map, whether resident blocks that are views of a mapping are copied into
        huge pages of their own on the CPU (transports/resident_copy.py)."""
        if device.type != "cpu":
            resident_weights = "map"  # a device's resident blocks are its own memory already
        source = checkpoint.source
        self._source: BlockSource = source
        self._packed = checkpoint.packed
        self._dtype, self._device = dtype, device
        moe = checkpoint.cfg.moe
        self._expert_names = tuple(moe.expert_shapes(checkpoint.cfg.hidden_size)) if moe is not None else ()
        experts = entry = None
        if plan.expert_streaming:  # (MoE models are never quantized: the loader refuses that)
            # Blocks move without their experts; the expert tier moves each chosen expert by itself.
            forms = None
            if self._packed:
                # A GGUF file's experts stream only from its prepacked entry (the only case sizes() gives them
                # bytes): blocks map their other weights there, and each chosen expert is its views there.
                entry = _open_prepacked(checkpoint, dtype, device, on_progress,
                                        lambda b, name: group_kind(name) != "experts")
                if entry is None:
                    raise CheckpointError(f"{checkpoint.path}: its routed experts stream from the prepacked cache "
                                          "entry, which cannot be built here; load with --no-expert-streaming")
                forms = (lambda key: entry.expert(*key))
            try:
                experts = make_expert_tier(transport, checkpoint.cfg, source, dtype, device, plan, forms=forms,
                                           forms_moved=entry is not None)
            except BaseException:
                if entry is not None:
                    entry.close()
                raise
            source = source.without_experts()
        offload_source = on_device = None
        device_plan = plan  # what the block streamer serves: with groups off the device, every block's rest
        if plan.group_placement is not None:
            if quantization or experts is not None:
                raise ValueError("tensor groups off the device are served from unquantized safetensors weights or "
                                 "a GGUF file, without expert streaming, for now")
            off = plan.group_placement.off_device

            def on_device(b: int, name: str) -> bool:  # a stored tensor's short name, or a prepacked weight's
                return (b, group_kind(name)) not in off

            offload_source = source.select(lambda b, short: not on_device(b, short))
            source = source.select(on_device)
            device_plan = dataclasses.replace(plan, resident_blocks=list(range(plan.num_layers)),
                                              streamed_blocks=[], host_blocks=[], disk_blocks=[])
        quantized = head = None
        prepacked = entry
        try:
            # The prepacked entry's head is read every step, as its resident blocks are (the same choice).
            head_copies: list[torch.Tensor] = []  # the head's copy, collapsed into huge pages with the blocks'

            def copied_head(raw: torch.Tensor) -> torch.Tensor:
                head_copies.append(copied(raw))
                return head_copies[-1]

            copy_head = copied_head if resident_weights in ("auto", "copy") else None
            if entry is not None:
                head = entry.head(copy_head)
            elif quantization:
                # Weight-only int8/int4 at load, once per checkpoint: a cache entry under the layerstream
                # cache holds the quantized blocks and head (packed/quant_cache.py); later loads map it.
                from .packed.quant_cache import QuantizedBlocks

                quantized = QuantizedBlocks(source, quantization, dtype, on_progress=on_progress)
            elif self._packed and experts is None and resolve(transport, device) != "cuda":
                prepacked = _open_prepacked(checkpoint, dtype, device, on_progress, on_device)
                head = prepacked.head(copy_head) if prepacked is not None else None
            t = make_transport(transport, source, dtype, device, device_plan, pin_host_memory, host_budget,
                               disk_gbps, quantized=quantized, prepacked=prepacked)
        except BaseException:
            if quantized is not None:
                quantized.close()
            if prepacked is not None:
                prepacked.close()
            if experts is not None:
                experts.close()
            raise
        self.plan = plan
        self._acquired: dict[int, dict[str, torch.Tensor]] = {}
        self._experts = experts
        self._transport: Transport = t
        self._streamer: BlockStreamer | None = None
        self._offload: OffloadTier | None = None
        # The link a CPU-computed group's activations cross (transports/activations.py), with groups off the device.
        self.activations: ActivationLink | None = None
        try:
            self.globals = _place_globals(source, dtype, device, quantized, head)
            if on_progress:
                on_progress(-1)
            if offload_source is not None:
                self._offload = _offload_tier(checkpoint, offload_source, plan, dtype, device, transport,
                                              pin_host_memory, host_budget, disk_gbps)
                self.activations = make_activation_link(transport, checkpoint.cfg, plan, dtype, device)
            # On a CUDA device stacking would briefly hold a block's projections twice in device memory,
            # which the plan does not budget: CPU only for now.
            self._streamer = BlockStreamer(self._transport, device_plan.resident_blocks, device_plan.streamed_blocks,
                                           plan.prefetch_depth, on_progress=on_progress,
                                           fuse=device.type == "cpu", resident_weights=resident_weights,
                                           other_copies=head_copies)
        except BaseException:
            self.close()  # the prefetch thread, reader threads, pinned memory
            raise
        t = self._transport
        # With groups placed, every block may be resident: then the off-device MLPs' transport measured the link.
        h2d = t.link_gbps() or (self._offload.link_gbps() if self._offload is not None else None)
        self.links = LinkSpeeds(h2d_gbps=h2d, disk_gbps=disk_gbps, device_gbps=t.device_gbps)

    # -- the compute thread's side --------------------------------------------------------------
    def acquire(self, block: int) -> dict[str, torch.Tensor]:
        """Block `block`'s weights on the compute device (waits if the prefetcher is behind)."""
        w = self._streamer.acquire(block)
        self._acquired[block] = w
        return w

    def release(self, block: int) -> None:
        """The block's kernels were issued: its buffer may take the next streamed block."""
        self._acquired.pop(block, None)
        self._streamer.release(block)

    def offloaded(self, block: int, path: str) -> dict[str, torch.Tensor]:
        """Block `block`'s tensor groups off the device (plan.group_placement; acquire() hands over the rest) for
        this step's path (engine.placement.PathPolicy): "cpu", host tensors for the CPU to compute; "stream",
        moved to the device over the transport's link. Valid until release_offloaded(block)."""
        return self._offload.acquire(block, path)

    def release_offloaded(self, block: int) -> None:
        self._offload.release(block)

    def offloaded_experts(self, block: int, chosen: list[int], path: str
                          ) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """MoE block `block`'s chosen routed experts when the plan put them off the device, for this step's
        path: "cpu", host tensors (one group); "stream", only these experts, read into the device expert cache,
        in groups as weights.experts gives them (each valid until the next is asked for)."""
        return self._offload.experts(block, chosen, path)

    def set_visit_order(self, blocks: list[int]) -> None:
        """The cyclic order acquire() visits blocks in from now on (default: 0..n-1 every step). Training
        passes 0..n-1 then n-1..0 so that the backward pass's blocks are prefetched in reverse. Drops
        what was prepared for the old order."""
        self._acquired.clear()
        self._streamer.set_order(blocks)

    def experts(self, block: int, chosen: list[int], hidden: torch.Tensor, router: "Router"
                ) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
        """The chosen experts of MoE block `block` (acquired), as groups {expert: {"w_gate", "w_up",
        "w_down"}} (the names MoEConfig.expert_shapes gives) that are valid until the next group is asked
        for. `hidden` (tokens, hidden) is the block's residual stream after attention: the expert tier
        guesses the next MoE block's experts from it with `router` (the model's, experts/tier.py Router)
        and starts fetching them while this block computes."""
        if self._experts is not None:
            yield from self._experts.groups(block, chosen, hidden, router)
            return
        w = self._acquired[block]  # whole-block streaming: the experts came with the block
        yield {e: {k: w[expert_key(e, k)] for k in self._expert_names} for e in chosen}

    def reset(self) -> None:
        """After a step failed half-way: drop what is in flight, restart at the first streamed block."""
        self._acquired.clear()
        if self._experts is not None:
            self._experts.reset()
        if self._offload is not None:
            self._offload.reset()
        self._streamer.reset()

    def self_draft(self, on_progress: Callable[[int], None] | None = None) -> "SelfDraftWeights":
        """Speculative decoding's self-draft: these weights with every streamed block (every block
        when none streams or on the CPU) replaced by a resident int4 copy quantized from the
        checkpoint; the other resident blocks and the globals shared. Safetensors checkpoints on the CPU."""
        from .self_draft import SelfDraftWeights

        if self._packed or self._device.type != "cpu":
            raise ValueError("the self-draft needs a safetensors checkpoint computed on the CPU")
        from .self_draft import self_draft_copies_every_block

        copy = self.plan.streamed_blocks
        if not copy or self_draft_copies_every_block(self._device):
            copy = list(range(self.plan.num_layers))
        return SelfDraftWeights.build(self._source, self.globals, self._streamer.resident_weights(), copy,
                                      self._dtype, self._device, on_progress)

    @property
    def stream_stats(self) -> StreamStats:
        """Cumulative counters (an immutable record: subtract two with since()), the expert tier's included."""
        stats = self._streamer.stats
        if self._offload is not None:  # off-device groups streamed for a step
            stats = stats.plus(self._offload.stats)
        return stats if self._experts is None else stats.plus(self._experts.stats)

    def telemetry(self) -> WeightsTelemetry:
        t = self._transport
        # Host buffer sets: dtype conversion (BufferPool) or, for packed blocks, the repack's slots.
        pool = t.pool if t.pool is not None else getattr(t, "repacker", None)
        pinned = t.host_bytes + sum(x.host_bytes for x in (self._experts, self.activations) if x is not None)
        copies = self._streamer.resident_copies if self._streamer is not None else 0
        collapse = self._streamer.huge_pages if self._streamer is not None else None
        return WeightsTelemetry(type(t).__name__, self.stream_stats, self.links, pinned,
                                pool.sets_made if pool else 0, pool.takes if pool else 0, t.pinned_cache,
                                copies, collapse.collapsed if collapse is not None else 0)

    def wait_resident_copies(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the background collapse of the resident copies into huge pages
        (--resident-weights; benchmarks that time steady state). True when it is done or there is none."""
        collapse = self._streamer.huge_pages if self._streamer is not None else None
        return collapse is None or collapse.wait(timeout)

    def close(self) -> None:
        """Stop the prefetch thread and give back buffers, pinned memory and threads (idempotent)."""
        if getattr(self, "_experts", None) is not None:
            self._experts.close()
            self._experts = None
        if getattr(self, "_offload", None) is not None:
            self._offload.close()
            self._offload = None
        if getattr(self, "activations", None) is not None:
            self.activations.close()
            self.activations = None
        if self._streamer is not None:
            self._streamer.close()  # closes the transport too
            self._streamer = None
        elif self._transport is not None:
            self._transport.close()
        self._transport = None


def _offload_tier(checkpoint: ModelCheckpoint, source: BlockSource, plan: MemoryPlan, dtype: torch.dtype,
                  device: torch.device, transport: str, pin_host_memory: bool, host_budget: int | None,
                  disk_gbps: float | None) -> OffloadTier:
    """The tier serving the plan's off-device groups (`source`: their tensors): MLPs (and shared experts) stream
    through a transport of their own, routed experts through an expert tier whose cache takes what the plan's
    stream buffers leave after the MLPs' (placement.place_groups sized them so that prefetch depth + 1 experts
    fit beside the MLPs' buffers: the cache has those slots at least, within the budget). A GGUF file's MLPs
    stream as its blocks do (the prepacked entry's bytes to a CPU device, GGML bytes to a GPU) and the CPU
    computes them in the packed kernels' form (_host_transport); so are its routed experts computed, and streamed
    they move their GGML bytes into a GPU's slots, or on a CPU device the packed forms the CPU path holds (views of
    the prepacked entry, moving their parts there, or made once at load, moving the file's bytes)."""
    cfg = checkpoint.cfg
    placed = plan.group_placement
    off = placed.off_device_groups
    mlps = sorted({g.layer for g in off if g.kind == "mlp"})
    routed = [g for g in off if g.kind == "experts"]
    link = experts = host = prepacked = None

    def off_device(b: int, name: str) -> bool:
        return placed.is_off_device(b, group_kind(name))

    try:
        host = _host_transport(checkpoint, source, dtype, off_device)
        from .transports.prepacked import PrepackedTransport

        from_entry = isinstance(host, PrepackedTransport)  # its experts are views of the prepacked entry
        mlp_buffers = 0
        if mlps:
            groups_plan = dataclasses.replace(plan, resident_blocks=[], streamed_blocks=mlps)
            if checkpoint.packed and resolve(transport, device) != "cuda":
                # the MLPs' weights only: routed experts move through the expert tier (they are the host's views)
                prepacked = _open_prepacked(checkpoint, dtype, device, None,
                                            lambda b, name: off_device(b, name) and group_kind(name) != "experts")
            link = make_transport(transport, source.without_experts(), dtype, device, groups_plan, pin_host_memory,
                                  host_budget, disk_gbps, prepacked=prepacked)
            prepacked = None  # the transport's now
            if placed.stream_buffer_bytes:
                mlp_buffers = (plan.prefetch_depth + 1) * max(g.nbytes for g in off if g.kind == "mlp")
        if routed and placed.stream_buffer_bytes:
            expert_bytes = max(g.nbytes // g.experts_total for g in routed)
            slots = (placed.stream_buffer_bytes - mlp_buffers) // expert_bytes
            assert slots >= 1, "place_groups reserves expert slots beside the MLPs' buffers"

            def experts(host_experts) -> "ExpertTier":
                # A GGUF file's experts on a CPU device: the slots hold the packed forms the CPU path has; from the
                # prepacked entry, a fill moves their parts there (what group_bytes priced the group at).
                forms = (lambda key: host_experts[key[0]][key[1]]) if checkpoint.packed else None
                return make_expert_tier(transport, cfg, source, dtype, device,
                                        dataclasses.replace(plan, expert_slots=slots), guess=False, forms=forms,
                                        forms_moved=from_entry)
        return OffloadTier(source, plan, dtype, link, experts, host)
    except BaseException:
        for owned in (link, prepacked, host):
            if owned is not None:
                owned.close()
        raise


def _host_transport(checkpoint: ModelCheckpoint, source: BlockSource, dtype: torch.dtype,
                    keep: Callable[[int, str], bool]) -> Transport:
    """The transport whose resident() blocks are the CPU's tensors of the off-device groups (`source`; `keep`
    selects the same by block and name): a plain checkpoint's, views of its mapping (converted copies where the
    dtype differs); a GGUF file's, the packed bytes the CPU kernels read where they lie: views of the prepacked
    entry's mapping (built now if missing, whatever the compute device: it is the CPU that reads them). Where
    there is no entry: exact fp32 mode, GGUFWeight views of the file dequantized per use (the values a resident
    block holds); otherwise (no VNNI kernels, LAYERSTREAM_PREPACK=off, a cache that cannot take it) the resident
    compute form, packed, made once at load."""
    if not checkpoint.packed:
        return CpuTransport(source, dtype)
    cpu = torch.device("cpu")
    store = _open_prepacked(checkpoint, dtype, cpu, None, keep)
    if store is not None:
        from .transports.prepacked import PrepackedTransport

        return PrepackedTransport(store)
    from .transports.gguf import PackedCpuTransport

    fmt = PackedFormat(dtype, cpu)
    return PackedCpuTransport(source, fmt, resident_views=fmt.exact)


def _open_prepacked(checkpoint: ModelCheckpoint, dtype: torch.dtype, device: torch.device,
                    on_progress: Callable[[int], None] | None, keep: Callable[[int, str], bool] | None = None):
    """The GGUF blocks' prepacked cache entry (built now if it is missing), or None where there is
    none: the mode has no such form, or the cache cannot take it (then blocks are repacked at load
    and per step, as without the entry). keep(block, name): only those weights (PrepackedBlocks)."""
    layout = checkpoint.prepacked_layout(dtype, device)
    if layout is None:
        return None
    from .packed.prepacked import PrepackedBlocks

    try:
        store = PrepackedBlocks(checkpoint.source, layout, on_progress, keep)
        log.info("GGUF blocks in the CPU kernels' layout from %s%s", store.path, " (built now)" if store.built else "")
        return store
    except OSError as e:
        log.warning("cannot build the prepacked cache entry %s (%s): GGUF blocks are repacked at every load and "
                    "streamed ones at every step; `layerstream convert` where the cache is writable avoids that",
                    layout.folder, e)
        return None


def _place_globals(source: BlockSource, dtype: torch.dtype, device: torch.device, quantized=None,
                   head=None) -> PlacedGlobals:
    """`head`: the head in its compute form already (a prepacked entry's view), else made here."""
    if source.packed:
        return _place_packed_globals(source, PackedFormat(dtype, device), head)
    views = source.global_views()
    lazy_embed = device.type == "cpu" and "lm_head" in views
    # On the CPU, a table the checkpoint holds in the compute dtype is used where it lies, as resident
    # blocks are (CpuTransport.resident): a copy would cost the load its time and the process its
    # anonymous memory. Other dtypes, and other devices, get their own converted copy.
    placed = {k: v if k == "embed" and lazy_embed else to_compute({k: v}, dtype, device, copy=device.type != "cpu")[k]
              for k, v in views.items() if not (k == "lm_head" and quantized is not None)}
    # Quantized at load: the head is int8 per row, whatever the blocks' mode (packed/quantize.py).
    head = quantized.head() if quantized is not None else placed.get("lm_head", placed["embed"])
    return PlacedGlobals(placed["embed"], placed["norm"], head, dtype)


def _place_packed_globals(source: BlockSource, fmt: PackedFormat, head=None) -> PlacedGlobals:
    """The token table stays packed (rows unpacked on lookup); norm and head in their compute form."""
    infos = source.global_infos()
    if head is None:
        name = "lm_head" if "lm_head" in infos else "embed"
        head = fmt.resident(infos[name], source.global_rows(name))
    return PlacedGlobals(fmt.embedding(infos["embed"], source.global_rows("embed")),
                         fmt.resident(infos["norm"], source.global_rows("norm")), head, fmt.dtype)
