"""The warm-up reaches the longest prompt a run may send: a worker's first prompt longer than any
before it pays a one-time cost (docs/known-behaviour.md), which would land on a run's first turns.
Its last turns are abandoned after their first token, so that a bidirectional D keeps nothing of
the warm-up (tests/integration/test_capacity_vllm.py checks that on real workers)."""

from __future__ import annotations

import json
import time

import httpx

from serving.handle_check import RELEASE_MAX_TOKENS, release_turn
from serving.topology import embedded_topology
from tests.integration.http_stub import Script, StubServer
from turnscope.conductor.evaluation import EvalSettings, warm_up, warm_up_tokens

REPLY = json.dumps({"choices": [{"token_ids": list(range(100, 108))}]}).encode()


def test_warm_up_last_prompts_are_the_asked_length():
    with StubServer(Script(fragments=[(0.0, REPLY)], headers={"Content-Type": "application/json"})) as stub:
        outcomes = warm_up(stub.url, "m", prompt_tokens=3500)
    # the stub is no turnscope proxy: its /metrics (asked once, first) has no turnscope_ series, so
    # the warm-up does not wait for the proxy to count the release turns
    assert [r["path"] for r in stub.requests].count("/metrics") == 1 and stub.requests[0]["path"] == "/metrics"
    turns = [r for r in stub.requests if r["path"] == "/v1/completions"]
    lengths = [len(r["body"]["prompt"]) for r in turns]
    # two sessions of two turns: 3500 - (8 reply + 100 new) = 3392 first, then the whole 3500
    assert lengths == [3392, 3500, 3392, 3500]
    ids = [r["body"]["conversation_id"] for r in turns]
    assert ids[0] == ids[1] != ids[2] == ids[3]             # each session's turns in one conversation
    assert len(outcomes) == 4
    second = turns[1]["body"]["prompt"]
    assert second[3392:3400] == list(range(100, 108))      # the session's reply is in its next prompt
    # each session's last turn is its release turn: streamed, asking for 64 tokens
    assert [r["body"].get("stream", False) for r in turns] == [False, True, False, True]
    assert [r["body"]["max_tokens"] for r in turns] == [8, RELEASE_MAX_TOKENS, 8, RELEASE_MAX_TOKENS]


def test_the_release_turn_leaves_after_the_first_token():
    # the server sends one token, then nothing for 5 s: the release turn leaves after that token
    first = b'data: {"choices": [{"text": "a"}]}\n\n'
    script = Script(fragments=[(0.0, first)], headers={"Content-Type": "text/event-stream", "x-turnscope-reuse": "hit"},
                    end="hang", hang_s=5.0)
    with StubServer(script) as stub, httpx.Client(timeout=30) as client:
        t0 = time.perf_counter()
        outcome = release_turn(client, stub.url, {"model": "m", "prompt": [1, 2], "max_tokens": 8})
        took = time.perf_counter() - t0
    assert outcome == "hit" and took < 2.5                 # not the 5 s the server would have taken
    assert stub.requests[0]["body"] == {"model": "m", "prompt": [1, 2], "max_tokens": RELEASE_MAX_TOKENS,
                                             "stream": True}
    with StubServer(Script(status=503, fragments=[(0.0, b"busy")])) as stub, httpx.Client(timeout=30) as client:
        assert release_turn(client, stub.url, {"model": "m", "prompt": [1]}) == "error HTTPStatusError"


def test_warm_up_tokens_is_the_runs_longest_prompt_within_the_context():
    topology = embedded_topology("m")                       # max_model_len 8,192
    assert warm_up_tokens(EvalSettings(topology=topology, max_prompt_tokens=3500)) == 3500
    short = topology.model_copy(update={"max_model_len": 2048})
    assert warm_up_tokens(EvalSettings(topology=short, max_prompt_tokens=3500)) == 2040   # 2048 less the 8-token reply
