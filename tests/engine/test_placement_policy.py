"""The CPU-offload cost model and policy (engine.placement, issue #38): the path an off-device tensor group
takes in a step, pinned for given measured speeds: the token threshold, its MoE scaling by total / active
experts, the --cpu-offload-policy overrides, and a bad value's error. No torch, no model: milliseconds."""

from __future__ import annotations

import argparse
import math

import pytest

from engine.args import EngineArgs
from engine.cli import add_engine_arguments, engine_args_from
from engine.placement import (MeasuredSpeeds, PathPolicy, StepShape, TensorGroup, check_policy, cpu_seconds, refreshed,
                              row_threshold, stream_seconds, token_threshold)

# Round numbers, so the thresholds below can be worked out by hand. A Llama-3-8B-shaped MLP in bf16:
# 3 x 4096 x 14336 parameters = 176,160,768; 352,321,536 bytes; a row's hidden state 8 KiB.
PARAMS = 3 * 4096 * 14336
MLP = TensorGroup(0, "mlp", nbytes=2 * PARAMS, params=PARAMS, activation_bytes=4096 * 2)
# The link at 25 GB/s (PCIe 4 x16), the CPU at 100 GB/s of weights read and 2 TFLOP/s, the device at 400 TFLOP/s.
SPEEDS = MeasuredSpeeds(link_gbps=25, cpu_gbps=100, cpu_flops=2e12, device_flops=400e12)


def test_the_cost_model_is_the_roofline_written_in_its_docstring():
    # One row: the CPU reads the weights once (W / 100 GB/s) and moves 2 x 8 KiB; streaming moves W at 25 GB/s.
    assert cpu_seconds(MLP, 1, SPEEDS) == pytest.approx(2 * PARAMS / 100e9 + 2 * 8192 / 25e9)
    assert stream_seconds(MLP, 1, SPEEDS) == pytest.approx(2 * PARAMS / 25e9)
    # 1000 rows: the CPU is compute-bound (2 P r / 2 TFLOP/s), the device still waits on the link.
    assert cpu_seconds(MLP, 1000, SPEEDS) == pytest.approx(2 * PARAMS * 1000 / 2e12 + 2 * 1000 * 8192 / 25e9)
    assert stream_seconds(MLP, 1000, SPEEDS) == pytest.approx(2 * PARAMS / 25e9)


def test_the_threshold_is_where_streaming_becomes_cheaper():
    """CPU: 2 P r / 2e12 + 2 r 8192 / 25e9 seconds (compute-bound from r = 20); streaming: 2 P / 25e9. They
    cross at r = (2 P / 25e9) / (2 P / 2e12 + 16384 / 25e9) = 79.70...: 80 tokens."""
    crossing = (2 * PARAMS / 25e9) / (2 * PARAMS / 2e12 + 2 * 8192 / 25e9)
    assert 79 < crossing < 80
    assert row_threshold(MLP, SPEEDS) == token_threshold(MLP, SPEEDS) == 80
    policy = PathPolicy("auto", SPEEDS)
    assert policy.threshold(MLP) == 80
    assert [policy.path(MLP, StepShape(n)) for n in (1, 16, 79, 80, 512)] == ["cpu", "cpu", "cpu", "stream", "stream"]


@pytest.mark.parametrize("link_gbps, cpu_flops, threshold", [
    (50, 2e12, 40),    # a link twice as fast halves it: streaming costs half as much
    (25, 4e12, 159),   # a CPU twice as fast nearly doubles it (its rows' activations still cross the link)
    (25, 1e12, 40),
])
def test_the_threshold_follows_the_measured_speeds(link_gbps, cpu_flops, threshold):
    speeds = MeasuredSpeeds(link_gbps=link_gbps, cpu_gbps=100, cpu_flops=cpu_flops, device_flops=400e12)
    assert PathPolicy("auto", speeds).threshold(MLP) == threshold
    assert PathPolicy("auto", speeds).path(MLP, StepShape(threshold - 1)) == "cpu"
    assert PathPolicy("auto", speeds).path(MLP, StepShape(threshold)) == "stream"


def test_a_cpu_faster_than_the_link_at_one_row_computes_every_step_below_its_compute_bound():
    # The CPU reads its weights slower than the link moves them (cpu_gbps 10 < link 25): streaming wins at once.
    slow_cpu = MeasuredSpeeds(link_gbps=25, cpu_gbps=10, cpu_flops=2e12, device_flops=400e12)
    assert PathPolicy("auto", slow_cpu).threshold(MLP) == 1
    assert PathPolicy("auto", slow_cpu).path(MLP, StepShape(1)) == "stream"


def test_a_link_slower_than_any_cpu_work_never_streams():
    """When the device is slower than the CPU at every row count, streaming never wins: no threshold."""
    speeds = MeasuredSpeeds(link_gbps=25, cpu_gbps=100, cpu_flops=400e12, device_flops=2e12)
    assert row_threshold(MLP, speeds) is None
    assert PathPolicy("auto", speeds).path(MLP, StepShape(100_000)) == "cpu"


# Mixtral-like experts: 8 of 2 per token, each 3 x 4096 x 14336 parameters (the MLP above).
EXPERTS = TensorGroup(0, "experts", nbytes=8 * 2 * PARAMS, params=8 * PARAMS, activation_bytes=4096 * 2,
                      experts_total=8, experts_active=2)


def test_experts_scale_the_threshold_by_total_over_active_experts():
    """Each expert is priced like the MLP above (80 rows), and a step of n tokens gives each n x 2 / 8 rows:
    the group streams from 80 x 8 / 2 = 320 tokens."""
    assert row_threshold(EXPERTS, SPEEDS) == row_threshold(MLP, SPEEDS) == 80
    assert token_threshold(EXPERTS, SPEEDS) == 320
    policy = PathPolicy("auto", SPEEDS)
    assert policy.threshold(EXPERTS) == 320
    assert policy.path(EXPERTS, StepShape(319)) == "cpu" and policy.path(EXPERTS, StepShape(320)) == "stream"
    # The router's own count, when given, replaces the average: a skewed step's busiest expert decides.
    assert policy.path(EXPERTS, StepShape(100, tokens_per_expert=80)) == "stream"
    assert policy.path(EXPERTS, StepShape(400, tokens_per_expert=79)) == "cpu"


@pytest.mark.parametrize("total, active", [(64, 6), (128, 8), (32, 4), (60, 4)])
def test_the_moe_scaling_holds_for_any_expert_count(total, active):
    experts = TensorGroup(3, "experts", nbytes=total * 2 * PARAMS, params=total * PARAMS, activation_bytes=8192,
                          experts_total=total, experts_active=active)
    assert token_threshold(experts, SPEEDS) == math.ceil(80 * total / active)
    policy = PathPolicy("auto", SPEEDS)
    n = policy.threshold(experts)
    assert policy.path(experts, StepShape(n - 1)) == "cpu" and policy.path(experts, StepShape(n)) == "stream"


def test_the_flag_overrides_the_cost_model():
    for n in (1, 80, 10_000):
        assert PathPolicy("stream", SPEEDS).path(MLP, StepShape(n)) == "stream"
        assert PathPolicy("cpu", SPEEDS).path(MLP, StepShape(n)) == "cpu"
        assert PathPolicy("cpu", SPEEDS).path(EXPERTS, StepShape(n)) == "cpu"
    assert PathPolicy("stream").threshold(MLP) == 0 and PathPolicy("cpu").threshold(MLP) is None
    # Nothing measured yet: auto streams, as the engine did before the CPU could compute a group.
    assert PathPolicy("auto").path(MLP, StepShape(1)) == "stream"
    assert PathPolicy("auto").with_speeds(SPEEDS).path(MLP, StepShape(1)) == "cpu"


@pytest.mark.parametrize("bad", ["gpu", "Auto", ""])
def test_a_bad_policy_is_a_clear_error_everywhere(bad):
    with pytest.raises(ValueError, match=rf"cpu_offload_policy must be one of auto, stream, cpu, got '{bad}'"):
        check_policy(bad)
    with pytest.raises(ValueError, match="cpu_offload_policy must be one of"):
        PathPolicy(bad)
    with pytest.raises(ValueError, match="cpu_offload_policy must be one of"):
        EngineArgs(model="demo", cpu_offload_policy=bad)


def test_the_flag_reaches_engine_args_with_its_default(capsys):
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_args_from(p.parse_args([])).cpu_offload_policy == "auto" == EngineArgs.default("cpu_offload_policy")
    assert engine_args_from(p.parse_args(["--cpu-offload-policy", "cpu"])).cpu_offload_policy == "cpu"
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-offload-policy", "gpu"])
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("link_gbps", 0), ("cpu_gbps", -1.0), ("cpu_flops", float("nan")),
                                          ("device_flops", None), ("device_gbps", 0)])
def test_measured_speeds_are_validated(field, value):
    kw = dict(link_gbps=25, cpu_gbps=100, cpu_flops=2e12, device_flops=400e12)
    kw[field] = value
    with pytest.raises(ValueError, match=f"measured speed {field} must be a positive number"):
        MeasuredSpeeds(**kw)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        StepShape(-1)


def test_live_observations_nudge_the_bounding_cpu_term():
    """One row is memory-bound at these speeds: an observed time updates cpu_gbps; 1000 rows are compute-bound:
    it updates cpu_flops. A quarter of the way each time, so one noisy step moves the threshold only a little."""
    seen_gbps = 50e9  # half the measured 100 GB/s
    one_row = refreshed(SPEEDS, MLP, 1, 2 * PARAMS / seen_gbps)
    assert one_row.cpu_gbps == pytest.approx(0.75 * 100 + 0.25 * 50) and one_row.cpu_flops == SPEEDS.cpu_flops
    many = refreshed(SPEEDS, MLP, 1000, 2 * PARAMS * 1000 / 1e12)  # seen at 1 TFLOP/s, half the measured
    assert many.cpu_flops == pytest.approx(0.75 * 2e12 + 0.25 * 1e12) and many.cpu_gbps == SPEEDS.cpu_gbps
    # A slower CPU than measured lowers the threshold: the device takes over sooner.
    assert PathPolicy("auto", many).threshold(MLP) < PathPolicy("auto", SPEEDS).threshold(MLP)
    assert refreshed(SPEEDS, MLP, 1, 0.0) == SPEEDS  # nothing seen, nothing learnt
    with pytest.raises(ValueError, match="weight must be in"):
        refreshed(SPEEDS, MLP, 1, 1.0, weight=0)
