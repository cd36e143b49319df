"""Streaming telemetry from one engine step into Prometheus gauges."""

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.placement import PathStats
from engine.planner import PlanInputs, plan_memory
from engine.structured_output import MaskStats
from engine.telemetry import EngineTelemetry, KVTelemetry, PlanSummary, StepTelemetry
from engine.weights import LinkSpeeds, StreamStats
from server.metrics import ServerMetrics


def kv_snapshot(**kw) -> KVTelemetry:
    base = dict(block_size=16, blocks_total=100, blocks_used=25, blocks_cached=40, host_blocks_total=50,
                host_blocks_used=10, prefix_caching=True, queried_tokens=1000, hit_tokens=640, host_hit_tokens=32,
                blocks_swapped_out=12, blocks_swapped_in=2, bytes_swapped_out=12 * 4096, bytes_swapped_in=2 * 4096,
                preemptions=3)
    return KVTelemetry(**(base | kw))


def snapshot(link_gbps, bytes_streamed=400_000_000, seconds=0.5, kv: KVTelemetry | None = None) -> EngineTelemetry:
    """The telemetry an engine would report after one step that streamed `bytes_streamed` in `seconds`."""
    links = LinkSpeeds(h2d_gbps=link_gbps)
    stream = StreamStats(host_tier_bytes=bytes_streamed, blocks_streamed=10, stall_seconds=0.01, prepare_seconds=0.4)
    plan = plan_memory(PlanInputs(num_layers=4, block_bytes=100, global_bytes=10, kv_bytes_per_token=1,
                                  workspace_bytes=1, budget=None, max_model_len=8, max_num_seqs=1))
    return EngineTelemetry(plan=PlanSummary.of(plan, links), links=links, transport_name="CudaTransport",
                           dtype="float32", steps=1, last_step=StepTelemetry.of(seconds, stream, links), total=stream,
                           kv=kv or kv_snapshot(), pinned_host_bytes=0, buffer_sets=0, blocks_converted=0,
                           structured_output=MaskStats(masks=3, compute_seconds=0.25, wait_seconds=0.5, skips=7,
                                                       over_budget=2, cache_bytes=5 << 20, cache_entries=4,
                                                       gil_parse_seconds=0.125, pool_parse_seconds=2.5,
                                                       probe_bytes=60 << 20))


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
    assert 'layerstream_structured_output_parse_seconds{gil="held",model_name="x"} 0.125' in text
    assert 'layerstream_structured_output_parse_seconds{gil="released",model_name="x"} 2.5' in text
    got = samples(m)
    assert got["layerstream_structured_output_skipped_steps"] == 7
    assert got["layerstream_structured_output_too_costly"] == 2
    assert got["layerstream_structured_output_cache_bytes"] == 5 << 20
    assert got["layerstream_structured_output_cache_entries"] == 4
    assert got["layerstream_structured_output_probe_bytes"] == 60 << 20


def test_vllm_metric_names():
    m = ServerMetrics("x")
    queue = SimpleNamespace(num_running=lambda: 3, num_waiting=lambda: 2, kv_cache_usage=lambda: 0.75)
    m.on_queue(queue)
    m.on_finished("stop", 7)
    got = samples(m)
    assert got["vllm:num_requests_running"] == 3 and got["vllm:num_requests_waiting"] == 2
    assert got["vllm:kv_cache_usage_perc"] == 0.75 == got["vllm:gpu_cache_usage_perc"]
    assert got["vllm:prompt_tokens_total"] == 7 and got["vllm:request_success_total"] == 1


def test_kv_pool_prefix_hits_host_tier_and_preemptions():
    m = ServerMetrics("x")
    m.on_step(snapshot(link_gbps=None))
    m.on_step(snapshot(link_gbps=None, kv=kv_snapshot(blocks_used=50, queried_tokens=1500, hit_tokens=800,
                                                          blocks_swapped_in=5, bytes_swapped_in=5 * 4096,
                                                          preemptions=4, disk_hit_tokens=320, blocks_spilled=7)))
    got = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for smp in fam.samples:
            got[(smp.name, tuple(sorted((k, v) for k, v in smp.labels.items() if k != "model_name")))] = smp.value
    assert got[("layerstream_kv_cache_usage_perc", ())] == 0.5
    assert got[("layerstream_kv_cache_blocks", (("state", "total"),))] == 100
    assert got[("layerstream_kv_cache_blocks", (("state", "cached"),))] == 40
    # Counters carry the engine's totals, not the sum of the snapshots.
    assert got[("layerstream_prefix_cache_queries_total", ())] == 1500
    assert got[("layerstream_prefix_cache_hits_total", ())] == 800
    assert got[("layerstream_kv_swapped_blocks_total", (("direction", "in"),))] == 5
    assert got[("layerstream_kv_swapped_bytes_total", (("direction", "out"),))] == 12 * 4096
    assert got[("layerstream_kv_host_blocks", (("state", "used"),))] == 10
    assert got[("layerstream_num_preemptions_total", ())] == 4
    assert got[("layerstream_kv_disk_hit_tokens_total", ())] == 320
    assert got[("layerstream_kv_disk_blocks_written_total", ())] == 7
    # and under vLLM's names
    assert got[("vllm:prefix_cache_queries_total", ())] == 1500 and got[("vllm:prefix_cache_hits_total", ())] == 800
    assert got[("vllm:num_preemptions_total", ())] == 4


def test_expert_cache_counters():
    m = ServerMetrics("x")
    t = snapshot(link_gbps=None)
    stream = StreamStats(host_tier_bytes=5000, expert_bytes=3000, expert_hits=7, expert_misses=3,
                         experts_guessed=6, experts_guessed_right=4, experts_needed_guessed=9)
    links = LinkSpeeds()
    m.on_step(EngineTelemetry(**{**t.__dict__, "last_step": StepTelemetry.of(0.5, stream, links)}))
    text = m.render().decode()
    assert 'layerstream_expert_lookups_total{model_name="x",result="hit"} 7.0' in text
    assert 'layerstream_expert_lookups_total{model_name="x",result="miss"} 3.0' in text
    assert 'layerstream_expert_bytes_total{model_name="x"} 3000.0' in text
    assert 'layerstream_expert_guesses_total{model_name="x",result="right"} 4.0' in text
    assert 'layerstream_expert_guesses_total{model_name="x",result="wrong"} 5.0' in text


def test_offload_counters_by_path():
    """Tensor groups off the device (issue #38): totals by path; absent while none is off the device."""
    m = ServerMetrics("x")
    t = snapshot(link_gbps=None)
    m.on_step(t)
    assert "layerstream_offload_steps{" not in m.render().decode()
    stats = PathStats().plus_step(1, {"cpu": 3}, {"cpu": 1536}).plus_step(40, {"stream": 3}, {"stream": 294912})
    m.on_step(EngineTelemetry(**{**t.__dict__, "offload": stats}))
    text = m.render().decode()
    for line in ('layerstream_offload_steps{model_name="x",path="cpu"} 1.0',
                 'layerstream_offload_steps{model_name="x",path="stream"} 1.0',
                 'layerstream_offload_tokens{model_name="x",path="stream"} 40.0',
                 'layerstream_offload_groups{model_name="x",path="cpu"} 3.0',
                 'layerstream_offload_link_bytes{model_name="x",path="cpu"} 1536.0',
                 'layerstream_offload_link_bytes{model_name="x",path="stream"} 294912.0'):
        assert line in text, line
