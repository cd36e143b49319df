"""The weights package: the only code that knows where a model's weights live, in what format, and how
they reach compute (and the only code that touches copy streams and events).

Public interface (everything else in engine/weights is internal; tests/test_import_rules.py enforces it):

  checkpoint = ModelCheckpoint(path)   (checkpoint.cfg: the ModelConfig its format records)
      Open the checkpoint through its format's reader (`open_checkpoint`, the one place formats are told
      apart: a safetensors folder or a GGUF file) and check every tensor the architecture needs (present,
      expected shape). CheckpointError names the file and tensor otherwise. checkpoint.packed: GGUF.
  checkpoint.sizes(dtype) -> WeightSizes
      Bytes of a block and of the globals in the compute dtype, and as stored: the planner's inputs.
  checkpoint.host_tiering(transport, device, dtype, depth) -> HostTiering | None
      How planning may split streamed blocks between host memory and disk for that transport.
  Int4Weight, Int8Weight, quantize_int4
      The packed weight types (each multiplies itself: `w.linear(x)`) and int4 quantization, for the
      kernel micro-benchmark (layerstream/bench/int4_kernel.py).
  checkpoint.measure_disk() -> (GB/s | None, note | None)
      The disk's sequential read speed, for a plan with a disk tier (cached per file system);
      measure_disk_bandwidth(files, ...) is the measurement itself, for benchmarks.
  checkpoint.time_disk_reads(blocks) -> (bytes, seconds)
      Read blocks once the way the disk tier does (benchmarks).
  weights = ModelWeights(checkpoint, plan, dtype, device, transport=..., pin_host_memory=...,
                         host_budget=..., disk_gbps=...)
      Open the weights for a frozen MemoryPlan: the transport serving the plan's tiers is chosen in one
      place (tiers.make_transport), resident blocks are materialised, streaming starts.
  weights.globals -> PlacedGlobals
      Embeddings, final norm and head placed on the device; .embed(ids) gathers rows in the compute dtype.
  weights.acquire(i) -> {short name: tensor}; weights.release(i); weights.reset()
      Block i's weights for the math, then give its buffer back (compute thread only, blocks in order).
  weights.experts(i, chosen, hidden) -> iterator of {expert: {"w_gate", "w_up", "w_down"}} groups
      Mixtures of experts: the experts the step's tokens chose in block i (acquired). With a plan that
      streams experts (plan.expert_streaming) each is its own unit, read by byte range into the device
      expert cache (experts.py, expert_cache.py; its slots in device memory behind pinned staging, a
      copy stream and events on a GPU: cuda_experts.py); `hidden` lets the tier guess block i+1's experts and
      prefetch them. Otherwise they come out of block i's own weights.
  weights.stream_stats -> StreamStats; weights.telemetry() -> WeightsTelemetry; weights.links -> LinkSpeeds
      Bytes streamed by tier (counted as they cross the link, after dtype conversion), stall and
      prepare time; the measured link speeds, kept in their own record, never in the plan.
  PINNED_HOST_MARGIN, host_register_works(device), host_to_device_gbps(device)
      What a GPU benchmark or probe needs to know about the CUDA path without reaching into it.
  config_folder(path) -> Path; find_gguf(folder) -> Path
      Where transformers reads the tokenizer and chat template (a GGUF file's are its metadata, cached);
      the one GGUF model in a folder.
  quantization="int8"|"int4" (ModelWeights, checkpoint.sizes): weight-only quantization at load, once
      per checkpoint: the result is a cache entry under the layerstream cache (quant_cache.py).
  checkpoint.convert(dtype, quantization=None, on_progress=None) -> ConvertedEntry (folder, built, what);
  checkpoint.prepack_pending(dtype, device) -> blocks the next load prepacks first
      A GGUF file in CPU fast mode is prepacked once, on its first load or by `layerstream convert`: its
      blocks in the int4/int8 kernels' layout, stacked, in a cache entry that later loads map
      (prepacked.py; streamed blocks are views of it, or disk reads of it: prepacked_transport.py).
      LAYERSTREAM_PREPACK=off keeps the repack at load and per step (stream_repack.py).
  checkpoint.self_draft_sizes(dtype) -> (bytes of a block's int4 copy, of the int8 head copy); and
  weights.self_draft() -> SelfDraftWeights
      Speculative decoding's self-draft: the compute side of these weights (globals, acquire/release)
      with every streamed block replaced by a resident int4 copy and an int8 head; resident blocks,
      embeddings and norm shared (self_draft_copies_every_block(device): on the CPU every block gets a copy).
  weights.close(); checkpoint.close()
      Give back threads, buffers, pinned memory, file descriptors and mappings. A constructor that
      fails releases what it took before raising.

Readers (checkpoint.py): a CheckpointReader is named tensors with byte ranges, a storage dtype OR a quant
type (e.g. "Q4_K"), a logical shape, zero-copy typed views of plain tensors and raw-byte views of packed
ones, the format's tensor names, its row order and its model config. safetensors_index.WeightIndex and
gguf_file.GGUFIndex are the readers, told apart in formats.open_checkpoint. The unit a transport moves is
a block's set of named tensors (BlockSource.tensors(i)), plain or packed: packed (GGUF) blocks move
their stored bytes on every tier (page cache, disk, CUDA); a routed expert is a finer unit
of the same source (BlockSource.expert_tensors(i, e)), moved by the expert tier (experts, expert_cache).

Inside (may change freely): source.BlockSource (a block's tensors by short name), streamer.BlockStreamer
(prefetch thread), transport (Transport, Ticket, CpuTransport), tiers (which transport), cuda_transport
(with cuda_runtime, layout, cuda_trace), disk_transport, packed_transport, simulated_transport,
disk_reader, buffers.BufferPool, bandwidth, disk_bandwidth, views, packed / packed_format / dequant /
quantize / quant_cache / quantized_transport (packed weights, their compute forms, quantization at
load), stream_repack / prepacked / prepacked_transport (GGUF blocks in the CPU kernels' layout: repacked
per step, or once into a cache entry), gguf_file / gguf_config (the GGUF reader).
"""

from ..errors import CheckpointError
from .transports.bandwidth import LinkSpeeds, StepEstimate, efficiency, expected_step, floor_percent, host_to_device_gbps
from .formats.reader import CheckpointReader, TensorInfo
from .transports.cuda import HOST_MARGIN as PINNED_HOST_MARGIN
from .transports.cuda_runtime import host_register_works
from .transports.disk_bandwidth import DiskBandwidth
from .transports.disk_bandwidth import disk_bandwidth as measure_disk_bandwidth
from .formats.open import config_folder, open_checkpoint
from .formats.gguf_file import find_gguf
from .packed.weights import Int4Weight, Int8Weight
from .packed.quantize import quantize_int4
from .model_weights import ModelCheckpoint, ModelWeights, PlacedGlobals, WeightsTelemetry
from .self_draft import SELF_DRAFT_QUANTIZATION, SelfDraftWeights, self_draft_copies_every_block
from .formats.block_source import WeightSizes
from .transports.streamer import StreamStats
from .transports.tiers import TRANSPORTS, check_transport

__all__ = [
    "CheckpointError", "CheckpointReader", "DiskBandwidth", "config_folder", "find_gguf", "LinkSpeeds",
    "ModelCheckpoint", "ModelWeights",
    "PINNED_HOST_MARGIN", "PlacedGlobals", "SELF_DRAFT_QUANTIZATION", "SelfDraftWeights",
    "self_draft_copies_every_block", "StepEstimate", "StreamStats", "TRANSPORTS", "TensorInfo",
    "WeightSizes", "WeightsTelemetry", "check_transport", "efficiency", "expected_step", "floor_percent",
    "host_register_works", "host_to_device_gbps", "measure_disk_bandwidth", "open_checkpoint",
    "Int4Weight", "Int8Weight", "quantize_int4",
]
