"""The proxy's Prometheus metrics (prefix ``turnscope_``; docs/design.md). No session ids in labels.

Histogram bounds are chosen for LLM serving latencies, with common TTFT SLO edges (100 ms,
200 ms, 500 ms, 1 s, 2 s) among them; the overhead histogram resolves the sub-millisecond range.
Handle bytes are estimated from tokens x KV bytes per token, where KV bytes per token = layers x
KV heads x head dim x 2 (K and V) x dtype bytes (the page-size formula of vLLM's
``AttentionSpec``; docs/design.md).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                     10.0, 20.0, 30.0, 60.0, 120.0)
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
HANDLE_AGE_BUCKETS_S = (1, 5, 10, 30, 60, 120, 240, 300, 360, 420, 450, 480, 600)


class ProxyMetrics:
    """All ``turnscope_*`` metrics of one proxy, in their own registry.

    ``live_handles`` is a callable returning the table's live handles (objects with
    ``num_tokens``); ``kv_bytes_per_token`` may be None when the model's shape is unknown, then
    ``turnscope_handle_bytes_live`` reads 0 and says so in its help text.
    """

    def __init__(self, live_handles, kv_bytes_per_token: int | None, handle_ttl_s: float | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("turnscope_requests", "Requests by serving mode and reuse outcome.",
                                ["mode", "outcome"], registry=r)
        self.reused_tokens = Counter(
            "turnscope_reused_tokens",
            "Prompt tokens by where their KV came from: pulled from the decode worker (remote_decode), "
            "the prefill worker's prefix cache (local_prefix), or computed (recomputed).",
            ["mode", "source"], registry=r)
        self.rejected = Counter("turnscope_rejected_requests",
                                "Requests answered 400 by the proxy itself, neither worker called, by the body "
                                "field at fault (n: n > 1 in a P/D mode).", ["param"], registry=r)
        self.unauthorized = Counter(
            "turnscope_proxy_unauthorized_requests",
            "Requests the proxy refused with HTTP 401: its api_key is set and the request carried no "
            "Bearer token, or another one. Neither worker called.", registry=r)
        self.client_disconnects = Counter(
            "turnscope_proxy_client_disconnects",
            "Requests whose client went away before they ended, by the phase they were in (prefill, "
            "before_first_token, streaming); the legs in flight are closed. Not errors.", ["phase"], registry=r)
        self.prefill_failures = Counter(
            "turnscope_prefill_failures",
            "Prefill legs that failed, so the request was answered with the failure and D never called, by "
            "reason (http_<status> of P, or the transport error's name).", ["reason"], registry=r)
        self.prefill_attempts = Counter("turnscope_prefill_retries",
                                        "Prefill legs retried as a plain recompute after a failed pull.",
                                        registry=r)
        self.handle_age_at_use = Histogram("turnscope_handle_age_at_use_seconds",
                                           "Age of a handle when a turn took it from the table (used, "
                                           "expired or mismatched alike).",
                                           buckets=HANDLE_AGE_BUCKETS_S, registry=r)
        self.decode_restarts = Counter("turnscope_decode_restarts",
                                       "Decode workers seen in a new lifetime (a new process start or "
                                       "engine id); their older handles were dropped.", ["decode"], registry=r)
        self.handles_dropped_restart = Counter("turnscope_handles_dropped_restart",
                                               "Handles dropped because their decode worker restarted.",
                                               registry=r)
        self.canaries = Counter(
            "turnscope_canaries",
            "Known-answer canaries run (POST /canary, serving.canary) by result: match, mismatch (the serving "
            "path answered 200 with other tokens than the reference worker), error (a request failed).",
            ["result"], registry=r)
        self.canary_mismatches = Counter(
            "turnscope_canary_mismatches",
            "Known-answer canaries whose serving path answered other tokens than the reference worker, "
            "greedily, for the same prompt.", registry=r)
        self.prefill_leg = Histogram("turnscope_prefill_leg_seconds", "Wall time of the prefill leg.",
                                     buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("turnscope_ttft_seconds",
                              "Time from request arrival at the proxy to the first token sent on.",
                              ["mode", "outcome"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.overhead = Histogram("turnscope_proxy_overhead_seconds",
                                  "Time the proxy itself adds before the stream starts (excludes waiting "
                                  "on workers).", buckets=OVERHEAD_BUCKETS_S, registry=r)
        self.handle_ttl = Gauge("turnscope_handle_ttl_seconds",
                                "How long the proxy offers a handle: decoder_kv_blocks_ttl minus the margin.",
                                registry=r)
        self.handle_ttl.set(handle_ttl_s or 0)
        self.handles_live = Gauge("turnscope_handles_live", "Handles held (not consumed, not expired).",
                                  registry=r)
        self.handles_live.set_function(lambda: len(live_handles()))
        self.handle_tokens_live = Gauge("turnscope_handle_tokens_live",
                                        "Tokens of KV pinned on decode workers by live handles.", registry=r)
        self.handle_tokens_live.set_function(lambda: sum(h.num_tokens for h in live_handles()))
        self.handle_bytes_live = Gauge(
            "turnscope_handle_bytes_live",
            "Estimated bytes of KV pinned by live handles: tokens x layers x KV heads x head dim x 2 x "
            "dtype bytes" + ("" if kv_bytes_per_token else " (model shape unknown: reads 0)"), registry=r)
        self.handle_bytes_live.set_function(
            lambda: sum(h.num_tokens for h in live_handles()) * (kv_bytes_per_token or 0))
