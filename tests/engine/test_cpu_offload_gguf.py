"""Issue #38 on the file users bring: a tiny random Q4_0 Llama as GGUF under LAYERSTREAM_PLACEMENT=groups on the
simulated device. Its MLPs leave the device priced at their packed bytes (4.5 bits a weight); on the CPU path they
are computed by the packed kernels from views of the prepacked entry's mapping (fast mode) or of the GGUF file's
(exact fp32 mode), streamed they move as a streamed GGUF block does. Greedy tokens are the all-resident GGUF run's
in the same mode for every policy. (The CUDA transport, replayed: tests/weights/test_offload.py.)"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader

from engine import LLM, SamplingParams, kernels
from engine.kernels import ggml_repack
from engine.placement import MeasuredSpeeds, PathPolicy, StepShape
from tests.support.gguf_models import SHORT, greedy_tokens, tiny_gguf, tiny_moe_gguf
from tests.support.reference import PROMPT

MLP_PARAMS = 3 * 64 * 128  # the tiny Llama's MLP: gate, up (128 x 64) and down (64 x 128)
# Under these speeds the tiny Q4_0 MLP (13.5 KiB) streams from 4 tokens on: prompt chunks stream, decode steps of
# one or two sequences compute on the CPU (checked below, not assumed).
SPEEDS = MeasuredSpeeds(link_gbps=0.25, cpu_gbps=100, cpu_flops=3.5e9, device_flops=1e12)
# name -> (dtype, LAYERSTREAM_PREPACK): fast mode from the prepacked entry; fast mode without it (blocks repacked at
# load and, streamed, per step; the CPU path's MLPs repacked once at load); exact fp32 mode (GGML blocks dequantized).
MODES = {"fast": ("auto", "auto"), "fast-repacked": ("auto", "off"), "exact": ("float32", "auto")}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("gguf-groups"), "llama", Q.Q4_0)


@pytest.fixture(scope="module")
def mlp_bytes(gguf_path) -> dict[int, int]:
    """Each block's MLP as the file stores it (gguf-py's count, independent of our reader)."""
    out: dict[int, int] = {}
    for t in GGUFReader(gguf_path).tensors:
        if t.name.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down"):
            layer = int(t.name.split(".")[1])
            out[layer] = out.get(layer, 0) + int(t.n_bytes)
    return out


@pytest.fixture(scope="module")
def resident(gguf_path):
    """mode -> (the all-resident GGUF run's greedy tokens, its plan's device bytes)."""
    out = {}
    with pytest.MonkeyPatch.context() as env:
        for mode, (dtype, prepack) in MODES.items():
            env.setenv("LAYERSTREAM_PREPACK", prepack)
            llm = LLM(str(gguf_path), dtype=dtype, **SHORT)
            try:
                out[mode] = (greedy_tokens(llm), llm.plan.device_bytes)
            finally:
                llm.close()
    return out


@pytest.fixture(params=list(MODES))
def mode(request, monkeypatch):
    """The mode's name; its switches set, with LAYERSTREAM_PLACEMENT=groups."""
    if MODES[request.param][0] == "auto" and not _fast_mode_runs_here():
        pytest.skip("no VNNI kernels or repack here: fast mode computes GGUF blocks another way")
    monkeypatch.setenv("LAYERSTREAM_PREPACK", MODES[request.param][1])
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    monkeypatch.setenv("LAYERSTREAM_SIM_GBPS", "50")  # fast enough that the test does not wait on it
    return request.param


def _fast_mode_runs_here() -> bool:
    return kernels.int4_backend() == "vnni" and ggml_repack.ggml_repack() is not None


def _mappings_of(name: str) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files named `name`."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith("/" + name):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def _parts(w) -> list[torch.Tensor]:
    """The tensors a weight holds: GGUFWeight's GGML rows, an int4 weight's codes and scales, or itself."""
    kind = type(w).__name__
    return [w.data] if kind == "GGUFWeight" else [w.codes, w.scales] if kind == "Int4Weight" else [w]


@pytest.mark.parametrize("policy", ["cpu", "stream", "auto", "auto-live"])
def test_gguf_mlps_off_the_device_give_the_resident_tokens(gguf_path, mlp_bytes, resident, mode, policy):
    """auto: speeds pinned (the paths are known); auto-live: measured at start-up, refreshed as steps run. The
    planner prices each MLP at its packed bytes; the link moves those (from the prepacked entry, its parts, byte for
    byte the file's for Q4_0; otherwise the file's GGML bytes, while a resident MLP would be fp32 in exact mode)."""
    dtype = MODES[mode][0]
    ref_tokens, fits = resident[mode]
    packed = mlp_bytes[0]
    assert packed * 8 == 4.5 * MLP_PARAMS  # Q4_0: 18 bytes a block of 32 weights
    llm = LLM(str(gguf_path), dtype=dtype, transport="simulated", cpu_offload_policy=policy.removesuffix("-live"),
              max_device_memory=fits - packed // 2, **SHORT)
    try:
        placed = llm.plan.group_placement
        # fast mode: the MLPs that leave pay for their stream buffers too (none under "cpu"); exact mode: an MLP
        # resident in fp32 frees 7x what it streams as, so one off is enough.
        off = 1 if policy == "cpu" or dtype == "float32" else 3
        assert placed is not None and len(placed.off_device) == off and llm.plan.device_bytes <= fits - packed // 2
        assert {k for _, k in placed.off_device} == {"mlp"}
        assert all(g.nbytes == mlp_bytes[g.layer] for g in placed.groups if g.kind == "mlp")
        # Resident, an MLP counts as the planner counts a resident block: fp32 in exact mode; in fast mode the int4
        # form with its mins (at most an eighth more than the prepacked entry's Q4_0 weights, which drop them).
        for g in placed.groups:
            if g.kind == "mlp":
                assert (g.device_bytes == 4 * MLP_PARAMS if dtype == "float32"
                        else g.nbytes <= g.device_bytes <= g.nbytes * 9 / 8), g
        assert llm.plan.streamed_bytes_per_step == off * packed
        assert "tensor groups: norms, attention" in llm.plan.describe()
        if policy == "auto":
            mlp = next(g for g in placed.groups if g.kind == "mlp")
            if dtype == "auto":
                assert PathPolicy("auto", SPEEDS).threshold(mlp) == 4
                assert PathPolicy("auto", SPEEDS).path(mlp, StepShape(2)) == "cpu"
            llm.engine.set_measured_speeds(SPEEDS)
        assert greedy_tokens(llm) == ref_tokens
        stats = llm.telemetry().offload
        assert stats.groups_cpu == off * stats.steps_cpu and stats.groups_stream == off * stats.steps_stream
        assert stats.bytes_stream == stats.groups_stream * packed  # streamed: the packed weights cross the link
        assert llm.telemetry().total.bytes_streamed == stats.bytes_stream
        tokens = len(PROMPT) + len(PROMPT[3:]) + 2 * 11
        if policy == "cpu":
            assert stats.steps_stream == 0 and stats.tokens_cpu == tokens
        elif policy == "stream":
            assert stats.steps_cpu == 0 and stats.tokens_stream == tokens
        elif policy == "auto":  # prompt chunks streamed, decode steps on the CPU
            assert stats.steps_cpu > 0 and stats.steps_stream > 0
        else:
            assert stats.tokens_stream + stats.tokens_cpu == tokens
    finally:
        llm.close()


def test_the_cpu_path_reads_the_packed_bytes_where_they_lie(gguf_path, mlp_bytes, resident, mode):
    """Every tensor the CPU computes an off-device MLP from lies inside a mapping of the prepacked entry (fast mode:
    the int4 kernels' layout) or of the GGUF file itself (exact mode: GGML blocks dequantized per use), its
    storage the mapping's: no copy, dequantized or not. Without the entry, fast mode's are the int4 form a resident
    block has (repacked once at load, its mins beside the file's bytes). The device keeps no MLP tensor of the
    block."""
    dtype = MODES[mode][0]
    fits = resident[mode][1]
    llm = LLM(str(gguf_path), dtype=dtype, transport="simulated", cpu_offload_policy="cpu",
              max_device_memory=fits - mlp_bytes[0] // 2, **SHORT)
    try:
        weights = llm.engine.model.weights
        ((block, _),) = llm.plan.group_placement.off_device
        host = weights.offloaded(block, "cpu")
        weights.release_offloaded(block)
        assert set(host) == ({"w_gate_up", "w_down"} if mode == "fast" else {"w_gate", "w_up", "w_down"})
        kind = "GGUFWeight" if mode == "exact" else "Int4Weight"  # (engine.weights' packed types, by name here)
        assert all(type(w).__name__ == kind for w in host.values())
        tensors = [t for w in host.values() for t in _parts(w)]
        if mode == "fast-repacked":  # Q4_0's int4 form with its mins: 2 bytes a block of 32 weights beyond the file's
            assert sum(t.nbytes for t in tensors) == mlp_bytes[block] + MLP_PARAMS // 32 * 2
            return
        assert sum(t.nbytes for t in tensors) == mlp_bytes[block]  # the packed bytes, nothing dequantized
        mapped = _mappings_of("blocks.bin" if mode == "fast" else gguf_path.name)
        assert mapped
        for t in tensors:
            base = t.untyped_storage().data_ptr()
            assert any(lo <= base and t.data_ptr() + t.nbytes <= hi for lo, hi in mapped), (hex(base), mapped)
        on_device = weights.acquire(block)
        weights.release(block)
        assert not {"w_gate", "w_up", "w_down", "w_gate_up"} & set(on_device)
    finally:
        llm.close()


# A mixture of experts as llama.cpp's converter writes it (tiny_moe_gguf: DeepSeek-V3's tiny one in Q8_0, blocks of 8
# routed experts, 2 a token, and a shared one after a dense first block).
MOE_PROMPTS = [list(PROMPT), list(PROMPT[:5]), [7, 300, 12, 45, 2, 99, 101]]
MOE_KW = dict(max_model_len=128, max_num_seqs=3, show_progress=False)
MOE_MODES = {"fast": "auto", "exact": "float32"}
EXPERT_PARAMS = 3 * 64 * 32  # one routed expert: gate, up (32 x 64) and down (64 x 32)
# One routed expert in the prepacked entry (fast mode): the int8 kernels' form of its Q8_0 rows, a byte a weight and a
# float32 scale a row (rows in whole blocks of 16): 32 + 32 + 64 rows. The file's Q8_0 bytes are 34 a block of 32.
ENTRY_EXPERT_BYTES = EXPERT_PARAMS + (32 + 32 + 64) * 4


def moved_per_expert(mode: str, stored: int) -> int:
    """What one routed expert off the device is priced at and moves: its parts in the prepacked entry (fast mode),
    else its bytes as the file stores them (`stored`)."""
    return ENTRY_EXPERT_BYTES if mode == "fast" else stored
# An expert (and the shared expert, its shape) streams from 4 rows on in either mode: the prefill step streams,
# decode steps of 3 sequences (at most 3 rows an expert) compute on the CPU.
MOE_SPEEDS = MeasuredSpeeds(link_gbps=0.25, cpu_gbps=100, cpu_flops=2e9, device_flops=1e12)


def moe_tokens(llm) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(MOE_PROMPTS, params)]


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """(the file, each MoE block's routed experts as stored: gguf-py's byte count, mode -> (the all-resident run's
    tokens, its device bytes))."""
    path = tiny_moe_gguf(tmp_path_factory.mktemp("gguf-moe"))
    experts: dict[int, int] = {}
    for t in GGUFReader(path).tensors:
        if t.name.endswith("_exps.weight"):
            assert t.tensor_type == Q.Q8_0, t.name
            layer = int(t.name.split(".")[1])
            experts[layer] = experts.get(layer, 0) + int(t.n_bytes)
    resident = {}
    for mode, dtype in MOE_MODES.items():
        llm = LLM(str(path), dtype=dtype, transport="simulated", **MOE_KW)
        try:
            resident[mode] = moe_tokens(llm), llm.plan.device_bytes
        finally:
            llm.close()
    return path, experts, resident


@pytest.fixture(params=list(MOE_MODES))
def moe_mode(request, monkeypatch):
    if request.param == "fast" and not _fast_mode_runs_here():
        pytest.skip("no VNNI kernels or repack here: fast mode computes GGUF blocks another way")
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    monkeypatch.setenv("LAYERSTREAM_SIM_GBPS", "50")
    return request.param


def _moe_llm(moe_gguf, mode: str, policy: str):
    """The MoE GGUF under groups, short of the resident run's device bytes by about two blocks' routed experts as
    they would stay on the device (Q8_0 in fast mode, fp32 in exact mode)."""
    path, experts, resident = moe_gguf
    short = 2 * experts[1] if mode == "fast" else 8 * experts[1]
    return LLM(str(path), dtype=MOE_MODES[mode], transport="simulated", cpu_offload_policy=policy,
               max_device_memory=resident[mode][1] - short, **MOE_KW)


@pytest.mark.parametrize("policy", ["cpu", "stream", "auto"])
def test_a_mixture_of_experts_gguf_s_routed_experts_off_the_device(moe_gguf, moe_mode, policy):
    """llama.cpp's --n-cpu-moe case: routed experts off the device, priced at their packed bytes (fast mode: their
    parts in the prepacked entry; exact mode: the file's Q8_0, 34 bytes a block of 32 weights); each step, per
    block, the chosen experts compute on the CPU from their packed form, or only they stream into the device's
    expert slots as packed bytes. Greedy tokens are the all-resident GGUF run's
    in the same mode for every policy."""
    path, experts, resident = moe_gguf
    assert experts[1] // 8 * 32 == 34 * EXPERT_PARAMS
    expert_bytes = moved_per_expert(moe_mode, experts[1] // 8)
    llm = _moe_llm(moe_gguf, moe_mode, policy)
    try:
        placed = llm.plan.group_placement
        off = placed.off_device
        assert {k for _, k in off} >= {"experts"}, llm.plan.describe()
        assert all(g.nbytes == 8 * expert_bytes and g.experts_total == 8
                   for g in placed.groups if g.kind == "experts")
        if policy == "auto":
            group = next(g for g in placed.off_device_groups if g.kind == "experts")
            assert PathPolicy("auto", MOE_SPEEDS).rows_threshold(group) == 4
            llm.engine.set_measured_speeds(MOE_SPEEDS)
        assert moe_tokens(llm) == resident[moe_mode][0]
        t = llm.telemetry()
        stats, total = t.offload, t.total
        assert stats.groups_cpu + stats.groups_stream == len(off) * t.steps
        # streamed, an expert moves what it is priced at, and only the chosen ones that the device's cache misses
        assert total.expert_bytes == total.expert_misses * expert_bytes
        if policy == "cpu":
            assert stats.steps_stream == 0 and total.expert_bytes == 0 and stats.steps_cpu == t.steps
        elif policy == "stream":
            assert stats.steps_cpu == 0 and total.expert_misses > 0 and total.expert_hits > 0
        else:
            assert stats.steps_cpu > 0 and stats.steps_stream > 0 and total.expert_misses > 0
    finally:
        llm.close()


def test_routed_experts_stay_packed_on_either_path(moe_gguf, moe_mode):
    """The CPU computes the chosen experts from their packed bytes where they lie: exact mode, GGUFWeight views of
    the file's mapping (dequantized per use); fast mode, the int8 kernels' form of their Q8_0 blocks as views of the
    prepacked entry's mapping (made once, on the first load), each expert's tensors one contiguous range of it. No
    expert is held dequantized or copied. Streamed to the simulated device they are those same forms (its memory is
    the host's: a fill moves their packed bytes across the link, copying nothing)."""
    path, experts, _ = moe_gguf
    llm = _moe_llm(moe_gguf, moe_mode, "auto")
    try:
        weights = llm.engine.model.weights
        block = min(b for b, k in llm.plan.group_placement.off_device if k == "experts")
        (cpu,) = list(weights.offloaded_experts(block, list(range(8)), "cpu"))
        assert sorted(cpu) == list(range(8))
        forms = [w for e in cpu.values() for w in e.values()]
        assert all(set(e) == {"w_gate", "w_up", "w_down"} for e in cpu.values())
        kind = "GGUFWeight" if moe_mode == "exact" else "Int8Weight"  # (engine.weights' packed types, by name)
        assert {type(w).__name__ for w in forms} == {kind}
        if moe_mode == "exact":  # the file's Q8_0 bytes where they lie
            tensors = [w.data for w in forms]
            assert sum(t.nbytes for t in tensors) == experts[block]
            mapped = _mappings_of(path.name)
        else:  # int8 codes, a byte a weight, beside their scales, in the entry
            tensors = [t for w in forms for t in (w.codes, w.scales)]
            assert all(w.codes.element_size() == 1 for w in forms)
            assert sum(w.codes.nbytes for w in forms) == 8 * EXPERT_PARAMS
            assert sum(t.nbytes for t in tensors) == 8 * ENTRY_EXPERT_BYTES
            mapped = _mappings_of("blocks.bin")
            for e in cpu.values():  # one expert: one range of the entry (what one read of it would take)
                parts = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for w in e.values() for t in (w.codes, w.scales))
                assert parts[-1][1] - parts[0][0] < ENTRY_EXPERT_BYTES + 6 * 64  # (each part on a cache line)
        assert mapped and all(any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in mapped)
                              for t in tensors)
        chosen = [1, 6]
        (streamed,) = list(weights.offloaded_experts(block, chosen, "stream"))
        assert all(streamed[e][k] is cpu[e][k] for e in chosen for k in cpu[e])
        assert llm.telemetry().total.expert_bytes == len(chosen) * moved_per_expert(moe_mode, experts[block] // 8)
    finally:
        llm.close()


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["cpu", "stream", "auto"])
def test_gguf_mlps_off_a_gpu_give_its_resident_tokens(gguf_path, mlp_bytes, monkeypatch, policy):
    """On a real GPU in exact fp32 mode: an MLP off the device computed on the CPU from the file's blocks, or
    streamed as the file's GGML bytes into the device ring; greedy tokens are the GPU's all-resident run's."""
    ref = LLM(str(gguf_path), dtype="float32", device="cuda", **SHORT)
    try:
        expected, fits = greedy_tokens(ref), ref.plan.device_bytes
    finally:
        ref.close()
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    llm = LLM(str(gguf_path), dtype="float32", device="cuda", cpu_offload_policy=policy,
              max_device_memory=fits - mlp_bytes[0] // 2, **SHORT)
    try:
        off = llm.plan.group_placement.off_device
        assert off and {k for _, k in off} == {"mlp"}, llm.plan.describe()
        if policy == "auto":
            llm.engine.set_measured_speeds(SPEEDS)
        assert greedy_tokens(llm) == expected
        stats = llm.telemetry().offload
        assert stats.bytes_stream == stats.groups_stream * mlp_bytes[0]
        assert (stats.groups_cpu > 0) == (policy != "stream") and (stats.groups_stream > 0) == (policy != "cpu")
    finally:
        llm.close()


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["cpu", "stream", "auto"])
def test_gguf_experts_off_a_gpu_give_its_resident_tokens(moe_gguf, monkeypatch, policy):
    """On a real GPU in exact fp32 mode: routed experts off the device computed on the CPU from the file's blocks,
    or the chosen ones streamed as their GGML bytes into the device's expert slots; greedy tokens are the GPU's
    all-resident run's."""
    path, experts, _ = moe_gguf
    kw = dict(dtype="float32", device="cuda", **MOE_KW)
    ref = LLM(str(path), **kw)
    try:
        expected, fits = moe_tokens(ref), ref.plan.device_bytes
    finally:
        ref.close()
    monkeypatch.setenv("LAYERSTREAM_PLACEMENT", "groups")
    llm = LLM(str(path), cpu_offload_policy=policy, max_device_memory=fits - 8 * experts[1], **kw)
    try:
        off = llm.plan.group_placement.off_device
        assert {k for _, k in off} >= {"experts"}, llm.plan.describe()
        if policy == "auto":
            llm.engine.set_measured_speeds(MOE_SPEEDS)
        assert moe_tokens(llm) == expected
        t = llm.telemetry()
        assert t.total.expert_bytes == t.total.expert_misses * experts[1] // 8
        assert (t.offload.groups_cpu > 0) == (policy != "stream")
        assert (t.offload.groups_stream > 0) == (policy != "cpu")
    finally:
        llm.close()
