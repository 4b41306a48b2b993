"""The guard's incremental renderer gives exactly the ids of a full render (serving/prompt_render.py).

The truth is the tokenizer's encode of the whole conversation rendered by the chat template (a
second route through the same tokenizer, with no boundary logic); the real workers' /tokenize is
checked in tests/integration/test_proxy_outcomes_vllm.py.
"""

import random

import pytest

from serving.embedded_model import ensure_model
from serving.prompt_render import IncrementalRenderer, MessageLocalTemplate

TRICKY = ["", " ", "\n", "  \n\n", "<|im_start|>", "<|im_end|>", "<|im_start|>user\nfake", "é漢字🙂",
          "word", " word", "word ", "\t", "```json\n{\"a\": 1}\n```", "<|endoftext|>", "<|im_end", "im_start|>"]


@pytest.fixture(scope="module", params=["message-local", "whole-text"])
def renderer(request):
    """The embedded template rendered message by message, and (local off) re-rendered whole."""
    r = IncrementalRenderer(ensure_model())
    assert r.local is not None  # the embedded ChatML template is message-local
    if request.param == "whole-text":
        r.local = None
    return r


def full_ids(r: IncrementalRenderer, body: dict) -> list[int]:
    return r.fast.encode(r.render_text(body), add_special_tokens=False).ids


def random_text(rng: random.Random) -> str:
    words = ["the", "flight", "booking", "refund", " ", "\n", "UA123", "12:30", "€40", "ok."] + TRICKY
    return "".join(rng.choice(words) + rng.choice(["", " ", "\n"]) for _ in range(rng.randrange(0, 30)))


def test_incremental_equals_full_render_on_many_conversations(renderer):
    rng = random.Random(15)
    checked = 0
    for conv in range(60):
        session = f"s{conv}"
        messages = [{"role": "system", "content": random_text(rng)}]
        for turn in range(6):
            messages.append({"role": "user", "content": random_text(rng)})
            body = {"messages": list(messages)}
            if turn == 0:
                assert renderer.keep(session, body, full_ids(renderer, body))  # P agreed
            else:
                got = renderer.render(session, body)
                assert got is not None, (conv, turn)
                assert (renderer._state[session].text is None) == (renderer.local is not None)
                assert list(got) == full_ids(renderer, body), (conv, turn)
                checked += 1
            reply = {"role": "assistant", "content": random_text(rng)}
            if rng.random() < 0.3:
                reply = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": random_text(rng)}}]}
            messages.append(reply)
            if rng.random() < 0.3:
                messages.append({"role": "tool", "content": random_text(rng)})
    assert checked == 60 * 5


def test_an_edit_or_other_options_fall_back_to_the_full_render(renderer):
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    assert renderer.keep("e", body, full_ids(renderer, body))
    edited = {"messages": [{"role": "user", "content": "hello, there"}, {"role": "assistant", "content": "x"},
                           {"role": "user", "content": "more"}]}
    assert renderer.render("e", edited) is None  # the prefix changed: P renders it
    grown = {"messages": body["messages"] + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}
    assert renderer.render("e", grown | {"add_generation_prompt": False}) is None
    assert renderer.render("e", grown | {"chat_template": "{{ messages }}"}) is None
    assert list(renderer.render("e", grown)) == full_ids(renderer, grown)
    assert renderer.render("unknown-session", grown) is None


def test_a_disagreement_with_p_turns_the_renderer_off():
    r = IncrementalRenderer(ensure_model())
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert not r.keep("s", body, full_ids(r, body) + [1])  # P computed something else
    assert r.disabled
    assert not r.keep("s", body, full_ids(r, body))
    assert r.render("s", body | {"messages": body["messages"] * 2}) is None


CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, local", [
    (CHATML, True),
    ("{{ bos_token }}" + CHATML, True),
    (CHATML.replace("<|im_end|>", "{% if loop.last %}!{% endif %}<|im_end|>"), False),   # reads loop
    ("{{ messages[0]['content'] }}" + CHATML, False),                                    # reads messages
    ("{% set ns = namespace(n=0) %}" + CHATML, False),                                   # assigns
    (CHATML.replace("<|im_end|>", "{% if message['role'] == 'x' %}{% break %}{% endif %}<|im_end|>"), False),
    (CHATML + CHATML, False),                                                            # two loops
])
def test_message_local_templates_are_recognised_statically(template, local):
    assert (MessageLocalTemplate.of(template) is not None) == local
