"""Timing rules of loadgen.stream_client.ChunkAccumulator on hand-made chunks (no I/O)."""

from __future__ import annotations

import datetime as dt

import pytest

from loadgen.stream_client import ChunkAccumulator, TurnResult


def chat(delta: dict, n: int | None = None, **top: object) -> dict:
    c: dict = {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": None}], **top}
    if n is not None:
        c["usage"] = {"prompt_tokens": 10, "completion_tokens": n}
    return c


def run(chunks: list[tuple[float, dict]], end: float) -> TurnResult:
    acc = ChunkAccumulator(TurnResult(sent_at=dt.datetime.now(dt.UTC)))
    for t, c in chunks:
        acc.add(c, t)
    return acc.finish(end)


def test_stream_acc_role_and_empty_chunks_do_not_set_ttft() -> None:
    r = run([(0.01, chat({"role": "assistant", "content": ""}, 0)), (0.02, chat({}, 0)),
             (0.5, chat({"content": "x"}, 1))], end=0.6)
    assert r.ttft_s == 0.5 and r.ttfc_s == 0.5 and r.itl_s == [] and r.tpot_s is None


def test_stream_acc_per_token_first_chunk_with_several_tokens() -> None:
    # First chunk carries 3 tokens at 0.2 s (no measurable gaps), then +2 at 0.3 s, +1 at 0.35 s.
    r = run([(0.2, chat({"content": "abc"}, 3)), (0.3, chat({"content": "de"}, 5)),
             (0.35, chat({"content": "f"}, 6)), (0.36, {"choices": [], "usage": {"completion_tokens": 6}})],
            end=0.37)
    assert r.itl_kind == "per_token"
    assert r.itl_s == pytest.approx([0.05, 0.05, 0.05])
    # TPOT runs to the last token (0.35 s), not to the stream's end (0.37 s).
    assert r.last_token_s == 0.35 and r.e2e_s == 0.37
    assert r.tpot_s == pytest.approx((0.35 - 0.2) / 5)


def test_stream_acc_final_eos_token_without_text_counts() -> None:
    # vLLM counts the stop token: the finish chunk has no text but usage rises 2 -> 3.
    r = run([(0.1, chat({"content": "a"}, 1)), (0.12, chat({"content": "b"}, 2)),
             (0.15, {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}],
                     "usage": {"completion_tokens": 3}})], end=0.16)
    assert r.itl_s == pytest.approx([0.02, 0.03]) and r.finish_reason == "stop"
    assert r.last_token_s == 0.15  # the stop token's usage rise, though it has no text


def test_stream_acc_without_usage_is_inter_chunk() -> None:
    r = run([(0.1, chat({"content": "a"})), (0.25, chat({"content": "bc"})), (0.3, chat({"content": "d"})),
             (0.31, {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}})], end=0.32)
    assert r.itl_kind == "inter_chunk"
    assert r.itl_s == pytest.approx([0.15, 0.05])
    # The usage-only chunk (0.31 s) is no token: the last token is "d" at 0.3 s.
    assert r.last_token_s == 0.3
    assert r.completion_tokens == 4 and r.tpot_s == pytest.approx((0.3 - 0.1) / 3)


def test_stream_acc_reasoning_field_names() -> None:
    r = run([(0.1, chat({"reasoning": "hm"}, 1)), (0.2, chat({"reasoning_content": "!"}, 2)),
             (0.3, chat({"content": "ok"}, 3))], end=0.3)
    assert (r.ttft_s, r.ttfc_s, r.reasoning_text, r.text) == (0.1, 0.3, "hm!", "ok")


def test_stream_acc_cached_tokens_and_proxy_facts_merge() -> None:
    r = run([(0.1, chat({"content": "a"}, 1, turnscope={"reuse_hint": 1})),
             (0.2, {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 1,
                                             "prompt_tokens_details": {"cached_tokens": 256}},
                    "turnscope": {"reused_tokens": 256}})], end=0.2)
    assert (r.prompt_tokens, r.cached_tokens) == (300, 256)
    assert r.proxy_facts == {"reuse_hint": 1, "reused_tokens": 256}
    assert r.request_id == "c1"
