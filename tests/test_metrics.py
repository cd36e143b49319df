"""Streaming telemetry from one engine step into Prometheus gauges."""

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.planner import PlanInputs, plan_memory
from engine.structured_output import MaskStats
from engine.telemetry import EngineTelemetry, KVUsage, PlanSummary, StepTelemetry
from engine.weights import LinkSpeeds, StreamStats
from server.metrics import ServerMetrics


def snapshot(link_gbps, bytes_streamed=400_000_000, seconds=0.5) -> EngineTelemetry:
    """The telemetry an engine would report after one step that streamed `bytes_streamed` in `seconds`."""
    links = LinkSpeeds(h2d_gbps=link_gbps)
    stream = StreamStats(host_tier_bytes=bytes_streamed, blocks_streamed=10, stall_seconds=0.01, prepare_seconds=0.4)
    plan = plan_memory(PlanInputs(num_layers=4, block_bytes=100, global_bytes=10, kv_bytes_per_token=1,
                                  workspace_bytes=1, budget=None, max_model_len=8, max_num_seqs=1))
    return EngineTelemetry(plan=PlanSummary.of(plan, links), links=links, transport_name="CudaTransport",
                           dtype="float32", steps=1, last_step=StepTelemetry.of(seconds, stream, links), total=stream,
                           kv=KVUsage(1, 1, 8, 4, 64), pinned_host_bytes=0, buffer_sets=0, blocks_converted=0,
                           structured_output=MaskStats(masks=3, compute_seconds=0.25, wait_seconds=0.5))


def samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[s.name] = s.value
    return out


def test_achieved_rate_and_percent_of_floor():
    m = ServerMetrics("x")
    m.on_step(snapshot(link_gbps=1.6))
    got = samples(m)
    assert got["layerstream_streaming_gbps"] == 0.8  # 0.4 GB in 0.5 s
    assert got["layerstream_streaming_floor_percent"] == 50.0  # 0.8 of a 1.6 GB/s link
    assert got["layerstream_streamed_bytes_last_step"] == 400_000_000


def test_no_floor_without_a_measured_link():
    m = ServerMetrics("x")
    m.on_step(snapshot(link_gbps=None))
    got = samples(m)
    assert got["layerstream_streaming_gbps"] == 0.8  # the step was recorded: only the floor is absent
    assert "layerstream_streaming_floor_percent" not in got


def test_structured_output_mask_seconds():
    m = ServerMetrics("x")
    m.on_step(snapshot(link_gbps=None))
    text = m.render().decode()
    assert 'layerstream_structured_output_mask_seconds{kind="compute",model_name="x"} 0.25' in text
    assert 'layerstream_structured_output_mask_seconds{kind="wait",model_name="x"} 0.5' in text


def test_vllm_metric_names():
    m = ServerMetrics("x")
    queue = SimpleNamespace(num_running=lambda: 3, num_waiting=lambda: 2, kv_cache_usage=lambda: 0.75)
    m.on_queue(queue)
    m.on_finished("stop", 7)
    got = samples(m)
    assert got["vllm:num_requests_running"] == 3 and got["vllm:num_requests_waiting"] == 2
    assert got["vllm:kv_cache_usage_perc"] == 0.75 == got["vllm:gpu_cache_usage_perc"]
    assert got["vllm:prompt_tokens_total"] == 7 and got["vllm:request_success_total"] == 1
