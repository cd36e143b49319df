"""Bad checkpoints get one clear error naming the file and tensor, never a crash or a torch trace."""

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from engine import LLM
from engine.arch import UnsupportedModelError
from engine.weights.formats.safetensors_index import CheckpointError, SafetensorsFile
from tests.support.checkpoints import edited_header, read_header


@pytest.fixture
def bad_copy(llama_dir, tmp_path):
    """A fresh copy of the tiny llama checkpoint to damage."""
    dst = tmp_path / "bad"
    shutil.copytree(llama_dir, dst)
    return dst


def load(folder):
    return LLM(str(folder), max_model_len=64, max_num_seqs=1)


def test_truncated_file(bad_copy):
    f = bad_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*': data ends at byte \d+ but the file "
                                              r"holds only \d+ data bytes \(truncated"):
        load(bad_copy)


def test_file_cut_inside_header(bad_copy):
    f = bad_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="header length .* does not fit the file"):
        load(bad_copy)


def test_garbage_file(bad_copy):
    (bad_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length"):
        load(bad_copy)


def test_header_not_json(bad_copy):
    f = bad_copy / "model.safetensors"
    _, data = read_header(f)
    f.write_bytes(struct.pack("<Q", 8) + b"{not json" [:8] + data)
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        load(bad_copy)


def test_offsets_past_end(bad_copy):
    f = bad_copy / "model.safetensors"
    _, data = read_header(f)
    name = "model.layers.1.mlp.up_proj.weight"
    with edited_header(f) as header:
        b, e = header[name]["data_offsets"]
        header[name]["data_offsets"] = [len(data) + 8, len(data) + 8 + (e - b)]
    with pytest.raises(CheckpointError, match=f"tensor '{name}': data ends at byte"):
        load(bad_copy)


def test_size_does_not_match_shape(bad_copy):
    name = "model.norm.weight"
    with edited_header(bad_copy / "model.safetensors") as header:
        header[name]["shape"] = [header[name]["shape"][0] * 2]
    with pytest.raises(CheckpointError, match=f"tensor '{name}': holds \\d+ bytes but shape"):
        load(bad_copy)


def test_overlapping_tensors(bad_copy):
    with edited_header(bad_copy / "model.safetensors") as header:
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        a, b = names[0], names[1]
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
        start = header[a]["data_offsets"][0]
        if header[a]["data_offsets"][1] - start >= size:  # same size region starting where `a` starts
            header[b]["data_offsets"] = [start, start + size]
    with pytest.raises(CheckpointError, match="overlap"):
        load(bad_copy)


def test_missing_tensor(bad_copy):
    with edited_header(bad_copy / "model.safetensors") as header:
        del header["model.layers.2.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match="tensor 'model.layers.2.self_attn.k_proj.weight' is missing"):
        load(bad_copy)


def test_wrong_shape(bad_copy):
    name = "model.layers.0.mlp.up_proj.weight"
    with edited_header(bad_copy / "model.safetensors") as header:
        rows, cols = header[name]["shape"]
        header[name]["shape"] = [cols, rows]  # same byte size, transposed: only the shape check catches it
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[{cols}, {rows}\], expected \[{rows}, {cols}\]"):
        load(bad_copy)


def test_unknown_dtype(bad_copy):
    name = "model.norm.weight"
    with edited_header(bad_copy / "model.safetensors") as header:
        header[name]["dtype"] = "F8_E4M3"
    with pytest.raises(CheckpointError, match=f"tensor '{name}': dtype 'F8_E4M3' is not supported"):
        load(bad_copy)


def test_unsupported_architecture(bad_copy):
    cfg_path = bad_copy / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported; supported: LlamaForCausalLM"):
        load(bad_copy)


def test_missing_shard_in_index(bad_copy):
    (bad_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: shard named in the index is missing"):
        load(bad_copy)


def test_sharded_checkpoint_loads(tmp_path):
    """Shards plus model.safetensors.index.json go through the same index."""
    from engine import SamplingParams
    from tests.support.models import build

    folder = build(tmp_path / "sharded", "qwen2", max_shard_size="100KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    llm = load(folder)
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_entries_are_zero_copy_views(llama_dir):
    f = SafetensorsFile(llama_dir / "model.safetensors")
    e = f.entries["model.norm.weight"]
    a, b = f.view(e), f.view(e)
    assert a.data_ptr() == b.data_ptr()  # both point into the same mapping: no copy was made
    # ... at the tensor's own offset in it (two views of one cached copy would pass the line above)
    assert a.data_ptr() == torch.frombuffer(f._map, dtype=torch.uint8).data_ptr() + e.start


def test_cli_reports_one_clear_line(bad_copy):
    f = bad_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    proc = subprocess.run([sys.executable, "-m", "layerstream", "generate", "--model", str(bad_copy), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "layerstream: error:" in proc.stderr and "truncated" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_shard_leaves_no_file_open(tmp_path):
    """The shards opened before a corrupt one are closed again (descriptors and mappings) when the
    checkpoint is refused: a server that retries a bad path must not leak a descriptor per try."""
    import os

    from engine.weights.probes import open_checkpoint
    from tests.support.models import build

    folder = build(tmp_path / "sharded", "qwen2", max_shard_size="100KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[-1].write_bytes(shards[-1].read_bytes()[:100])  # the last shard, cut inside its header
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(CheckpointError, match=shards[-1].name):
            open_checkpoint(folder)
    assert len(os.listdir("/proc/self/fd")) == before


def test_close_twice_is_harmless(llama_dir):
    """LLM.close() and the engine thread's own close may both run: the second finds nothing open."""
    llm = LLM(str(llama_dir), max_model_len=32, max_num_seqs=1)
    llm.close()
    llm.close()
