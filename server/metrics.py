"""Prometheus metrics: the usual serving figures plus the streaming telemetry only a
layer-streaming server has (blocks resident / streamed, bytes and GB/s per step, stall time).

`ServerMetrics` is the engine loop's observer: the engine thread calls it after each step and for
each token; prometheus-client's metrics are thread-safe. Each server gets its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the /metrics route

from engine.telemetry import EngineTelemetry, PlanSummary

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
        self.tier_bytes = Counter("layerstream_streamed_tier_bytes", "bytes streamed in all steps by the tier "
                                  "the blocks came from (host memory, or read from disk each step)",
                                  labels + ["tier"], registry=r)
        # Mixtures of experts with expert-granular streaming (zero otherwise).
        self.expert_lookups = Counter("layerstream_expert_lookups", "chosen experts looked up in the expert cache: "
                                      "result=hit (cached or already being prefetched) or miss (fetched on demand)",
                                      labels + ["result"], registry=r)
        self.expert_bytes = Counter("layerstream_expert_bytes", "bytes fetched into the expert cache (demand and "
                                    "prefetch; also counted in layerstream_streamed_bytes)", labels, registry=r)
        self.expert_guesses = Counter("layerstream_expert_guesses", "experts chosen by blocks whose experts were "
                                      "guessed ahead: result=right (the guess named it) or wrong",
                                      labels + ["result"], registry=r)
        self.masks = Gauge("layerstream_structured_output_mask_seconds", "seconds spent on structured-output "
                           "token masks since start: kind=compute (grammar pool threads, overlapped with the "
                           "forward pass) or wait (the engine thread waiting for a mask, only when no other "
                           "sequence could run)", labels + ["kind"], registry=r)
        self.parses = Gauge("layerstream_structured_output_parse_seconds", "CPU seconds spent parsing sampled "
                            "tokens against their grammar since start: gil=held (cheap parses on the engine "
                            "thread; every thread waits meanwhile) or released (dearer ones on the grammar pool)",
                            labels + ["gil"], registry=r)
        self.mask_skips = Gauge("layerstream_structured_output_skipped_steps", "steps a grammar-constrained "
                                "sequence sat out since start because its mask was not ready (the others went on)",
                                labels, registry=r)
        self.too_costly = Gauge("layerstream_structured_output_too_costly", "requests since start refused (400) or "
                                "ended because their grammar cost more than --max-grammar-ms or hit a grammar "
                                "engine limit", labels, registry=r)
        self.grammar_cache = Gauge("layerstream_structured_output_cache_bytes", "compiled grammars held in host "
                                   "memory (an estimate; capped by --grammar-cache-memory)", labels, registry=r)
        self.grammar_entries = Gauge("layerstream_structured_output_cache_entries", "compiled grammars cached",
                                     labels, registry=r)
        self.grammar_probe = Gauge("layerstream_structured_output_probe_bytes", "resident memory of the grammar "
                                   "probe, the process that compiles each new grammar first under the budgets",
                                   labels, registry=r)
        self.vllm = _VLLMNames(r, labels)
        # Paged KV cache: pool use, prefix-cache hits (in tokens, as vLLM counts them), host tier.
        self.kv_usage = Gauge("layerstream_kv_cache_usage_perc", "fraction of KV pool blocks held by running "
                              "requests (1 = full; cached free blocks count as free)", labels, registry=r)
        self.kv_blocks = Gauge("layerstream_kv_cache_blocks", "KV blocks by state (total, used = held by "
                               "running requests, cached = holding a prefix-cache entry)", labels + ["state"],
                               registry=r)
        self.prefix_queries = Counter("layerstream_prefix_cache_queries", "prompt tokens looked up in the "
                                      "prefix cache", labels, registry=r)
        self.prefix_hits = Counter("layerstream_prefix_cache_hits", "prompt tokens whose KV came from the "
                                   "prefix cache instead of being computed", labels, registry=r)
        self.kv_host_blocks = Gauge("layerstream_kv_host_blocks", "KV host tier blocks (total, used)",
                                    labels + ["state"], registry=r)
        self.kv_swapped_blocks = Counter("layerstream_kv_swapped_blocks", "KV blocks copied between the device "
                                         "pool and the host tier (direction out = to host, in = to device)",
                                         labels + ["direction"], registry=r)
        self.kv_disk_hits = Counter("layerstream_kv_disk_hit_tokens", "prompt tokens whose KV was read from the KV "
                                    "disk tier (--kv-disk-bytes; also counted in layerstream_prefix_cache_hits)",
                                    labels, registry=r)
        self.kv_disk_written = Counter("layerstream_kv_disk_blocks_written", "KV blocks written through to the KV "
                                       "disk tier", labels, registry=r)
        self.kv_swapped_bytes = Counter("layerstream_kv_swapped_bytes", "bytes copied between the device "
                                        "pool and the host tier", labels + ["direction"], registry=r)
        self.preemptions = Counter("layerstream_num_preemptions", "running requests preempted because the KV "
                                   "pool was full (recomputed on readmission, minus prefix-cache hits)",
                                   labels, registry=r)
        self._kv_seen = None  # the last KVTelemetry, to turn its totals into counter increments
        self.spec = _SpecMetrics(r, labels)
        # Tensor groups off the device (--cpu-offload-policy): totals since start by path (cpu: computed where the
        # weights lie, activations cross the link; stream: the weights cross it); absent when none is off.
        g = lambda name, doc: Gauge(name, doc, labels + ["path"], registry=r)  # noqa: E731
        self.offload_steps = g("layerstream_offload_steps", "steps that computed at least one off-device "
                               "tensor group on this path since start")
        self.offload_tokens = g("layerstream_offload_tokens", "tokens of those steps")
        self.offload_groups = g("layerstream_offload_groups", "off-device tensor groups computed on this path")
        self.offload_bytes = g("layerstream_offload_link_bytes", "bytes across the host-device link for them: "
                               "activations both ways (cpu) or weights (stream)")
        self.ready = Gauge("layerstream_engine_ready", "1 while the engine serves; 0 while loading, after a "
                           "failed load, or after a step failure left it unhealthy (see "
                           "layerstream_engine_not_ready)", labels, registry=r)
        self.not_ready = Gauge("layerstream_engine_not_ready", "1 for the reason the engine stopped serving",
                               labels + ["reason"], registry=r)

    def set_plan(self, plan: PlanSummary) -> None:
        m = self._model
        self.blocks_resident.labels(m).set(plan.blocks_resident)
        self.blocks_streamed.labels(m).set(plan.blocks_streamed)
        self.plan_bytes_per_step.labels(m).set(plan.planned_bytes_per_step)

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

    def on_step(self, telemetry: EngineTelemetry) -> None:
        m = self._model
        step = telemetry.last_step
        if step is None:
            return
        self.steps.labels(m).inc()
        self.step_seconds.labels(m).observe(step.seconds)
        s = step.stream
        self.step_bytes.labels(m).set(s.bytes_streamed)
        self.bytes_total.labels(m).inc(s.bytes_streamed)
        self.stall.labels(m).observe(max(0.0, s.stall_seconds))
        self.tier_bytes.labels(m, "host").inc(s.host_tier_bytes)
        self.tier_bytes.labels(m, "disk").inc(s.disk_tier_bytes)
        self.expert_lookups.labels(m, "hit").inc(s.expert_hits)
        self.expert_lookups.labels(m, "miss").inc(s.expert_misses)
        self.expert_bytes.labels(m).inc(s.expert_bytes)
        self.expert_guesses.labels(m, "right").inc(s.experts_guessed_right)
        self.expert_guesses.labels(m, "wrong").inc(s.experts_needed_guessed - s.experts_guessed_right)
        self.gbps.labels(m).set(step.gbps)
        if step.floor_percent is not None:
            self.floor_pct.labels(m).set(step.floor_percent)
        masks = telemetry.structured_output
        self.masks.labels(m, "compute").set(masks.compute_seconds)
        self.masks.labels(m, "wait").set(masks.wait_seconds)
        self.parses.labels(m, "held").set(masks.gil_parse_seconds)
        self.parses.labels(m, "released").set(masks.pool_parse_seconds)
        self.mask_skips.labels(m).set(masks.skips)
        self.too_costly.labels(m).set(masks.over_budget)
        self.grammar_cache.labels(m).set(masks.cache_bytes)
        self.grammar_entries.labels(m).set(masks.cache_entries)
        self.grammar_probe.labels(m).set(masks.probe_bytes)
        self.observe_kv(telemetry.kv)
        if telemetry.speculative is not None:
            self.spec.update(m, telemetry.speculative)
        if telemetry.offload is not None:
            o = telemetry.offload
            for path in ("cpu", "stream"):
                self.offload_steps.labels(m, path).set(getattr(o, f"steps_{path}"))
                self.offload_tokens.labels(m, path).set(getattr(o, f"tokens_{path}"))
                self.offload_groups.labels(m, path).set(getattr(o, f"groups_{path}"))
                self.offload_bytes.labels(m, path).set(getattr(o, f"bytes_{path}"))

    def observe_kv(self, t) -> None:
        """Publish the paged KV cache's snapshot (EngineTelemetry.kv)."""
        m, prev = self._model, self._kv_seen
        self.kv_usage.labels(m).set(t.usage)
        self.kv_blocks.labels(m, "total").set(t.blocks_total)
        self.kv_blocks.labels(m, "used").set(t.blocks_used)
        self.kv_blocks.labels(m, "cached").set(t.blocks_cached)
        self.kv_host_blocks.labels(m, "total").set(t.host_blocks_total)
        self.kv_host_blocks.labels(m, "used").set(t.host_blocks_used)

        def delta(name: str) -> int:
            return getattr(t, name) - (getattr(prev, name) if prev is not None else 0)

        self.prefix_queries.labels(m).inc(delta("queried_tokens"))
        self.prefix_hits.labels(m).inc(delta("hit_tokens"))
        self.kv_swapped_blocks.labels(m, "out").inc(delta("blocks_swapped_out"))
        self.kv_swapped_blocks.labels(m, "in").inc(delta("blocks_swapped_in"))
        self.kv_swapped_bytes.labels(m, "out").inc(delta("bytes_swapped_out"))
        self.kv_swapped_bytes.labels(m, "in").inc(delta("bytes_swapped_in"))
        self.kv_disk_hits.labels(m).inc(delta("disk_hit_tokens"))
        self.kv_disk_written.labels(m).inc(delta("blocks_spilled"))
        self.preemptions.labels(m).inc(delta("preemptions"))
        self.vllm.prefix_queries.labels(m).inc(delta("queried_tokens"))
        self.vllm.prefix_hits.labels(m).inc(delta("hit_tokens"))
        self.vllm.preemptions.labels(m).inc(delta("preemptions"))
        self._kv_seen = t

    def on_token(self, first: bool, seconds: float, count: int = 1) -> None:
        """One output of `count` tokens (several when speculative drafts were accepted): the time
        since the previous output is shared by its tokens."""
        m = self._model
        if first:
            self.ttft.labels(m).observe(seconds)
            self.vllm.ttft.labels(m).observe(seconds)
        for _ in range(count - 1 if first else count):
            self.tpot.labels(m).observe(0.0 if first else seconds / count)
            self.vllm.tpot.labels(m).observe(0.0 if first else seconds / count)
        self.generation_tokens.labels(m).inc(count)
        self.vllm.generation_tokens.labels(m).inc(count)

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
    the paged pool's blocks held by running sequences; vLLM's v1 name and its older gpu_ one are
    both exported. Prefix-cache queries and hits count tokens, as vLLM's do."""

    def __init__(self, r: CollectorRegistry, labels: list[str]):
        self.running = Gauge("vllm:num_requests_running", "requests running (in a KV slot)", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting for a slot", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", labels, registry=r)
        self.gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = full (older vLLM name)",
                                     labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "requests preempted (KV pool full)", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated", labels, registry=r)
        self.success = Counter("vllm:request_success", "finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "time between tokens", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)


class _SpecMetrics:
    """Speculative decoding: totals since start (set from the engine's cumulative counters each
    step), under layerstream names and vLLM's spec_decode names."""

    def __init__(self, r: CollectorRegistry, labels: list[str]):
        g = lambda name, doc, extra=(): Gauge(name, doc, labels + list(extra), registry=r)  # noqa: E731
        self.passes = g("layerstream_spec_decode_verify_passes", "sequences verified (one per sequence per step "
                        "that drafted for it)")
        self.drafted = g("layerstream_spec_decode_draft_tokens", "tokens drafted")
        self.accepted = g("layerstream_spec_decode_accepted_tokens", "drafted tokens accepted")
        self.rate = g("layerstream_spec_decode_acceptance_rate", "accepted / drafted tokens")
        self.mean = g("layerstream_spec_decode_mean_accepted_tokens", "drafted tokens accepted per verify pass")
        self.mean_drafted = g("layerstream_spec_decode_mean_draft_tokens", "tokens drafted per verify pass (the "
                              "mean k: adaptive per sequence unless --no-speculative-adaptive-k)")
        self.seconds = g("layerstream_spec_decode_seconds", "wall time spent drafting (phase=draft) and in "
                         "the target passes that verified drafts (phase=verify)", ["phase"])
        self.vllm_drafts = g("vllm:spec_decode_num_drafts", "drafts verified")
        self.vllm_draft_tokens = g("vllm:spec_decode_num_draft_tokens", "tokens drafted")
        self.vllm_accepted = g("vllm:spec_decode_num_accepted_tokens", "drafted tokens accepted")
        self.vllm_per_pos = g("vllm:spec_decode_num_accepted_tokens_per_pos", "drafted tokens accepted at each "
                              "draft position", ["position"])

    def update(self, m: str, s) -> None:
        self.passes.labels(m).set(s.verify_passes)
        self.drafted.labels(m).set(s.draft_tokens)
        self.accepted.labels(m).set(s.accepted_tokens)
        self.rate.labels(m).set(s.acceptance_rate)
        self.mean.labels(m).set(s.mean_accepted)
        self.mean_drafted.labels(m).set(s.mean_drafted)
        self.seconds.labels(m, "draft").set(s.draft_seconds)
        self.seconds.labels(m, "verify").set(s.verify_seconds)
        self.vllm_drafts.labels(m).set(s.verify_passes)
        self.vllm_draft_tokens.labels(m).set(s.draft_tokens)
        self.vllm_accepted.labels(m).set(s.accepted_tokens)
        for pos, n in enumerate(s.accepted_per_position):
            self.vllm_per_pos.labels(m, str(pos)).set(n)
