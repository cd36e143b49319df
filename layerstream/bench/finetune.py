"""Fine-tuning benchmark: LoRA training tokens/s and peak memory of layerstream (the base streamed under a
device budget, AdamW on the host) against PEFT + transformers with accelerate's device_map offload under
the same budget (on a GPU; on the CPU, PEFT + transformers all resident, there being nothing to offload
to), each in its own process, on the same batches.

    layerstream bench-finetune [--model FOLDER] [--device cuda] [--budget-fraction 0.25] [--steps 5]
    layerstream bench-finetune --serve [--model FOLDER] [--requests 16] [--adapters 3] [--max-tokens 64]

--serve measures serving adapters instead (issue 39): --requests concurrent requests spread over
--adapters random rank --lora-r adapters and the base, against as many on the base alone, in one engine
with every request in flight at once; aggregate generated tokens/s of each, and their ratio.

The budget is a fraction of the base's weights in fp32 (the issue's 25%). Peak device memory: CUDA's
max_memory_allocated; on the CPU, the sampled peak of anonymous memory (RssAnon), beside which the
layerstream plan states its runtime overhead. Run it on an idle machine: the figures go to
docs/benchmarks/ with this command line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from layerstream.bench.common import MemorySampler, bench_main, bench_model_path, fmt, machine_description, mib, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a safetensors folder (default: the shared benchmark checkpoint)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-fraction", type=float, default=0.25, help="device budget / the weights' fp32 bytes")
    p.add_argument("--tokens", type=int, default=512, help="tokens of one step (sequences of --seq-len)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps, after one warm-up step")
    p.add_argument("--lora-r", type=int, default=16)
    serve = p.add_argument_group("--serve: adapters served over one base")
    serve.add_argument("--serve", action="store_true", help="measure serving adapters, not training")
    serve.add_argument("--requests", type=int, default=16, help="concurrent requests")
    serve.add_argument("--adapters", type=int, default=3, help="adapters the mixed run spreads them over (with the base)")
    serve.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--peer", choices=("layerstream", "peft"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)


def _batches(ns, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    n = ns.tokens // ns.seq_len
    return [torch.randint(0, vocab, (n, ns.seq_len), generator=gen) for _ in range(ns.steps + 1)]


def _layerstream(ns) -> dict:
    import torch

    from engine.finetune import Example, LoRAConfig, LoRATuner, TrainConfig

    config = TrainConfig(max_length=ns.seq_len, batch_tokens=ns.tokens, lora=LoRAConfig(r=ns.lora_r, alpha=2 * ns.lora_r))
    with LoRATuner(ns.model, config, device=ns.device, dtype=ns.dtype, max_device_memory=ns.budget) as tuner:
        plan = tuner.plan
        times = []
        for ids in _batches(ns, tuner.cfg.vocab_size):
            examples = [Example(tuple(row.tolist()), (True,) * ns.seq_len) for row in ids]
            t0 = time.perf_counter()
            tuner.step([examples])
            if ns.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if ns.device == "cuda" else None
        return {"times": times[1:], "device_peak": peak, "streamed_blocks": len(plan.streamed_blocks),
                "blocks": plan.num_layers, "runtime_bytes": getattr(plan, "runtime_bytes", None)}


def _peft(ns) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.args import DTYPE_NAMES

    dtype = DTYPE_NAMES[ns.dtype]
    if ns.device == "cuda":  # accelerate: whole blocks on the GPU up to the budget, the rest offloaded
        model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=dtype, device_map="auto",
                                                     max_memory={0: ns.budget, "cpu": "512GiB"})
    else:
        model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=dtype)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=ns.lora_r, lora_alpha=2 * ns.lora_r, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    times = []
    first = next(model.parameters()).device
    for ids in _batches(ns, model.config.vocab_size):
        ids = ids.to(first)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if ns.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if ns.device == "cuda" else None
    return {"times": times[1:], "device_peak": peak}


def _child(ns, peer: str, budget: int) -> dict:
    cmd = [sys.executable, "-m", "layerstream.bench.finetune", "--peer", peer, "--budget", str(budget),
           "--model", ns.model, "--device", ns.device, "--dtype", ns.dtype, "--tokens", str(ns.tokens),
           "--seq-len", str(ns.seq_len), "--steps", str(ns.steps), "--lora-r", str(ns.lora_r)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    with MemorySampler(proc.pid) as sampler:
        out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{peer} failed (exit {proc.returncode})")
    result = json.loads(out.strip().splitlines()[-1])
    result["rss_anon_peak"] = sampler.peaks.rss_anon
    return result


def _random_adapters(model: str, folder, count: int, r: int) -> dict[str, str]:
    """count adapters of rank r on every projection, A and B random (B starts at zero in training), in PEFT's
    format under folder."""
    import torch

    from engine.finetune import LoRAAdapter, LoRAConfig, save_adapter
    from engine.lora_targets import projection_shapes
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(model)
    cfg = checkpoint.cfg
    checkpoint.close()
    out = {}
    for i in range(count):
        adapter = LoRAAdapter(LoRAConfig(r=r, alpha=2 * r), projection_shapes(cfg), cfg.num_layers,
                              torch.device("cpu"), seed=i)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for _, b in adapter.params.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
        out[f"adapter-{i}"] = str(save_adapter(Path(folder) / f"adapter-{i}", adapter, model))
    return out


def _serving(ns: argparse.Namespace) -> int:
    """Aggregate decode throughput with every request in flight at once: on the base alone, then spread
    round-robin over the base and the adapters."""
    import tempfile

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    ns.model = ns.model or str(bench_model_path())
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 31 + j * 7) % 500 + 6 for j in range(32)] for i in range(ns.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        modules = _random_adapters(ns.model, tmp, ns.adapters, ns.lora_r)
        llm = LLM(ns.model, device=ns.device, dtype=ns.dtype, max_num_seqs=ns.requests,
                  enable_prefix_caching=False, lora_modules=modules)
        names = [None, *modules]
        try:
            def timed(loras: list[str | None]) -> float:
                engine = llm.engine
                for i, (prompt, lora) in enumerate(zip(prompts, loras)):
                    engine.add_request(prompt, params, f"r{i}", lora_name=lora)
                t0, tokens = time.perf_counter(), 0
                while engine.has_unfinished():
                    tokens += sum(len(o.new_token_ids) for o in engine.step())
                return tokens / (time.perf_counter() - t0)

            spread = [names[i % len(names)] for i in range(ns.requests)]
            timed([None] * ns.requests)  # warm-up of both paths: kernels, page cache, the op-by-op block
            timed(spread)
            base = timed([None] * ns.requests)
            mixed = timed(spread)
        finally:
            llm.close()
    print(machine_description())
    print(f"{ns.model}: {ns.requests} concurrent requests of 32 prompt tokens, {ns.max_tokens} generated each, "
          f"{ns.dtype} on {ns.device}; {ns.adapters} adapters of rank {ns.lora_r} on every projection")
    print(table(["requests", "tok/s"], [["base only", fmt(base, 1)],
                                        [f"base + {ns.adapters} adapters, round-robin", fmt(mixed, 1)]]))
    print(f"mixed / base-only: {mixed / base:.2f}x")
    return 0


def run(ns: argparse.Namespace) -> int:
    if ns.serve:
        return _serving(ns)
    if ns.peer:
        print(json.dumps(_layerstream(ns) if ns.peer == "layerstream" else _peft(ns)))
        return 0
    from engine.weights import ModelCheckpoint

    ns.model = ns.model or str(bench_model_path())
    checkpoint = ModelCheckpoint(ns.model)
    import torch

    fp32 = checkpoint.sizes(torch.float32)
    checkpoint.close()
    weights = checkpoint.cfg.num_layers * fp32.block_bytes + fp32.global_bytes
    budget = int(weights * ns.budget_fraction)
    rows, speeds = [], {}
    for peer in ("layerstream", "peft"):
        r = _child(ns, peer, budget)
        tps = ns.tokens * len(r["times"]) / sum(r["times"])
        speeds[peer] = tps
        streamed = f"{r['streamed_blocks']}/{r['blocks']} streamed" if "blocks" in r else \
            ("device_map offload" if ns.device == "cuda" else "all resident")
        rows.append([peer, streamed, fmt(tps, 1), mib(r["device_peak"]), mib(r["rss_anon_peak"])])
    print(machine_description())
    print(f"{ns.model}: weights {mib(weights)} in fp32, budget {mib(budget)} ({ns.budget_fraction:.0%}); "
          f"{ns.tokens} tokens a step in sequences of {ns.seq_len}, {ns.dtype}, LoRA r={ns.lora_r} on every projection")
    print(table(["peer", "base", "train tok/s", "device peak", "RssAnon peak"], rows))
    print(f"layerstream / peft: {speeds['layerstream'] / speeds['peft']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(bench_main("python -m layerstream.bench.finetune", __doc__, add_arguments, run, None))
