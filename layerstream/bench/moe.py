"""`layerstream bench-moe`: a mixture of experts that does not fit, expert-granular vs whole-block streaming.

Two random-weight bf16 MoE checkpoints of ~2.3 GB each are built once (written straight with
safetensors, in Hugging Face's per-expert layout) under the benchmark directory:
  top2-of-32   Mixtral-style, 16 blocks x 32 experts, 2 chosen per token
  top8-of-64   Qwen3-MoE-style, 16 blocks x 64 experts, 8 chosen per token (renormalised)
Both run under one device budget that holds --cache-fraction of all routed experts besides the blocks
without their experts, as two engines loaded side by side in one process:
  experts   expert-granular streaming (the default): chosen experts fetched into an LRU expert cache
  blocks    the same engine with expert_streaming=False: MoE blocks stream whole, experts inside
and timed in --rounds alternating rounds (experts, blocks, blocks, experts, ...), so a change of load on
a shared machine falls on both; the median round of each is reported, with the range of the per-round
speed-ups. Before every round the checkpoint is read into the page cache, and its share there is
measured (mincore) before and after the timed steps: a peer that reads the page cache (the simulated
link) would otherwise pay disk reads whenever other work on the machine evicted the checkpoint (seen:
a whole-block baseline 7x below its link floor), and a cold round is reported and kept out of the median.
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
import statistics
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT, Chart, bench_main, fmt, machine_description, table, warm_page_cache

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
    p.add_argument("--rounds", type=int, default=3,
                   help="timed rounds per peer, alternating between the two peers; the median is reported")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
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


def page_cache_share(folder: Path) -> float:
    """The share of the checkpoint's weight-file pages in the page cache now (mincore): below 1.0, a
    peer that reads through the page cache (the simulated link) also paid disk reads."""
    import ctypes
    import mmap
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    resident = total = 0
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        pages = -(-size // mmap.PAGESIZE)
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {f}")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {f}")
                resident += sum(b & 1 for b in bytes(vec))
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 1.0


class Peer:
    """One engine of the comparison (expert-granular or whole-block), loaded once, timed in rounds."""

    def __init__(self, folder: Path, budget: int, transport: str, granular: bool, ns):
        import torch

        from engine import LLM, SamplingParams

        self.folder, self.granular = folder, granular
        self.reads_page_cache = transport != "disk"  # the disk tier reads with O_DIRECT, around the page cache
        self.llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, max_device_memory=budget, transport=transport,
                       expert_streaming=granular, show_progress=False)
        g = torch.Generator().manual_seed(3)
        self.prompts = [torch.randint(10, VOCAB, (ns.prompt_tokens,), generator=g).tolist() for _ in range(ns.batch)]
        sampling = dict(temperature=1.0, seed=1234) if ns.sampling == "random" else dict(temperature=0.0)
        self.params = SamplingParams(max_tokens=ns.decode_tokens + 1, ignore_eos=True, **sampling)
        self.tokens = ns.decode_tokens * ns.batch
        self.llm.generate(self.prompts, self.params)  # warm-up: fills the caches
        self.rounds: list[dict] = []

    def time_round(self) -> dict:
        """The same requests again, stepped by hand: the first step (prefill and first token) is not
        timed, the decode steps after it are. The checkpoint is read into the page cache first, and its
        share there is measured before and after the timed steps."""
        warm_page_cache(self.folder)
        cached_before = page_cache_share(self.folder)
        engine, tokens_of, done = self.llm.engine, {}, set()
        for p in self.prompts:
            tokens_of[engine.add_request(engine.encode(p), self.params)] = []

        def step():
            for o in engine.step():
                tokens_of[o.request_id] += o.new_token_ids
                if o.finished:
                    done.add(o.request_id)

        step()
        before = self.llm.telemetry().total
        t0 = time.perf_counter()
        while len(done) < len(tokens_of):
            step()
        seconds = time.perf_counter() - t0
        s = self.llm.telemetry().total.since(before)
        r = dict(tok_s=self.tokens / seconds, bytes_per_token=s.bytes_streamed / self.tokens, hit=s.expert_hit_rate,
                 accuracy=s.prefetch_accuracy, wait_ms=1e3 * s.stall_seconds / self.tokens,
                 tokens=list(tokens_of.values()), cached=min(cached_before, page_cache_share(self.folder)))
        self.rounds.append(r)
        return r

    def summary(self) -> dict:
        """The median round by speed (rounds whose checkpoint left the page cache are kept out of it
        when a warm round exists), with the lowest page-cache share seen."""
        warm = [r for r in self.rounds if r["cached"] >= 0.999 or not self.reads_page_cache] or self.rounds
        ranked = sorted(warm, key=lambda r: r["tok_s"])
        out = dict(ranked[len(ranked) // 2])
        plan = self.llm.plan
        out.update(resident=len(plan.resident_blocks), slots=plan.expert_slots, warm_rounds=len(warm),
                   all_tokens=[r["tokens"] for r in self.rounds],
                   cached=min(r["cached"] for r in self.rounds))
        return out

    def close(self) -> None:
        self.llm.close()


def compare(folder: Path, budget: int, transport: str, ns) -> tuple[dict, dict, list[float]]:
    """Both peers loaded side by side and timed in alternating rounds (ABBA...), so a change of load on
    the machine falls on both: (experts summary, blocks summary, per-round speed-ups)."""
    peers = {}
    try:
        for g in (True, False):
            peers[g] = Peer(folder, budget, transport, g, ns)
        ratios = []
        for i in range(ns.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {g: peers[g].time_round() for g in order}
            ratios.append(got[True]["tok_s"] / got[False]["tok_s"])
        return peers[True].summary(), peers[False].summary(), ratios
    finally:
        for p in peers.values():
            p.close()


def run(ns: argparse.Namespace) -> int:
    import os

    import torch

    os.environ["LAYERSTREAM_SIM_GBPS"] = str(ns.sim_gbps)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rows, chart = [], Chart(f"MoE: expert-granular vs whole-block streaming ({ns.cache_fraction:.0%} of experts cached)")
    labels, tps, bpt, colors = [], [], [], []
    failed = False
    load0 = os.getloadavg()
    print(f"machine: {machine_description()}; torch threads {torch.get_num_threads()}; "
          f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start")
    for name in ns.models.split(","):
        folder = model_path(name)
        budget, slots = budget_for(folder, ns.cache_fraction)
        for transport in ns.transports.split(","):
            ex, bl, ratios = compare(folder, budget, transport, ns)
            same = ex["all_tokens"] == bl["all_tokens"]  # every round, both peers
            failed |= not same
            for g, r in ((True, ex), (False, bl)):
                rows.append([name, transport, "experts" if g else "blocks", f"{budget / 2**20:.0f}",
                             f"{r['resident']}/{LAYERS}", str(r["slots"]) if g else "-",
                             fmt(r["tok_s"]), f"{r['bytes_per_token'] / 2**20:.1f}",
                             fmt(100 * r["hit"], 0) + "%" if r["hit"] is not None else "-",
                             fmt(100 * r["accuracy"], 0) + "%" if r["accuracy"] is not None else "-",
                             fmt(r["wait_ms"], 1), f"{100 * r['cached']:.0f}%",
                             fmt(bl["bytes_per_token"] / r["bytes_per_token"], 1) + "x" if g else "",
                             fmt(statistics.median(ratios), 2) + "x" if g else "",
                             f"{min(ratios):.2f}-{max(ratios):.2f}x" if g else "", "yes" if same else "NO"])
                labels.append(f"{name} {transport} {'experts' if g else 'blocks'}")
                colors.append(1 if g else 0)
                tps.append(r["tok_s"])
                bpt.append(r["bytes_per_token"] / 2**20)
    load1 = os.getloadavg()
    print(f"\nbatch {ns.batch}, {ns.decode_tokens} decode tokens after a {ns.prompt_tokens}-token prompt "
          f"({ns.sampling} sampling), median of {ns.rounds} alternating rounds per peer; simulated link "
          f"{ns.sim_gbps} GB/s; checkpoint read into the page cache before every round; random router weights"
          + (": each token routes differently, the worst case for a cache" if ns.sampling == "random" else
             ": greedy tokens repeat and route alike, a best case"))
    print(f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end")
    print(table(["model", "transport", "streaming", "budget MiB", "blocks resident", "expert slots", "decode tok/s",
                 "MiB moved/token", "expert hit rate", "prefetch accuracy", "wait ms/token", "page cache",
                 "fewer bytes", "speed-up", "per round", "same tokens"], rows))
    print("speed-up: the median of the rounds' speed-ups (each round times both peers back to back); per round: "
          "their range")
    print("wait ms/token: compute waiting for streamed blocks or expert fills; page cache: the lowest share "
          "of the checkpoint's pages in the page cache seen around a timed round (below 100% on the simulated "
          "link, that round read from disk: it is left out of the median when a warm round exists; the disk "
          "transport reads around the page cache)")
    if ns.png:
        chart.add("decode tok/s", labels, tps, colors)
        chart.add("MiB moved per token", labels, bpt, colors)
        chart.save(ns.png)
        print(f"\nchart written to {ns.png}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.moe", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
