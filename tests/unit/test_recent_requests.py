"""The proxy's table of recent requests' facts (serving.recent_requests) and its look-up route, and
the load generator's look-up (loadgen.facts_lookup) against a stub server. Every expected value is
set by hand in the test."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from core.contract import (
    FACTS_FIELD,
    PUBLIC_FACT_KEYS,
    REQUEST_FACTS_ROUTE,
    answer_as_response,
    request_facts_path,
    response_facts,
)
from loadgen.facts_lookup import lookup_request_facts
from serving.proxy import ProxyConfig, Worker, create_app
from serving.proxy_request import RequestFacts
from serving.recent_requests import RecentRequests


def facts(request_id: str, mode: str = "pd-bidir") -> RequestFacts:
    return RequestFacts(request_id=request_id, mode=mode, prefill_engine="prefill-0", decode_engine="decode-0")


def test_the_table_keeps_the_newest_requests_and_drops_the_oldest():
    t = RecentRequests(capacity=3)
    for i in range(5):
        t.admitted(facts(f"r{i}"))
    assert len(t) == 3
    assert [t.answer(f"r{i}") is None for i in range(5)] == [True, True, False, False, False]
    t.admitted(facts("r2"))  # an id seen again is the newest request
    t.admitted(facts("r5"))
    assert t.answer("r3") is None and t.answer("r2") is not None
    with pytest.raises(ValueError, match="at least 1"):
        RecentRequests(capacity=0)


def test_an_answer_reads_the_facts_as_the_proxy_fills_them_in_and_says_when_the_request_ended():
    t = RecentRequests()
    f = facts("lg-1")
    t.admitted(f)
    a = t.answer("lg-1")
    # admitted, P has not answered: the counts are unknown, not 0
    assert a["ended"] is False and a["status"] is None
    assert a[FACTS_FIELD]["reused_tokens"] is None and a[FACTS_FIELD]["prefill_cached_tokens"] is None
    assert a[FACTS_FIELD]["remote_tokens"] == 0
    # P answered (SessionProxy.account_prefill): 2 blocks of 128 pulled, 384 cached locally
    f.reuse, f.prefill_leg_s, f.remote_tokens, f.reused_tokens = "hit", 0.0421, 640, 256
    f.prefill_cached_tokens, f.recomputed_tokens = 384, 17
    a = t.answer("lg-1")
    assert a["ended"] is False
    assert (a[FACTS_FIELD]["reuse"], a[FACTS_FIELD]["reused_tokens"], a[FACTS_FIELD]["prefill_cached_tokens"],
            a[FACTS_FIELD]["recomputed_tokens"]) == ("hit", 256, 384, 17)
    t.ended(f, "client_disconnected")
    t.ended(f, "ok")  # the first end wins
    a = t.answer("lg-1")
    assert (a["ended"], a["status"], a["prefill_engine"], a["decode_engine"]) == (
        True, "client_disconnected", "prefill-0", "decode-0")
    assert set(a[FACTS_FIELD]) == set(PUBLIC_FACT_KEYS)


def test_an_end_of_an_older_request_with_the_same_id_leaves_the_newer_alone():
    t = RecentRequests()
    old, new = facts("dup"), facts("dup")
    t.admitted(old)
    t.admitted(new)
    t.ended(old, "ok")
    assert t.answer("dup")["ended"] is False


def test_aggregated_counts_are_known_without_a_prefill_leg():
    t = RecentRequests()
    t.admitted(facts("a", mode="aggregated"))
    assert t.answer("a")[FACTS_FIELD]["reused_tokens"] == 0


def test_the_row_fields_of_a_looked_up_answer_are_those_of_the_response_it_stands_for():
    f = facts("lg-2")
    f.reuse, f.prefill_leg_s, f.reused_tokens, f.remote_tokens = "hit", 0.5, 256, 256
    t = RecentRequests()
    t.admitted(f)
    looked_up = response_facts(*answer_as_response(t.answer("lg-2")))
    as_sent = response_facts({k.lower(): v for k, v in f.headers().items()}, dict(f.public()))
    assert looked_up == as_sent
    assert looked_up["reused_tokens"] == 256 and looked_up["prefill_engine"] == "prefill-0"


def app(api_key_env: str | None = None):
    from serving.api_keys import SecretRef

    cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url="http://127.0.0.1:9")],
                      decode=[Worker(name="decode-0", url="http://127.0.0.1:9")], recent_requests=2,
                      api_key=SecretRef(env=api_key_env) if api_key_env else None)
    return create_app(cfg)


def test_the_route_answers_a_kept_request_and_404_otherwise():
    a = app()
    f = facts("lg-3/x y")  # any character a header may hold
    a.state.proxy.recent.admitted(f)
    with TestClient(a) as c:
        assert request_facts_path("lg-3/x y") == "/v1/turnscope/requests/lg-3%2Fx%20y"
        r = c.get(request_facts_path("lg-3/x y"))
        assert r.status_code == 200 and r.json()["request_id"] == "lg-3/x y" and r.json()["ended"] is False
        r = c.get(REQUEST_FACTS_ROUTE.format(request_id="nope"))
        assert r.status_code == 404 and "keeps the last 2" in r.json()["error"]["message"]


def test_the_route_needs_the_proxys_api_key(monkeypatch):
    monkeypatch.setenv("TS_TEST_PROXY_KEY", "k1")
    a = app("TS_TEST_PROXY_KEY")
    a.state.proxy.recent.admitted(facts("lg-4"))
    with TestClient(a) as c:
        assert c.get(request_facts_path("lg-4")).status_code == 401
        assert c.get(request_facts_path("lg-4"), headers={"Authorization": "Bearer k1"}).status_code == 200


# -- the load generator's look-up, against a stub server ------------------------------------------


class Stub:
    """A server answering the look-up route: ``answers`` in turn (the last repeats), counting asks."""

    def __init__(self, answers: list[tuple[int, object]]):
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked.append(request.url.path)
        status, body = self.answers[min(len(self.asked) - 1, len(self.answers) - 1)]
        if isinstance(body, (dict, list)):
            return httpx.Response(status, json=body)
        return httpx.Response(status, text=str(body))


def answer(ended: bool, status: str | None = None) -> dict:
    return {"request_id": "lg-5", "ended": ended, "status": status, "prefill_engine": "p", "decode_engine": "d",
            FACTS_FIELD: {"reuse": "hit", "reused_tokens": 256}}


def lookup(stub: Stub, **kw):
    sleeps: list[float] = []
    with httpx.Client(transport=httpx.MockTransport(stub)) as c:
        got = lookup_request_facts(c, "http://proxy/", "lg-5", sleep=sleeps.append, **kw)
    return got, sleeps


def test_the_lookup_asks_until_the_request_ended():
    stub = Stub([(200, answer(False)), (200, answer(False)), (200, answer(True, "client_disconnected"))])
    got, sleeps = lookup(stub, poll_s=0.01)
    assert got["status"] == "client_disconnected" and len(stub.asked) == 3 and sleeps == [0.01, 0.01]
    assert stub.asked[0] == "/v1/turnscope/requests/lg-5"


def test_the_lookup_gives_the_last_answer_when_the_request_has_not_ended_in_time():
    stub = Stub([(200, answer(False))])
    got, sleeps = lookup(stub, wait_s=0.0, poll_s=0.01)
    assert got["ended"] is False and got[FACTS_FIELD]["reused_tokens"] == 256 and len(stub.asked) == 1
    assert sleeps == []


@pytest.mark.parametrize("status, body", [(404, {"detail": "Not Found"}), (200, "not json"), (500, "boom"),
                                          (200, {"no": "ended"})])
def test_a_server_that_is_not_the_proxy_gives_no_answer(status, body):
    got, _ = lookup(Stub([(status, body)]))
    assert got is None


def test_an_unreachable_server_gives_no_answer():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(refuse)) as c:
        assert lookup_request_facts(c, "http://proxy", "lg-5") is None
