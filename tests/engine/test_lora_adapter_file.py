"""Adapter folders checked before they are served (engine.lora_serving.read_adapter): each mistake is a
LoRAAdapterError naming what is wrong; and the --lora-modules specs."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine.lora_serving import LoRAAdapterError, parse_lora_modules, read_adapter
from engine.weights import ModelCheckpoint
from tests.support.lora import make_adapter


@pytest.fixture(scope="module")
def cfg(llama_dir):
    checkpoint = ModelCheckpoint(llama_dir)
    try:
        yield checkpoint.cfg
    finally:
        checkpoint.close()


@pytest.fixture(scope="module")
def good(llama_dir, tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("adapter") / "good", llama_dir, r=4, alpha=8.0,
                        targets=("q_proj", "down_proj"))


def _copy(good, tmp_path, config=None, tensors=None):
    """The good adapter copied, its config updated with `config` and its tensors replaced by tensors(state)."""
    folder = tmp_path / "adapter"
    shutil.copytree(good, folder)
    if config is not None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if tensors is not None:
        path = folder / "adapter_model.safetensors"
        save_file(tensors(load_file(path)), path)
    return folder


def test_a_good_adapter_is_read_with_its_scale_and_targets(good, cfg):
    w = read_adapter(good, cfg)
    assert w.r == 4 and w.scale == 2.0 and w.target_modules == ("q_proj", "down_proj")
    assert len(w.params) == 2 * cfg.num_layers
    a, b = w.params[0, "q_proj"]
    assert a.shape == (4, cfg.hidden_size) and b.shape == (cfg.num_heads * cfg.head_dim, 4)


def test_rslora_scales_by_the_square_root_of_the_rank(good, cfg, tmp_path):
    assert read_adapter(_copy(good, tmp_path, {"use_rslora": True}), cfg).scale == 8.0 / 2.0


def test_the_digest_follows_the_weights(good, cfg, tmp_path):
    changed = _copy(good, tmp_path, tensors=lambda s: {k: v * 2 for k, v in s.items()})
    assert read_adapter(changed, cfg).digest != read_adapter(good, cfg).digest
    assert read_adapter(good, cfg).digest == read_adapter(good, cfg).digest


@pytest.mark.parametrize("config,tensors,message", [
    ({"target_modules": ["q_proj", "c_attn"]}, None, "c_attn"),
    ({"target_modules": ["q_proj", "down_proj", "k_proj"]}, None, "no tensors for them"),
    ({"r": 8}, None, "rank r=8 in adapter_config.json"),
    ({"r": 0}, None, "rank r=0"),
    ({"use_dora": True}, None, "use_dora"),
    ({"bias": "all"}, None, "bias"),
    ({"peft_type": "IA3"}, None, "not a LoRA adapter"),
    (None, lambda s: {k.replace("q_proj", "qkv_proj"): v for k, v in s.items()}, "qkv_proj"),
    (None, lambda s: {k.replace("layers.0.", "layers.9."): v for k, v in s.items()}, "block 9"),
    (None, lambda s: {k: v for k, v in s.items() if not ("layers.1." in k and "lora_B" in k)}, "no lora_B"),
    (None, lambda s: s | {"base_model.model.lm_head.lora_A.weight": next(iter(s.values())).clone()}, "lm_head"),
], ids=["unknown-module", "config-target-without-tensors", "rank-mismatch", "bad-rank", "dora", "bias", "ia3",
        "module-the-model-lacks", "layer-out-of-range", "half-a-pair", "head-adapter"])
def test_a_bad_adapter_is_refused_with_what_is_wrong(good, cfg, tmp_path, config, tensors, message):
    with pytest.raises(LoRAAdapterError, match="adapter") as e:
        read_adapter(_copy(good, tmp_path, config, tensors), cfg)
    assert message in str(e.value)


def test_missing_and_corrupt_files_are_refused(good, cfg, tmp_path):
    with pytest.raises(LoRAAdapterError, match="does not exist"):
        read_adapter(tmp_path / "nowhere", cfg)
    folder = _copy(good, tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(LoRAAdapterError, match="not a valid safetensors file"):
        read_adapter(folder, cfg)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors"):
        read_adapter(folder, cfg)
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError):
        read_adapter(folder, cfg)


def test_lora_modules_specs():
    assert parse_lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    assert parse_lora_modules("a=/x b=/y") == {"a": "/x", "b": "/y"}  # as LAYERSTREAM_LORA_MODULES gives them
    assert parse_lora_modules(['{"name": "a", "path": "/x"}']) == {"a": "/x"}  # vLLM's JSON form
    assert parse_lora_modules('{"a": "/x", "b": "/y"}') == {"a": "/x", "b": "/y"}  # a dict through Ray's arguments
    assert parse_lora_modules({"a": "/x"}) == {"a": "/x"} and parse_lora_modules(None) == {}
    for bad, message in [(["a"], "not name=path"), (["a=/x", "a=/y"], "given twice"), (["=/x"], "needs a name"),
                         (['{"name": "a"}'], "needs a name")]:
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
