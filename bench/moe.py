"""`layerstream bench-moe`: a mixture of experts that does not fit, expert-granular vs whole-block streaming.

Two random-weight bf16 MoE checkpoints of ~2.3 GB each are built once (written straight with
safetensors, in Hugging Face's per-expert layout) under the benchmark directory:
  top2-of-32   Mixtral-style, 16 blocks x 32 experts, 2 chosen per token
  top8-of-64   Qwen3-MoE-style, 16 blocks x 64 experts, 8 chosen per token (renormalised)
Both run under one device budget that holds --cache-fraction of all routed experts besides the blocks
without their experts, twice, side by side in one process:
  experts   expert-granular streaming (the default): chosen experts fetched into an LRU expert cache
  blocks    the same engine with expert_streaming=False: MoE blocks stream whole, experts inside
Per run: decode tok/s, bytes moved per decoded token (StreamStats: every byte streamed into compute's
memory, expert fills included), the expert cache's hit rate and the prefetch guess accuracy, and the
tokens (which must be identical). The transport decides what "moving" costs: `disk` reads every
streamed byte off the disk with O_DIRECT (a CPU box whose RAM cannot hold the model); `simulated`
copies from the page cache behind a slow link (LAYERSTREAM_SIM_GBPS, a GPU's PCIe stand-in).

Routing here is random (random router weights): no expert is hotter than another, which is the worst
case for any cache. Real models route with locality, so hit rates there are higher.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT, Chart, bench_main, fmt, machine_description, table

MODELS = {
    # name: (architecture, experts, top_k, expert width)
    "top2-of-32": ("MixtralForCausalLM", 32, 2, 704),
    "top8-of-64": ("Qwen3MoeForCausalLM", 64, 8, 352),
}
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 1024, 16, 16, 4, 8192


def moe_config(name: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    arch, experts, top_k, width = MODELS[name]
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  num_experts_per_tok=top_k, tie_word_embeddings=False, architectures=[arch])
    if arch == "MixtralForCausalLM":
        return MixtralConfig(**common, intermediate_size=width, num_local_experts=experts)
    return Qwen3MoeConfig(**common, head_dim=HIDDEN // HEADS, intermediate_size=4 * width, moe_intermediate_size=width,
                          num_experts=experts, norm_topk_prob=True)


def _tensors(cfg, layer: int):
    """Hugging Face names and shapes of one block (per-expert tensors, as on the hub)."""
    import torch  # noqa: F401

    h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    p = f"model.layers.{layer}."
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
           p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
    if cfg.architectures[0] == "MixtralForCausalLM":
        experts, width = cfg.num_local_experts, cfg.intermediate_size
        out[p + "block_sparse_moe.gate.weight"] = (experts, h)
        for e in range(experts):
            x = f"{p}block_sparse_moe.experts.{e}."
            out.update({x + "w1.weight": (width, h), x + "w3.weight": (width, h), x + "w2.weight": (h, width)})
    else:
        experts, width = cfg.num_experts, cfg.moe_intermediate_size
        out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate.weight": (experts, h)})
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            out.update({x + "gate_proj.weight": (width, h), x + "up_proj.weight": (width, h),
                        x + "down_proj.weight": (h, width)})
    return out


def build_checkpoint(folder: Path, cfg) -> None:
    """Random bf16 weights, one shard per block, written without building a transformers model (which
    would hold the whole model in fp32 first)."""
    import torch
    from safetensors.torch import save_file

    from engine.demo import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder)
    g = torch.Generator().manual_seed(7)
    weight_map = {}

    def rand(shape, name):
        if name.endswith("norm.weight"):
            return (1 + 0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        # Routers: decisive scores. Embeddings: large enough that the residual stream is dominated by the
        # current token, not by attention's average over the context (which is alike from step to step
        # and would route every token to the same experts: a best case, not the worst).
        std = 1.0 if name.endswith(("gate.weight", "embed_tokens.weight")) and "proj" not in name else 0.02
        return (torch.randn(shape, generator=g) * std).to(torch.bfloat16)

    shards = [("model-globals.safetensors", {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                                             "model.norm.weight": (cfg.hidden_size,),
                                             "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)})]
    shards += [(f"model-block{i:02d}.safetensors", _tensors(cfg, i)) for i in range(cfg.num_hidden_layers)]
    for shard, shapes in shards:
        save_file({n: rand(s, n) for n, s in shapes.items()}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in shapes})
        print(f"  wrote {shard}", file=sys.stderr)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)


def model_path(name: str, root: Path = BENCH_ROOT) -> Path:
    from engine.cache import build_once

    folder = root / f"moe-{name}-v2"

    def build(tmp: Path) -> None:
        print(f"building the MoE benchmark checkpoint {name} in {folder} (once)", file=sys.stderr)
        build_checkpoint(tmp, moe_config(name))

    return build_once(folder, "layerstream-bench.json", {"random_weights": True}, build)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--transports", default="disk,simulated", help="disk and/or simulated")
    p.add_argument("--sim-gbps", type=float, default=8.0, help="the simulated link's GB/s")
    p.add_argument("--cache-fraction", type=float, default=0.2, help="share of all routed experts the budget caches")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--sampling", default="random", choices=["random", "greedy"],
                   help="random: temperature 1 with a fixed seed, so each token routes differently (the worst "
                        "case); greedy: a random model repeats its tokens and routes the same way each step")
    p.add_argument("--png", default=None, help="write a bar chart of the results to this file")


def budget_for(folder: Path, fraction: float) -> tuple[int, int]:
    """(device budget, expert slots): everything but the routed experts, plus `fraction` of the experts."""
    import torch

    from engine import LLM
    from engine.args import EngineArgs
    from engine.arch import load_model_config
    from engine.loader import expert_inputs
    from engine.weights import ModelCheckpoint

    cfg = load_model_config(folder)
    checkpoint = ModelCheckpoint(folder, cfg)
    sizes = checkpoint.sizes(torch.bfloat16)
    checkpoint.close()
    slots = int(fraction * sizes.num_experts_total)
    probe = LLM(str(folder), max_model_len=256, max_num_seqs=4, show_progress=False)  # all resident: the fixed parts
    p = probe.plan
    probe.close()
    inputs = expert_inputs(EngineArgs(model=str(folder)), cfg, sizes, torch.bfloat16)
    budget = (p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + inputs["predictor_bytes"]
              + LAYERS * sizes.dense_block_bytes + slots * sizes.expert_bytes + sizes.expert_bytes // 2)
    return budget, slots


def run_one(folder: Path, budget: int, transport: str, granular: bool, ns) -> dict:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, max_device_memory=budget, transport=transport,
              expert_streaming=granular, show_progress=False)
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(10, VOCAB, (ns.prompt_tokens,), generator=g).tolist() for _ in range(ns.batch)]
        sampling = dict(temperature=1.0, seed=1234) if ns.sampling == "random" else dict(temperature=0.0)

        params = SamplingParams(max_tokens=ns.decode_tokens + 1, ignore_eos=True, **sampling)
        llm.generate(prompts, params)  # warm-up: fills the caches
        # Then the same requests again, stepped by hand: the first step (prefill and first token) is not
        # timed, the decode steps after it are.
        engine, tokens_of, done = llm.engine, {}, set()
        for p in prompts:
            tokens_of[engine.add_request(engine.encode(p), params)] = []

        def step():
            for o in engine.step():
                tokens_of[o.request_id] += o.new_token_ids
                if o.finished:
                    done.add(o.request_id)

        step()
        before = llm.telemetry().total
        t0 = time.perf_counter()
        while len(done) < len(tokens_of):
            step()
        seconds = time.perf_counter() - t0
        s = llm.telemetry().total.since(before)
        outs = list(tokens_of.values())
        tokens = ns.decode_tokens * ns.batch
        plan = llm.plan
        return dict(tok_s=tokens / seconds, bytes_per_token=s.bytes_streamed / tokens, hit=s.expert_hit_rate,
                    accuracy=s.prefetch_accuracy, stall=s.stall_seconds / tokens,
                    tokens=outs, resident=len(plan.resident_blocks),
                    slots=plan.expert_slots)
    finally:
        llm.close()


def run(ns: argparse.Namespace) -> int:
    import os

    os.environ["LAYERSTREAM_SIM_GBPS"] = str(ns.sim_gbps)
    rows, chart = [], Chart(f"MoE: expert-granular vs whole-block streaming ({ns.cache_fraction:.0%} of experts cached)")
    labels, tps, bpt, colors = [], [], [], []
    failed = False
    print(f"machine: {machine_description()} (shared: other work ran beside these figures)")
    for name in ns.models.split(","):
        folder = model_path(name)
        budget, slots = budget_for(folder, ns.cache_fraction)
        for transport in ns.transports.split(","):
            res = {g: run_one(folder, budget, transport, g, ns) for g in (True, False)}
            ex, bl = res[True], res[False]
            same = ex["tokens"] == bl["tokens"]
            failed |= not same
            for g, r in ((True, ex), (False, bl)):
                rows.append([name, transport, "experts" if g else "blocks", f"{budget / 2**20:.0f}",
                             f"{r['resident']}/{LAYERS}", str(r["slots"]) if g else "-",
                             fmt(r["tok_s"]), f"{r['bytes_per_token'] / 2**20:.1f}",
                             fmt(100 * r["hit"], 0) + "%" if r["hit"] is not None else "-",
                             fmt(100 * r["accuracy"], 0) + "%" if r["accuracy"] is not None else "-",
                             fmt(bl["bytes_per_token"] / r["bytes_per_token"], 1) + "x" if g else "",
                             fmt(r["tok_s"] / bl["tok_s"], 2) + "x" if g else "", "yes" if same else "NO"])
                labels.append(f"{name} {transport} {'experts' if g else 'blocks'}")
                colors.append(1 if g else 0)
                tps.append(r["tok_s"])
                bpt.append(r["bytes_per_token"] / 2**20)
    print(f"\nbatch {ns.batch}, {ns.decode_tokens} decode tokens after a {ns.prompt_tokens}-token prompt "
          f"({ns.sampling} sampling); simulated link {ns.sim_gbps} GB/s; random router weights"
          + (": each token routes differently, the worst case for a cache" if ns.sampling == "random" else
             ": greedy tokens repeat and route alike, a best case"))
    print(table(["model", "transport", "streaming", "budget MiB", "blocks resident", "expert slots", "decode tok/s",
                 "MiB moved/token", "expert hit rate", "prefetch accuracy", "fewer bytes", "speed-up",
                 "same tokens"], rows))
    if ns.png:
        chart.add("decode tok/s", labels, tps, colors)
        chart.add("MiB moved per token", labels, bpt, colors)
        chart.save(ns.png)
        print(f"\nchart written to {ns.png}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m bench.moe", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
