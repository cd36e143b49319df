"""Conventions users bring from vLLM and Hugging Face (issue #35): speculative_config as a dict or its
JSON (the speculative_* fields and --speculative-* flags its aliases), `layerstream serve MODEL`, and a
hub id resolved from the local Hugging Face cache without the network."""

from __future__ import annotations

import argparse
import json

import pytest

from engine.args import EngineArgs
from engine.cli import add_engine_arguments, engine_args_from

# -- speculative_config ----------------------------------------------------------------------------

# vLLM's dict -> the same settings as layerstream's older fields.
EQUIVALENT = {
    "ngram": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
              dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=5)),
    "draft_model": ({"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 6},
                    dict(speculative_method="draft", speculative_model="org/draft", num_speculative_tokens=6)),
    "model, no method": ({"model": "org/draft"},  # vLLM: a model without a method is a draft model
                         dict(speculative_method="draft", speculative_model="org/draft")),
    "ngram as the model": ({"model": "[ngram]"}, dict(speculative_method="ngram")),
    "self, fixed k": ({"method": "self", "adaptive_k": False},
                      dict(speculative_method="self", speculative_adaptive_k=False)),
}


@pytest.mark.parametrize("name", list(EQUIVALENT))
def test_speculative_config_is_the_speculative_fields(name):
    config, fields = EQUIVALENT[name]
    old = EngineArgs(model="demo", **fields)
    assert old.speculative_config is not None
    assert EngineArgs(model="demo", speculative_config=config) == old
    assert EngineArgs(model="demo", speculative_config=json.dumps(config)) == old


def test_speculative_config_sets_the_fields_the_engine_reads():
    args = EngineArgs(model="demo", speculative_config={"method": "draft_model", "model": "org/draft",
                                                        "num_speculative_tokens": 7})
    assert (args.speculative_method, args.speculative_model, args.num_speculative_tokens) == ("draft", "org/draft", 7)
    assert args.speculative_config.method == "draft" and args.speculative_config.num_speculative_tokens == 7


def test_an_alias_field_fills_a_key_the_dict_leaves_out():
    args = EngineArgs(model="demo", speculative_config={"method": "ngram"}, num_speculative_tokens=9)
    assert args.speculative_config.num_speculative_tokens == 9


def test_tuning_fields_without_a_method_leave_speculation_off():
    assert EngineArgs(model="demo", num_speculative_tokens=8).speculative_config is None
    assert EngineArgs(model="demo").speculative_config is None


def test_rebuilding_engine_args_keeps_the_config():
    import dataclasses

    args = EngineArgs(model="demo", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    again = dataclasses.replace(args, max_num_seqs=4)
    assert again.speculative_config == args.speculative_config and again.max_num_seqs == 4


@pytest.mark.parametrize("kw, message", [
    (dict(speculative_config={"method": "ngram", "num_lookahead": 3}), "key 'num_lookahead' is not supported"),
    (dict(speculative_config={"method": "ngram", "draft_tensor_parallel_size": 1}),
     "key 'draft_tensor_parallel_size' is not supported"),
    (dict(speculative_config={"method": "eagle", "model": "x/y"}), "must be one of .* got 'eagle'"),
    (dict(speculative_config={}), "needs a 'method'"),
    (dict(speculative_config={"num_speculative_tokens": 3}), "needs a 'method'"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": "3"}), "num_speculative_tokens .* '3'"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}), "num_speculative_tokens .* got 0"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_min": 5}), "min 5, max 4"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_max": 2.5}), "prompt_lookup_max .* 2.5"),
    (dict(speculative_config={"method": "ngram", "adaptive_k": "no"}), "adaptive_k .* 'no'"),
    (dict(speculative_config={"method": "draft_model"}), "needs --speculative-model .*key 'model'"),
    (dict(speculative_config={"method": "ngram", "model": "x/y"}), "only used by method 'draft'"),
    (dict(speculative_config='{"method": "ngram"'), "not valid JSON"),
    (dict(speculative_config='["ngram"]'), "must be a dict .* got \\['ngram'\\]"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, num_speculative_tokens=5),
     "'num_speculative_tokens' is 3 but num_speculative_tokens is 5"),
    (dict(speculative_config={"method": "ngram"}, speculative_method="self"), "'method' is 'ngram' but"),
    (dict(speculative_config={"method": "self"}, quantization="int4"), "unquantized target"),
])
def test_bad_speculative_config_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="demo", **kw)


def test_the_same_setting_given_both_ways_alike_is_accepted():
    args = EngineArgs(model="demo", speculative_config={"method": "draft_model", "model": "a/b"},
                      speculative_method="draft", speculative_model="a/b")
    assert args.speculative_config.model == "a/b"


def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p


@pytest.mark.parametrize("flags, config", [
    (["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-max", "2"],
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}),
    (["--speculative-method", "draft", "--speculative-model", "a/b", "--no-speculative-adaptive-k"],
     {"method": "draft_model", "model": "a/b", "adaptive_k": False}),
])
def test_speculative_config_flag_is_the_speculative_flags(flags, config):
    p = _engine_parser()
    old = engine_args_from(p.parse_args(flags))
    new = engine_args_from(p.parse_args(["--speculative-config", json.dumps(config)]))
    assert old.speculative_config is not None and new == old


def test_speculative_config_flag_names_a_bad_key():
    ns = _engine_parser().parse_args(["--speculative-config", '{"method": "ngram", "k": 3}'])
    with pytest.raises(ValueError, match="key 'k' is not supported"):
        engine_args_from(ns)


def test_llm_takes_speculative_config(llama_dir):
    """The dict reaches the engine: it drafts (by prompt lookup) and its greedy output is the plain one."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]  # the continuation is in the prompt: lookup drafts it
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for name, kw in {"plain": {}, "spec": dict(speculative_config=spec)}.items():
        llm = LLM(str(llama_dir), max_model_len=128, **kw)
        try:
            outputs[name] = llm.generate([prompt], params)[0].outputs[0].token_ids
            telemetry = llm.telemetry().speculative
        finally:
            llm.close()
    assert telemetry is not None and telemetry.method == "ngram" and telemetry.num_speculative_tokens == 3
    assert telemetry.draft_tokens > 0
    assert outputs["spec"] == outputs["plain"] and len(outputs["plain"]) == 12


# -- a hub id, from the local Hugging Face cache -----------------------------------------------------

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_cache(root, repo_id: str):
    """The layout huggingface_hub leaves: models--org--name/snapshots/<commit>/ and refs/main naming it."""
    from tests.support.models import build

    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = build(repo / "snapshots" / SNAPSHOT, "llama")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """No socket may connect, and nothing says "offline" (HF_HUB_OFFLINE): the lookup must be offline by itself."""
    import socket

    def refuse(*_a, **_k):
        raise AssertionError("the model lookup tried the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)


def test_a_hub_id_resolves_from_hf_hub_cache(tmp_path, monkeypatch, no_network):
    from engine.model_source import resolve_model

    snapshot = _fake_hub_cache(tmp_path / "hub-cache", "SmolOrg/Tiny-Instruct")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    assert resolve_model("SmolOrg/Tiny-Instruct") == snapshot


def test_a_hub_id_resolves_from_hf_home(tmp_path, monkeypatch, no_network):
    from engine.model_source import resolve_model

    snapshot = _fake_hub_cache(tmp_path / "hf-home" / "hub", "SmolOrg/Tiny-Instruct")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert resolve_model("SmolOrg/Tiny-Instruct") == snapshot


def test_llm_serves_a_cached_hub_model_as_its_folder(tmp_path, monkeypatch, no_network):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    snapshot = _fake_hub_cache(tmp_path / "hub-cache", "SmolOrg/Tiny-Instruct")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for model in ("SmolOrg/Tiny-Instruct", str(snapshot)):
        llm = LLM(model, max_model_len=64)
        try:
            outputs.append(llm.generate([[3, 4, 5]], params)[0].outputs[0].token_ids)
        finally:
            llm.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_a_hub_id_not_in_the_cache_says_where_it_looked_and_what_to_do(tmp_path, monkeypatch, no_network):
    from engine.model_source import resolve_model

    _fake_hub_cache(tmp_path / "hub-cache", "SmolOrg/Other")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("SmolOrg/Tiny-Instruct")
    message = str(e.value)
    assert "'SmolOrg/Tiny-Instruct' is not in the local Hugging Face cache at " + str(tmp_path / "hub-cache") in message
    assert "hf download SmolOrg/Tiny-Instruct" in message and "give a local path" in message


def test_a_snapshot_without_its_ref_is_not_found(tmp_path, monkeypatch, no_network):
    """refs/main names the snapshot to serve: without it, none is chosen."""
    from engine.model_source import resolve_model

    _fake_hub_cache(tmp_path / "hub-cache", "SmolOrg/Tiny-Instruct")
    (tmp_path / "hub-cache" / "models--SmolOrg--Tiny-Instruct" / "refs" / "main").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("SmolOrg/Tiny-Instruct")


# -- the model as MODEL or --model ---------------------------------------------------------------------

def _parser(command: str) -> argparse.ArgumentParser:
    """A subcommand's parser as `layerstream` builds it (serve's reads LAYERSTREAM_* now, at build time)."""
    import importlib

    from layerstream.cli import SUBCOMMANDS

    p = argparse.ArgumentParser(prog=f"layerstream {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(p)
    return p


@pytest.fixture
def no_model_variable(monkeypatch):
    monkeypatch.delenv("LAYERSTREAM_MODEL", raising=False)


@pytest.mark.parametrize("command, extra", [("serve", []), ("generate", ["--prompt", "hi"])])
@pytest.mark.parametrize("argv, model", [
    (["org/name"], "org/name"),
    (["--model", "org/name"], "org/name"),
    (["--max-num-seqs", "2", "org/name"], "org/name"),  # MODEL after a flag and its value
    (["org/name", "--model", "org/name"], "org/name"),  # both ways, the same: fine
    ([], "demo"),
])
def test_the_model_is_positional_or_a_flag(command, extra, argv, model, no_model_variable):
    ns = _parser(command).parse_args(argv + extra)
    assert ns.model == model


@pytest.mark.parametrize("argv", [["a/b", "--model", "c/d"], ["--model", "c/d", "a/b"]])
def test_two_different_models_are_an_error(argv, capsys, no_model_variable):
    with pytest.raises(SystemExit) as e:
        _parser("serve").parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "the model is given twice" in err and "'a/b'" in err and "'c/d'" in err


def test_model_on_the_command_line_beats_layerstream_model(monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_MODEL", "env/model")
    assert _parser("serve").parse_args([]).model == "env/model"
    assert _parser("serve").parse_args(["cli/model"]).model == "cli/model"


def test_convert_takes_the_model_either_way_and_needs_one(capsys):
    from layerstream.cli import main

    p = _parser("convert")
    assert p.parse_args(["m.gguf"]).model == p.parse_args(["--model", "m.gguf"]).model == "m.gguf"
    assert main(["convert"]) == 2
    assert "convert needs a model" in capsys.readouterr().err


def test_ray_flags_take_the_model_and_a_speculative_config_dict(no_model_variable):
    """serveConfigV2's args: `model:` as before, and speculative_config as YAML's mapping, not a JSON string."""
    from server.launch import parse_flags

    ns = parse_flags({"model": "org/name", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    args = engine_args_from(ns)
    assert args.model == "org/name"
    assert args.speculative_config.method == "ngram" and args.speculative_config.num_speculative_tokens == 2
