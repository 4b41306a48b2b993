"""The turn-N oracle cases of shared/cases/multiturn/README.md, as pure logic over token ids.

Each case's numbers are derived by hand in the comments (block arithmetic, character counts of a
character-level tokenizer, or the embedded BPE tokenizer's own encode); the code under test is
``loadgen.token_prompt.reuse_oracle`` / ``reuse_against`` and ``loadgen.session.apply_edit``. The
same behaviours through real vLLM P/D workers are in tests/integration/test_multiturn_vllm.py.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from loadgen.session import apply_edit
from loadgen.token_prompt import reuse_against, reuse_oracle
from tests.embedded_tokenizer import tokenizer_json
from tests.handed_cases import CASES as HANDED
from tests.integration.openai_stub import IM_END, encode, render

CASES = HANDED / "multiturn"
BLOCK = 128   # vLLM CPU KV block size (docs/design.md)


def test_multiturn_cases_present():
    text = (CASES / "README.md").read_text()
    for name in ("block_rounding", "edited_history", "template_divergence", "below_threshold", "retokenization"):
        assert f"`{name}`" in text, name


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


# 1. block_rounding ----------------------------------------------------------------------------

@pytest.mark.parametrize("p, g, reusable", [
    (1000, 32, 1024),   # P + G - 1 = 1031 -> 8 whole blocks of 128 = 1024; 7 rest recomputed
    (1000, 25, 1024),   # 1024 exactly: 8 blocks
    (1000, 24, 896),    # 1023 -> 7 blocks
    (100, 10, 0),       # 109 < one block
])
def test_block_rounding(p, g, reusable):
    prev, gen = ids(p, 1), ids(g, 2)
    turn2 = prev + gen + ids(150, 3)                      # the history plus new text
    o = reuse_oracle(prev, gen, turn2, block_size=BLOCK)
    assert o.handle_tokens == p + g - 1                   # the last sampled token has no KV
    assert o.reusable_tokens == reusable
    assert (o.lcp, o.divergence) == (p + g, None)
    assert len(turn2) - o.reusable_tokens == len(turn2) - reusable  # the rest is recomputed


def test_block_rounding_pull_beyond_the_local_prefix_cache():
    # P = 1000, G = 32 with P's prefix cache on: P holds floor(1000 / 128) = 7 blocks = 896 tokens
    # itself, and vLLM pulls min(handle, prompt) - local = 1031 - 896 = 135 tokens from D (the
    # number tests/integration/test_pd_bidir_vllm.py measured on P's external_kv_transfer counter)
    prev, gen = ids(1000, 1), ids(32, 2)
    o = reuse_oracle(prev, gen, prev + gen + ids(150, 3), block_size=BLOCK, local_cached_tokens=896)
    assert (o.remote_tokens, o.outcome) == (135, "hit")


# 2. edited_history ----------------------------------------------------------------------------

def test_edited_history_compaction_diverges_inside_the_reply():
    u1 = {"role": "user", "content": "Book a flight to Seattle."}
    reply = "Sure, booked."                                # 13 characters
    prompt1 = encode(render([u1], True))
    gen = encode(reply) + [IM_END]
    history = [u1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Thanks"}]
    edited, what = apply_edit(history, {"style": "compact", "target": "last", "keep": 0.5})
    assert what == "compact" and edited[1]["content"] == "Sure, "   # int(13 * 0.5) = 6 characters kept
    assert history[1]["content"] == reply                           # the input is not modified
    turn2 = encode(render(edited, True))
    # char-level ids: the prompt, then "Sure, " agrees; next the edited history has <|im_end|>
    # where the generated reply had "b"
    o = reuse_oracle(prompt1, gen, turn2, block_size=BLOCK)
    assert (o.lcp, o.divergence) == (len(prompt1) + 6, len(prompt1) + 6)
    # the prompt is 44 ids (<|im_start|> + "user\n" 5 + 25 + <|im_end|> "\n" 2 + header 11), so the
    # divergence (50) is inside block 0: no whole block before it, the proxy must not offer D's blocks
    assert len(prompt1) == 44 and o.usable_tokens == 0 and o.outcome == "miss_mismatch"
    # the same edit after a long history keeps only the whole blocks before the divergence
    long_u = {"role": "user", "content": "x" * 300}
    p_long = encode(render([long_u], True))                          # 6 + 300 + 2 + 11 = 319 ids
    t_long = encode(render([long_u, edited[1], history[2]], True))
    o = reuse_oracle(p_long, gen, t_long, block_size=BLOCK)
    assert (len(p_long), o.lcp, o.usable_tokens) == (319, 325, 256)  # floor(325 / 128) * 128


def test_edited_history_reasoning_strip():
    hist = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>let me see</think>\nThe answer is 4.", "reasoning_content": "r"},
            {"role": "user", "content": "and?"}]
    edited, what = apply_edit(hist, {"style": "strip_reasoning", "target": "last", "keep": 1.0})
    assert what == "strip_reasoning"
    assert edited[1] == {"role": "assistant", "content": "The answer is 4."}
    # nothing to strip: compacted instead
    plain = [{"role": "assistant", "content": "abcdefghij"}]
    assert apply_edit(plain, {"style": "strip_reasoning", "keep": 0.3}) == (
        [{"role": "assistant", "content": "abc"}], "compact")
    first = [{"role": "assistant", "content": "aaaa"}, {"role": "assistant", "content": "bbbb"}]
    assert apply_edit(first, {"style": "compact", "target": "first", "keep": 0.5})[0][0]["content"] == "aa"


# 3. template_divergence -----------------------------------------------------------------------

THINK = "<think>\n\n</think>\n\n"


def render_think(messages, add_generation_prompt):
    """ChatML whose generation prompt opens an empty think block that history turns never show."""
    return render(messages, False) + ("<|im_start|>assistant\n" + THINK if add_generation_prompt else "")


def test_template_divergence_lcp_and_position():
    u1, u2 = {"role": "user", "content": "hi"}, {"role": "user", "content": "more"}
    prompt1 = encode(render_think([u1], True))
    gen = encode("hello") + [IM_END]
    turn2 = encode(render_think([u1, {"role": "assistant", "content": "hello"}, u2], True))
    # by hand: render([u1]) = <|im_start|> u s e r \n h i <|im_end|> \n = 1 + 4 + 1 + 2 + 1 + 1 = 10 ids,
    # then the header <|im_start|> a s s i s t a n t \n = 11 ids agree; then turn 1 had "<" (think),
    # the history has "h" (the reply)
    assert reuse_against(prompt1 + gen, turn2) == (21, 21)
    o = reuse_oracle(prompt1, gen, turn2, block_size=BLOCK)
    assert (o.lcp, o.divergence, o.outcome) == (21, 21, "miss_mismatch")


# 4. below_threshold ---------------------------------------------------------------------------

@pytest.mark.parametrize("p, g, local, remote, outcome", [
    (1030, 20, 1024, 25, "miss_below_threshold"),   # handle 1049, P holds 8 blocks (1024): 25 < 64
    (1000, 32, 896, 135, "hit"),                    # 1031 - 896 = 135 >= 64
    (1024, 1, 1024, 0, "miss_below_threshold"),     # handle 1024 = what P already holds: nothing to pull
    (1000, 80, 896, 183, "hit"),
])
def test_below_threshold(p, g, local, remote, outcome):
    prev, gen = ids(p, 4), ids(g, 5)
    o = reuse_oracle(prev, gen, prev + gen + ids(40, 6), block_size=BLOCK, local_cached_tokens=local, threshold=64)
    assert (o.remote_tokens, o.outcome) == (remote, outcome)


# 5. retokenization ----------------------------------------------------------------------------

def test_retokenization_two_generated_tokens_come_back_as_one():
    # The case's example is "\n" "\n" -> "\n\n"; the embedded vocabulary has no "\n\n" token
    # (it encodes as two), so the same BPE merge is shown with " book" + "ing" -> " booking".
    tok = Tokenizer.from_file(str(tokenizer_json()))

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    book, ing, booking = enc(" book"), enc("ing"), enc(" booking")
    assert len(book) == len(ing) == len(booking) == 1               # premise: three single tokens
    head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    prompt1 = enc(head)
    gen = enc("Your") + book + ing + enc(" is done")                  # a non-canonical split, generated
    reply_text = tok.decode(gen)
    assert reply_text == "Your booking is done"                       # the same text ...
    turn2 = enc(head + reply_text + "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")
    k = len(prompt1) + len(enc("Your"))
    assert turn2[k] == booking[0] and gen[len(enc("Your"))] == book[0]   # ... other ids
    # messages equal, ids not: divergence right after "Your", where " book" became " booking"
    o = reuse_oracle(prompt1, gen, turn2, block_size=BLOCK)
    assert (o.lcp, o.divergence) == (k, k)
    assert o.usable_tokens == 0 and o.outcome == "miss_mismatch"     # k < 128: no whole block before it
