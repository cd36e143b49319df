"""What the benchmarks and probes measure inside the weights package, apart from its interface.

Only layerstream/bench (and tests) import this module; the engine uses engine/weights/__init__.py
(tests/test_import_rules.py checks it).

  open_checkpoint(path) -> CheckpointReader
      The format's reader itself, without ModelCheckpoint's checks (the offline and GPU benchmarks read
      sizes and headers with it).
  quantize_int4(w, dtype) -> Int4Weight
      int4 quantization of a dense weight, for the kernel micro-benchmark (bench/int4_kernel.py).
  measure_disk_bandwidth(files, ...) -> DiskBandwidth
      The disk's sequential read speed, measured (ModelCheckpoint.measure_disk is the cached one).
  PINNED_HOST_MARGIN, host_register_works(device), host_to_device_gbps(device)
      What a GPU benchmark or probe needs to know about the CUDA path without reaching into it.
  efficiency, expected_step, StepEstimate
      A step's floor from the plan and the measured links, and how close a run came to it.
  file_mappings() -> {path: (resident bytes, of which in huge pages)}, map_file(fd) -> mmap, ChunkedFileWriter
      How the checkpoint files this process maps are paged (bench/decode_profile.py prints it), the mapping
      the readers make and the prepacked entry's writer (bench/pages.py times them against plain ones).
  tensor_parts(w) -> {name: tensor}
      The tensors holding a weight's bytes (itself, or a packed weight's parts): what a plain read of the
      weights reads (bench/decode_profile.py).
"""

from .formats.open import open_checkpoint
from .formats.views import file_mappings, map_file
from .packed.chunked_file import ChunkedFileWriter
from .packed.quantize import quantize_int4
from .transports.bandwidth import StepEstimate, efficiency, expected_step, host_to_device_gbps
from .transports.cuda import HOST_MARGIN as PINNED_HOST_MARGIN
from .transports.cuda_runtime import host_register_works
from .transports.disk_bandwidth import DiskBandwidth
from .transports.disk_bandwidth import disk_bandwidth as measure_disk_bandwidth
from .transports.resident_copy import tensor_parts

__all__ = ["ChunkedFileWriter", "DiskBandwidth", "PINNED_HOST_MARGIN", "StepEstimate",
           "efficiency", "expected_step", "file_mappings", "host_register_works", "host_to_device_gbps", "map_file",
           "measure_disk_bandwidth", "open_checkpoint", "quantize_int4", "tensor_parts"]
