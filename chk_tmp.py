import argparse, sys
from pathlib import Path
from bench.disk import _run_peer, PROMPT
from transformers import AutoTokenizer
ids = AutoTokenizer.from_pretrained("/var/tmp/layerstream-bench/smollm2/bf16").encode(PROMPT * 4)[:16]
ns = argparse.Namespace(gguf="/var/tmp/layerstream-bench/smollm2/SmolLM2-135M-Instruct.Q4_0.gguf", decode_tokens=16,
                        prefetch_depth=2, max_host_memory="100MB", timeout=600)
for peer, cap in (("layerstream-gguf", 10**9), ("layerstream-gguf", None), ("layerstream-gguf-uncapped", 10**9)):
    r = _run_peer(ns, peer, Path("/var/tmp/layerstream-bench/smollm2/bf16"), ids, cap)
    print(peer, cap, r.get("tokens"), r.get("disk_blocks"), r.get("error"), r.get("stderr_tail", "")[-300:])
