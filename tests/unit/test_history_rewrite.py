"""``loadgen.session.rewrite_reply``: a reply as a client that rewrites history sends it back.
Truths: the expected messages written out by hand."""

from loadgen.session import rewrite_reply

CALL = {"id": "call_7", "type": "function", "function": {"name": "search", "arguments": '{"to": "SEA", "from": "SFO"}'}}


def test_reasoning_is_stripped_from_content_and_fields():
    m = {"role": "assistant", "content": "<think>check the fare\nrules</think>\nBooked.", "reasoning_content": "x"}
    assert rewrite_reply(m, strip_reasoning=True) == {"role": "assistant", "content": "Booked."}
    assert m["reasoning_content"] == "x"  # pure: the reply itself is untouched
    assert rewrite_reply(m) == m           # nothing asked: sent back as returned


def test_the_stand_in_drops_the_start_of_a_reply_without_markers():
    m = {"role": "assistant", "content": "abcdefghij"}
    assert rewrite_reply(m, strip_reasoning=True)["content"] == "abcdefghij"  # no share: no reasoning to drop
    assert rewrite_reply(m, strip_reasoning=True, reasoning_share=0.3)["content"] == "defghij"
    # a reply with real reasoning loses only that, whatever the share
    t = {"role": "assistant", "content": "<think>r</think>answer"}
    assert rewrite_reply(t, strip_reasoning=True, reasoning_share=0.9)["content"] == "answer"


def test_tool_calls_are_re_rendered_as_a_client_that_parsed_them():
    m = {"role": "assistant", "content": None, "tool_calls": [CALL, {"id": "c2", "type": "function",
                                                                     "function": {"name": "f", "arguments": "not json"}}]}
    out = rewrite_reply(m, rerender_tool_calls=True)
    assert out["tool_calls"][0] == {"id": "call_rerendered_0", "type": "function",
                                    "function": {"name": "search", "arguments": '{"from":"SFO","to":"SEA"}'}}
    assert out["tool_calls"][1]["function"]["arguments"] == "not json"
    assert m["tool_calls"][0] is CALL and CALL["function"]["arguments"] == '{"to": "SEA", "from": "SFO"}'
