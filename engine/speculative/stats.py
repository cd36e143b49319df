"""Speculative decoding's counters and their immutable snapshot (engine telemetry, /metrics, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecTelemetry:
    method: str
    num_speculative_tokens: int  # K, the most drafted per pass
    adaptive_k: bool  # each sequence's k follows its acceptance (adaptive.DraftLength)
    verify_passes: int  # sequences verified (one per sequence per step that drafted for it)
    draft_tokens: int  # tokens proposed
    accepted_tokens: int  # of which accepted
    emitted_tokens: int  # tokens the verify passes produced (accepted + one per pass, before stops)
    draft_seconds: float  # wall time spent drafting
    verify_seconds: float  # wall time of the target passes that verified drafts
    accepted_per_position: tuple[int, ...]  # [i]: drafts accepted at position i (vLLM's per-position count)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_drafted(self) -> float:
        """Drafted tokens per verify pass: K when fixed (less where max_tokens or the budget cut it)."""
        return self.draft_tokens / self.verify_passes if self.verify_passes else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verify pass."""
        return self.accepted_tokens / self.verify_passes if self.verify_passes else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens per verify pass (accepted + the target's own): vLLM's mean acceptance length."""
        return self.emitted_tokens / self.verify_passes if self.verify_passes else 0.0


@dataclass
class SpecCounters:
    method: str
    k: int
    adaptive_k: bool = False
    verify_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_position = [0] * self.k

    def verified(self, drafted: int, accepted: int) -> None:
        self.verify_passes += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += accepted + 1
        for i in range(accepted):
            self.per_position[i] += 1

    def snapshot(self) -> SpecTelemetry:
        return SpecTelemetry(self.method, self.k, self.adaptive_k, self.verify_passes, self.draft_tokens,
                             self.accepted_tokens, self.emitted_tokens, self.draft_seconds, self.verify_seconds,
                             tuple(self.per_position))
