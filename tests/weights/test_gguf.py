"""GGUF straight from the file: dequantizers against gguf-py, tiny GGUF models against transformers'
GGUF loader (fp32, resident and streamed), fast packed kernels against the exact mode, and clear
errors for corrupt, truncated or unsupported files."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader, quants

from engine import LLM, SamplingParams, ops
from engine.grammar_probe import probe_memory_bytes
from engine.weights import CheckpointError
from engine.weights.packed.dequant import SUPPORTED_TYPES, dequantize
from engine.weights.formats.gguf_file import GGUFIndex
from engine.weights.packed.weights import int4_from_gguf
from tests.support.gguf_models import (QUANTIZABLE, SHORT, greedy_tokens, hf_gguf_model, random_blocks, tiny_gguf,
                                       write_gguf)
from tests.support.models import build
from tests.support.reference import PROMPT, assert_matches_reference, greedy_with, prompt_logits

# transformers dequantizes with gguf-py (numpy) and runs its own fp32 model; we dequantize with the
# torch port (bit-identical, tested below) and run ours: agreement to fp32 rounding, like safetensors
# (assert_matches_reference holds both to test_reference's ATOL/RTOL).


# -- dequantization ------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_equals_gguf_reference(qtype):
    """Every byte of every block type: random blocks (NaN/inf scales included) and, where gguf-py
    can quantize, real quantized data; compared bit for bit (NaN where the reference has NaN:
    arithmetic on a NaN scale may propagate a different payload)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(7, 3 * size), dtype=np.uint8)
    samples = [raw, random_blocks(qtype, 5, 2 * block, seed=1)] if qtype not in (Q.F32, Q.F16, Q.BF16) else [raw]
    if qtype in QUANTIZABLE and qtype != Q.F32:
        data = rng.standard_normal((4, 4 * block)).astype(np.float32)
        q = quants.quantize(data, qtype)
        samples.append(q.view(np.uint8).reshape(4, -1))
    for s in samples:
        with np.errstate(all="ignore"):
            ref = quants.dequantize(s, qtype)
        ours = dequantize(torch.from_numpy(s.copy()), qtype).numpy()
        assert ours.dtype == np.float32 and ours.shape == ref.shape
        nan = np.isnan(ref)
        assert np.array_equal(np.isnan(ours), nan)
        assert np.array_equal(ours.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


def test_mxfp4_dequantizes_gguf_pys_own_quantization_exactly():
    """GPT-OSS's MXFP4 (GGUF type 39): blocks quantized by gguf-py's own MXFP4 quantizer from real values, and
    every one of the 256 E8M0 exponents (the two subnormal ones among them) beside every code, dequantized bit
    for bit as gguf.quants.dequantize does; the quantized values stay within the format's step of the data."""
    rng = np.random.default_rng(39)
    data = (rng.standard_normal((6, 4 * 32)) * rng.uniform(1e-3, 10.0, size=(6, 1))).astype(np.float32)
    packed = quants.quantize(data, Q.MXFP4)  # (6, 4 * 17) uint8
    every = np.zeros((256, 17), dtype=np.uint8)
    every[:, 0] = np.arange(256)  # each exponent once
    every[:, 1:] = (np.arange(16, dtype=np.uint8) * 17)[None, :]  # codes 0..15 in both nibbles
    for blocks in (packed, every.reshape(16, 16 * 17)):
        ref = quants.dequantize(blocks, Q.MXFP4)
        ours = dequantize(torch.from_numpy(blocks.copy()), Q.MXFP4).numpy()
        assert ours.shape == ref.shape and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    back = dequantize(torch.from_numpy(packed.copy()), Q.MXFP4).numpy()
    # e2m1 steps are at most a third of the block's largest value apart (4 -> 6 of 6)
    assert np.abs(back - data).max() <= np.abs(data).max() / 3
    # code 1 is e2m1's 0.5 (doubled: 1) at scale 2^(e - 128): exponents 0 and 1 give float32 subnormals, 254 2^126
    ones = dequantize(torch.from_numpy(every.copy()), Q.MXFP4)[:, 1]  # (256,) code 1 at each exponent
    assert ones[0].item() == 2.0 ** -128 and ones[1].item() == 2.0 ** -127 and ones[254].item() == 2.0 ** 126


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_int4_repack_keeps_the_codes(qtype):
    """The int4 kernel over repacked Q4 blocks holds the exact dequantization's weights: multiplying
    unit vectors reads them back (the VNNI kernel quantizes a unit vector without loss) to fp32
    rounding, except Q4_K's products d * sc and dmin * m, rounded once to float16 in the VNNI layout.
    On real activations, in bf16, it stays within 2% of the exact product."""
    rows, cols = 48, 512
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=3))
    w = dequantize(raw, qtype, (rows, cols))
    packed = int4_from_gguf(raw, qtype, (rows, cols), torch.float32)
    back = ops.linear(torch.eye(cols), packed).T  # (rows, cols)
    fp16_products = packed.layout == "vnni" and qtype == Q.Q4_K
    torch.testing.assert_close(back, w, rtol=1e-5, atol=(2.0 ** -10 if fp16_products else 1e-6) * w.abs().max().item())
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(0))
    ref = x @ w.T
    got16 = ops.linear(x.bfloat16(), int4_from_gguf(raw, qtype, (rows, cols), torch.bfloat16)).float()
    assert (got16 - ref).abs().max() < 0.02 * ref.abs().max()


# -- tiny models against transformers' GGUF loader ----------------------------------------------

CASES = [("llama", Q.Q4_0), ("llama", Q.Q8_0), ("mistral", Q.Q5_1), ("qwen2", Q.Q4_K), ("qwen3", Q.Q6_K),
         ("qwen3", Q.Q5_K), ("qwen2", Q.Q4_1), ("llama", Q.Q5_0), ("qwen3", Q.BF16), ("qwen2", Q.F16),
         ("llama", Q.F16)]  # unpacked Q/K rows of a permuting architecture are unpermuted too


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def reference(path, prompt, n):
    return greedy_with(hf_gguf_model(path), prompt, n)


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_matches_transformers_gguf_loader(gguf_root, arch, qtype):
    path = tiny_gguf(gguf_root, arch, qtype)
    ref_tokens, ref_logits = reference(path, PROMPT, 16)
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=2)
    budget = llm.plan.budget_keeping(1)
    block1 = [t for t in GGUFReader(path).tensors if t.name.startswith("blk.1.")]
    if qtype in (Q.F32, Q.F16, Q.BF16):  # nothing packed: converted to the compute dtype, like safetensors
        streamed_bytes = sum(int(t.n_elements) * 4 for t in block1)
    else:  # the packed GGML bytes
        streamed_bytes = sum(int(t.n_bytes) for t in block1)
    try:
        assert_matches_reference(llm, ref_tokens, ref_logits, 16)
    finally:
        llm.close()
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=2, max_device_memory=budget)
    try:
        assert len(llm.plan.resident_blocks) == 1
        out = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
        assert out.token_ids == ref_tokens
        stats = llm.engine.model.weights.stream_stats
        # What streamed is the packed GGML bytes, and the plan says the same.
        assert stats.bytes_streamed == stats.blocks_streamed * streamed_bytes
        assert llm.plan.streamed_bytes_per_step == len(llm.plan.streamed_blocks) * streamed_bytes
    finally:
        llm.close()


# Fast mode computes in bf16 with int4 (Q4_*) or per-row int8 (others) weights, Q4_K and Q6_K as stored
# where the VNNI kernels run; over the prompt its
# log-probabilities stay this close to the exact fp32 dequantization (random tiny models; the real
# SmolLM2 file is compared in test_smollm2.py).
FAST_LOGPROB_TOL = 0.1


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_fast_mode_close_to_exact(gguf_root, qtype):
    path = tiny_gguf(gguf_root, "llama", qtype)
    logprobs = {}
    for dtype in ("float32", "auto"):
        llm = LLM(str(path), dtype=dtype, max_model_len=128, max_num_seqs=1)
        try:
            logprobs[dtype] = torch.log_softmax(prompt_logits(llm, PROMPT), dim=-1)  # (prompt, vocab)
            if dtype == "auto":
                kinds = {type(w).__name__ for w in llm.engine.model.weights.acquire(0).values()}
                expected = "Int4Weight" if qtype in (Q.Q4_0, Q.Q4_K) else "Int8Weight"
                if qtype in (Q.Q4_K, Q.Q6_K) and ops.gguf_repack() is not None:
                    expected = "KQuantWeight"  # every stored bit kept, for the VNNI kernel
                assert expected in kinds
        finally:
            llm.close()
    diff = (logprobs["float32"] - logprobs["auto"]).abs().max().item()
    assert 0 < diff < FAST_LOGPROB_TOL


def test_split_files_and_folder(gguf_root, tmp_path):
    folder = gguf_root / "llama"
    if not folder.exists():
        build(folder, "llama")
    split_dir = tmp_path / "split"
    first = write_gguf(folder, split_dir / "tiny.gguf", Q.Q8_0, split_max_tensors=20)
    assert first.name == "tiny-00001-of-00003.gguf"
    single = tiny_gguf(gguf_root, "llama", Q.Q8_0)
    one_dir = tmp_path / "one"
    one_dir.mkdir()
    shutil.copy(single, one_dir / "model.gguf")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = []
    for model in (single, first, split_dir, one_dir):
        llm = LLM(str(model), dtype="float32", max_model_len=64, max_num_seqs=1)
        try:
            results.append(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
        finally:
            llm.close()
    assert results[0] == results[1] == results[2] == results[3]
    (split_dir / "tiny-00002-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="missing tiny-00002-of-00003.gguf"):
        GGUFIndex(first)


def test_tokenizer_and_chat_template_from_metadata(gguf_root):
    path = tiny_gguf(gguf_root, "qwen2", Q.Q8_0)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=1)
    try:
        tok = llm.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        assert text == "<|user|>\nhi<|end|>\n<|assistant|>\n"
        assert tok.decode(tok.encode("Hello world")) == "Hello world"
        assert tok.eos_token == "<|endoftext|>"
    finally:
        llm.close()


# -- packed bytes on every tier ------------------------------------------------------------------
# A llama Q4_0 file (Q/K rows permuted in the file) and a Qwen2 Q4_K one (biases, 256-weight blocks),
# computed exactly (fp32) and fast (bf16, int4 resident blocks): each streamed run must give the
# all-resident run's tokens, and what each tier moved must be the file's packed bytes.
TIER_CASES = [("llama", Q.Q4_0, "float32"), ("qwen2", Q.Q4_K, "float32"), ("llama", Q.Q4_0, "auto")]


def _packed_block_bytes(path, block: int) -> int:
    """Bytes of block `block` as stored, read by gguf-py (independent of our reader); F32 tensors
    (norms) count in the compute dtype, as they are converted when streamed."""
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name.startswith(f"blk.{block}."))


@pytest.fixture(scope="module")
def resident_runs(gguf_root):
    """(tokens, plan) of the all-resident run of each TIER_CASE."""
    out = {}
    for arch, qtype, dtype in TIER_CASES:
        llm = LLM(str(tiny_gguf(gguf_root, arch, qtype)), dtype=dtype, **SHORT)
        try:
            out[arch, qtype, dtype] = (greedy_tokens(llm), llm.plan)
        finally:
            llm.close()
    return out


@pytest.mark.parametrize("arch,qtype,dtype", TIER_CASES, ids=[f"{a}-{q.name}-{d}" for a, q, d in TIER_CASES])
def test_disk_tier_reads_packed_bytes(gguf_root, resident_runs, monkeypatch, arch, qtype, dtype):
    """transport="disk": every streamed block is read from the file each step (O_DIRECT) as its packed
    bytes and computed from the read buffer; tokens are the resident run's. (In fast mode the disk tier
    reads the prepacked cache entry instead: tests/weights/test_prepacked.py; here it is off.)"""
    monkeypatch.setenv("LAYERSTREAM_PREPACK", "off")
    path = tiny_gguf(gguf_root, arch, qtype)
    tokens, plan = resident_runs[arch, qtype, dtype]
    llm = LLM(str(path), dtype=dtype, transport="disk", max_device_memory=plan.budget_keeping(1), **SHORT)
    try:
        assert llm.plan.disk_blocks == llm.plan.streamed_blocks and len(llm.plan.resident_blocks) == 1
        packed = _packed_block_bytes(path, llm.plan.streamed_blocks[0])
        assert llm.plan.disk_block_bytes == packed
        assert greedy_tokens(llm) == tokens
        total = llm.telemetry().total
        # One aligned read per block (a block's tensors lie together in the file): at most a page of
        # alignment on either side beyond its packed bytes.
        assert total.blocks_streamed * packed <= total.disk_bytes_read <= total.blocks_streamed * (packed + 2 * 4096)
    finally:
        llm.close()


def test_auto_tiers_a_packed_model_between_ram_and_disk(gguf_root, resident_runs):
    """auto on the CPU with host memory for only part of the streamed blocks: the planner keeps some
    packed blocks in RAM and reads the others from disk, counting packed bytes; same tokens."""
    arch, qtype, dtype = TIER_CASES[0]
    path = tiny_gguf(gguf_root, arch, qtype)
    tokens, plan = resident_runs[arch, qtype, dtype]
    budget = plan.budget_keeping(1)
    probe = LLM(str(path), dtype=dtype, max_device_memory=budget, **SHORT)
    device_bytes, block = probe.plan.device_bytes, probe.plan.disk_block_bytes
    vocab = probe.engine.model.cfg.vocab_size
    probe.close()
    # Host memory: the device plan, depth + 1 disk staging buffers, the grammar cache (set, since by
    # default it is a share of the host memory) and its probe, and room for two of the 4 streamed blocks.
    cache = 64 << 10
    grammar = cache + probe_memory_bytes(cache, vocab)
    llm = LLM(str(path), dtype=dtype, max_device_memory=budget, grammar_cache_memory=cache,
              max_host_memory=device_bytes + grammar + (2 + 2) * block + block // 2, **SHORT)
    try:
        p = llm.plan
        assert p.host_blocks and p.disk_blocks, p.describe()
        assert greedy_tokens(llm) == tokens
        total = llm.telemetry().total
        assert total.disk_tier_bytes and total.host_tier_bytes
    finally:
        llm.close()


@pytest.mark.parametrize("pin", [False, True], ids=["staging", "pinned"])
@pytest.mark.parametrize("arch,qtype,dtype", TIER_CASES[:2], ids=[f"{a}-{q.name}" for a, q, _ in TIER_CASES[:2]])
def test_cuda_transport_moves_packed_bytes_replayed_on_cpu(gguf_root, resident_runs, monkeypatch, arch, qtype,
                                                           dtype, pin):
    """The CUDA transport on CPU (test_overlap's recording runtime): packed rows are staged (Q/K put in
    engine row order), copied into the device ring as bytes and computed as GGUFWeight views of it;
    the event protocol holds, the tokens are the resident run's, and every counter is packed bytes."""
    import engine.weights.transports.cuda as ct
    from tests.support.cuda_replay import RecordingRuntime, capture_cuda_transports, check_protocol

    monkeypatch.setattr(ct, "CudaRuntime", RecordingRuntime)
    built = capture_cuda_transports(monkeypatch)
    path = tiny_gguf(gguf_root, arch, qtype)
    tokens, plan = resident_runs[arch, qtype, dtype]
    llm = LLM(str(path), dtype=dtype, device="cpu", transport="cuda", max_device_memory=plan.budget_keeping(1),
              pin_host_memory=pin, max_host_memory="8GiB", **SHORT)
    try:
        t = built[0]
        assert (len(t._stage) == 0) == pin and len(llm.plan.resident_blocks) == 1
        block = llm.plan.streamed_blocks[0]
        packed = _packed_block_bytes(path, block)
        fp32 = sum(int(x.n_elements) * 4 for x in GGUFReader(path).tensors if x.name.startswith(f"blk.{block}."))
        # The device ring holds packed bytes (plus alignment): far less than the block in fp32.
        assert packed <= t.buffer_bytes < fp32 / 3
        assert greedy_tokens(llm) == tokens
        stats = llm.telemetry().total
        assert stats.bytes_streamed == stats.blocks_streamed * packed
        assert check_protocol(t, t.rt.log) >= stats.blocks_streamed
    finally:
        llm.close()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_streams_packed_on_a_gpu(gguf_root, dtype):
    """On a real GPU: a Q4_0 file with one resident block and the rest streamed as packed bytes gives
    the CPU exact run's tokens in fp32 (and its logits to bf16 rounding in bf16)."""
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    ref = LLM(str(path), dtype="float32", **SHORT)
    try:
        ref_tokens, ref_logits = greedy_tokens(ref), prompt_logits(ref, PROMPT)
    finally:
        ref.close()
    llm = LLM(str(path), dtype=dtype, device="cuda", **SHORT)
    budget = llm.plan.budget_keeping(1)
    llm.close()
    llm = LLM(str(path), dtype=dtype, device="cuda", max_device_memory=budget, **SHORT)
    try:
        assert len(llm.plan.resident_blocks) == 1, llm.plan.describe()
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=8e-2, rtol=5e-2)
        torch.testing.assert_close(prompt_logits(llm, PROMPT).float().cpu(), ref_logits, **tol)
        if dtype == "float32":
            assert greedy_tokens(llm) == ref_tokens
        assert llm.telemetry().total.bytes_streamed > 0
    finally:
        llm.close()


# -- bad files -----------------------------------------------------------------------------------

def _header_end(path) -> int:
    idx = GGUFIndex(path)
    try:
        return min(t.start for t in idx.entries.values())
    finally:
        idx.close()


def test_truncated_file(gguf_root, tmp_path):
    good = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: tensor '.*' \(.*\): data ends at byte .*\(truncated"):
        GGUFIndex(cut)
    cut.write_bytes(data[:_header_end(good) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: file ends inside the header"):
        GGUFIndex(cut)
    cut.write_bytes(data[:10])
    with pytest.raises(CheckpointError, match="too short"):
        GGUFIndex(cut)
    with pytest.raises(CheckpointError, match="truncated"):
        LLM(str(cut))


def test_a_header_cut_anywhere_or_a_bad_string_is_a_clear_error(gguf_root, tmp_path):
    """Cut at any point of the header (inside the vocabulary's strings too), or with a string of the vocabulary
    not UTF-8: a CheckpointError naming the file, never another exception or a half-read header."""
    good = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    end = _header_end(good)
    for at in range(24, end, max(1, end // 97)):
        cut.write_bytes(data[:at])
        with pytest.raises(CheckpointError, match=r"cut\.gguf: file ends inside the header"):
            GGUFIndex(cut)
    token = data.index(b"tokenizer.ggml.tokens")
    first = data.index(b"\x00", token + 40)  # inside the array: a string's bytes follow its length
    bad = bytearray(data)
    bad[first - 1:first + 1] = b"\xff\xfe"  # the last byte of a length or the first of a string
    cut.write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"cut\.gguf: "):
        GGUFIndex(cut)


def test_corrupt_headers(gguf_root, tmp_path):
    data = bytearray(tiny_gguf(gguf_root, "llama", Q.Q4_0).read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GGUFIndex(bad)
    bad.write_bytes(data[:4] + struct.pack("<I", 7) + data[8:])
    with pytest.raises(CheckpointError, match="version 7 is not supported"):
        GGUFIndex(bad)
    bad.write_bytes(data[:8] + struct.pack("<Q", 1 << 40) + data[16:])
    with pytest.raises(CheckpointError, match="tensor count is 1099511627776"):
        GGUFIndex(bad)


def _retype(data: bytearray, name: bytes, ggml_type: int) -> bytearray:
    """Rewrite the type field of tensor `name` in a GGUF header."""
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    return data


def test_unsupported_and_unknown_types(gguf_root, tmp_path):
    data = bytearray(tiny_gguf(gguf_root, "llama", Q.Q4_0).read_bytes())
    bad = tmp_path / "types.gguf"
    bad.write_bytes(_retype(bytearray(data), b"blk.2.ffn_up.weight", int(Q.IQ2_XS)))
    with pytest.raises(CheckpointError, match=r"types\.gguf: tensor 'blk\.2\.ffn_up\.weight': type IQ2_XS is not "
                                              r"supported \(supported: F32, F16, BF16, Q4_0"):
        GGUFIndex(bad)
    bad.write_bytes(_retype(bytearray(data), b"blk.2.ffn_up.weight", 9999))
    with pytest.raises(CheckpointError, match="unknown GGML type 9999"):
        GGUFIndex(bad)


def test_unsupported_architecture_and_missing_tensor(gguf_root, tmp_path):
    data = bytearray(tiny_gguf(gguf_root, "llama", Q.Q4_0).read_bytes())
    bad = tmp_path / "arch.gguf"
    key = b"general.architecture"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4 + 8
    data[at:at + 5] = b"gemma"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="GGUF architecture 'gemma' is not supported"):
        LLM(str(bad))
    renamed = bytearray(tiny_gguf(gguf_root, "llama", Q.Q4_0).read_bytes())
    at = renamed.index(b"blk.3.attn_v.weight")
    renamed[at:at + 5] = b"blk.9"
    bad.write_bytes(renamed)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.3\.attn_v\.weight' is missing"):
        LLM(str(bad))


def test_quantization_of_a_gguf_file_is_refused(gguf_root):
    """A GGUF file is already quantized: quantization="int8" on it is one clear error naming the file."""
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    with pytest.raises(ValueError, match=r"llama-Q4_0\.gguf: quantization='int8' applies to bf16/fp16/fp32 "
                                         r"checkpoints; this one is already quantized"):
        LLM(str(path), quantization="int8", max_model_len=64, max_num_seqs=1)


def test_deepseek2_gating_function_contradicting_the_router_bias_is_refused(tmp_path):
    """llama.cpp's expert_gating_func (1 softmax, 2 sigmoid), where a file has it, must agree with the router
    correction bias the engine tells V3 by."""
    from engine.errors import UnsupportedModelError
    from engine.weights.formats.gguf_config import _config_from_metadata
    from engine.weights.formats.gguf_file import GGUFIndex
    from tests.support.families import build
    from tests.support.llama_cpp_convert import convert, llama_cpp_root

    if llama_cpp_root() is None:
        pytest.skip("llama.cpp's converter is not unpacked (tests/support/llama_cpp_convert.py)")
    path = convert(build(tmp_path / "hf", "deepseek_v3"), tmp_path / "tiny.gguf", "f32")
    index = GGUFIndex(path)
    try:
        meta, names = dict(index.metadata), frozenset(index.entries)
    finally:
        index.close()
    assert _config_from_metadata("deepseek2", {**meta, "deepseek2.expert_gating_func": 2}, names).model_type == \
        "deepseek_v3"
    with pytest.raises(UnsupportedModelError, match="expert_gating_func 1 with a router correction bias"):
        _config_from_metadata("deepseek2", {**meta, "deepseek2.expert_gating_func": 1}, names)
