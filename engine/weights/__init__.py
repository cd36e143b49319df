"""The weights package: the only code that knows where a model's weights live, in what format, and how
they reach compute (and the only code that touches copy streams and events).

Public interface (the engine imports nothing else from engine/weights; benchmarks also use probes.py;
tests/test_import_rules.py enforces both):

  checkpoint = ModelCheckpoint(path)   (checkpoint.cfg: the ModelConfig its format records)
      Open the checkpoint through its format's reader (formats/open.py, the one place formats are told
      apart: a safetensors folder or a GGUF file) and check every tensor the architecture needs (present,
      expected shape). CheckpointError names the file and tensor otherwise. checkpoint.packed: GGUF.
  checkpoint.sizes(dtype) -> WeightSizes
      Bytes of a block and of the globals in the compute dtype, and as stored: the planner's inputs.
  checkpoint.group_bytes(dtype, device) -> [{group kind: (bytes read and moved, bytes resident)}] | None
      A GGUF file's tensor groups per block at their packed bytes (placement below the block prices those);
      None for a plain checkpoint, whose groups are their parameters in the compute dtype.
  checkpoint.host_tiering(transport, device, dtype, depth) -> HostTiering | None
      How planning may split streamed blocks between host memory and disk for that transport.
  checkpoint.measure_disk() -> (GB/s | None, note | None)
      The disk's sequential read speed, for a plan with a disk tier (cached per file system).
  checkpoint.time_disk_reads(blocks) -> (bytes, seconds)
      Read blocks once the way the disk tier does (benchmarks).
  weights = ModelWeights(checkpoint, plan, dtype, device, transport=..., pin_host_memory=...,
                         host_budget=..., disk_gbps=..., resident_weights=...)
      Open the weights for a frozen MemoryPlan: the transport serving the plan's tiers is chosen in one
      place (transports/tiers.py), resident blocks are materialised, streaming starts.
  weights.globals -> PlacedGlobals
      Embeddings, final norm and head placed on the device; .embed(ids) gathers rows in the compute dtype.
  weights.acquire(i) -> {short name: tensor}; weights.release(i); weights.reset()
      Block i's weights for the math, then give its buffer back (compute thread only, blocks in order).
  weights.set_visit_order(blocks)
      Change that order (a cycle; a block may recur): fine-tuning's forward 0..n-1 then backward n-1..0.
      A weight is a tensor or a packed weight (GGUFWeight, Int4Weight, Int8Weight: data, which engine.ops
      multiplies).
  weights.experts(i, chosen, hidden, router) -> iterator of {expert: {"w_gate", "w_up", "w_down"}} groups
      (an expert's tensors are MoEConfig.expert_shapes': GPT-OSS's have biases and other names)
      Mixtures of experts: the experts the step's tokens chose in block i (acquired). With a plan that
      streams experts (plan.expert_streaming) each is its own unit, read by byte range into the device
      expert cache (experts/); `router(hidden, {"mlp_norm", "router"[, "router_bias"]})` -> expert ids (the
      model's router, passed by the runner: this package holds weights, not math) lets the tier guess block i+1's
      experts from `hidden` and prefetch them. Otherwise they come out of block i's own weights.
  weights.offloaded(i, path) -> {short name: tensor}; weights.release_offloaded(i)
      A plan with tensor groups off the device (plan.group_placement, engine.placement): acquire(i) hands
      over block i's groups on the device, offloaded(i, path) the rest (its MLP) for this step's path:
      "cpu", host tensors the CPU computes from (only activations cross the link), or "stream", moved to
      the device through the transport as a streamed block is (offload.py), counted in stream_stats. A
      GGUF file's host tensors are packed: views of the prepacked entry (exact mode: of the file).
  weights.offloaded_experts(i, chosen, path) -> iterator of {expert: tensors} groups
      A MoE block whose routed experts the plan put off the device: the chosen ones for this step's path,
      "cpu" (host tensors, one group) or "stream" (only these experts, read into the device expert cache,
      LRU over every block, grouped as weights.experts groups them; counted in stream_stats as expert bytes).
  weights.activations -> ActivationLink (None without groups off the device)
      How the CPU path's activations cross (transports/activations.py): link.to_host(*tensors).wait() -> host
      tensors (their copy ordered after the kernels that made them), link.to_device(host, like) -> on like's
      device (the next kernel there ordered after its copy). One crossing at a time, from the compute thread;
      device work enqueued between to_host and wait overlaps the copy and the host's computation. On a GPU:
      pinned staging sized once for the step's most tokens, a copy stream and events.
  weights.wait_resident_copies(timeout) -> bool
      Wait for the background collapse of resident copies into huge pages (benchmarks timing steady state).
  weights.stream_stats -> StreamStats; weights.telemetry() -> WeightsTelemetry; weights.links -> LinkSpeeds
      Bytes streamed by tier (counted as they cross the link, after dtype conversion), stall and
      prepare time; the measured link speeds, kept in their own record, never in the plan (floor_percent:
      a step's bytes against them).
  config_folder(path) -> Path; is_gguf_metadata_folder(folder) -> bool (config_folder's folder for a GGUF file,
      written by the engine); find_gguf(folder) -> Path
      Where transformers reads the tokenizer and chat template (a GGUF file's are its metadata, cached);
      the one GGUF model in a folder.
  TRANSPORTS, check_transport(name)
      The transport names (EngineArgs.transport), and their one validation.
  RESIDENT_WEIGHTS, check_resident_weights(mode); ModelWeights(..., resident_weights=mode)
      On the CPU, whether resident blocks that are views of a mapping are copied into huge pages of the
      process's own at load: auto (prepacked blocks and head: measured to read faster), copy, map
      (transports/resident_copy.py; EngineArgs.resident_weights).
  quantization="int8"|"int4" (ModelWeights, checkpoint.sizes): weight-only quantization at load, once
      per checkpoint: the result is a cache entry under the layerstream cache (packed/quant_cache.py).
  checkpoint.convert(dtype, quantization=None, on_progress=None) -> ConvertedEntry (folder, built, what);
  checkpoint.prepack_pending(dtype, device) -> blocks the next load prepacks first
      A GGUF file in CPU fast mode is prepacked once, on its first load or by `layerstream convert`: its
      blocks in the int4/int8 kernels' layout, stacked, in a cache entry that later loads map
      (packed/prepacked.py; streamed blocks are views of it, or disk reads of it: transports/prepacked.py).
      LAYERSTREAM_PREPACK=off keeps the repack at load and per step (packed/stream_repack.py).
  checkpoint.self_draft_sizes(dtype) -> (bytes of a block's int4 copy, of the int8 head copy); and
  weights.self_draft() -> SelfDraftWeights
      Speculative decoding's self-draft: the compute side of these weights (globals, acquire/release)
      with every streamed block replaced by a resident int4 copy and an int8 head; resident blocks,
      embeddings and norm shared (self_draft_copies_every_block(device): on the CPU every block gets a copy).
  weights.close(); checkpoint.close()
      Give back threads, buffers, pinned memory, file descriptors and mappings. A constructor that
      fails releases what it took before raising.

Inside (may change freely), one job per sub-package:
  formats/     the checkpoint readers: reader.py (CheckpointReader, TensorInfo: named tensors with byte
               ranges, a storage dtype OR a quant type such as "Q4_K", a logical shape, zero-copy views,
               the format's tensor names, row order and model config), safetensors_index.py (WeightIndex),
               gguf_file.py (GGUFIndex) with gguf_config.py, open.py (which reader), views.py, and
               block_source.py (BlockSource: a block's tensors by short name, over any reader).
  packed/      weights kept packed: weights.py (GGUFWeight, Int4Weight, Int8Weight), dequant.py (GGML blocks
               in torch), compute_form.py (what a GGUF tensor becomes for compute), stream_repack.py (that
               form made on the prefetch thread), prepacked.py (made once into a cache entry), quantize.py
               and quant_cache.py (quantization at load, once into a cache entry), fuse.py (q/k/v and
               gate/up stacked).
  transports/  how a streamed block reaches compute: base.py (Transport, Ticket), cpu.py, gguf.py,
               prepacked.py, quantized.py, disk.py (with disk_reader.py, read_ahead.py, disk_bandwidth.py),
               cuda.py (with cuda_runtime.py, cuda_layout.py, cuda_trace.py), simulated.py; tiers.py (which
               transport), streamer.py (the prefetch thread), buffers.py, bandwidth.py, exit_stop.py;
               activations.py (the CPU path's activations, both ways); resident_copy.py (resident blocks
               copied into huge pages).
  experts/     the expert-granular tier: tier.py (readers, host slots, the guess of the next block's
               experts), cache.py (slots, LRU, the fetch thread), cuda_slots.py (slots on a GPU).
  offload.py   tensor groups off the device: host tensors for the CPU path, the transport for the stream path.
The unit a transport moves is a block's set of named tensors (BlockSource.tensors(i)), plain or packed:
packed (GGUF) blocks move their stored bytes on every tier (page cache, disk, CUDA); a routed expert is a
finer unit of the same source (BlockSource.expert_tensors(i, e)), moved by the expert tier.
"""

from ..errors import CheckpointError
from .formats.block_source import WeightSizes
from .formats.gguf_file import find_gguf
from .formats.open import config_folder, is_gguf_metadata_folder
from .model_weights import ModelCheckpoint, ModelWeights, PlacedGlobals, WeightsTelemetry
from .packed.weights import GGUFWeight, Int4Weight, Int8Weight
from .self_draft import SELF_DRAFT_QUANTIZATION, SelfDraftWeights, self_draft_copies_every_block
from .transports.bandwidth import LinkSpeeds, floor_percent
from .transports.resident_copy import MODES as RESIDENT_WEIGHTS
from .transports.resident_copy import check_mode as check_resident_weights
from .transports.streamer import StreamStats
from .transports.tiers import TRANSPORTS, check_transport

__all__ = [
    "CheckpointError", "GGUFWeight", "Int4Weight", "Int8Weight", "LinkSpeeds", "ModelCheckpoint", "ModelWeights",
    "PlacedGlobals", "RESIDENT_WEIGHTS", "SELF_DRAFT_QUANTIZATION", "SelfDraftWeights", "StreamStats", "TRANSPORTS",
    "WeightSizes", "WeightsTelemetry", "check_resident_weights", "check_transport", "config_folder", "find_gguf",
    "floor_percent", "is_gguf_metadata_folder", "self_draft_copies_every_block",
]
