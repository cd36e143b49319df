"""Prometheus metrics: the usual serving figures plus the streaming telemetry only a
layer-streaming server has (blocks resident / streamed, bytes and GB/s per step, stall time).

`ServerMetrics` is the engine loop's observer: the engine thread calls it after each step and for
each token; prometheus-client's metrics are thread-safe. Each server gets its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the /metrics route

from engine.bandwidth import efficiency, stream_link_gbps

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter("layerstream_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.finished = Counter("layerstream_request_finished", "engine requests by finish reason "
                                "(stop, length, abort = cancelled, e.g. client disconnected, "
                                "error = failed by an engine step error)",
                                labels + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("layerstream_prompt_tokens", "prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("layerstream_generation_tokens", "tokens generated", labels, registry=r)
        self.ttft = Histogram("layerstream_time_to_first_token_seconds", "time from arrival to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("layerstream_time_per_output_token_seconds", "time between tokens of a request",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("layerstream_num_requests_running", "requests decoding (in a KV slot)", labels,
                             registry=r)
        self.waiting = Gauge("layerstream_num_requests_waiting", "requests queued for a slot", labels, registry=r)
        self.blocks_resident = Gauge("layerstream_blocks_resident", "transformer blocks kept on the device",
                                     labels, registry=r)
        self.blocks_streamed = Gauge("layerstream_blocks_streamed", "transformer blocks streamed every step",
                                     labels, registry=r)
        self.plan_bytes_per_step = Gauge("layerstream_planned_streamed_bytes_per_step",
                                         "bytes the plan streams per step (streamed blocks x block size)",
                                         labels, registry=r)
        self.step_bytes = Gauge("layerstream_streamed_bytes_last_step", "bytes streamed in the last step",
                                labels, registry=r)
        self.bytes_total = Counter("layerstream_streamed_bytes", "bytes streamed in all steps", labels,
                                   registry=r)
        self.gbps = Gauge("layerstream_streaming_gbps", "achieved streaming rate of the last step "
                          "(bytes streamed / step seconds, 1e9 bytes/s)", labels, registry=r)
        self.floor_pct = Gauge("layerstream_streaming_floor_percent", "last step's streaming rate as % of "
                               "the measured link (host->device or disk): 100 = as fast as the bytes allow; "
                               "absent when no link was measured (CPU page-cache streaming)", labels, registry=r)
        self.stall = Histogram("layerstream_stall_seconds_per_step", "time compute waited for a block, per step",
                               labels, buckets=(0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0), registry=r)
        self.step_seconds = Histogram("layerstream_step_seconds", "wall time of one engine step", labels,
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.steps = Counter("layerstream_steps", "engine steps", labels, registry=r)
        self.masks = Gauge("layerstream_structured_output_mask_seconds", "seconds spent on structured-output "
                           "token masks since start: kind=compute (worker thread, overlapped with the forward "
                           "pass) or wait (the engine thread waiting for a mask before sampling)",
                           labels + ["kind"], registry=r)
        self.vllm = _VLLMNames(r, labels)
        self.ready = Gauge("layerstream_engine_ready", "1 while the engine serves; 0 while loading, after a "
                           "failed load, or after a step failure left it unhealthy (see "
                           "layerstream_engine_not_ready)", labels, registry=r)
        self.not_ready = Gauge("layerstream_engine_not_ready", "1 for the reason the engine stopped serving",
                               labels + ["reason"], registry=r)

    def set_plan(self, plan) -> None:
        m = self._model
        self.blocks_resident.labels(m).set(len(plan.resident_blocks))
        self.blocks_streamed.labels(m).set(len(plan.streamed_blocks))
        self.plan_bytes_per_step.labels(m).set(plan.streamed_bytes_per_step)

    # -- EngineObserver ---------------------------------------------------------------------------
    def on_queue(self, engine) -> None:
        m = self._model
        self.running.labels(m).set(engine.num_running())
        self.waiting.labels(m).set(engine.num_waiting())
        self.vllm.running.labels(m).set(engine.num_running())
        self.vllm.waiting.labels(m).set(engine.num_waiting())
        usage = engine.kv_cache_usage()
        self.vllm.kv_usage.labels(m).set(usage)
        self.vllm.gpu_cache_usage.labels(m).set(usage)

    def on_step(self, engine) -> None:
        m = self._model
        timing = engine.model.runner.last_step
        if timing is None:
            return
        self.steps.labels(m).inc()
        self.step_seconds.labels(m).observe(timing.seconds)
        s = timing.stream
        self.step_bytes.labels(m).set(s.bytes_streamed)
        self.bytes_total.labels(m).inc(s.bytes_streamed)
        self.stall.labels(m).observe(max(0.0, s.stall_seconds))
        runner = engine.model.runner
        gbps, floor = efficiency(s.bytes_streamed, timing.seconds,
                                 stream_link_gbps(runner.streamer.transport, engine.plan))
        self.gbps.labels(m).set(gbps)
        if floor is not None:
            self.floor_pct.labels(m).set(floor)
        stats = engine.grammar.stats
        self.masks.labels(m, "compute").set(stats.compute_seconds)
        self.masks.labels(m, "wait").set(stats.wait_seconds)

    def on_token(self, first: bool, seconds: float) -> None:
        (self.ttft if first else self.tpot).labels(self._model).observe(seconds)
        (self.vllm.ttft if first else self.vllm.tpot).labels(self._model).observe(seconds)
        self.generation_tokens.labels(self._model).inc()
        self.vllm.generation_tokens.labels(self._model).inc()

    def on_finished(self, reason: str, prompt_tokens: int) -> None:
        self.finished.labels(self._model, reason).inc()
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.vllm.success.labels(self._model, reason).inc()
        self.vllm.prompt_tokens.labels(self._model).inc(prompt_tokens)

    def on_health(self, ready: bool, reason: str) -> None:
        self.ready.labels(self._model).set(1 if ready else 0)
        if not ready:
            self.not_ready.labels(self._model, reason).set(1)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VLLMNames:
    """The same figures under vLLM's metric names, so routers and autoscalers written for vLLM
    (llm-d, KServe, KEDA rules) read this server unchanged. The KV-cache usage is the fraction of
    KV slots held by running sequences (each holds a whole max_model_len slot); vLLM's v1 name and
    its older gpu_ one are both exported."""

    def __init__(self, r: CollectorRegistry, labels: list[str]):
        self.running = Gauge("vllm:num_requests_running", "requests running (in a KV slot)", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting for a slot", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", labels, registry=r)
        self.gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (older vLLM name)",
                                     labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated", labels, registry=r)
        self.success = Counter("vllm:request_success", "finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "time between tokens", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
