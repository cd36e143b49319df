"""`layerstream generate`, and the engine flags every command that loads a model shares.

The `layerstream` dispatcher itself is layerstream/cli.py, above the engine, the server and the
benchmarks; this module is the engine's part of the command line and imports none of them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


MODEL_HELP = ("a model folder, a .gguf file, a hub id like org/name found in the local Hugging Face cache "
              "($HF_HUB_CACHE, $HF_HOME/hub; nothing is downloaded)")


class _ModelAction(argparse.Action):
    """MODEL and --model name the same thing (`layerstream serve MODEL`, as `vllm serve MODEL`; --model
    stays for scripts and LAYERSTREAM_MODEL): given both ways, they must agree."""

    def __call__(self, parser, namespace, value, option_string=None):
        other = getattr(namespace, "_model_given", None)
        if other is not None and other != value:
            parser.error(f"the model is given twice, {other!r} and {value!r}: give it as MODEL or as --model")
        namespace._model_given = value
        namespace.model = value


def add_model_argument(p: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """The model as an optional positional MODEL or as --model (both land in namespace.model)."""
    p.add_argument("model", nargs="?", action=_ModelAction, default=argparse.SUPPRESS, metavar="MODEL", help=help)
    p.add_argument("--model", dest="model", action=_ModelAction, default=default, metavar="MODEL",
                   help="the same as MODEL")


def add_placement_arguments(p, device_budget_help: str = "device memory budget, e.g. 4GiB or 512MB") -> None:
    """Where a model computes and within what memory: --device, --dtype, --max-device-memory and
    --max-host-memory, with EngineArgs' defaults (p: a parser or an argument group)."""
    from .args import EngineArgs

    d = EngineArgs.default
    p.add_argument("--device", default=d("device"), help="cpu or cuda")
    p.add_argument("--dtype", default=d("dtype"), help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--max-device-memory", default=d("max_device_memory"), help=device_budget_help)
    p.add_argument("--max-host-memory", default=d("max_host_memory"),
                   help="host memory budget (default: what is available)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model; defaults are EngineArgs' own."""
    from .args import EngineArgs
    from .placement import POLICIES
    from .weights import RESIDENT_WEIGHTS

    d = EngineArgs.default
    add_model_argument(p, default="demo", help=f"{MODEL_HELP}, or demo (the default: a built-in small model)")
    add_placement_arguments(p)
    p.add_argument("--max-model-len", type=int, default=d("max_model_len"),
                   help="context window (prompt + completion)")
    p.add_argument("--max-num-seqs", type=int, default=d("max_num_seqs"), help="sequences decoded together in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=d("max_num_batched_tokens"),
                   help="tokens per step (chunked prefill)")
    p.add_argument("--prefetch-depth", type=int, default=d("prefetch_depth"),
                   help="streamed blocks prepared ahead of compute")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="quantize a bf16/fp16/fp32 checkpoint's block weights at load (weight-only; CPU)")
    p.add_argument("--pin-host-memory", action="store_true",
                   help="cuda: keep all streamed blocks in pinned host memory (if RAM allows) instead of staging")
    p.add_argument("--resident-weights", default=d("resident_weights"), choices=list(RESIDENT_WEIGHTS),
                   help="cpu: resident blocks that are views of a mapped file copied into huge pages of the "
                        "process's own at load: auto (a GGUF file's prepacked blocks and head, measured to read "
                        "faster so), copy (plain checkpoints' too), map (views, as llama.cpp's mmap)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d("enable_prefix_caching"),
                   help="reuse the KV cache of prompt prefixes seen before (on by default; "
                        "--no-enable-prefix-caching turns it off)")
    p.add_argument("--block-size", type=int, default=d("block_size"), help="token positions per paged KV block")
    p.add_argument("--kv-cache-memory", default=d("kv_cache_memory"),
                   help="device KV pool size, e.g. 512MiB (default: planned from the budget)")
    p.add_argument("--kv-host-memory", default=d("kv_host_memory"),
                   help="host tier for KV blocks evicted from the pool, e.g. 2GiB (default: min(4GiB, 10%% of host "
                        "memory) on cuda, none on cpu where the pool already is host memory)")
    p.add_argument("--kv-cache-dtype", default=d("kv_cache_dtype"), choices=["auto", "int8", "int4"],
                   help="KV cache storage: auto (the compute dtype), int8 or int4 (codes with float16 scales: about "
                        "1.9x / 3.5x the tokens in the same memory)")
    p.add_argument("--kv-cache-rotation", action=argparse.BooleanOptionalAction, default=d("kv_cache_rotation"),
                   help="with --kv-cache-dtype int8|int4, rotate each head by a Hadamard matrix before quantizing "
                        "(on by default: much closer to bf16 for int4)")
    p.add_argument("--kv-disk-bytes", default=d("kv_disk_bytes"),
                   help="KV disk tier: keep full prefix-cache blocks on disk, at most this much, e.g. 20GiB, and find "
                        "them again after a restart (default: off)")
    p.add_argument("--kv-disk-dir", default=d("kv_disk_dir"),
                   help="the KV disk tier's folder (default: kv/ in the layerstream cache)")
    p.add_argument("--no-expert-streaming", dest="expert_streaming", action="store_false",
                   help="mixtures of experts: stream blocks whole, experts inside, instead of each chosen expert")
    p.add_argument("--cpu-offload-policy", default=d("cpu_offload_policy"), choices=list(POLICIES),
                   help="where a tensor group placed off the device (a block's MLP or experts) computes each step: "
                        "auto (measured speeds decide: the CPU for few tokens, such as decoding a small batch, "
                        "the device for many, such as a prompt chunk), stream (always streamed to the device) or "
                        "cpu (always on the CPU, only activations cross the link)")
    so = p.add_argument_group("structured output (docs/usage/structured-output.md)")
    so.add_argument("--max-grammar-ms", type=float, default=d("max_grammar_ms"),
                    help="CPU time one request's grammar may spend compiling, and on each token mask; over it, "
                         "a 400 before any token, or an error that ends that request alone")
    so.add_argument("--grammar-cache-memory", default=d("grammar_cache_memory"),
                    help="host memory for compiled grammars, e.g. 256MiB (default: 256MiB, at most a twentieth "
                         "of host memory; least recently used go first)")
    spec = p.add_argument_group("speculative decoding (docs/usage/speculative.md)")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help="as vLLM's: a JSON object with keys method (ngram: prompt lookup; draft_model: a separate "
                           "resident model, key model; self: int4 copies of the target's blocks), model, "
                           "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, adaptive_k, e.g. "
                           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'. The flags below set the same "
                           "keys one by one")
    spec.add_argument("--speculative-method", default=None, choices=["ngram", "draft", "draft_model", "self"],
                      help="key method: draft k tokens per step and verify them in one pass: ngram (prompt lookup), "
                           "draft or draft_model (--speculative-model, resident), self (int4 copies of the target's "
                           "blocks)")
    spec.add_argument("--num-speculative-tokens", type=int, default=d("num_speculative_tokens"),
                      help="key num_speculative_tokens: the most tokens drafted per sequence per step (k)")
    spec.add_argument("--speculative-adaptive-k", action=argparse.BooleanOptionalAction,
                      default=d("speculative_adaptive_k"),
                      help="key adaptive_k: adapt each sequence's k to its acceptance: +2 after a pass that "
                           "accepted every draft (at most --num-speculative-tokens), -1 after a rejection (on by "
                           "default; --no-speculative-adaptive-k keeps k fixed)")
    spec.add_argument("--speculative-model", default=None,
                      help="key model: the draft model, with the target's tokenizer")
    spec.add_argument("--prompt-lookup-min", type=int, default=d("prompt_lookup_min"),
                      help="key prompt_lookup_min: ngram's shortest n-gram looked up")
    spec.add_argument("--prompt-lookup-max", type=int, default=d("prompt_lookup_max"),
                      help="key prompt_lookup_max: ngram's longest n-gram looked up (tried first)")


def engine_args_from(ns: argparse.Namespace, **overrides):
    from .args import EngineArgs

    fields = dict(model=ns.model, device=ns.device, dtype=ns.dtype, max_device_memory=ns.max_device_memory,
                  max_host_memory=ns.max_host_memory, max_model_len=ns.max_model_len,
                  max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                  prefetch_depth=ns.prefetch_depth, pin_host_memory=ns.pin_host_memory,
                  quantization=getattr(ns, "quantization", None),  # Namespaces built elsewhere (Ray) may lack it
                  enable_prefix_caching=ns.enable_prefix_caching, block_size=ns.block_size,
                  kv_cache_memory=ns.kv_cache_memory, kv_host_memory=ns.kv_host_memory,
                  expert_streaming=getattr(ns, "expert_streaming", True))
    for name in ("kv_cache_dtype", "kv_cache_rotation", "kv_disk_bytes", "kv_disk_dir", "cpu_offload_policy",
                 "resident_weights"):
        if hasattr(ns, name):
            fields[name] = getattr(ns, name)
    for name in ("speculative_config", "speculative_method", "num_speculative_tokens", "speculative_model",
                 "prompt_lookup_min", "prompt_lookup_max", "speculative_adaptive_k", "max_grammar_ms",
                 "grammar_cache_memory"):
        if hasattr(ns, name):
            fields[name] = getattr(ns, name)
    fields.update(overrides)
    return EngineArgs(**fields)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`layerstream generate`'s flags."""
    p.usage = "%(prog)s [MODEL] --prompt PROMPT [options]"  # MODEL first, as it is typed, not after 30 flags
    add_engine_arguments(p)
    p.add_argument("--prompt", required=True, help="the prompt, as plain text (no chat template)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with this "
                   "much probability (default: 1, all)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (default: -1, all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, for a reproducible output")
    p.add_argument("--json", action="store_true", help="print token ids, text and timing as JSON")


def run(ns: argparse.Namespace) -> int:
    """`layerstream generate`: one prompt, streamed to stdout (or as JSON)."""
    from .llm_engine import LLMEngine
    from .sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(engine_args_from(ns, max_num_seqs=1, show_progress=not ns.json))
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed)
    t0 = time.perf_counter()
    engine.add_request(ns.prompt, params, "cli")
    ids, text, first, reason = [], "", None, None
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            ids += out.new_token_ids
            text += out.text
            reason = out.finish_reason
            if not ns.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
    end = time.perf_counter()
    decode_tps = (len(ids) - 1) / (end - first) if first and len(ids) > 1 else None
    if ns.json:
        print(json.dumps({"token_ids": ids, "text": text, "finish_reason": reason,
                          "timing": {"load_s": round(load_s, 3), "ttft_s": round(first - t0, 4) if first else None,
                                     "total_s": round(end - t0, 4),
                                     "decode_tokens_per_s": round(decode_tps, 2) if decode_tps else None}}))
    else:
        print()
    engine.close()
    return 0
