"""What a client reads through the proxy is D's stream, byte for byte, plus only the additive
``turnscope`` field (vLLM's ``bench serve`` broke on an SSE comment the proxy once sent).

The truth is the stub decode worker's own bytes for the same body, read straight from it.
"""

import json

import httpx
import pytest

from serving.proxy import ProxyConfig, Worker
from tests.integration.pd_stub import decode_app, prefill_app
from tests.integration.vllm_stack import AppThread, ProxyThread

BODY = {"model": "m", "prompt": list(range(10)), "max_tokens": 4, "stream": True}


def raw_events(url: str, body: dict) -> list[bytes]:
    """The SSE events exactly as received (split on the blank line that ends each event)."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read()
    assert raw.endswith(b"\n\n")
    return [e + b"\n\n" for e in raw[:-2].split(b"\n\n")]


def strip_facts(event: bytes) -> tuple[bytes, dict]:
    """The event without the proxy's spliced-in ``,"turnscope":{...}`` (which must end the object)."""
    marker = b',"turnscope":'
    assert event.count(marker) == 1, event
    head, tail = event.split(marker)
    facts_json = tail[:-len(b"}\n\n")]
    return head + b"}\n\n", json.loads(facts_json)


@pytest.mark.parametrize("mode", ["pd-bidir", "aggregated"])
@pytest.mark.parametrize("handle", [True, False])
def test_streamed_bytes_are_upstreams_plus_only_the_facts_field(mode, handle):
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4, handle=handle)) as d:
        workers = {"aggregated": [Worker(name="agg-0", url=d.url)]} if mode == "aggregated" else {
            "prefill": [Worker(name="prefill-0", url=p.url)], "decode": [Worker(name="decode-0", url=d.url)]}
        with ProxyThread(ProxyConfig(mode=mode, block_size=4, **workers)) as proxy:
            via_proxy = raw_events(proxy.url, BODY | {"conversation_id": "s1"})
        direct = raw_events(d.url, BODY | {"return_token_ids": True})
    assert not any(e.startswith(b":") for e in via_proxy)  # no SSE comment, ever
    assert len(via_proxy) == len(direct)  # no event added
    facts_seen = []
    for mine, theirs in zip(via_proxy, direct, strict=True):
        if b'"kv_transfer_params"' in theirs:  # D's handle is replaced by the facts, nothing else changes
            got, want = json.loads(mine[6:]), json.loads(theirs[6:])
            want.pop("kv_transfer_params")
            facts_seen.append(got.pop("turnscope"))
            assert got == want
        elif b'"finish_reason": "length"' in theirs:  # the finishing chunk: D's bytes + the field
            stripped, facts = strip_facts(mine)
            assert stripped == theirs
            facts_seen.append(facts)
        else:
            assert mine == theirs
    assert via_proxy[-1] == b"data: [DONE]\n\n"
    assert len(facts_seen) == (2 if handle else 1)
    expected_reuse = None if mode == "aggregated" else "miss_first_turn"
    assert all(f["reuse"] == expected_reuse for f in facts_seen)


def test_decode_error_status_still_reaches_the_client_without_a_sentinel():
    with AppThread(prefill_app()) as p, AppThread(decode_app(status=503)) as d, \
            ProxyThread(ProxyConfig(mode="pd-bidir", prefill=[Worker(name="p", url=p.url)],
                                    decode=[Worker(name="d", url=d.url)])) as proxy:
        r = httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 503 and r.json() == {"error": {"message": "boom"}}
