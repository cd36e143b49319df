"""What one HTTP request may ask for: the caps that keep one client from costing the others (event
loop time, memory, stop-string scans), each a `layerstream serve` flag.

Checked before any tokenizing, so an oversized request costs the server almost nothing; every
refusal is a 400 naming the field (413 for the body), never a retryable 503, because sending the
same request again cannot succeed. The engine's own limits (context length, slots, queue) stay in
EngineArgs; the ones here are about the shape of one HTTP request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import InvalidParameter

# JSON may spell one character as a 6-byte \uXXXX escape; the automatic body limit leaves room for
# one prompt of the longest text that could fit the context written entirely that way.
_JSON_BYTES_PER_CHAR = 6
_MIN_BODY_BYTES = 2 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int | None = None  # None: derived from the model once it is loaded (body_limit)
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_n: int = 64  # choices per prompt
    max_stop: int = 32  # stop strings
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        for name in ("max_prompts", "max_n", "max_stop", "max_stop_chars", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")

    def body_limit(self, max_prompt_chars: int | None) -> int:
        """Bytes a request body may have: the flag, or room for one longest-possible prompt."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        if max_prompt_chars is None:  # still loading: every generation request is refused anyway
            return _MIN_BODY_BYTES
        return _MIN_BODY_BYTES + _JSON_BYTES_PER_CHAR * max_prompt_chars

    def check(self, req, num_prompts: int, capacity: int) -> None:
        """Refuse a request these caps (or the engine's capacity) can never admit."""
        if num_prompts > self.max_prompts:
            raise InvalidParameter("prompt", f"at most {self.max_prompts} prompts per request (--max-prompts), "
                                             f"got {num_prompts}")
        if req.n > self.max_n:
            raise InvalidParameter("n", f"n must be at most {self.max_n} (--max-n), got {req.n}")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > self.max_stop:
            raise InvalidParameter("stop", f"at most {self.max_stop} stop strings (--max-stop), got {len(stop)}")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise InvalidParameter("stop", f"a stop string may have at most {self.max_stop_chars} characters "
                                           f"(--max-stop-chars), got {longest}")
        if len(req.stop_token_ids or []) > self.max_stop_token_ids:
            raise InvalidParameter("stop_token_ids", f"at most {self.max_stop_token_ids} stop_token_ids, "
                                                     f"got {len(req.stop_token_ids)}")
        sequences = num_prompts * req.n
        if sequences > capacity:
            raise InvalidParameter(
                "n", f"this request needs {sequences} sequences ({num_prompts} prompt(s) x n={req.n}) but the "
                     f"server holds at most {capacity} at once (--max-num-seqs + --max-queue); it can never be "
                     "admitted, so send fewer prompts or a smaller n")
