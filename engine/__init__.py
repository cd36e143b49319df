"""layerstream engine: run LLMs larger than device memory by streaming transformer blocks."""

from .llm import LLM, CompletionOutput, GenerationResult
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "GenerationResult"]
