"""The warm-up reaches the longest prompt a run may send: a worker's first prompt longer than any
before it pays a one-time cost (docs/known-behaviour.md), which would land on a run's first turns."""

from __future__ import annotations

import json

from serving.topology import embedded_topology
from tests.integration.http_stub import Script, StubServer
from turnscope.evaluation import EvalSettings, warm_up, warm_up_tokens

REPLY = json.dumps({"choices": [{"token_ids": list(range(100, 108))}]}).encode()


def test_warm_up_last_prompts_are_the_asked_length():
    with StubServer(Script(fragments=[(0.0, REPLY)], headers={"Content-Type": "application/json"})) as stub:
        outcomes = warm_up(stub.url, "m", prompt_tokens=3500)
    lengths = [len(r["body"]["prompt"]) for r in stub.requests]
    # two sessions of two turns: 3500 - (8 reply + 100 new) = 3392 first, then the whole 3500
    assert lengths == [3392, 3500, 3392, 3500]
    ids = [r["body"]["conversation_id"] for r in stub.requests]
    assert ids[0] == ids[1] != ids[2] == ids[3]             # each session's turns in one conversation
    assert len(outcomes) == 4
    second = stub.requests[1]["body"]["prompt"]
    assert second[3392:3400] == list(range(100, 108))      # the session's reply is in its next prompt


def test_warm_up_tokens_is_the_runs_longest_prompt_within_the_context():
    topology = embedded_topology("m")                       # max_model_len 8,192
    assert warm_up_tokens(EvalSettings(topology=topology, max_prompt_tokens=3500)) == 3500
    short = topology.model_copy(update={"max_model_len": 2048})
    assert warm_up_tokens(EvalSettings(topology=short, max_prompt_tokens=3500)) == 2040   # 2048 less the 8-token reply
