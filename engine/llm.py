"""The offline Python API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from dataclasses import dataclass, field

from .llm_engine import LLMEngine
from .args import EngineArgs
from .planner import MemoryPlan
from .sampler import TokenLogprobs
from .sampling_params import SamplingParams, normalize_prompts


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    prompt: str | list[int]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    def __init__(self, model: str, **kwargs):
        """kwargs: any EngineArgs field (device, dtype, max_device_memory, max_num_seqs, ...), with
        EngineArgs' defaults; only show_progress defaults to False here (a library prints no bars)."""
        kwargs.setdefault("show_progress", False)
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    @property
    def plan(self) -> MemoryPlan:
        return self.engine.plan

    def telemetry(self):
        """The engine's telemetry snapshot (engine.telemetry.EngineTelemetry)."""
        return self.engine.telemetry()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_lora(self, name: str, folder: str) -> None:
        """Serve the PEFT adapter in `folder` as `name` (as lora_modules={name: folder} does at start)."""
        self.engine.load_lora(name, folder)

    def unload_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def generate(self, prompts, sampling_params: SamplingParams | None = None,
                 lora_name: str | None = None) -> list[GenerationResult]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists.
        lora_name: a served adapter's name (lora_modules, load_lora) to generate with; None: the base."""
        params = sampling_params or SamplingParams()
        if params.structured is not None:
            self.engine.grammar.check(params.structured)  # an invalid constraint raises here, as other bad params do
        results, pending, owner = [], {}, {}
        for p in normalize_prompts(prompts):
            ids = self.engine.encode(p)
            res = GenerationResult(p, ids, [CompletionOutput(i) for i in range(params.n)])
            results.append(res)
            for out, choice in zip(res.outputs, params.per_choice()):
                rid = self.engine.add_request(ids, choice, lora_name=lora_name)
                pending[rid], owner[rid] = out, len(results) - 1
        while pending:
            for o in self.engine.step():
                out = pending[o.request_id]
                out.token_ids += o.new_token_ids
                out.text += o.text
                out.logprobs += o.logprobs
                if o.prompt_logprobs is not None:
                    results[owner[o.request_id]].prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    out.finish_reason = o.finish_reason
                    del pending[o.request_id]
        return results

    def close(self) -> None:
        self.engine.close()
