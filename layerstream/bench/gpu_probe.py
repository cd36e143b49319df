"""The GPU check's first ~20 s: what the machine is, printed before any test spends time on it.

Prints torch / CUDA / cuDNN / transformers versions, host memory (MemAvailable decides whether a
pinned cache fits), which SDPA kernel our own attention call runs (engine.attention_backend.attend)
and which one SDPA would pick left to itself, with the first call's time against a repeat's and
the time of a call at a context length not seen before (what decode does every step), whether
cudaHostRegister works, and host->device GB/s. On a machine without a GPU (the check's dry run)
it prints what applies to the CPU.

    python -m layerstream.bench.gpu_probe [--device cuda]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# aten op -> backend name; the profiler shows which of them ran (longest names first: prefixes).
SDPA_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_attention_math": "math",
}


def sdpa_backends_used(fn) -> list[str]:
    """The SDPA kernels fn() ran, by the aten ops torch's profiler saw."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name() for e in prof.profiler.kineto_results.events()}
    return sorted({backend for op, backend in SDPA_OPS.items() if op in names})


def mem_info() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def decode_problem(ctx: int, device, dtype, seqs: int = 4, heads: int = 32, kv_heads: int = 8, head_dim: int = 128):
    """A decode step's attention as model.attention hands it over: one query row per sequence,
    Llama-3-8B's heads, a boolean mask over `ctx` keys."""
    q = torch.randn(seqs, heads, 1, head_dim, device=device, dtype=dtype)  # (seqs, heads, 1, head_dim)
    k = torch.randn(seqs, kv_heads, ctx, head_dim, device=device, dtype=dtype)  # (seqs, kv_heads, ctx, head_dim)
    v = torch.randn_like(k)
    mask = torch.ones(seqs, 1, 1, ctx, dtype=torch.bool, device=device)
    mask[1:, ..., ctx // 2:] = False  # shorter sequences in the batch: a real mask, not all-True
    return q, k, v, mask


def _timed(fn, device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _default_sdpa(q, k, v, m):
    """SDPA with every backend allowed, cuDNN included (our attention turns cuDNN off process-wide)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    every = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(every):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)


def probe_attention(device, dtype) -> list[str]:
    from engine.attention_backend import attend

    lines = []
    calls = {
        "ours (attention_backend.attend)": lambda q, k, v, m: attend(q, k, v, m),
        "SDPA left to itself": lambda q, k, v, m: _default_sdpa(q, k, v, m),
    }
    # On a CPU (the dry run) a smaller problem: the point there is that the probe runs, not the figures.
    size = dict(heads=32, kv_heads=8, head_dim=128) if device.type == "cuda" else dict(heads=8, kv_heads=2, head_dim=32)
    for i, (name, call) in enumerate(calls.items()):
        base = (1000 if device.type == "cuda" else 200) + 100 * i  # each call family sees lengths new to it
        with torch.inference_mode():
            q, k, v, m = decode_problem(base, device, dtype, **size)
            first = _timed(lambda: call(q, k, v, m), device)
            repeat = statistics.median(_timed(lambda: call(q, k, v, m), device) for _ in range(5))
            new_shapes = []
            for j in range(1, 6):  # decode: the context grows by one every step
                q2, k2, v2, m2 = decode_problem(base + j, device, dtype, **size)
                new_shapes.append(_timed(lambda: call(q2, k2, v2, m2), device))
            used = sdpa_backends_used(lambda: call(q, k, v, m))
        lines.append(f"sdpa {name}: {'+'.join(used) or 'unknown'}; first call {first * 1e3:.2f} ms, repeat "
                     f"{repeat * 1e3:.3f} ms, new context length {statistics.median(new_shapes) * 1e3:.3f} ms "
                     f"(bool mask, {str(dtype).replace('torch.', '')}, 4 seqs x {size['heads']} heads / {size['kv_heads']} kv "
                     f"heads x ~{base} keys)")
    return lines


def probe_host_register(device) -> str:
    if device.type != "cuda":
        return "cudaHostRegister: n/a (no CUDA device)"
    from engine.weights.probes import host_register_works

    return ("cudaHostRegister: works" if host_register_works(device) else
            "cudaHostRegister: FAILS here; pinned memory comes from the caching allocator instead")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerstream.bench.gpu_probe", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = p.parse_args(argv)
    device = torch.device(ns.device)
    t0 = time.perf_counter()
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {cudnn}, transformers {tf}")
    mem = mem_info()
    print(f"host memory: MemAvailable {mem.get('MemAvailable', 0) / 2**30:.1f} GiB of MemTotal "
          f"{mem.get('MemTotal', 0) / 2**30:.1f} GiB")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        print(f"device: {torch.cuda.get_device_name(device)}, {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for line in probe_attention(device, dtype):
        print(line, flush=True)
    print(probe_host_register(device), flush=True)
    if device.type == "cuda":
        from engine.weights.probes import host_to_device_gbps

        print(f"host->device (pinned, 256 MiB copies): {host_to_device_gbps(device):.1f} GB/s")
    else:
        print("host->device: n/a (no CUDA device)")
    print(f"probe took {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
