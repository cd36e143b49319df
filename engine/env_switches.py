"""Every LAYERSTREAM_* environment variable that is not a `layerstream serve` flag: one table of data.

Each variable is read where it acts (the module named in `read_by`); this table only names and describes
them, so docs/reference/environment.md can be generated from it (`python -m layerstream.reference`) and
tests/layerstream/test_docs_reference.py can check that every LAYERSTREAM_* name in the source tree is listed here.
The LAYERSTREAM_<FLAG> variables of `layerstream serve` (server/launch.py) are not listed: the reference
derives them from the flags themselves. Imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE = "engine"  # read by the library at run time: every entry point (LLM, generate, serve)
BENCH = "benchmarks"  # read by layerstream.bench
SETUP = "set-up and image"  # read by scripts/, docker/ and the Dockerfile, not by Python code


@dataclass(frozen=True)
class EnvSwitch:
    name: str
    default: str
    values: str  # what it accepts
    scope: str  # ENGINE, BENCH or SETUP
    read_by: str  # where it is read
    help: str


SWITCHES: tuple[EnvSwitch, ...] = (
    EnvSwitch("LAYERSTREAM_CACHE", "$XDG_CACHE_HOME/layerstream, else ~/.cache/layerstream", "a folder", ENGINE,
              "engine/cache.py",
              "The layerstream cache: built C++ kernels, quantized and prepacked model entries, GGUF metadata, "
              "the disk bandwidth measured per file system, the random-weight demo model. Never the model's "
              "own folder."),
    EnvSwitch("LAYERSTREAM_INT4_KERNEL", "auto", "auto, vnni, aten", ENGINE, "engine/kernels/__init__.py",
              "int4 and int8 weight products: the AVX512-VNNI kernel where the CPU has it (auto, vnni), or "
              "torch's weight-only kernels (aten). Quantized cache entries are keyed by the layout."),
    EnvSwitch("LAYERSTREAM_FUSED_OPS", "auto", "auto, torch", ENGINE, "engine/kernels/fused_ops.py",
              "The fused C++ CPU ops (RMSNorm, residual add + RMSNorm, SwiGLU, rotary, decode attention); "
              "torch runs torch's ops instead, and turns the decode block off too."),
    EnvSwitch("LAYERSTREAM_ATTENTION_OPS", "auto", "auto, torch", ENGINE, "engine/kernels/attention_ops.py",
              "The C++ scale + mask + softmax pass of the CPU bf16 attention path; torch uses torch's ops."),
    EnvSwitch("LAYERSTREAM_KV_ATTENTION", "auto", "auto, torch", ENGINE, "engine/kernels/kv_attention.py",
              "Attention over a quantized KV cache (--kv-cache-dtype int8|int4) token by token in C++, reading the "
              "codes in place; torch gathers and dequantizes a bounded group of sequences at a time instead."),
    EnvSwitch("LAYERSTREAM_BF16_ROWS", "auto", "auto, off", ENGINE, "engine/kernels/bf16_rows.py",
              "bf16 products of 1-16 rows by engine/kernels/bf16_rows.cpp (CPUs with AVX512-BF16 and no AMX); "
              "off leaves them to oneDNN."),
    EnvSwitch("LAYERSTREAM_AMX_PREFILL", "auto", "auto, off", ENGINE, "engine/ops.py",
              "Packed (GGUF, int4, int8) weights times a prompt chunk of many rows on a CPU with AMX: dequantized "
              "to bf16 a chunk at a time for oneDNN's AMX products; off keeps every product on the integer "
              "kernel."),
    EnvSwitch("LAYERSTREAM_DECODE_BLOCK", "auto", "auto, off", ENGINE, "engine/kernels/decode_block.py",
              "A decode step's transformer block as one C++ call; off runs the block op by op."),
    EnvSwitch("LAYERSTREAM_STREAM_REPACK", "auto", "auto, off", ENGINE, "engine/kernels/ggml_repack.py",
              "Streamed GGUF blocks repacked into the CPU kernels' layout on the prefetch thread; off "
              "dequantizes them in each matmul instead."),
    EnvSwitch("LAYERSTREAM_PREPACK", "auto", "auto, off", ENGINE, "engine/weights/packed/prepacked.py",
              "A GGUF file's blocks written once in the CPU kernels' layout to a cache entry that later loads "
              "map; off repacks at load and per step."),
    EnvSwitch("LAYERSTREAM_CPU_ATTENTION", "auto", "auto, sdpa", ENGINE, "engine/ops.py",
              "CPU bf16 prompt attention: auto picks the matmul path on AVX512-BF16 CPUs without AMX; sdpa "
              "uses torch's SDPA for every dtype (for A/B runs)."),
    EnvSwitch("LAYERSTREAM_SIM_GBPS", "2", "GB/s, >= 0 (0: no delay)", ENGINE, "engine/weights/transports/simulated.py",
              "Link speed of the simulated transport (--transport simulated / LLM(transport=\"simulated\")), "
              "a stand-in for a GPU's host-to-device link."),
    EnvSwitch("LAYERSTREAM_SIM_COMPUTE_MS", "0", "milliseconds, >= 0", ENGINE,
              "engine/weights/transports/simulated.py",
              "Extra compute time per block on the simulated transport (overlap tests)."),
    EnvSwitch("LAYERSTREAM_PLACEMENT", "blocks", "blocks, groups", ENGINE, "engine/loader.py",
              "What a plan places when the model does not fit a device behind a link (the simulated or the CUDA "
              "transport): whole blocks, streamed; or tensor groups (issue #38): attention, norms and routers on "
              "the device in every layer, MLPs and routed experts off it, computed on the CPU or streamed each "
              "step as --cpu-offload-policy decides."),
    EnvSwitch("LAYERSTREAM_BENCH_DIR", "/var/tmp/layerstream-bench", "a folder", BENCH, "layerstream/bench/common.py",
              "Where the benchmarks build their checkpoints and files, once."),
    EnvSwitch("LAYERSTREAM_TORCH_VERSION", "2.13.0", "a torch version", SETUP,
              "scripts/setup.sh, docker/base-image.sh",
              "The torch installed when none is (the CPU wheel)."),
    EnvSwitch("LAYERSTREAM_UID", "10001", "a user id", SETUP, "Dockerfile (build argument)",
              "The uid of the image's non-root user."),
    EnvSwitch("LAYERSTREAM_DOCKER_STATE", "/var/tmp/layerstream-docker", "a folder", SETUP,
              "docker/smoke.sh, docker/base-image.sh",
              "Build state of the image check without a Docker engine (buildah)."),
    EnvSwitch("LAYERSTREAM_BASE_IMAGE", "pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime (compose)", "an image",
              SETUP, "docker/compose.yaml, docker/base-image.sh", "The base image of the GPU image."),
    EnvSwitch("LAYERSTREAM_CPU_BASE_IMAGE", "python:3.11-slim-bookworm", "an image", SETUP, "docker/compose.yaml",
              "The base image of the compose file's cpu profile."),
    EnvSwitch("LAYERSTREAM_MODELS_DIR", "./models", "a folder", SETUP, "docker/compose.yaml",
              "The host folder mounted read-only at /models."),
    EnvSwitch("LAYERSTREAM_PUBLISH", "127.0.0.1:8000", "address:port", SETUP, "docker/compose.yaml",
              "Where compose publishes the server's port."),
)
