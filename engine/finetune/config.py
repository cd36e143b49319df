"""What a fine-tune is asked to do: the adapter's shape and the training run's settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..lora_targets import MODULE_PATHS, TARGETS  # noqa: F401 - this package's names for them


@dataclass(frozen=True)
class LoRAConfig:
    """The adapter: rank r, scale alpha / r (PEFT's lora_alpha), which projections of every block.
    Every projection by default (QLoRA's finding: adapting all of them matters more than the rank)."""

    r: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = tuple(TARGETS)

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        unknown = [m for m in self.target_modules if m not in TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(f"unknown LoRA target modules {unknown or '(none)'}; choose from {', '.join(TARGETS)}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scale(self) -> float:
        return self.alpha / self.r


@dataclass(frozen=True)
class TrainConfig:
    """One training run. A step is `grad_accum` micro-batches of at most `batch_tokens` tokens each
    (sequences are packed into a micro-batch whole, each attending only to itself); the loss is the mean
    over the step's trained tokens."""

    lr: float = 2e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    epochs: int = 1
    max_steps: int | None = None  # stops earlier than the epochs when set
    max_length: int = 1024  # tokens of one example; longer ones are cut (their end dropped)
    batch_tokens: int = 4096  # tokens of one micro-batch
    grad_accum: int = 1
    packing: bool = True  # several examples in a micro-batch; False: one example per micro-batch
    seed: int = 0
    save_every: int = 0  # steps between checkpoints; 0: only the final adapter
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self):
        checks = [("lr", self.lr > 0), ("epochs", self.epochs >= 1), ("max_length", self.max_length >= 2),
                  ("batch_tokens", self.batch_tokens >= self.max_length), ("grad_accum", self.grad_accum >= 1),
                  ("save_every", self.save_every >= 0), ("weight_decay", self.weight_decay >= 0),
                  ("max_steps", self.max_steps is None or self.max_steps >= 1)]
        for name, ok in checks:
            if not ok:
                hint = f" (max_length is {self.max_length})" if name == "batch_tokens" else ""
                raise ValueError(f"invalid {name}: {getattr(self, name)!r}{hint}")
