"""The engine: requests in, batched steps through the runner, sampled tokens and text deltas out.

Single-threaded by design; `engine_loop.EngineLoop` runs it on a background thread for the server
and `llm.LLM` drives it synchronously for the offline API.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from pathlib import Path
from typing import Callable

import torch

from .args import EngineArgs
from .arch import ModelConfig
from .detokenizer import IncrementalDetokenizer
from .failures import EngineUnhealthyError, raise_if_fatal
from .loader import DraftReservation, LoadedModel, kv_layout, load_draft_model, load_model
from .lora_serving import AdapterSet, AdapterWeights, LoRAAdapterError, ServedAdapter, read_adapter
from .model_source import resolve_model
from .placement import MeasuredSpeeds
from .request import RequestOutput, RequestState, emit
from .runner import check_token_ids
from .sampler import make_generator, sample_one, score_tokens
from .sampling_params import InvalidParameter, SamplingParams
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SeqStatus, Sequence
from .speculative import SpeculativeStep, build_drafter
from .structured_output import GrammarCompiler
from .telemetry import EngineTelemetry, PlanSummary, StepTelemetry

log = logging.getLogger("layerstream")


def prefix_caching(args: EngineArgs, cfg: ModelConfig, max_model_len: int) -> bool:
    """Whether the prefix cache is on: as asked, unless LongRoPE switches RoPE tables within max_model_len
    (K cached under the short table must not serve a sequence rotated by the long one, or the reverse)."""
    if not args.enable_prefix_caching or not cfg.rope_switches_within(max_model_len):
        return args.enable_prefix_caching
    log.warning("prefix caching is off: LongRoPE switches RoPE tables past %d tokens (max_model_len %d), and K "
                "cached under one table would not match the other", cfg.rope_long_after, max_model_len)
    return False


# When every sequence left is waiting for its grammar mask, the engine thread waits for one this
# long at most before it looks at its command queue again (new requests, cancellations).
HELD_WAIT_SECONDS = 0.05
# Masks that were cheap last time and are late (a busy machine) are waited for up to this fraction
# of the step's forward pass, rather than their sequences losing a step; expensive ones never are.
CHEAP_MASK_GRACE = 0.05

# One-token probe passes tried after a step in which every sequence failed even alone: if all of
# them fail too, the fault is the engine's (device, weights, disk), not any request's.
PROBE_TRIES = 3


class PromptTooLongError(ValueError):
    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens."
        )
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len


def load_tokenizer(path):
    """The model's tokenizer: its folder's (a GGUF file's comes from its metadata: engine.weights.config_folder).

    Where tokenizer_config.json names its class, that class loads it directly: AutoTokenizer would load
    the model's transformers config first, whose import costs a fresh process more than mapping the
    weights. It is the class AutoTokenizer picks from that name (its fast variant where one exists).

    A GGUF file's metadata folder is the exception: its tokenizer.json is the engine's own save of the
    tokenizer that class built, so transformers' generic backend loads the same pipeline from it in Rust,
    where a class with its own __init__ (GemmaTokenizer, LlamaTokenizer) parses the whole file once more
    in Python to rebuild it: about as long again as the Rust parse for a 262k-token vocabulary."""
    import transformers

    from .weights import config_folder, is_gguf_metadata_folder

    folder = Path(config_folder(path))
    if is_gguf_metadata_folder(folder) and (folder / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str):
        for candidate in ((name,) if name.endswith("Fast") else (name + "Fast", name)):
            try:
                cls = getattr(transformers, candidate)
            except (AttributeError, ImportError):
                continue
            return cls.from_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def _tokenizer_of_a_runnable_model(path):
    """load_tokenizer(path); where that fails, the checkpoint's own error first when it has one: a model
    the engine cannot run (an unsupported architecture, a corrupt file) fails its tokenizer too, in
    transformers' words, and the loader's message says what is wrong and what is supported."""
    try:
        return load_tokenizer(path)
    except Exception:
        from .weights import ModelCheckpoint

        ModelCheckpoint(path).close()  # raises the checkpoint's error, if it has one
        raise


def check_same_tokenizer(target_tokenizer, draft_path) -> None:
    """A speculative draft model must tokenize as the target does: its token ids are verified as the target's."""
    draft_tokenizer = load_tokenizer(draft_path)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"the speculative draft model {draft_path} does not use the target's tokenizer "
                         f"(vocabularies of {len(draft_tokenizer)} and {len(target_tokenizer)} tokens differ)")


class LoRAAdapterBusyError(LoRAAdapterError):
    """An adapter that requests in flight (running or waiting) use cannot be unloaded."""


class LLMEngine:
    def __init__(self, args: EngineArgs, tokenizer=None):
        path = resolve_model(args.model)
        # Before the weights: the plan measures the runtime outside its budget (interpreter, torch, kernels,
        # tokenizer) as the anonymous memory held when it is made.
        self.tokenizer = tokenizer if tokenizer is not None else _tokenizer_of_a_runnable_model(path)
        spec = args.speculative_config
        draft_model = reservation = None
        if spec is not None and spec.method == "draft":
            # Loaded first, resident: the target's plan reserves what it takes.
            draft_model = load_draft_model(args)
            reservation = DraftReservation(draft_model.plan.device_bytes, f"draft model {spec.model}, resident")
        try:
            # A slow tokenizer has no serialized form for the grammar probe to build from: no probe runs.
            self.model: LoadedModel = load_model(args, path, reservation,
                                                 grammar_probe=hasattr(self.tokenizer, "backend_tokenizer"))
        except BaseException:
            if draft_model is not None:
                draft_model.close()
            raise
        self.speculative: SpeculativeStep | None = None
        try:
            plan = self.model.plan
            self.scheduler = Scheduler(SchedulerConfig(
                max_num_seqs=plan.max_num_seqs,  # args.max_num_seqs <= max_num_batched_tokens
                max_num_batched_tokens=plan.max_num_batched_tokens or args.max_num_batched_tokens,
                max_queue=args.max_queue,
                max_model_len=plan.max_model_len,
                block_size=plan.kv_block_size,
                num_kv_blocks=plan.num_kv_blocks,
                enable_prefix_caching=prefix_caching(args, self.model.cfg, plan.max_model_len),
                num_host_kv_blocks=plan.num_host_kv_blocks,
                kv_layout=kv_layout(args, self.model.cfg),
                kv_group_blocks=plan.kv_group_blocks,
                kv_group_host_blocks=plan.kv_group_host_blocks,
            ), disk=self.model.kv_disk)
            if spec is not None:
                if draft_model is not None:
                    check_same_tokenizer(self.tokenizer, draft_model.path)
                self.speculative = SpeculativeStep(spec, build_drafter(spec, self.model, draft_model))
                draft_model = None
        except BaseException:
            self.model.close()  # a draft that does not fit: the weights stream no more
            if draft_model is not None:
                draft_model.close()
            raise
        self.spec = spec
        self._seqs: dict[str, Sequence] = {}
        self._held: list[Sequence] = []  # sequences whose logits wait for their grammar mask
        self._ids = itertools.count()
        self._steps = 0
        try:
            # The cache's cap as the plan counted it in host memory, and the probe where the plan holds it.
            limits = dataclasses.replace(args.grammar_limits(), cache_bytes=self.model.plan.grammar_cache_bytes
                                         or args.grammar_limits().cache_bytes,
                                         probe=self.model.plan.grammar_probe_bytes > 0)
            self.grammar = GrammarCompiler(self.tokenizer, self.model.cfg.vocab_size, self._eos_ids(), limits)
        except BaseException:
            if self.speculative is not None:
                self.speculative.close()
            self.model.close()
            raise
        self.adapters = AdapterSet(self.model.cfg, torch.device(self.model.runner.device), self.model.runner.dtype)
        try:
            for name, folder in args.lora_modules.items():
                self.load_lora(name, folder)
        except BaseException:
            self.close()
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

    # -- LoRA adapters (engine.lora_serving) ---------------------------------------------------------
    def read_adapter(self, folder: str) -> AdapterWeights:
        """An adapter folder read and checked against this model (LoRAAdapterError says what is wrong). Safe off
        the engine thread: it reads the folder and the model's config only."""
        return read_adapter(folder, self.model.cfg)

    def add_lora(self, name: str, weights: AdapterWeights) -> ServedAdapter:
        """Serve an adapter read by read_adapter as `name` from the next step on."""
        if self.speculative is not None:
            raise LoRAAdapterError("LoRA adapters are not served with speculative decoding yet (this engine "
                                   "drafts): restart without a speculative method to serve them")
        if self.model.plan.group_placement is not None:
            # An MLP off the device computes outside adapt()'s reach: its targeted projections would go unadapted.
            raise LoRAAdapterError("LoRA adapters are not served with tensor groups off the device yet "
                                   "(LAYERSTREAM_PLACEMENT=groups)")
        served = self.adapters.add(name, weights)
        log.info("LoRA adapter %r loaded from %s (r=%d, %s)", name, weights.path, weights.r,
                 ", ".join(served.target_modules))
        return served

    def load_lora(self, name: str, folder: str) -> ServedAdapter:
        return self.add_lora(name, self.read_adapter(folder))

    def remove_lora(self, name: str) -> ServedAdapter:
        """Stop serving adapter `name` (UnknownAdapterError when none is). Refused (LoRAAdapterBusyError) while
        any request using it is running or waiting: cancelling them would fail requests the client was
        promised, and letting them finish would need an adapter that is no longer listed. Its prefix-cache
        blocks stay under its digest and age out; the same folder loaded again finds them."""
        served = self.adapters.get(name)
        busy = sum(1 for seq in self._seqs.values() if seq.lora_slot == served.slot)
        if busy:
            raise LoRAAdapterBusyError(f"the LoRA adapter {name!r} is in use by {busy} request(s) in flight; "
                                       "unload it once they have finished")
        self.adapters.remove(name)
        log.info("LoRA adapter %r unloaded", name)
        return served

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    lora_name: str | None = None) -> str:
        """lora_name: a served adapter (UnknownAdapterError when there is none of that name); None: the base."""
        ids = self.encode(prompt)
        self.check_length(len(ids), params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        adapter = self.adapters.get(lora_name) if lora_name is not None else None
        params.check_vocab(self.model.cfg.vocab_size)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self._eos_ids())
        guide = self.grammar.guide(params.structured) if params.structured is not None else None
        seq = Sequence(rid, ids, params.max_tokens, prompt_logits=params.prompt_logprobs is not None,
                       lora_slot=adapter.slot if adapter else None, cache_salt=adapter.digest if adapter else None)
        seq.state = RequestState(params, make_generator(params.seed),
                                 IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens),
                                 stop_ids, guide, [None] * len(ids) if seq.prompt_logits else None)
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
        """Fraction of the KV pool's blocks held by running sequences (cached free blocks count as free)."""
        return self.scheduler.blocks.num_used_blocks / self.scheduler.blocks.num_blocks

    def step(self) -> list[RequestOutput]:
        """One batched step. A failure that belongs to one sequence (sampling, detokenizing, stop
        checks) finishes that sequence alone with finish_reason "error". If the forward pass itself
        fails, nothing was committed (num_computed advances only after it returns, and a retried
        pass rewrites the same KV positions), so each chunk is retried alone: the innocent ones
        proceed and the one that fails again is failed. When none survives, a one-token probe
        tells a request's fault from the engine's. A fatal device error, or a probe that cannot
        run, raise EngineUnhealthyError: the engine's state can no longer be trusted and the
        caller must stop serving.

        A structured-output sequence whose grammar mask is not ready when its logits are keeps
        them and samples at the first step where it is, before that step is scheduled; the step
        never waits for it (only an engine with nothing else to run waits, briefly)."""
        outputs = self._sample_held()
        chunks = self.scheduler.schedule()
        if not chunks:
            if self._held and not outputs:
                self.grammar.wait_any([s.state.guide for s in self._held], HELD_WAIT_SECONDS)
            return outputs
        if self.speculative is not None:
            chunks = self.speculative.draft(chunks, self.scheduler, self.max_model_len, self.model.cfg.vocab_size)
        try:
            logits = self._execute(chunks)
        except EngineUnhealthyError:
            raise
        except Exception as e:  # noqa: BLE001 - isolate the sequence that caused it
            log.warning("engine step over %d sequences failed (%s: %s); retrying each alone",
                        len(chunks), type(e).__name__, e)
            outputs += self._step_isolated(chunks)
            self._steps += 1  # one step however many passes its retries and probe took (as /metrics counts)
            return outputs
        self._steps += 1
        return outputs + self._sample(chunks, logits)

    def _alone(self, seq: Sequence, work: Callable, *args) -> tuple[object, RequestOutput | None]:
        """(work(*args), None), or (None, the output that ends seq) when work raises: a failure that
        belongs to one sequence (its pass retried alone, sampling, scoring, detokenizing, stop checks,
        its grammar) finishes that sequence alone with finish_reason "error". EngineUnhealthyError is
        the engine's, not the sequence's: it propagates."""
        try:
            return work(*args), None
        except EngineUnhealthyError:
            raise
        except Exception as e:  # noqa: BLE001 - this sequence fails alone
            return None, self._fail(seq, e)

    def _sample_held(self) -> list[RequestOutput]:
        """Sample the held sequences whose masks are now ready (and start their next masks, which
        then compute while this step's pass runs); forget those that finished or were preempted
        meanwhile (a preempted one samples again after its re-prefill)."""
        if not self._held:
            return []
        outputs, still, released = [], [], []
        for seq in self._held:
            st = seq.state
            if seq.status != SeqStatus.RUNNING or seq.num_computed != seq.num_tokens:
                st.held_logits = None
                continue
            if not st.guide.ready:
                still.append(seq)
                continue
            logits, st.held_logits = st.held_logits, None
            out, failed = self._alone(seq, self._advance, seq, logits)
            outputs.append(failed or out)
            if seq.status == SeqStatus.RUNNING:
                released.append(st.guide)
        self._held = still
        self.grammar.prefetch(released)
        return outputs

    def _execute(self, chunks: list[ScheduledChunk]):
        # Sampling runs on the CPU: each sequence's torch.Generator is a CPU generator (multinomial
        # rejects it for CUDA probabilities) and the penalties build CPU tensors. One copy per step.
        self._copy_kv_blocks()
        try:
            logits = self.model.runner.execute(chunks, self.adapters).cpu()
        except Exception as e:
            raise_if_fatal(e)
            raise
        if self.speculative is not None and self.speculative.verifies(chunks):
            self.speculative.counters.verify_seconds += self.model.runner.last_step.seconds
        return logits

    def _copy_kv_blocks(self) -> None:
        """Run the KV block copies (host tier <-> pool) that scheduling queued, before the pass that
        reads them. They are taken once: a pass retried alone finds them done. A copy that fails
        leaves blocks the prefix cache vouches for with unknown content, so the engine stops."""
        copies = self.scheduler.blocks.take_copies()
        if not copies:
            return
        try:
            self.model.runner.copy_kv_blocks(copies)
        except Exception as e:
            raise EngineUnhealthyError(f"KV block copies failed ({type(e).__name__})") from e

    def _step_isolated(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        outputs, survived = [], 0
        for chunk in chunks:
            logits, failed = self._alone(chunk.seq, self._execute, [chunk])
            if failed is not None:
                outputs.append(failed)
                continue
            survived += 1
            outputs += self._sample([chunk], logits)
        if not survived:
            self._probe()
        return outputs

    def _probe(self) -> None:
        """Run a one-token pass on a KV block borrowed from the pool (the failed sequences just
        freed theirs), so that requests that fail whatever runs with them cannot make the engine
        give up, and an engine that cannot run anything does."""
        if not self.scheduler.blocks.num_free_blocks:
            return
        seq = Sequence("health-probe", [0], 1, status=SeqStatus.RUNNING)
        error: Exception | None = None
        for _ in range(PROBE_TRIES):
            try:
                self._borrowed_pass(seq)
                return
            except EngineUnhealthyError:
                raise
            except Exception as e:  # noqa: BLE001 - tried again, then reported
                error = e
        raise EngineUnhealthyError(f"the engine cannot run a step ({type(error).__name__})") from error

    def _fail(self, seq: Sequence, error: BaseException) -> RequestOutput:
        user_error = error if isinstance(error, InvalidParameter) else None
        if user_error is not None:  # the request's own doing (its grammar's cost): no traceback
            log.info("request %s ended: %s", seq.request_id, error)
        else:
            log.error("request %s failed: %s: %s", seq.request_id, type(error).__name__, error,
                      exc_info=error)
        self.scheduler.finish(seq, "error")
        self._seqs.pop(seq.request_id, None)
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], text="", finished=True,
                             finish_reason="error", num_prompt_tokens=len(seq.prompt_ids),
                             num_output_tokens=len(seq.output_ids), error=user_error)

    def _sample(self, chunks: list[ScheduledChunk], logits) -> list[RequestOutput]:
        """logits: (rows, vocab) fp32 on the CPU, in the runner's order: each chunk's num_logits rows
        (1 per sampling chunk, 1 + k per verify chunk), then the prompt-logit rows of the chunks that have them."""
        outputs = []
        guides = [c.seq.state.guide for c in chunks if c.samples and c.seq.state.guide is not None]
        if guides and self.model.runner.last_step is not None:
            self.grammar.wait_cheap(guides, CHEAP_MASK_GRACE * self.model.runner.last_step.seconds)
        row, prompt_row = 0, sum(c.num_logits for c in chunks)
        for chunk in chunks:
            seq = chunk.seq
            rows = logits[row:row + chunk.num_logits]  # (num_logits, vocab): 1, or 1 + k when verifying
            row += chunk.num_logits
            if chunk.ids is None:
                self.scheduler.commit(chunk)  # a verify chunk commits the positions it keeps (_verify)
            positions = chunk.prompt_logit_positions
            prompt_row += len(positions)
            if positions and seq.status == SeqStatus.RUNNING:
                _, failed = self._alone(seq, self._score_prompt, seq, positions,
                                        logits[prompt_row - len(positions):prompt_row])
                if failed is not None:
                    outputs.append(failed)
            if not chunk.samples:
                continue
            if seq.status != SeqStatus.RUNNING:
                continue  # failed while scoring its prompt
            out, failed = (self._alone(seq, self._advance, seq, rows[0]) if chunk.ids is None
                           else self._alone(seq, self._verify, chunk, rows))
            if failed is not None or out is not None:  # None: held until its grammar mask is ready
                outputs.append(failed or out)
        # The next step's grammar masks, computed while its forward pass runs.
        self.grammar.prefetch([c.seq.state.guide for c in chunks if c.seq.state.guide is not None
                               and c.seq.status == SeqStatus.RUNNING and c.seq.state.held_logits is None])
        return outputs

    def _score_prompt(self, seq: Sequence, positions: range, rows: torch.Tensor) -> None:
        """Prompt logprobs of the prompt tokens after `positions`, from their logits rows (len(positions), vocab)."""
        st = seq.state
        scored = score_tokens(rows, [seq.prompt_ids[p + 1] for p in positions], st.params.prompt_logprobs)
        st.prompt_logprobs[positions.start + 1:positions.stop + 1] = scored

    def _verify(self, chunk: ScheduledChunk, rows) -> RequestOutput:
        """rows: (1 + k, vocab) target logits at the last token and each draft: the accepted drafts and
        the token after them are emitted."""
        tokens, infos, accepted = self.speculative.verify(chunk, rows)
        # Kept: the last token's and the accepted drafts' K/V (as far as they were emitted).
        return self._emit(chunk.seq, tokens, infos,
                          commit=lambda emitted: self.scheduler.commit(chunk, 1 + min(accepted, emitted)))

    def measured_speeds(self) -> MeasuredSpeeds | None:
        """The speeds --cpu-offload-policy auto decides from now (measured at start-up and refreshed by steps, or
        set), None where it has none (it then streams)."""
        return self.model.runner.offload.policy.speeds

    def set_measured_speeds(self, speeds: MeasuredSpeeds) -> None:
        """Measured speeds for --cpu-offload-policy auto (engine.placement): from the next step on, off-device
        groups take the path the cost model gives for them. Speeds given here are kept as given until given
        again; those start-up measured are refreshed from each step's own CPU computations."""
        self.model.runner.offload.set_speeds(speeds)

    def telemetry(self) -> EngineTelemetry:
        """A snapshot of what the engine is doing: the plan, bytes streamed (last step and in total,
        by tier), time compute waited for weights, achieved GB/s and % of the measured floor, the paged
        KV cache (pool use, prefix-cache hits, host tier, preemptions). Cheap; meant to be read after every step (the server's /metrics does)."""
        weights = self.model.weights.telemetry()
        last = self.model.runner.last_step
        plan = self.model.plan
        swapped_out, swapped_in = self.model.runner.kv_bytes_swapped()
        return EngineTelemetry(
            plan=PlanSummary.of(plan, weights.links),
            links=weights.links,
            transport_name=weights.transport_name,
            dtype=str(self.model.dtype).replace("torch.", ""),
            steps=self._steps,
            last_step=None if last is None else StepTelemetry.of(last.seconds, last.stream, weights.links),
            total=weights.stream,
            kv=self.scheduler.blocks.telemetry(swapped_out, swapped_in, self.scheduler.num_preemptions),
            pinned_host_bytes=weights.pinned_host_bytes,
            buffer_sets=weights.buffer_sets,
            blocks_converted=weights.blocks_converted,
            structured_output=self.grammar.telemetry(),
            pinned_cache=weights.pinned_cache,
            resident_copies=weights.resident_copies,
            resident_copies_in_huge_pages=weights.resident_copies_in_huge_pages,
            speculative=self.speculative.counters.snapshot() if self.speculative is not None else None,
            kernels=self.model.kernels,
            lora_adapters=self.adapters.served(),
            offload=self.model.runner.offload.stats if self.model.runner.offload.groups else None,
        )

    def prompt_logits(self, prompt_ids: list[int], lora_name: str | None = None) -> torch.Tensor:
        """fp32 logits (vocab,) of the token after `prompt_ids` (under the served adapter lora_name), from one
        prefill step on KV blocks borrowed from the pool, outside the scheduler and the prefix cache: for
        tests and tools comparing against a reference, not while requests run."""
        if self.scheduler.has_work():
            raise RuntimeError("prompt_logits needs an idle engine (requests are in flight)")
        slot = self.adapters.get(lora_name).slot if lora_name is not None else None
        seq = Sequence("prompt-logits", list(prompt_ids), 1, lora_slot=slot)
        if not self.scheduler.blocks.can_grow(seq, seq.num_tokens):
            raise ValueError(f"{seq.num_tokens} tokens do not fit the KV pool "
                             f"({self.scheduler.blocks.num_blocks} blocks of {self.scheduler.blocks.block_size})")
        return self._borrowed_pass(seq)[0]

    def _borrowed_pass(self, seq: Sequence) -> torch.Tensor:
        """One prefill pass of all of seq's tokens on blocks taken from the pool and given back
        unpublished (their content is nobody's), outside the scheduler; its logits."""
        blocks = self.scheduler.blocks
        blocks.grow(seq, seq.num_tokens)
        try:
            return self._execute([ScheduledChunk(seq, 0, seq.num_tokens)])
        finally:
            blocks.free(seq)

    def _advance(self, seq: Sequence, logits) -> RequestOutput | None:
        """Sample seq's next token from logits (vocab,); None when its grammar mask is not ready:
        the logits are held and the sequence samples at a later step (_sample_held)."""
        st: RequestState = seq.state
        allowed = None
        if st.guide is not None:
            allowed = st.guide.allowed(timeout=0)  # GrammarTooCostly: this request ends, alone
            if allowed is None:
                st.held_logits = logits.clone()  # a row of the step's logits: keep only it
                if seq not in self._held:  # (preempted and re-prefilled while held)
                    self._held.append(seq)
                self.grammar.stats.skips += 1
                return None
            if st.guide.stopped:
                # Complete once the pool parsed its last token (an expensive parse): it admits only
                # end-of-sequence, which ends it now.
                return self._emit(seq, [], [], reason="stop")
        prompt_logprobs = None
        if st.prompt_logprobs is not None and not seq.output_ids:  # the first output carries them
            prompt_logprobs = st.prompt_logprobs
            if any(p is None for p in prompt_logprobs[1:]):
                # Positions whose logits were never computed (say, a prompt prefix taken from a cache).
                raise RuntimeError("prompt logprobs are missing for part of the prompt")
        token, info = sample_one(logits, st.params, seq.prompt_ids, seq.output_ids, st.generator, allowed)
        return self._emit(seq, [token], [info], prompt_logprobs=prompt_logprobs)

    def _emit(self, seq: Sequence, tokens: list[int], infos: list, commit=None,
              prompt_logprobs: list | None = None, reason: str | None = None) -> RequestOutput:
        """request.emit (tokens in, stop rules, the client's output); a sequence it finishes gives its
        blocks back and leaves the engine."""
        out = emit(seq, tokens, infos, self.max_model_len, commit, prompt_logprobs, reason)
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason)
            self._seqs.pop(seq.request_id, None)
        return out

    def close(self) -> None:
        """Stop streaming and release the model's threads, buffers, pinned memory and files."""
        self.grammar.close()
        if self.model.kv_disk is not None:
            # Blocks published by the last step are written through before the next pass copies them; there
            # is none: write them now, so a restart finds them.
            spills = [c for c in self.scheduler.blocks.take_copies() if c.direction == "spill"]
            try:
                self.model.runner.copy_kv_blocks(spills)
            except Exception as e:  # noqa: BLE001 - closing goes on; those blocks are only not kept
                log.warning("KV disk tier: the last blocks were not written (%s: %s)", type(e).__name__, e)
        if self.speculative is not None:
            self.speculative.close()
            self.speculative = None
        self.model.close()
