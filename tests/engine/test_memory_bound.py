"""On the CPU, --max-device-memory bounds the process's anonymous memory, up to the runtime the plan
prints (what the process held before loading: interpreter, torch, kernels).

Each case runs a model whose blocks mostly stream in a process of its own, its RssAnon sampled from
here the whole time (the kernel keeps no peak of anonymous memory): loading, a prompt, a few decoded
tokens. The model is large enough that what the plan does not count shows: a tied Q6_K head
dequantized whole at load took several times its size; resident blocks read from disk kept their
read buffer alive behind the stacked projections (1.5 blocks each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import LlamaConfig

from engine.cache import cache_root
from engine.demo import build_random_model
from layerstream.bench.common import MemorySampler
from tests.support.gguf_models import write_gguf

MiB = 1 << 20
# Allocator slack and thread stacks the plan cannot name: what the bound allows beyond budget + runtime.
SLACK = 32 * MiB

CONFIG = dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
              architectures=["LlamaForCausalLM"])

CHILD = r"""
import json, sys
import torch
from engine import EngineArgs, LLMEngine
from engine.sampling_params import SamplingParams

torch.set_num_threads(2)
model, budget, extra = sys.argv[1], None if sys.argv[2] == "None" else int(sys.argv[2]), json.loads(sys.argv[3])
engine = LLMEngine(EngineArgs(model=model, device="cpu", max_device_memory=budget, max_num_seqs=2, max_model_len=512,
                              max_num_batched_tokens=256, show_progress=False, **extra))
engine.add_request(list(range(3, 300)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "r")
tokens = []
while engine.has_unfinished():
    for out in engine.step():
        tokens += out.new_token_ids
plan = engine.plan
print(json.dumps(dict(budget=plan.budget, runtime=plan.runtime_bytes, planned=plan.device_bytes, tokens=tokens,
                      resident=len(plan.resident_blocks), host=len(plan.host_blocks), disk=len(plan.disk_blocks),
                      grammar=plan.grammar_cache_bytes + plan.grammar_probe_bytes)))
engine.close()
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A bf16 safetensors checkpoint (~300 MB) and its GGUF: Q4_0 blocks, the tied token table in Q6_K."""
    root = tmp_path_factory.mktemp("bound")
    folder = build_random_model(root / "bf16", LlamaConfig(**CONFIG), dtype=torch.bfloat16, seed=3)
    gguf = write_gguf(folder, root / "model-Q4_0.gguf", Q.Q4_0, types={"token_embd.weight": Q.Q6_K})
    return folder, gguf


@pytest.fixture
def cache(tmp_path):
    """A layerstream cache of this test's own (the prepacked entry), sharing the built kernels."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(cache_root() / "kernels", target_is_directory=True)
    return tmp_path / "cache"


def run(model: Path, budget: int | None, cache: Path, cgroup=None, **extra) -> tuple[dict, int]:
    """(what the child printed, its peak RssAnon in bytes); in `cgroup` (a MemoryCgroup) if given."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(budget), json.dumps(extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LAYERSTREAM_CACHE": str(cache)},
                            preexec_fn=cgroup.join_fn() if cgroup is not None else None)
    with MemorySampler(proc.pid, interval=0.002) as sampler:
        out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        return dict(returncode=proc.returncode, stderr=err), sampler.peaks.rss_anon
    return json.loads(out.strip().splitlines()[-1]), sampler.peaks.rss_anon


# Budgets under which most blocks stream and a few stay resident.
@pytest.mark.parametrize("kind, transport, budget", [("bf16", "auto", 320 * MiB), ("bf16", "disk", 320 * MiB),
                                                     ("gguf", "auto", 200 * MiB), ("gguf", "disk", 200 * MiB)])
def test_peak_anonymous_memory_is_within_the_budget_and_the_runtime(models, cache, kind, transport, budget):
    folder, gguf = models
    model = folder if kind == "bf16" else gguf
    first, _ = run(model, budget, cache, transport=transport)  # (a GGUF's first load writes its prepacked entry)
    assert "returncode" not in first, first
    result, peak = run(model, budget, cache, transport=transport)
    assert "returncode" not in result, result
    assert result["tokens"] == first["tokens"] and len(result["tokens"]) == 4
    assert result["disk"] if transport == "disk" else result["host"], result
    assert result["resident"] and result["planned"] <= budget
    assert 0 < result["runtime"] <= 350 * MiB
    assert peak <= result["runtime"] + budget + SLACK, (
        f"peak RssAnon {peak / MiB:.0f} MiB > runtime {result['runtime'] / MiB:.0f} MiB + budget "
        f"{budget / MiB:.0f} MiB + {SLACK / MiB:.0f} MiB ({result})")


@pytest.fixture
def cgroups():
    from layerstream.bench.disk import MemoryCgroup, cgroups_unavailable

    why = cgroups_unavailable()
    if why:
        pytest.skip(why)
    made = []

    def make(limit: int) -> MemoryCgroup:
        made.append(MemoryCgroup(f"layerstream-test-{os.getpid()}-{len(made)}", limit))
        return made[-1]

    yield make
    for cg in made:
        cg.remove()


@pytest.mark.parametrize("kind", ["bf16", "gguf"])
def test_under_a_memory_cgroup_smaller_than_the_model_the_plan_fits_it(models, cache, cgroups, kind):
    """No budget given: in a memory cgroup that holds the runtime, the margin host_budget keeps for
    its growth (engine.host_memory) and 60% of the model, the plan fits
    the room the cgroup leaves (blocks read from disk each step) and the tokens are the unlimited
    run's; in one that cannot hold even the runtime and what must stay in RAM, the start is refused
    with a clear message, before loading, never by the OOM killer."""
    folder, gguf = models
    model = folder if kind == "bf16" else gguf
    size = (sum(p.stat().st_size for p in folder.glob("*.safetensors")) if kind == "bf16" else gguf.stat().st_size)
    # Structured output's host memory (a grammar cache set small, and the grammar probe's process) is
    # the plan's too, besides the model.
    grammar = dict(grammar_cache_memory=16 * MiB)
    free, _ = run(model, None, cache, **grammar)
    assert "returncode" not in free, free
    assert free["grammar"] > 16 * MiB
    cg = cgroups(free["runtime"] + 128 * MiB + free["grammar"] + int(0.6 * size))  # host_budget's margin: 128 MiB + 5%
    capped, _ = run(model, None, cache, cgroup=cg, **grammar)
    assert "returncode" not in capped, capped
    assert cg.stat()["oom_kills"] == 0
    assert capped["disk"] and capped["tokens"] == free["tokens"], json.dumps(capped)
    tiny = cgroups(free["runtime"] + 96 * MiB)
    refused, _ = run(model, None, cache, cgroup=tiny, **grammar)
    assert refused.get("returncode") == 1 and tiny.stat()["oom_kills"] == 0, refused
    assert "does not fit in host memory" in refused["stderr"], refused["stderr"][-2000:]
