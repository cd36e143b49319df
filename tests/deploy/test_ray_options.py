"""`layerstream serve --ray` options without Ray: flags, LAYERSTREAM_* variables and `serve run`
key=value arguments become the same checked deployment options; bad values are refused before any
cluster starts."""

from __future__ import annotations

import argparse
import sys

import pytest

from server.cli import add_arguments, run
from server.launch import parse_flags
from server.ray_options import ReplicaOptions


def test_fixed_replicas_on_cpu():
    options = ReplicaOptions.from_namespace(parse_flags({"model": "demo", "num_replicas": "3", "replica_cpus": "2"}))
    assert options.deployment_options() == {
        "num_replicas": 3, "max_ongoing_requests": 32,  # 2 x the default --max-num-seqs 16
        "ray_actor_options": {"num_cpus": 2.0, "num_gpus": 0.0}}


def test_autoscaling_one_gpu_per_replica():
    ns = parse_flags({"model": "m", "device": "cuda", "min_replicas": "1", "max_replicas": "4", "max_num_seqs": "8"})
    assert ReplicaOptions.from_namespace(ns).deployment_options() == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0},
        "max_ongoing_requests": 16, "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0}}


def test_environment_variables_and_switches(monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_NUM_REPLICAS", "2")
    monkeypatch.setenv("LAYERSTREAM_PIN_HOST_MEMORY", "1")
    ns = parse_flags({"model": "demo"})
    assert ns.num_replicas == 2 and ns.pin_host_memory
    assert parse_flags({"num_replicas": "5"}).num_replicas == 5  # an argument beats the variable
    assert not parse_flags({"pin_host_memory": "false"}).pin_host_memory


def test_prefix_caching_switch_from_arguments_and_environment(monkeypatch):
    assert parse_flags({}).enable_prefix_caching is True  # on by default
    assert parse_flags({"enable_prefix_caching": "false"}).enable_prefix_caching is False
    monkeypatch.setenv("LAYERSTREAM_ENABLE_PREFIX_CACHING", "0")
    assert parse_flags({}).enable_prefix_caching is False
    assert parse_flags({"enable_prefix_caching": "true"}).enable_prefix_caching is True


@pytest.mark.parametrize("args, message", [
    ({"num_replicas": "0"}, "--num-replicas must be >= 1, got 0"),
    ({"min_replicas": "1"}, "needs both --min-replicas and --max-replicas"),
    ({"min_replicas": "3", "max_replicas": "2"}, "min 3, max 2"),
    ({"min_replicas": "0", "max_replicas": "0"}, "min 0, max 0"),
    ({"target_ongoing_requests": "0"}, "--target-ongoing-requests must be > 0, got 0.0"),
    ({"max_ongoing_requests": "0"}, "--max-ongoing-requests must be >= 1, got 0"),
    ({"replica_gpus": "-1"}, "must be >= 0"),
])
def test_bad_options_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        ReplicaOptions.from_namespace(parse_flags(args))


def test_unknown_or_malformed_arguments():
    with pytest.raises(ValueError, match="unknown argument 'num_replica'"):
        parse_flags({"num_replica": "2"})
    with pytest.raises(ValueError, match="bad arguments"):
        parse_flags({"num_replicas": "two"})


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


def test_serve_refuses_bad_options_before_starting_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # were Ray imported, this would fail differently
    with pytest.raises(ValueError, match="--num-replicas must be >= 1, got 0"):
        _serve(["--ray", "--num-replicas", "0"])


def test_serve_without_ray_installed_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "server.ray_serve", raising=False)
    with pytest.raises(ValueError, match=r"--ray needs Ray Serve.*pip install 'layerstream\[ray\]'"):
        _serve(["--ray"])
