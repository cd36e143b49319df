"""layerstream engine: run LLMs larger than device memory by streaming transformer blocks."""

from .args import EngineArgs
from .finetune import LoRAConfig, TrainConfig
from .finetune import finetune as train_lora  # not `finetune`: that name is the engine.finetune package
from .llm import LLM, CompletionOutput, GenerationResult
from .llm_engine import LLMEngine
from .sampling_params import SamplingParams
from .telemetry import EngineTelemetry

__all__ = ["LLM", "LLMEngine", "EngineArgs", "EngineTelemetry", "SamplingParams", "CompletionOutput",
           "GenerationResult", "train_lora", "TrainConfig", "LoRAConfig"]
