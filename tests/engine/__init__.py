"""The engine: scheduling, planning, batching, sampling, speculative decoding, structured output, and the
models against their references."""
