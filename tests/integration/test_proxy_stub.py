"""Proxy routing logic against stub P/D workers (tests/integration/pd_stub.py)."""

import json
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.proxy import PREFILL_PARAMS, ProxyConfig, Worker
from tests.integration.pd_stub import decode_app, prefill_app
from tests.integration.vllm_stack import AppThread, ProxyThread


def config(p, d, **kw):
    return ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p.url)],
                       decode=[Worker(name="decode-0", url=d.url)], kv_bytes_per_token=4096,
                       block_size=4, kv_recompute_threshold=2, **kw)


def stream(url, prompt, session=None, extra=None, headers=None):
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True} | (extra or {})
    if session:
        body["conversation_id"] = session
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30, headers=headers) as r:
        text = r.read().decode()
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    facts = None  # merged over the chunks in order, as loadgen.stream_client does
    for e in events:
        if "turnscope" in e:
            facts = {**(facts or {}), **e["turnscope"]}
    return r, events, facts, text


@pytest.fixture()
def stubs():
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d:
        yield p, d


def test_handle_flows_from_decode_to_next_prefill_and_never_to_the_client(stubs):
    p, d = stubs
    with ProxyThread(config(p, d)) as proxy:
        r1, _, facts1, text1 = stream(proxy.url, list(range(10)), "s1")
        assert r1.headers["x-turnscope-reuse"] == "miss_first_turn"
        # the handle D kept for turn 1: 10 prompt + 4 generated - 1 tokens (the stub's remote_num_tokens)
        assert facts1["handle_tokens"] == 13
        assert "kv_transfer_params" not in text1  # the handle stays in the proxy
        assert p.app.state.bodies[0]["kv_transfer_params"] == PREFILL_PARAMS
        assert p.app.state.bodies[0]["max_tokens"] == 1 and p.app.state.bodies[0]["stream"] is False
        assert d.app.state.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "P"
        prompt2 = list(range(10)) + [100, 101, 102, 103] + [50, 51]
        r2, _, facts2, _ = stream(proxy.url, prompt2, "s1")
    assert r2.headers["x-turnscope-reuse"] == "hit"
    sent = p.app.state.bodies[1]["kv_transfer_params"]
    assert sent["remote_engine_id"] == "D" and sent["remote_num_tokens"] == 13  # 10 + 4 - 1
    assert sent["do_remote_decode"] is True and sent["do_remote_prefill"] is False
    # P's own prefix cache holds the whole 4-token blocks of turn 1's prompt: 8 tokens; the rest of
    # D's 13 is pulled (5), and the 3 new tokens are computed
    assert facts2["remote_tokens"] == 13 and facts2["prefill_cached_tokens"] == 8
    assert facts2["reused_tokens"] == 5 and facts2["recomputed_tokens"] == 3
    assert facts2["handle_tokens"] == len(prompt2) + 4 - 1  # turn 2's own handle


def test_pulled_tokens_are_ps_own_count_where_p_reports_it():
    """P evicted turn 1's blocks but its first (the proxy's index still holds both whole blocks, 8
    tokens): P's own split, 4 local and 9 pulled, is what the turn records, and D never sees it."""
    with AppThread(prefill_app(split_local=4)) as p, AppThread(decode_app(gen=4)) as d, \
            ProxyThread(config(p, d)) as proxy:
        stream(proxy.url, list(range(10)), "s1")
        r2, _, facts2, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103] + [50, 51], "s1")
    assert r2.headers["x-turnscope-reuse"] == "hit"
    assert facts2["prefill_cached_tokens"] == 4 and facts2["reused_tokens"] == 9  # the index alone: 8 and 5
    assert facts2["recomputed_tokens"] == 3
    assert "turnscope_external_cached_tokens" not in json.dumps(d.app.state.bodies)


def test_client_supplied_kv_transfer_params_are_dropped(stubs):
    p, d = stubs
    forged = {"do_remote_decode": True, "remote_block_ids": [[666]], "remote_engine_id": "forged",
              "remote_request_id": "x", "remote_host": "10.9.9.9", "remote_port": 9, "remote_num_tokens": 8}
    with ProxyThread(config(p, d)) as proxy:
        stream(proxy.url, list(range(10)), "s1", {"kv_transfer_params": forged})
        stream(proxy.url, list(range(10)), None, {"kv_transfer_params": forged})
    for body in p.app.state.bodies + d.app.state.bodies:
        assert "forged" not in json.dumps(body) and "666" not in json.dumps(body)


def test_prefill_timeout_with_handle_retries_as_plain_recompute():
    with AppThread(prefill_app(hang_with_handle_s=3.0)) as p, AppThread(decode_app(gen=4)) as d, \
            ProxyThread(config(p, d, prefill_timeout_s=0.5)) as proxy:
        stream(proxy.url, list(range(10)), "s1")
        r, _, facts, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103, 7], "s1")
    assert r.headers["x-turnscope-reuse"] == "miss_transfer_failed"
    assert facts["prefill_attempts"] == 2 and facts["reused_tokens"] == 0
    with_handle = [b for b in p.app.state.bodies if b["kv_transfer_params"].get("remote_block_ids")]
    assert len(p.app.state.bodies) == 3 and len(with_handle) == 1
    assert p.app.state.bodies[-1]["kv_transfer_params"] == PREFILL_PARAMS


def test_decode_error_is_passed_to_the_client_and_no_handle_kept():
    with AppThread(prefill_app()) as p, AppThread(decode_app(status=503)) as d, \
            ProxyThread(config(p, d)) as proxy:
        r, _, _, _ = stream(proxy.url, list(range(10)), "s1")
        assert r.status_code == 503
        r2, _, _, _ = stream(proxy.url, list(range(12)), "s1")
    assert r2.headers["x-turnscope-reuse"] == "miss_no_handle_returned"


def test_metrics_count_outcomes_and_estimate_handle_bytes(stubs, caplog):
    p, d = stubs
    caplog.set_level(logging.INFO, logger="turnscope.proxy")
    with ProxyThread(config(p, d)) as proxy:
        stream(proxy.url, list(range(10)), "secret-session-a")  # D then holds 10 + 4 - 1 = 13 tokens
        stream(proxy.url, list(range(20)), "secret-session-b")  # 20 + 4 - 1 = 23 tokens
        stream(proxy.url, list(range(5)))                        # no session id
        text = httpx.get(proxy.url + "/metrics").text
        health = httpx.get(proxy.url + "/health").json()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    assert values[("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "miss_first_turn")))] == 2
    assert values[("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "miss_no_session_id")))] == 1
    assert values[("turnscope_handles_live", ())] == 2
    assert values[("turnscope_handle_tokens_live", ())] == 36
    assert values[("turnscope_handle_bytes_live", ())] == 36 * 4096
    assert "secret-session" not in text
    assert health["handles_live"] == 2
    lines = [json.loads(r.message) for r in caplog.records if r.message.startswith("{")]
    assert [line["reuse"] for line in lines] == ["miss_first_turn", "miss_first_turn", "miss_no_session_id"]


@pytest.mark.parametrize("policy", ["session", "round-robin"])
def test_prefill_routing_policy_through_the_proxy(policy):
    with AppThread(prefill_app()) as p0, AppThread(prefill_app()) as p1, AppThread(decode_app(gen=4)) as d:
        cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p0.url),
                                                    Worker(name="prefill-1", url=p1.url)],
                          decode=[Worker(name="decode-0", url=d.url)], block_size=4, prefill_routing=policy)
        with ProxyThread(cfg) as proxy:
            engines = [stream(proxy.url, list(range(10 + 5 * k)), "s1")[0].headers["x-turnscope-prefill-engine"]
                       for k in range(4)]
    served = (len(p0.app.state.bodies), len(p1.app.state.bodies))
    if policy == "session":
        assert len(set(engines)) == 1 and sorted(served) == [0, 4]
    else:
        assert engines == ["prefill-0", "prefill-1"] * 2 and served == (2, 2)


@pytest.mark.parametrize("leave", ["mid_stream", "during_prefill"])
def test_a_request_the_client_leaves_is_logged_as_it_ends(caplog, leave):
    """The proxy's log holds every request it took, one the client walked away from included
    (the soak's rows check joins it to the stored rows by request id): logged ``incomplete`` once
    the client is gone, not whenever the garbage collector closes the relay."""
    import time

    caplog.set_level(logging.INFO, logger="turnscope.proxy")
    slow_p = 1.0 if leave == "during_prefill" else 0.0
    with AppThread(prefill_app(delay_s=slow_p)) as p, AppThread(decode_app(gen=200, itl_s=0.05)) as d, \
            ProxyThread(config(p, d)) as proxy:
        body = {"model": "m", "prompt": list(range(10)), "max_tokens": 200, "stream": True, "conversation_id": "s"}
        try:
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, headers={"x-request-id": "lg-left"},
                              timeout=httpx.Timeout(30, read=0.3 if slow_p else 30)) as r:
                next(r.iter_raw())  # the first event, then the client closes the connection (10 s of stream left)
        except httpx.ReadTimeout:
            pass  # gave up during the 1 s prefill leg: the connection is closed
        deadline = time.monotonic() + 5 + slow_p
        logged = []
        while time.monotonic() < deadline and not logged:
            logged = [json.loads(x.message) for x in caplog.records
                      if x.message.startswith("{") and '"lg-left"' in x.message]
            time.sleep(0.1)
    assert [(e["request_id"], e["status"]) for e in logged] == [("lg-left", "client_disconnected")]


def test_session_routing_fails_over_when_its_prefill_worker_goes_away():
    """A session's P stops answering: that request fails with a 502 naming it (no handle was at
    stake), the proxy skips the worker, and the session's next turns stay on the other P."""
    with AppThread(prefill_app()) as p0, AppThread(prefill_app()) as p1, \
            AppThread(decode_app(gen=4)) as d:
        workers = {"prefill-0": p0, "prefill-1": p1}
        cfg = ProxyConfig(mode="pd", prefill=[Worker(name=n, url=t.url) for n, t in workers.items()],
                          decode=[Worker(name="decode-0", url=d.url)], block_size=4, prefill_routing="session")
        with ProxyThread(cfg) as proxy:
            first = stream(proxy.url, list(range(10)), "s-fail")[0].headers["x-turnscope-prefill-engine"]
            survivor = next(n for n in workers if n != first)
            workers[first].__exit__()  # its server stops: connections are refused
            r = httpx.post(proxy.url + "/v1/completions", timeout=30,
                           json={"model": "m", "prompt": list(range(15)), "max_tokens": 4, "conversation_id": "s-fail"})
            assert r.status_code == 502 and f"prefill worker {first}" in r.text
            engines = [stream(proxy.url, list(range(15 + k)), "s-fail")[0].headers["x-turnscope-prefill-engine"]
                       for k in range(3)]
        assert engines == [survivor] * 3
        assert len(workers[survivor].app.state.bodies) == 3


@pytest.mark.parametrize("policy", ["session", "round-robin"])
def test_decode_routing_policy_through_the_proxy(policy):
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d0, AppThread(decode_app(gen=4)) as d1:
        cfg = ProxyConfig(mode="pd", prefill=[Worker(name="prefill-0", url=p.url)],
                          decode=[Worker(name="decode-0", url=d0.url), Worker(name="decode-1", url=d1.url)],
                          block_size=4, decode_routing=policy)
        with ProxyThread(cfg) as proxy:
            engines = [stream(proxy.url, list(range(10 + 5 * k)), "s1")[0].headers["x-turnscope-decode-engine"]
                       for k in range(4)]
    served = (len(d0.app.state.bodies), len(d1.app.state.bodies))
    if policy == "session":
        assert len(set(engines)) == 1 and sorted(served) == [0, 4]
    else:
        assert engines == ["decode-0", "decode-1"] * 2 and served == (2, 2)


def test_round_robin_credits_the_prefix_a_prefill_worker_kept_from_an_earlier_turn():
    """Turns go P0, P1, P0: turn 2's P0 still holds turn 0's prompt (10 tokens: 2 whole blocks
    of 4), so of what P0 reports cached for turn 2, 8 tokens are its own prefix cache and only the
    rest was pulled from D (the stub P reports local + pulled as one count, as vLLM does)."""
    gen = [100, 101, 102, 103]  # decode_app(gen=4)'s ids
    with AppThread(prefill_app()) as p0, AppThread(prefill_app()) as p1, AppThread(decode_app(gen=4)) as d:
        cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p0.url),
                                                    Worker(name="prefill-1", url=p1.url)],
                          decode=[Worker(name="decode-0", url=d.url)], block_size=4, kv_recompute_threshold=2,
                          prefill_routing="round-robin")
        prompts = [list(range(10))]
        prompts.append(prompts[0] + gen + list(range(200, 206)))
        prompts.append(prompts[1] + gen + list(range(300, 306)))
        with ProxyThread(cfg) as proxy:
            out = [stream(proxy.url, p, "s-rr") for p in prompts]
    assert [r.headers["x-turnscope-prefill-engine"] for r, *_ in out] == ["prefill-0", "prefill-1", "prefill-0"]
    facts = out[2][2]
    assert facts["reuse"] == "hit" and facts["remote_tokens"] > 8
    assert facts["prefill_cached_tokens"] == 8
    assert facts["reused_tokens"] == facts["remote_tokens"] - 8
    # turn 1 on P1, which never saw the session: everything P1 reports cached was pulled
    assert out[1][2]["prefill_cached_tokens"] == 0 and out[1][2]["reused_tokens"] == out[1][2]["remote_tokens"]


def test_round_robin_counts_a_prefix_another_session_left_on_a_prefill_worker_as_local():
    """Two sessions share an 8-token prefix (2 whole blocks of 4). Round-robin over P0, P1: A0 on
    P0, A1 on P1, B0 on P0, B1 on P1. P1 never served B, but A1 left the shared prefix there, so
    of the 16 tokens P1 reports cached for B1 (D's handle: B0's 13 + 4 generated - 1; the stub
    reports local + pulled as one count, as vLLM does) 8 are P1's own and 8 were pulled."""
    gen = [100, 101, 102, 103]  # decode_app(gen=4)'s ids
    shared = list(range(8))
    a0 = shared + [10, 11, 12]
    a1 = a0 + gen + list(range(13, 19))
    b0 = shared + [50, 51, 52, 53, 54]
    b1 = b0 + gen + list(range(60, 66))
    with AppThread(prefill_app()) as p0, AppThread(prefill_app()) as p1, AppThread(decode_app(gen=4)) as d:
        cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p0.url),
                                                    Worker(name="prefill-1", url=p1.url)],
                          decode=[Worker(name="decode-0", url=d.url)], block_size=4, kv_recompute_threshold=2,
                          prefill_routing="round-robin")
        with ProxyThread(cfg) as proxy:
            out = [stream(proxy.url, p, s) for p, s in ((a0, "A"), (a1, "A"), (b0, "B"), (b1, "B"))]
    assert [r.headers["x-turnscope-prefill-engine"] for r, *_ in out] == ["prefill-0", "prefill-1"] * 2
    facts = out[3][2]
    assert facts["reuse"] == "hit" and facts["remote_tokens"] == 13 + 4 - 1
    assert facts["prefill_cached_tokens"] == 8  # the shared prefix, from A1 on P1
    assert facts["reused_tokens"] == 16 - 8
    assert facts["recomputed_tokens"] == len(b1) - 16 == 7
    # A1 on P1, which held nothing yet: all 14 cached tokens (A0's 11 + 4 - 1) were pulled
    assert out[1][2]["prefill_cached_tokens"] == 0 and out[1][2]["reused_tokens"] == 14


def test_one_prefill_worker_with_session_routing_keeps_the_per_session_accounting():
    """One P, sessions sharing an 8-token prefix, interleaved. Each turn with a handle gets as
    P's own hit the whole blocks of the session's previous prompt (the rule before the prefix
    index: whole_blocks(previous prompt)), and the rest of what P reports as pulled."""
    gen = [100, 101, 102, 103]
    shared = list(range(8))
    a0 = shared + [10, 11, 12]  # 11 tokens
    b0 = shared + [50, 51, 52, 53, 54]  # 13
    a1 = a0 + gen + list(range(13, 19))  # 21
    b1 = b0 + gen + list(range(60, 66))  # 23
    a2 = a1 + gen + list(range(19, 25))  # 31
    turns = (("a0", a0), ("b0", b0), ("a1", a1), ("b1", b1), ("a2", a2))
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d, ProxyThread(config(p, d)) as proxy:
        out = {name: stream(proxy.url, ids, name[0])[2] for name, ids in turns}
    # (handle tokens = previous prompt + 4 - 1, P's own hit = whole blocks of the previous prompt)
    expected = {"a1": (14, 8), "b1": (16, 12), "a2": (24, 20)}
    for name, (remote, local) in expected.items():
        f = out[name]
        assert f["reuse"] == "hit" and f["remote_tokens"] == remote, name
        assert (f["prefill_cached_tokens"], f["reused_tokens"]) == (local, remote - local), name
    assert out["b0"]["reused_tokens"] == 0 and out["b0"]["prefill_cached_tokens"] == 0  # no handle, stub reports 0


@pytest.mark.parametrize("streamed", [True, False])
def test_n_above_1_is_refused_in_pd_modes_without_calling_either_worker(stubs, streamed):
    """``n`` > 1 cannot go through P/D (P's child requests have blocks one ``kv_transfer_params``
    cannot describe): a 400 naming ``n``, neither stub called, the session's handle left for its
    next turn (still a hit). Truths: the stubs' request logs."""
    p, d = stubs
    with ProxyThread(config(p, d)) as proxy:
        stream(proxy.url, list(range(10)), "s1")
        calls = (len(p.app.state.bodies), len(d.app.state.bodies))
        body = {"model": "m", "prompt": list(range(10)) + [100, 101, 102, 103, 5], "max_tokens": 4, "n": 2,
                "stream": streamed, "conversation_id": "s1"}
        r = httpx.post(proxy.url + "/v1/completions", json=body, headers={"x-request-id": "n2"}, timeout=30)
        assert (len(p.app.state.bodies), len(d.app.state.bodies)) == calls == (1, 1)
        assert r.status_code == 400 and r.headers["x-request-id"] == "n2"
        err = r.json()["error"]
        assert err["param"] == "n" and err["message"].startswith("n=2: ") and err["code"] == 400
        # n=1 is served as usual, and the session's handle was not spent by the refused request
        r2, _, _, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103, 5], "s1", extra={"n": 1})
        assert r2.headers["x-turnscope-reuse"] == "hit"
        rejected = [s.value for fam in text_string_to_metric_families(httpx.get(proxy.url + "/metrics").text)
                    for s in fam.samples if s.name == "turnscope_rejected_requests_total"]
    assert rejected == [1.0]


def test_n_above_1_is_served_in_aggregated_mode():
    with AppThread(decode_app(gen=4)) as d, ProxyThread(ProxyConfig(
            mode="aggregated", aggregated=[Worker(name="aggregated-0", url=d.url)])) as proxy:
        r, events, _, _ = stream(proxy.url, list(range(10)), "s1", extra={"n": 2})
    assert r.status_code == 200 and len(events) == 5
    assert len(d.app.state.bodies) == 1 and d.app.state.bodies[0]["n"] == 2
# ------------------------------------------------------------------- a decode worker restarts


def _proxy_values(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


RESTARTED = ("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "miss_decode_restarted")))
D_RESTARTS = ("turnscope_decode_restarts_total", (("decode", "decode-0"),))
DROPPED = ("turnscope_handles_dropped_restart_total", ())


def test_decode_restart_seen_by_the_probe_drops_its_handles(stubs):
    """D's process start changes (a restart) between two turns of two live sessions: the proxy's
    probe sees it and drops both handles; each session's next turn is ``miss_decode_restarted``
    with no handle given to P (it would name the dead engine), counted apart in the metrics; the
    turn after it is a hit on the new engine's handle."""
    p, d = stubs
    with ProxyThread(config(p, d, decode_probe_interval_s=0.05)) as proxy:
        stream(proxy.url, list(range(10)), "s1")
        stream(proxy.url, list(range(12)), "s2")
        d.app.state.process_start_s, d.app.state.engine_id = 2000.0, "D-new"
        deadline = time.monotonic() + 10
        while _proxy_values(proxy.url).get(D_RESTARTS, 0) < 1:
            assert time.monotonic() < deadline, "the proxy never saw D's new process start"
            time.sleep(0.05)
        assert httpx.get(proxy.url + "/health").json()["handles_live"] == 0
        n_before = len(p.app.state.bodies)
        r1, _, facts1, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103, 7], "s1")
        assert p.app.state.bodies[n_before]["kv_transfer_params"] == PREFILL_PARAMS  # no stale handle to P
        r2, _, _, _ = stream(proxy.url, list(range(12)) + [100, 101, 102, 103, 7], "s2")
        r3, _, _, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103, 7, 100, 101, 102, 103, 8], "s1")
        values = _proxy_values(proxy.url)
    assert r1.headers["x-turnscope-reuse"] == r2.headers["x-turnscope-reuse"] == "miss_decode_restarted"
    assert facts1["reused_tokens"] == 0 and facts1["remote_tokens"] == 0
    assert facts1["handle_age_s"] > 0  # the dropped handle's age: the store ties the turn to D's lifetimes
    assert r3.headers["x-turnscope-reuse"] == "hit"
    assert p.app.state.bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "D-new"
    assert values[RESTARTED] == 2 and values[D_RESTARTS] == 1 and values[DROPPED] == 2
    assert values[("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "hit")))] == 1


def test_decode_restart_seen_by_a_new_engine_id_drops_the_older_handles(stubs):
    """Without the probe, the first handle D returns under a new engine id shows the restart:
    the handles of the old engine are dropped, the new one is kept."""
    p, d = stubs
    with ProxyThread(config(p, d, decode_probe_interval_s=0)) as proxy:
        stream(proxy.url, list(range(10)), "s1")
        d.app.state.engine_id = "D-new"
        stream(proxy.url, list(range(20)), "s3")  # returns a handle of the new engine
        r1, _, _, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103, 7], "s1")
        r3, _, _, _ = stream(proxy.url, list(range(20)) + [100, 101, 102, 103, 7], "s3")
        values = _proxy_values(proxy.url)
    assert r1.headers["x-turnscope-reuse"] == "miss_decode_restarted"
    assert r3.headers["x-turnscope-reuse"] == "hit"
    assert values[D_RESTARTS] == 1 and values[DROPPED] == 1 and values[RESTARTED] == 1
