"""Token sampling: penalties, temperature, top-k / top-p / min-p, seeded generators, logprobs.

Each sequence carries its own torch.Generator, so its tokens depend only on its seed and its own
logits, never on which other requests share the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """logits: (vocab,) fp32. Repetition penalty over prompt + output (HF semantics); presence and
    frequency penalties over the output only (OpenAI semantics)."""
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature then top-k, top-p, min-p on (vocab,) fp32 logits; removed entries -> -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        drop[0] = False  # top_p = 0 (or one that rounds to 0 in fp32) keeps the best token, not none
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's logit_bias: each value is added to its token's logit before sampling."""
    ids = torch.tensor(list(bias), dtype=torch.long)
    logits[ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)
    return logits


def argmax(logits: torch.Tensor) -> int:
    """argmax that a NaN cannot capture (torch.argmax returns the index of a NaN)."""
    return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int | None:
    """One token drawn from probs (vocab,) by inverting its CDF with one uniform number; None when
    the probabilities are not finite. torch.multinomial draws the same distribution but was about
    twenty times slower over a 49k vocabulary, a large part of a batch-16 CPU decode step. The CDF is
    summed in fp64 so the tail of a large vocabulary keeps its mass."""
    cdf = probs.cumsum(0, dtype=torch.float64)  # (vocab,)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0):
        return None
    u = torch.rand((), generator=generator, dtype=torch.float64) * total
    # The first token whose CDF exceeds u: a token of probability 0 never is.
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def processed_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                     output_ids: list[int]) -> torch.Tensor:
    """(vocab,) raw logits -> a new tensor with penalties and logit_bias applied: what greedy takes
    the argmax of and sampling filters (speculative verification processes each row the same way)."""
    logits = apply_penalties(logits.clone(), params, prompt_ids, output_ids)
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
    return logits


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """Processed logits -> the (vocab,) probabilities sampling draws from (temperature, top-k/p,
    min-p), or None when they are not finite (the caller then takes the most likely token)."""
    probs = filter_logits(logits, params).softmax(-1)
    if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
        return probs
    return None


def token_logprobs(raw_logits: torch.Tensor, token: int, params: SamplingParams) -> TokenLogprobs | None:
    """Logprobs of the model's own distribution (before penalties and temperature), as vLLM reports;
    None when the request asked for none."""
    if params.logprobs is None:
        return None
    lp = torch.log_softmax(raw_logits, dim=-1)
    top = []
    if params.logprobs > 0:
        vals, ids = torch.topk(lp, params.logprobs)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(token, float(lp[token]), top)


def sample_one(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
               generator: torch.Generator, allowed: torch.Tensor | None = None) -> tuple[int, TokenLogprobs | None]:
    """logits: (vocab,) fp32 raw model output for one sequence. allowed: (k,) int64, the token ids a
    grammar admits (structured output), ascending; the others cannot be sampled whatever their bias."""
    processed = processed_logits(logits, params, prompt_ids, output_ids)
    if allowed is not None:
        # Sampling over the admitted tokens only: the same distribution as setting the others to
        # -inf (top-k/top-p/min-p never keep a -inf token), and a JSON grammar usually admits a
        # few hundred of 50k tokens, so every op after this gather is that much smaller.
        processed = processed[allowed]  # (k,)
    token = argmax(processed) if params.greedy else draw(filter_logits(processed, params).softmax(-1), generator)
    if token is None:
        # Penalties and temperature inside their ranges keep logits finite; if a model still
        # produced inf/NaN logits, this sequence gets its most likely token rather than an
        # exception that would fail the whole step.
        token = argmax(processed)
    if allowed is not None:
        token = int(allowed[token])
    return token, token_logprobs(logits, token, params)


def score_tokens(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprobs]:
    """logits: (n, vocab) fp32 raw model output at n positions; token_ids: the n tokens that came
    next (prompt logprobs). Each token's logprob under the model's own distribution, and the `top`
    best alternatives, as sample_one reports them for sampled tokens."""
    lp = torch.log_softmax(logits, dim=-1)  # (n, vocab)
    chosen = lp.gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])[:, 0].tolist()  # (n,)
    if top > 0:
        vals, ids = torch.topk(lp, top, dim=-1)  # (n, top)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in token_ids]
    return [TokenLogprobs(t, c, tp) for t, c, tp in zip(token_ids, chosen, tops)]
