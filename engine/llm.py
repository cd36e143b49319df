"""The offline Python API, shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .llm_engine import LLMEngine
from .loader import EngineArgs
from .planner import MemoryPlan
from .sampler import TokenLogprobs
from .sampling_params import SamplingParams, choice_seed


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


class LLM:
    def __init__(self, model: str, device: str = "cpu", max_device_memory: int | str | None = None,
                 dtype: str = "auto", **kwargs):
        kwargs.setdefault("show_progress", False)
        self.engine = LLMEngine(EngineArgs(model=model, device=device, max_device_memory=max_device_memory,
                                           dtype=dtype, **kwargs))

    @property
    def plan(self) -> MemoryPlan:
        return self.engine.plan

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | None = None) -> list[GenerationResult]:
        """prompts: a string, a list of strings, a list of token ids, or a list of token-id lists."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results, pending = [], {}
        for p in prompts:
            ids = self.engine.encode(p)
            res = GenerationResult(p, ids, [CompletionOutput(i) for i in range(params.n)])
            results.append(res)
            for i, out in enumerate(res.outputs):
                # n > 1: each choice samples independently; a fixed seed is offset per choice.
                rid = self.engine.add_request(ids, dataclasses.replace(params, seed=choice_seed(params.seed, i), n=1))
                pending[rid] = out
        while pending:
            for o in self.engine.step():
                out = pending[o.request_id]
                out.token_ids += o.new_token_ids
                out.text += o.text
                out.logprobs += o.logprobs
                if o.finished:
                    out.finish_reason = o.finish_reason
                    del pending[o.request_id]
        return results

    def close(self) -> None:
        self.engine.close()
