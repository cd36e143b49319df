"""The engine: requests in, batched steps through the runner, sampled tokens and text deltas out.

Single-threaded by design; `engine_loop.EngineLoop` runs it on a background thread for the server
and `llm.LLM` drives it synchronously for the offline API.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from .args import EngineArgs
from .detokenizer import IncrementalDetokenizer
from .loader import LoadedModel, load_model
from .model_source import resolve_model
from .runner import check_token_ids
from .sampler import TokenLogprobs, make_generator, sample_one
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, Sequence
from .structured_output import GrammarCompiler, Guide
from .telemetry import EngineTelemetry, KVUsage, PlanSummary, StepTelemetry

log = logging.getLogger("layerstream")


class PromptTooLongError(ValueError):
    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens."
        )
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len


@dataclass
class RequestOutput:
    """What one step produced for one request: deltas, plus totals once it finishes."""

    request_id: str
    new_token_ids: list[int]
    text: str  # text delta
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop_token_ids entry that ended it (vLLM's name)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class _SeqState:
    params: SamplingParams
    generator: object
    detok: IncrementalDetokenizer
    stop_ids: set[int]
    guide: Guide | None = None  # structured output: the grammar this sequence follows


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class LLMEngine:
    def __init__(self, args: EngineArgs, tokenizer=None):
        path = resolve_model(args.model, show_progress=args.show_progress)
        self.model: LoadedModel = load_model(args, path)
        try:
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
            plan = self.model.plan
            self.scheduler = Scheduler(SchedulerConfig(
                max_num_seqs=plan.max_num_seqs,  # at most args.max_num_seqs <= max_num_batched_tokens
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_queue=args.max_queue,
            ))
        except BaseException:
            self.model.close()  # a tokenizer that does not load: the weights stream no more
            raise
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._steps = 0
        try:
            self.grammar = GrammarCompiler(self.tokenizer, self.model.cfg.vocab_size, self._eos_ids())
        except BaseException:
            self.model.close()
            raise

    def _eos_ids(self) -> list[int]:
        ids = list(self.model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    @property
    def plan(self):
        return self.model.plan

    @property
    def max_model_len(self) -> int:
        return self.model.plan.max_model_len

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if ids:  # a tokenizer's added tokens may lie beyond the model's embedding table
                check_token_ids(ids, self.model.cfg.vocab_size)
            return ids
        if not prompt or not all(isinstance(t, int) and 0 <= t < self.model.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be a non-empty list of ints in [0, {self.model.cfg.vocab_size})")
        return list(prompt)

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len + max_tokens > self.max_model_len:
            raise PromptTooLongError(prompt_len, max_tokens, self.max_model_len)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        ids = self.encode(prompt)
        self.check_length(len(ids), params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        params.check_vocab(self.model.cfg.vocab_size)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self._eos_ids())
        guide = self.grammar.guide(params.structured) if params.structured is not None else None
        seq = Sequence(rid, ids, params.max_tokens)
        seq.state = _SeqState(params, make_generator(params.seed),
                              IncrementalDetokenizer(self.tokenizer, ids, params.stop), stop_ids, guide)
        if guide is not None:
            guide.prefetch()  # the first mask is computed while the prompt is prefilled
        self.scheduler.add(seq)  # may raise QueueFullError: nothing registered yet
        self._seqs[rid] = seq
        return rid

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_usage(self) -> float:
        """Fraction of the KV cache held: running sequences own a whole slot each."""
        return len(self.scheduler.running) / self.scheduler.config.max_num_seqs

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        # Sampling runs on the CPU: each sequence's torch.Generator is a CPU generator (multinomial
        # rejects it for CUDA probabilities) and the penalties build CPU tensors. One copy per step.
        logits = self.model.runner.execute(chunks).cpu()
        self._steps += 1
        outputs = []
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed += chunk.count
            if not chunk.samples:
                continue
            st: _SeqState = seq.state
            allowed = st.guide.allowed() if st.guide is not None else None
            token, info = sample_one(logits[row], st.params, seq.prompt_ids, seq.output_ids, st.generator, allowed)
            row += 1
            seq.output_ids.append(token)
            reason = None
            if token in st.stop_ids:
                reason = "stop"
            else:
                st.detok.add_token(token)
                if st.guide is not None:
                    st.guide.accept(token)
                if st.detok.stopped or (st.guide is not None and st.guide.stopped):
                    # A complete grammar admits only end-of-sequence: end now rather than spend a step on it.
                    reason = "stop"
                elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                    reason = "length"
            if reason:
                st.detok.flush()
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
            elif st.guide is not None:
                st.guide.prefetch()  # overlaps the next forward pass
            outputs.append(RequestOutput(
                request_id=seq.request_id,
                new_token_ids=[token],
                text=st.detok.take_delta(final=reason is not None),
                logprobs=[info] if info else [],
                finished=reason is not None,
                finish_reason=reason,
                stop_reason=st.detok.stop_string or (token if token in st.params.stop_token_ids else None),
                num_prompt_tokens=len(seq.prompt_ids),
                num_output_tokens=len(seq.output_ids),
            ))
        return outputs

    def telemetry(self) -> EngineTelemetry:
        """A snapshot of what the engine is doing: the plan, bytes streamed (last step and in total,
        by tier), time compute waited for weights, achieved GB/s and % of the measured floor, KV-cache
        usage. Cheap; meant to be read after every step (the server's /metrics does)."""
        weights = self.model.weights.telemetry()
        last = self.model.runner.last_step
        plan = self.model.plan
        running = list(self.scheduler.running)
        return EngineTelemetry(
            plan=PlanSummary.of(plan, weights.links),
            links=weights.links,
            transport_name=weights.transport_name,
            dtype=str(self.model.dtype).replace("torch.", ""),
            steps=self._steps,
            last_step=None if last is None else StepTelemetry.of(last.seconds, last.stream, weights.links),
            total=weights.stream,
            kv=KVUsage(plan.max_num_seqs, len(running), plan.max_model_len,
                       sum(s.num_computed for s in running), plan.kv_cache_bytes),
            pinned_host_bytes=weights.pinned_host_bytes,
            buffer_sets=weights.buffer_sets,
            blocks_converted=weights.blocks_converted,
            structured_output=self.grammar.stats.snapshot(),
            pinned_cache=weights.pinned_cache,
        )

    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """fp32 logits (vocab,) of the token after `prompt_ids`, from one prefill step in KV slot 0,
        outside the scheduler: for tests and tools comparing against a reference, not while requests run."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine (requests are in flight)")
        seq = Sequence("prompt-logits", list(prompt_ids), 1)
        seq.slot = 0
        return self.model.runner.execute([ScheduledChunk(seq, 0, len(prompt_ids))])[0]

    def close(self) -> None:
        """Stop streaming and release the model's threads, buffers, pinned memory and files."""
        self.grammar.close()
        self.model.close()
