"""Speculative decoding built for streaming: a cheap draft proposes k tokens per sequence, and one
pass of the target over the streamed blocks verifies all of them (at batch 1 a streamed step costs
about the same for 1 or k + 1 tokens: it is bound by moving the weights).

Interface (what the engine uses; the rest is internal):

  SpeculativeConfig(method, num_speculative_tokens, model, prompt_lookup_min, prompt_lookup_max, adaptive_k)
      validated settings; SpeculativeConfig.from_dict(d) reads vLLM's speculative_config dict (keys
      CONFIG_KEYS, method names METHOD_ALIASES). EngineArgs.speculative_config holds the one in effect.
  (method "draft": engine.loader.load_draft_model loads the separate draft model resident before
  the target is planned, and the target's plan reserves its bytes.)
  DraftLength(K, adaptive).initial() / .next(k, drafted, accepted)
      each sequence's k: +2 after a pass that accepted every draft (at most K), -1 after a
      rejection (at least 1); fixed at K when not adaptive.
  build_drafter(config, target, draft_model) -> Drafter
      drafter.propose([DraftRequest(seq, k, params, generator)]) -> [Draft(tokens, probs)]
  verify(rows, draft, params, prompt_ids, output_ids, generator) -> (accepted, next token)
      greedy: argmax matching; sampling: rejection sampling that preserves the target distribution.
  SpeculativeStep(config, drafter): the engine step's speculative part
      .draft(chunks, scheduler, max_model_len, vocab_size) before the target's pass turns decode chunks into
      verify chunks; .verify(chunk, rows) after it -> (tokens to emit, their logprobs, drafts accepted).
  SpecCounters / SpecTelemetry
      acceptance rate, accepted tokens per verify pass, draft vs verify time.
"""

from .adaptive import DraftLength
from .config import CONFIG_KEYS, METHOD_ALIASES, METHODS, SpeculativeConfig
from .drafter import Draft, Drafter, DraftRequest, ModelDrafter, NgramDrafter
from .ngram import ngram_draft
from .rejection import rejection_sample, verify_greedy
from .sources import build_drafter
from .stats import SpecCounters, SpecTelemetry
from .step import SpeculativeStep
from .verify import verify

__all__ = [
    "CONFIG_KEYS", "METHOD_ALIASES", "METHODS", "Draft", "DraftLength", "DraftRequest", "Drafter", "ModelDrafter",
    "NgramDrafter", "SpecCounters", "SpecTelemetry", "SpeculativeConfig", "SpeculativeStep", "build_drafter", "ngram_draft",
    "rejection_sample", "verify", "verify_greedy",
]
