"""Joining the next turn's prompt from ids (loadgen.token_prompt), with a known ChatML tokenizer stub."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest

from core.contract import common_prefix_length
from loadgen.session_recorder import prompt_sha256
from loadgen.token_prompt import (
    TemplateJoinError,
    TurnJoiner,
    calibrate_joiner,
    next_prompt_ids,
    reuse_against,
    strip_generation_prompt,
)
from tests.integration.openai_stub import CHAR_BASE, IM_END, IM_START, encode, render

NL = CHAR_BASE + ord("\n")


def stub_tokenize(messages=None, prompt=None, *, add_generation_prompt=True, add_special_tokens=False):
    """The stub server's /tokenize as a function: ChatML, one id per character."""
    if messages is not None:
        return encode(render(messages, add_generation_prompt))
    return encode(prompt)


CHATML = TurnJoiner(end_of_turn_ids=(IM_END,), separator_ids=(NL,),
                    generation_prompt_ids=tuple(encode("<|im_start|>assistant\n")))


def test_calibration_finds_chatml_glue():
    assert calibrate_joiner(stub_tokenize) == CHATML
    # i.e. "<|im_end|>" then "\n" between a reply and the next "<|im_start|>"
    assert CHATML.end_of_turn_ids == (2,) and CHATML.separator_ids == (ord("\n") + CHAR_BASE,)


def test_length_stopped_reply_gets_end_of_turn_and_separator():
    prev = [IM_START, 100, 101, IM_END, NL, IM_START, 102]
    gen = [7, 8, 9]                       # stopped by max_tokens: no <|im_end|>
    new = [IM_START, 103, IM_END, NL, IM_START, 104]
    assert next_prompt_ids(prev, gen, new, CHATML) == prev + gen + [IM_END, NL] + new


def test_eos_stopped_reply_gets_only_the_separator():
    prev, new = [1, 2, 3], [IM_START, 50]
    gen = [7, 8, IM_END]                  # vLLM returns the EOS id in token_ids
    assert next_prompt_ids(prev, gen, new, CHATML) == prev + gen + [NL] + new
    # an empty reply (no token) still closes the turn
    assert next_prompt_ids(prev, [], new, CHATML) == prev + [IM_END, NL] + new


def test_joined_prompt_equals_the_full_render_over_three_turns():
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    prompt = stub_tokenize(msgs)
    for reply, new in [("hello", [{"role": "user", "content": "book it"}]),
                       ("checking", [{"role": "tool", "content": '{"ok": true}'}])]:
        gen = encode(reply)
        joined = next_prompt_ids(prompt, gen, stub_tokenize(new), CHATML)
        msgs = msgs + [{"role": "assistant", "content": reply}] + new
        assert joined == stub_tokenize(msgs)
        prompt = joined


def test_template_with_default_system_prompt_is_refused():
    def qwen_like(messages=None, prompt=None, *, add_generation_prompt=True, add_special_tokens=False):
        if messages is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "You are helpful."}, *messages]
        return stub_tokenize(messages, prompt, add_generation_prompt=add_generation_prompt)

    with pytest.raises(TemplateJoinError, match="does not end with the new message rendered alone"):
        calibrate_joiner(qwen_like)


def test_template_that_rerenders_history_is_refused():
    def strips_history(messages=None, prompt=None, *, add_generation_prompt=True, add_special_tokens=False):
        if messages is not None:  # earlier assistant turns rendered differently (e.g. reasoning stripped)
            messages = [dict(m, content="[" + m["content"] + "]") if m["role"] == "assistant" else m
                        for m in messages]
        return stub_tokenize(messages, prompt, add_generation_prompt=add_generation_prompt)

    with pytest.raises(TemplateJoinError, match="re-renders earlier turns"):
        calibrate_joiner(strips_history)


def test_strip_generation_prompt():
    rendered = stub_tokenize([{"role": "assistant", "content": "ok"}], add_generation_prompt=False)
    assert strip_generation_prompt(rendered, CHATML) == encode("ok") + [IM_END, NL]
    with pytest.raises(TemplateJoinError, match="does not start with the generation prompt"):
        strip_generation_prompt(encode("ok"), CHATML)


@pytest.mark.parametrize("prev, cur, expected", [
    ([1, 2, 3], [1, 2, 3, 4, 5], (3, None)),      # history extended: whole span reusable
    ([1, 2, 3], [1, 2, 9, 4], (2, 2)),            # diverges inside the previous span
    ([1, 2, 3], [9], (0, 0)),
    ([1, 2, 3], [1, 2], (2, 2)),                  # shorter prompt: diverges where it ends
    ([], [1], (0, None)),
])
def test_reuse_against(prev, cur, expected):
    assert reuse_against(prev, cur) == expected
    assert common_prefix_length(prev, cur) == expected[0]


def test_prompt_sha256_is_over_comma_joined_decimals():
    assert prompt_sha256([1, 20, 300]) == hashlib.sha256(b"1,20,300").hexdigest()


def test_real_embedded_tokenizer_joins_exactly():
    """With the embedded model's real tokenizer and ChatML template (trained on the shipped trace),
    the joined ids equal the template's full render for every turn of 20 trace conversations."""
    embedded = pytest.importorskip("serving.embedded_model")
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from loadgen.traces.taubench import load_taubench

    tok = embedded.build_tokenizer(Path(tempfile.mkdtemp()), embedded.ModelSpec())

    def tokenize(messages=None, prompt=None, *, add_generation_prompt=True, add_special_tokens=False):
        if messages is not None:
            r = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
            return list(r["input_ids"] if hasattr(r, "keys") else r)
        return tok.encode(prompt, add_special_tokens=add_special_tokens)

    joiner = calibrate_joiner(tokenize)
    assert tok.convert_ids_to_tokens(list(joiner.end_of_turn_ids)) == ["<|im_end|>"]
    assert tok.decode(list(joiner.separator_ids)) == "\n"
    head, tail = "<|im_start|>assistant\n", "<|im_end|>\n"
    checked = 0
    for conv in load_taubench(max_conversations=20):
        turns = conv.turns()
        msgs = list(turns[0][0])
        prompt = tokenize(msgs)
        for k in range(1, len(turns)):
            reply = turns[k - 1][1]
            # the reply's ids as the model would have generated them: its rendered text, encoded
            text = tok.apply_chat_template([reply], add_generation_prompt=False, tokenize=False)
            assert text.startswith(head) and text.endswith(tail)
            gen = tok.encode(text[len(head):-len(tail)], add_special_tokens=False)
            new = turns[k][0]
            joined = next_prompt_ids(prompt, gen, tokenize(new), joiner)
            msgs = msgs + [reply] + new
            assert joined == tokenize(msgs), (conv.id, k)
            prompt = joined
            checked += 1
    assert checked > 150
