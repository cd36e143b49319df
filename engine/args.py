"""Engine arguments: the one place engine limits are defined, defaulted and validated.

The Python API (`LLM(...)`, `LLMEngine(EngineArgs(...))`), `layerstream generate` and `layerstream
serve` all build an EngineArgs; the command lines take their flag defaults from the fields below, so
every entry point has the same defaults and the same error for a bad value.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kv_quant import KV_CACHE_DTYPES
from .lora_serving import parse_lora_modules
from .placement import check_policy
from .planner import parse_bytes
from .weights import check_resident_weights, check_transport

if TYPE_CHECKING:
    from .speculative import SpeculativeConfig

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
               "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

# The speculative_* fields (the --speculative-* flags) -> the speculative_config key each one spells.
SPECULATIVE_ALIASES = {"speculative_method": "method", "speculative_model": "model",
                       "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "prompt_lookup_min",
                       "prompt_lookup_max": "prompt_lookup_max", "speculative_adaptive_k": "adaptive_k"}


@dataclass
class EngineArgs:
    model: str
    device: str = "cpu"
    dtype: str = "auto"
    max_device_memory: int | str | None = None
    max_host_memory: int | str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_queue: int = 256
    prefetch_depth: int = 1
    transport: str = "auto"  # auto | cpu | cuda | simulated | disk (every streamed block read from disk)
    show_progress: bool = True
    pin_host_memory: bool = False  # cuda: keep streamed blocks pinned in host memory when RAM allows
    # CPU: resident blocks that are views of a mapping (a GGUF file's prepacked entry, a plain checkpoint in the
    # compute dtype) copied into huge pages of the process's own at load: auto (where measured to read faster:
    # prepacked blocks and their head), copy (plain blocks too) or map (views; the page cache may evict them).
    resident_weights: str = "auto"
    quantization: str | None = None  # None | int8 | int4: weight-only, at load (engine.weights.packed.quantize)
    enable_prefix_caching: bool = True
    block_size: int = 16  # token positions per KV block
    kv_cache_memory: int | str | None = None  # device KV pool; None = planned from the budget
    # Host tier for KV blocks evicted from the pool; None = 4 GiB or a tenth of host memory on CUDA,
    # none on the CPU (there the pool already is host memory: give it more --kv-cache-memory instead).
    kv_host_memory: int | str | None = None
    # The KV cache's storage (engine.kv_quant): auto (the compute dtype), int8 or int4 codes with float16
    # scales, each head rotated by a Hadamard matrix first unless kv_cache_rotation is False.
    kv_cache_dtype: str = "auto"
    kv_cache_rotation: bool = True
    # The KV disk tier (engine.kv_disk): full prefix-cache blocks written under kv_disk_dir (None: the
    # layerstream cache's kv/ folder), at most kv_disk_bytes in all (None or 0: off), found again by their
    # hashes after a restart.
    kv_disk_bytes: int | str | None = None
    kv_disk_dir: str | None = None
    # Mixtures of experts that do not fit: stream each chosen expert by itself through a device expert
    # cache (engine.weights.experts.tier); False streams MoE blocks whole, experts inside (the baseline).
    expert_streaming: bool = True
    # Tensor groups placed off the device (a block's MLP or experts, engine.placement), each step: auto (the
    # cost model over measured speeds: the CPU computes them for few tokens, the device for many), stream
    # (always streamed to the device) or cpu (always computed on the CPU, only activations cross the link).
    cpu_offload_policy: str = "auto"
    # Speculative decoding (engine.speculative), as vLLM's speculative_config: a dict or its JSON, keys
    # method (ngram | draft_model | self), model, num_speculative_tokens, prompt_lookup_min/max, adaptive_k;
    # None: off. The fields below are the same settings one by one (aliases of those keys). Once built,
    # this holds the SpeculativeConfig in effect (or None) and the fields below its values.
    speculative_config: dict | str | SpeculativeConfig | None = None
    speculative_method: str | None = None  # None (off) | ngram | draft (draft_model) | self
    num_speculative_tokens: int = 4
    speculative_model: str | None = None  # method "draft": a model with the same tokenizer
    prompt_lookup_min: int = 1  # method "ngram": n-gram sizes looked up, longest first
    prompt_lookup_max: int = 4
    speculative_adaptive_k: bool = True  # k per sequence from its acceptance (False: always num_speculative_tokens)
    # Structured output (engine.structured_output.GrammarLimits): CPU time one request's grammar may
    # spend compiling (its first mask included) and on each later token, and the compiled-grammar
    # cache's size in host memory (None: 256 MiB, at most a twentieth of the host memory; the plan
    # counts it as host memory).
    max_grammar_ms: float = 500.0
    grammar_cache_memory: int | str | None = None
    # LoRA adapters served from the start over this base (engine.lora_serving), as vLLM's lora_modules:
    # {name: folder}, or "name=folder" specs; once built, the {name: folder} dict. A request names one as its
    # model; more load and unload at run time (LLMEngine.load_lora, the server's /v1/load_lora_adapter).
    lora_modules: dict[str, str] | list[str] | str | None = None

    def __post_init__(self) -> None:
        self.max_device_memory = parse_bytes(self.max_device_memory)
        self.max_host_memory = parse_bytes(self.max_host_memory)
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.kv_host_memory = parse_bytes(self.kv_host_memory)
        self.kv_disk_bytes = parse_bytes(self.kv_disk_bytes)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_disk_bytes is not None and self.kv_disk_bytes < 0:
            raise ValueError(f"kv_disk_bytes must be >= 0, got {self.kv_disk_bytes}")
        if self.kv_disk_bytes and not self.enable_prefix_caching:
            raise ValueError("kv_disk_bytes needs prefix caching: the disk tier holds prefix-cache blocks")
        self.grammar_cache_memory = parse_bytes(self.grammar_cache_memory)
        self.grammar_limits()  # raises ValueError on a bad value, before anything loads
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        # Checked here, before anything loads, so a bad value fails at once, and `layerstream serve`
        # reports it before it starts listening.
        limits = dict(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                      max_queue=self.max_queue, prefetch_depth=self.prefetch_depth, block_size=self.block_size)
        if self.max_model_len is not None:
            limits["max_model_len"] = self.max_model_len
        for name, value in limits.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step")
        check_transport(self.transport, self.device)
        check_resident_weights(self.resident_weights)
        check_policy(self.cpu_offload_policy)
        if self.quantization is not None:
            if self.quantization not in ("int8", "int4"):
                raise ValueError(f"quantization must be 'int8' or 'int4', got {self.quantization!r}")
            if self.device != "cpu" or self.transport not in ("auto", "cpu"):
                raise ValueError("quantization runs with the CPU device and transport for now "
                                 f"(device {self.device!r}, transport {self.transport!r} asked)")

        self.speculative_config = self._speculative()
        self.lora_modules = parse_lora_modules(self.lora_modules)
        if self.lora_modules and self.speculative_config is not None:
            # Refused rather than half-right: the drafts and their verification pass were not made to
            # carry each sequence's adapter.
            raise ValueError("LoRA adapters are not served with speculative decoding yet: give lora_modules or "
                             "a speculative method, not both")
        if self.speculative_method == "self" and (self.device != "cpu" or self.quantization is not None):
            raise ValueError("the self-draft (int4 copies of the target's blocks) runs on the CPU device, "
                             "with an unquantized target (its int4 copies would be the blocks themselves)")

    def _speculative(self) -> SpeculativeConfig | None:
        """speculative_config with the speculative_* fields that were given (not at their default) merged
        in as its keys; a key given both ways with two values is an error. The fields then hold the
        values in effect. Without a method (or a config), the tuning fields alone leave it off."""
        from .speculative import METHOD_ALIASES, SpeculativeConfig

        config = self.speculative_config
        if isinstance(config, str):  # --speculative-config, LAYERSTREAM_SPECULATIVE_CONFIG
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e}): {config!r}") from None
        if isinstance(config, SpeculativeConfig):  # an EngineArgs built again from one (dataclasses.replace)
            config = config.to_dict()
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON) such as "
                             f"{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}, got {config!r}")
        given = {name: getattr(self, name) for name in SPECULATIVE_ALIASES
                 if getattr(self, name) != self.default(name)}
        if config is None:
            if self.speculative_method is None:
                if self.speculative_model is not None:
                    raise ValueError("--speculative-model needs --speculative-method draft")
                return None
            config = {}
        merged = dict(config)

        def same(key, a, b):
            return METHOD_ALIASES.get(a, a) == METHOD_ALIASES.get(b, b) if key == "method" else a == b

        for name, value in given.items():
            key = SPECULATIVE_ALIASES[name]
            if key in config and not same(key, config[key], value):
                raise ValueError(f"speculative_config {key!r} is {config[key]!r} but {name} is {value!r}: "
                                 "give each setting once")
            merged[key] = value
        spec = SpeculativeConfig.from_dict(merged)
        for name, key in SPECULATIVE_ALIASES.items():
            setattr(self, name, getattr(spec, key))
        return spec

    def grammar_limits(self):
        """The validated GrammarLimits of structured output."""
        from .structured_output import GrammarLimits

        cache = GrammarLimits.cache_bytes if self.grammar_cache_memory is None else self.grammar_cache_memory
        return GrammarLimits(max_cpu_seconds=self.max_grammar_ms / 1000, cache_bytes=cache)

    @staticmethod
    def default(name: str):
        """The default of a field: the command lines use these, so every entry point has the same."""
        return next(f.default for f in dataclasses.fields(EngineArgs) if f.name == name)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The compute dtype: the named one, or for "auto" the checkpoint's (fp32 if it is none of fp32/16, bf16)."""
    if name != "auto":
        return DTYPE_NAMES[name]
    return checkpoint_dtype if checkpoint_dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
