"""`layerstream` command line: generate, serve, and the benchmarks.

The dispatcher lives here, above `engine`, `server` and `bench`, so the engine is a library that
imports neither the server nor the benchmarks. Each subcommand is a module with
add_arguments(parser) and run(namespace) -> exit status.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, help)
SUBCOMMANDS = {
    "generate": ("engine.cli", "generate text for one prompt"),
    "serve": ("server.cli", "start the OpenAI-compatible HTTP server"),
    "convert": ("layerstream.convert", "build a model's cache entry ahead of time: a GGUF file prepacked for the CPU "
                "kernels, or --quantization int4|int8 of a safetensors checkpoint"),
    "finetune": ("layerstream.finetune", "train a LoRA adapter on a JSONL file over a frozen base that streams (larger "
                 "than memory); PEFT's adapter format"),
    "finetune-demo": ("layerstream.finetune_demo", "fine-tune the demo model on the bundled answer cards, then compare "
                      "the base and the served adapter on held-out questions"),
    "build-kernels": ("engine.kernels.cli", "build the C++ CPU kernels now (setup and image builds run it), so no "
                      "start-up or request waits on a compiler"),
    "bench": ("layerstream.bench.offline", "decode speed and memory: transformers vs layerstream resident vs streaming"),
    "bench-serve": ("layerstream.bench.serving", "throughput of a running server at several concurrencies"),
    "bench-disk": ("layerstream.bench.disk", "models larger than RAM: transformers vs layerstream under a memory cgroup"),
    "bench-packed": ("layerstream.bench.packed", "GGUF / int4 / int8 on real SmolLM2: layerstream vs llama.cpp, one thread"),
    "bench-decode-profile": ("layerstream.bench.decode_profile", "where a CPU decode step's time goes: blocks, matmuls, head; "
                             "C++ block vs op by op"),
    "bench-bf16-rows": ("layerstream.bench.bf16_rows", "bf16 products of 1-16 rows: oneDNN's kernel vs torch's own vs "
                        "bf16_rows.cpp, 1 and 2 threads"),
    "bench-amx": ("layerstream.bench.amx", "the CPU choices AMX turns: one bf16 row on oneDNN vs torch's kernel, flash vs the "
                  "bf16 matmul attention path"),
    "bench-pages": ("layerstream.bench.pages", "the int4 kernel streaming weights from a file in scattered 4 KiB "
                    "pages, the same bytes in huge pages, and anonymous memory"),
    "bench-int4": ("layerstream.bench.int4_kernel", "one int4 matmul: the AVX512-VNNI kernel vs aten int4 / int8 / bf16, one thread"),
    "bench-moe": ("layerstream.bench.moe", "mixtures of experts: expert-granular vs whole-block streaming under one budget"),
    "bench-spec": ("layerstream.bench.speculative", "speculative decoding on real SmolLM2: each draft source resident, "
                   "streamed, from disk, repetitive"),
    "bench-scale": ("layerstream.bench.scale", "a Llama-3.2-3B-shaped model (or 8B): layerstream vs llama.cpp on the "
                    "same files, load, prefill, decode, peak memory, and under a memory cgroup"),
    "bench-placement": ("layerstream.bench.placement", "issue #38's per-step choice at a device budget below an "
                        "8B-shaped model: --cpu-offload-policy stream, cpu and auto side by side, prefill and decode "
                        "at batch 1 and 16 against their link and memory floors"),
    "bench-kv": ("layerstream.bench.kv_cache", "the quantized KV cache and the KV disk tier on real SmolLM2: accuracy "
                 "against bf16 KV, capacity, decode tok/s at 16 long sequences, TTFT after a restart"),
    "bench-finetune": ("layerstream.bench.finetune", "LoRA training tok/s and peak memory: layerstream streaming vs PEFT "
                       "+ accelerate offload under the same budget; --serve: adapters served beside the base vs "
                       "the base alone"),
    "bench-paged": ("layerstream.bench.paged", "paged KV: chat TTFT with/without prefix caching, concurrency, 16 vs 1 tok/s"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layerstream", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:  # a benchmark's optional dependency is missing: say so when it is asked for
            p.set_defaults(func=lambda _ns, e=e: sys.exit(f"layerstream: {e}"))
            continue
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError) as e:
        # User mistakes (bad checkpoint, bad flag value, budget too small): one clear line.
        print(f"layerstream: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
