"""Trace readers: Mooncake (sessions from hash chains), Azure CSV, vLLM multi-turn JSON.

Truths: hand-made traces whose sessions are known by construction; for the shipped traces, the
facts of data/traces/SOURCES.md and properties re-checked here with plain list code.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer

from loadgen.synth_text import LocalTokenizer, TextSynth
from loadgen.traces import azure, mooncake
from loadgen.traces.taubench import TraceFormatError
from loadgen.traces.vllm_multiturn import load_vllm_multiturn
from loadgen.workload import load_workload, plan_workload
from tests.embedded_tokenizer import tokenizer_json

B = mooncake.BLOCK_TOKENS


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def req(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


# A hand-made trace. Every request starts with block 0 (the common system prompt).
#   r0: [0, 1, 2]   1100 tokens (block 2 partial)            session A, turn 0
#   r1: [0, 7]       700 tokens                               session B, turn 0 (shares only block 0)
#   r2: [0, 1, 3, 4] 1900 tokens: r0's full blocks, block 2 re-hashed (3)   -> A turn 1 (rehash)
#   r3: [0, 14, 8]  1200: extends r1 by re-hashing its only own block (7 -> 14), so it shares only
#                    the common prefix with r1: not linkable, a new session
#   r4: [0, 1, 3, 15, 5] 2300: r2's full blocks [0,1,3], block 4 re-hashed (15) -> A turn 2 (rehash)
#   r5: [0, 9, 10, 11] 2048 (all full)                        session D
#   r6: [0, 9, 10, 11, 12] 2100: all of r5's blocks            -> D turn 1 (exact)
#   r7: [0, 1, 6]   1100: r0's full part [0, 1] plus a block of its own -> a second child of r0 (fork)
#   r8: [0, 1, 6]   1100: r7 again, same prompt (exact link, a repeat)   -> r7's session, turn 1
#   r9, r10: [0, 20], [0, 21]: unrelated one-block prompts
# Block 1 is in 5 of 11 requests, under half: only block 0 is the common prefix.
TRACE = [
    req(0, 1100, 50, [0, 1, 2]),
    req(1000, 700, 20, [0, 7]),
    req(61000, 1900, 40, [0, 1, 3, 4]),
    req(62000, 1200, 10, [0, 14, 8]),
    req(200000, 2300, 30, [0, 1, 3, 15, 5]),
    req(200500, 2048, 5, [0, 9, 10, 11]),
    req(260500, 2100, 5, [0, 9, 10, 11, 12]),
    req(300000, 1100, 5, [0, 1, 6]),
    req(300100, 1100, 7, [0, 1, 6]),
    req(301000, 700, 5, [0, 20]),
    req(302000, 700, 5, [0, 21]),
]


def test_mooncake_hand_made_sessions(tmp_path):
    reqs = mooncake.load_mooncake(write_jsonl(tmp_path / "t.jsonl", TRACE))
    sessions, parent, rep = mooncake.infer_sessions(reqs)
    assert rep.common_prefix_ids == (0,)
    # r2 re-hashes r0's partial block; r4 re-hashes r2's; r6 extends r5 exactly.
    # r7 = [0, 1, 6]: r0's full part [0, 1] plus a re-hashed block -> a second child of r0 (a fork)
    assert parent == {2: 0, 4: 2, 6: 5, 7: 0, 8: 7}
    assert [s.requests for s in sessions] == [(0, 2, 4), (1,), (3,), (5, 6), (7, 8), (9,), (10,)]
    assert (rep.links_exact, rep.links_rehash, rep.repeats, rep.forks) == (2, 3, 1, 1)
    assert rep.common_only == 6       # r0, r1, r3 (re-hashed r1's only own block), r5, r9, r10
    assert rep.max_chain_depth == 2
    assert rep.turns_per_session == {3: 1, 1: 4, 2: 2}
    assert rep.gaps_s.tolist() == [61.0, 139.0, 60.0, 300.0, 0.1]
    # child input - (parent input + output): 1900-1150, 2300-1940, 2100-2053, 1100-1150, 1100-1105
    assert rep.new_tokens.tolist() == [750, 360, 47, -50, -5]


def test_mooncake_format_errors_name_the_line(tmp_path):
    bad = write_jsonl(tmp_path / "b.jsonl", [req(0, 600, 1, [0, 1]), req(5, 600, 1, [0])])
    with pytest.raises(mooncake.TraceFormatError, match=r"b.jsonl:2: hash_ids: expected 2 ids"):
        mooncake.load_mooncake(bad)
    bad = write_jsonl(tmp_path / "c.jsonl", [req(9, 10, 1, [0]), req(5, 10, 1, [0])])
    with pytest.raises(mooncake.TraceFormatError, match=r"c.jsonl:2: timestamp: 5 is before"):
        mooncake.load_mooncake(bad)
    (tmp_path / "d.jsonl").write_text('{"timestamp": 0, "input_length": "x"}\n')
    with pytest.raises(mooncake.TraceFormatError, match=r"d.jsonl:1: input_length: expected an integer"):
        mooncake.load_mooncake(tmp_path / "d.jsonl")


def test_mooncake_shipped_trace_links_are_real_extensions():
    reqs = mooncake.load_mooncake()
    assert len(reqs) == 12031                                      # SOURCES.md
    assert all(r.hash_ids[0] == 0 for r in reqs)                   # SOURCES.md: every request starts with 0
    sessions, parent, rep = mooncake.infer_sessions(reqs)
    assert rep.common_prefix_ids == (0,)
    # every link, re-checked with plain list code against the definition
    for c, p in parent.items():
        hc, hp = reqs[c].hash_ids, reqs[p].hash_ids
        assert p < c and reqs[p].timestamp_ms <= reqs[c].timestamp_ms
        exact = hc[: len(hp)] == hp
        rehash = reqs[p].partial_last_block and hc[: len(hp) - 1] == hp[:-1] and len(hc) >= len(hp)
        assert exact or rehash
        assert len(hp) - (0 if exact else 1) > 1       # shares a block beyond the common prefix [0]
        if exact and reqs[p].partial_last_block:         # a partial block's id can only recur unchanged
            assert hc == hp                              # when the prompt is the same: a repeat
    # sessions partition the requests; each session is a parent chain
    flat = sorted(i for s in sessions for i in s.requests)
    assert flat == list(range(len(reqs)))
    for s in sessions:
        assert all(parent[b] == a for a, b in zip(s.requests, s.requests[1:], strict=False))
    assert sum(n * k for n, k in rep.turns_per_session.items()) == len(reqs)
    assert rep.sessions == len(reqs) - rep.linked + sum(
        n - 1 for n in np.bincount(list(parent.values())) if n > 1)
    assert rep.linked == rep.links_exact + rep.links_rehash == len(parent)
    assert rep.gaps_s.min() >= 0


def test_mooncake_replay_text_shares_blocks_and_has_the_trace_lengths(tmp_path):
    tok = Tokenizer.from_file(str(tokenizer_json()))
    synth = TextSynth(LocalTokenizer(tokenizer_json()), seed=1)
    trace = write_jsonl(tmp_path / "t.jsonl", TRACE)
    p = tmp_path / "w.yaml"
    p.write_text(yaml.safe_dump({"name": "m", "traces": [{"format": "mooncake", "path": str(trace),
                                                          "token_scale": 0.125}]}))
    plans = plan_workload(load_workload(p), synth, time_scale=0.5)
    by_src = {pl.source: pl for pl in plans}
    a = by_src["mooncake:r0"]
    # scale 1/8: blocks of 64 tokens; r0 1100 -> 138 (137.5 rounds to even), r2 1900 -> 238,
    # r4 2300 -> 288 (287.5 -> 288); outputs 50 -> 6 (6.25), 40 -> 5, 30 -> 4 (3.75)
    assert [t.max_tokens for t in a.turns] == [6, 5, 4]
    n = [len(tok.encode(t.new_messages[0]["content"], add_special_tokens=False).ids) for t in a.turns]
    assert n == [138, 238 - (138 + 6), 288 - (238 + 5)]
    # arrivals: r0 at 0 s, r2 at 61 s, r4 at 200 s, times the scale 0.5
    assert a.start_at_s == 0.0 and [t.at_s for t in a.turns[1:]] == [30.5, 100.0]
    assert [t.kind for t in a.turns] == ["turn", "turn", "turn"]           # gaps 61 s, 139 s < 480 s
    fork = by_src["mooncake:r7"]
    assert [t.kind for t in fork.turns] == ["turn", "retry"] and fork.turns[1].new_messages == []
    # r7 (a fork of r0) starts with r0's blocks 0 and 1: the same 128 words of text
    r7 = by_src["mooncake:r7"].turns[0].new_messages[0]["content"].split(" ")[1:]
    r0 = a.turns[0].new_messages[0]["content"].split(" ")[1:]
    assert r7[:128] == r0[:128] and r7[128:] != r0[128:]
    assert [pl.start_at_s for pl in plans] == sorted(pl.start_at_s for pl in plans)


# ------------------------------------------------------------------------------------- azure


def test_azure_shipped_csv():
    rows = azure.load_azure()
    assert len(rows) == 19366                                       # SOURCES.md
    # first row 2023-11-16 18:15:46.6805900, last 19:14:08.4025270: 58 min 21.721937 s apart
    assert rows[0].arrival_s == 0.0 and rows[-1].arrival_s == pytest.approx(3501.721937, abs=1e-6)
    assert (rows[0].context_tokens, rows[0].generated_tokens) == (374, 44)
    assert (rows[-1].context_tokens, rows[-1].generated_tokens) == (197, 183)


def test_azure_errors_name_line_and_column(tmp_path):
    (tmp_path / "a.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:15:46.6805900,10,2\n2023-11-16 18:15:47.1,x,3\n")
    with pytest.raises(azure.TraceFormatError, match=r"a.csv:3: ContextTokens: expected an integer"):
        azure.load_azure(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("TIME,ContextTokens\n1,2\n")
    with pytest.raises(azure.TraceFormatError, match=r"b.csv:1: header: missing column\(s\) TIMESTAMP, GeneratedTokens"):
        azure.load_azure(tmp_path / "b.csv")


# ----------------------------------------------------------------------------- vLLM multi-turn


def test_vllm_multiturn_turns_and_errors(tmp_path):
    f = tmp_path / "conv.json"
    f.write_text(json.dumps([
        {"id": "c1", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                                  {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                                  {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]},
        {"id": "c2", "messages": [{"role": "user", "content": "only a question"}]},
    ]))
    (c1,) = load_vllm_multiturn(f)       # c2 has no reply: no call to plan
    assert c1.source == "conv:c1" and c1.turn_count == 2
    assert c1.turns() == [([{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}],
                           {"role": "assistant", "content": "a1"}),
                          ([{"role": "user", "content": "u2"}], {"role": "assistant", "content": "a2"})]
    f.write_text(json.dumps([{"id": "x", "messages": [{"role": "user", "content": "a"},
                                                      {"role": "gpt", "content": "b"}]}]))
    with pytest.raises(TraceFormatError, match=r"\[0\].messages\[1\].role: expected one of"):
        load_vllm_multiturn(f)
    f.write_text(json.dumps([{"id": "x", "messages": [{"role": "user", "content": "a"},
                                                      {"role": "user", "content": "b"}]}]))
    with pytest.raises(TraceFormatError, match=r"\[0\].messages\[1\].role: expected assistant"):
        load_vllm_multiturn(f)


def test_vllm_multiturn_output_length_is_the_reply_token_count(tmp_path):
    tok = Tokenizer.from_file(str(tokenizer_json()))
    synth = TextSynth(LocalTokenizer(tokenizer_json()), seed=1)
    reply = "Your flight to Seattle is confirmed for tomorrow morning."
    f = tmp_path / "conv.json"
    f.write_text(json.dumps([{"id": "c", "messages": [{"role": "user", "content": "Book it"},
                                                      {"role": "assistant", "content": reply}]}]))
    w = tmp_path / "w.yaml"
    w.write_text(yaml.safe_dump({"name": "v", "traces": [{"format": "vllm_multiturn", "path": str(f)}]}))
    (plan,) = plan_workload(load_workload(w), synth)
    assert plan.turns[0].max_tokens == len(tok.encode(reply, add_special_tokens=False).ids)
