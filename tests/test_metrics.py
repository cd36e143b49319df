"""Streaming telemetry from one engine step into Prometheus gauges."""

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.runner import StepTiming
from engine.weights.streamer import StreamStats
from engine.structured_output import MaskStats
from server.metrics import ServerMetrics


def fake_engine(link_gbps, bytes_streamed=400_000_000, seconds=0.5):
    timing = StepTiming(seconds=seconds, tokens=4, stream=StreamStats(bytes_streamed, 10, 0.01, 0.4))
    transport = SimpleNamespace(h2d_gbps=link_gbps)
    runner = SimpleNamespace(last_step=timing, streamer=SimpleNamespace(transport=transport))
    plan = SimpleNamespace(disk_gbps=None)
    return SimpleNamespace(model=SimpleNamespace(runner=runner), plan=plan,
                           grammar=SimpleNamespace(stats=MaskStats(masks=3, compute_seconds=0.25, wait_seconds=0.5)))


def samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[s.name] = s.value
    return out


def test_achieved_rate_and_percent_of_floor():
    m = ServerMetrics("x")
    m.on_step(fake_engine(link_gbps=1.6))
    got = samples(m)
    assert got["layerstream_streaming_gbps"] == 0.8  # 0.4 GB in 0.5 s
    assert got["layerstream_streaming_floor_percent"] == 50.0  # 0.8 of a 1.6 GB/s link
    assert got["layerstream_streamed_bytes_last_step"] == 400_000_000


def test_no_floor_without_a_measured_link():
    m = ServerMetrics("x")
    m.on_step(fake_engine(link_gbps=None))
    got = samples(m)
    assert got["layerstream_streaming_gbps"] == 0.8  # the step was recorded: only the floor is absent
    assert "layerstream_streaming_floor_percent" not in got


def test_structured_output_mask_seconds():
    m = ServerMetrics("x")
    m.on_step(fake_engine(link_gbps=None))
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
