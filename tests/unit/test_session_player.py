"""The session player (loadgen.session_player) without a server: a fake ``send``, the stub's pure
ChatML tokenizer, a list writer and a fake sleep. Every expected value is worked out by hand."""

from __future__ import annotations

import datetime as dt

import pytest

from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_history import TextHistory, TokenIdsHistory, token_bound
from loadgen.session_player import GapClock, PlayerOptions, SessionPlayer
from loadgen.session_recorder import SessionRecorder
from loadgen.stream_client import TurnResult
from loadgen.token_prompt import calibrate_joiner
from tests.integration.openai_stub import IM_END, encode, render

SYS = {"role": "system", "content": "S"}
U1 = {"role": "user", "content": "hi"}
U2 = {"role": "user", "content": "more"}
REF = {"role": "assistant", "content": "REF"}


def tokenize(messages=None, prompt=None, *, add_generation_prompt=True, add_special_tokens=False):
    """The stub server's /tokenize as a function: ChatML, one id per character."""
    return encode(render(messages, add_generation_prompt)) if messages is not None else encode(prompt)


class ListWriter:
    def __init__(self):
        self.rows: list[tuple[str, dict]] = []

    def append(self, table, row):
        self.rows.append((table, row))

    def table(self, name):
        return [r for t, r in self.rows if t == name]


class FakeServer:
    """``send``: answers each request with the next reply text (ChatML ids + <|im_end|>), or fails."""

    def __init__(self, replies: list[str | None], report_prompt_ids: bool = True):
        self.replies = list(replies)
        self.report = report_prompt_ids
        self.sent: list[tuple[str, dict, dict]] = []

    def __call__(self, url, body, headers):
        self.sent.append((url, body, headers))
        text = self.replies.pop(0)
        r = TurnResult(sent_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), e2e_s=0.25, ttft_s=0.1)
        if text is None:
            r.status, r.error = "error", "boom"
            return r
        prompt = body["prompt"] if "prompt" in body else encode(render(body["messages"], True))
        r.status, r.text, r.token_ids = "ok", text, encode(text) + [IM_END]
        r.prompt_token_ids = list(prompt) if self.report else None
        return r


def player(plan, history, server, writer, *, sleeps=None, **opts):
    rec = SessionRecorder(writer, "run", plan)
    return SessionPlayer(plan, history, server, rec, base_url="http://x/", model="m", run_id="run",
                         options=PlayerOptions(**opts), sleep=(sleeps.append if sleeps is not None else lambda s: None))


def test_text_history_turn_retry_fresh_by_hand():
    plan = SessionPlan("s", "src", [
        TurnPlan([SYS, U1], REF),
        TurnPlan([], REF, 0.0, "none", "retry"),
        TurnPlan([U2], REF, 0.0, "think"),
        TurnPlan([{"role": "user", "content": "side"}], REF, 0.0, "tool", "fresh"),
    ])
    server, writer = FakeServer(["a", "b", "c", "d"]), ListWriter()
    result = player(plan, TextHistory(tokenize, "s"), server, writer, max_tokens=5).play()

    urls = {u for u, _, _ in server.sent}
    assert urls == {"http://x/v1/chat/completions"}
    msgs = [b["messages"] for _, b, _ in server.sent]
    assert msgs[0] == [SYS, U1] and msgs[1] == [SYS, U1]                     # the retry resends
    assert msgs[2] == [SYS, U1, {"role": "assistant", "content": "b"}, U2]  # the retry's reply replaced "a"
    assert msgs[3] == [{"role": "user", "content": "side"}]
    assert [h["X-Session-ID"] for _, _, h in server.sent] == ["run/s"] * 3 + ["run/s~fresh3"]
    assert [b["conversation_id"] for _, b, _ in server.sent] == ["run/s"] * 3 + ["run/s~fresh3"]
    assert all(b["max_tokens"] == 5 and b["return_token_ids"] is True for _, b, _ in server.sent)

    turns = writer.table("turns")
    assert [(t["session_id"], t["turn_index"], t["kind"]) for t in turns] == [
        ("s", 0, "turn"), ("s", 1, "retry"), ("s", 2, "turn"), ("s~fresh3", 0, "fresh")]
    # expected reuse by hand: turn 0's span = its prompt + "a" + <|im_end|>; the retry's prompt is
    # turn 0's prompt again, so it diverges where it ends
    p0 = encode(render([SYS, U1], True))
    assert (turns[1]["expected_reusable_tokens"], turns[1]["divergence_position"]) == (len(p0), len(p0))
    # turn 2 continues the retry's prompt + reply "b" + <|im_end|> + "\n": the whole span is reusable
    p1_span = p0 + encode("b") + [IM_END]
    assert (turns[2]["expected_reusable_tokens"], turns[2]["divergence_position"]) == (len(p1_span), None)
    sessions = writer.table("sessions")
    assert [s["session_id"] for s in sessions] == ["s~fresh3", "s"]
    assert sessions[1]["turns"] == 3 and sessions[1]["status"] == "ok" and sessions[1]["llm_s"] == 0.75
    assert result.stopped == "complete" and len(result.turns) == 4


def test_token_ids_prompt_equals_the_full_render():
    """Second route: with replies that re-encode to the generated ids, the id-joined prompt of each
    turn equals the chat template's render of the whole text history."""
    joiner = calibrate_joiner(tokenize)
    plan = SessionPlan("s", "src", [TurnPlan([SYS, U1], REF), TurnPlan([U2], REF, 0.0, "think"),
                                    TurnPlan([{"role": "user", "content": "x"}], REF, 0.0, "think")])
    server, writer = FakeServer(["a", "bb", "c"]), ListWriter()
    player(plan, TokenIdsHistory(tokenize, "s", joiner), server, writer, history_mode="token_ids").play()
    assert {u for u, _, _ in server.sent} == {"http://x/v1/completions"}
    history = [SYS, U1, {"role": "assistant", "content": "a"}, U2, {"role": "assistant", "content": "bb"},
               {"role": "user", "content": "x"}]
    assert server.sent[1][1]["prompt"] == encode(render(history[:4], True))
    assert server.sent[2][1]["prompt"] == encode(render(history, True))


def test_a_failed_turn_is_recorded_and_the_reference_reply_stands_in():
    plan = SessionPlan("s", "src", [TurnPlan([SYS, U1], REF), TurnPlan([U2], REF, 0.0, "think")])
    server, writer = FakeServer([None, "ok"]), ListWriter()
    player(plan, TextHistory(tokenize, "s"), server, writer).play()
    assert server.sent[1][1]["messages"] == [SYS, U1, REF, U2]
    turns = writer.table("turns")
    assert [t["status"] for t in turns] == ["error", "ok"] and turns[0]["error"] == "boom"
    assert writer.table("sessions")[0]["status"] == "error"


def test_the_session_stops_before_a_prompt_over_the_limit():
    plan = SessionPlan("s", "src", [TurnPlan([SYS, U1], REF), TurnPlan([U2], REF, 0.0, "think")])
    limit = len(encode(render([SYS, U1], True)))  # turn 0 fits exactly; turn 1 is longer
    # a bound of the second prompt above the limit makes the text history render it before sending
    assert token_bound([U2]) > 0
    server, writer = FakeServer(["a", "b"]), ListWriter()
    result = player(plan, TextHistory(tokenize, "s", max_prompt_tokens=limit), server, writer,
                    max_prompt_tokens=limit).play()
    assert result.stopped == "max_prompt_tokens" and len(server.sent) == 1
    assert writer.table("sessions")[0]["turns"] == 1 and writer.table("sessions")[0]["status"] == "ok"


def test_a_retry_first_is_refused_and_the_session_recorded_as_cancelled():
    plan = SessionPlan("s", "src", [TurnPlan([{"role": "user", "content": "f"}], REF, kind="fresh")])
    object.__setattr__(plan, "turns", [TurnPlan([], REF, kind="retry")])  # past SessionPlan's own check
    writer = ListWriter()
    with pytest.raises(ValueError, match="retry with nothing to retry"):
        player(plan, TextHistory(tokenize, "s"), FakeServer([]), writer).play()
    assert writer.table("sessions")[0]["status"] == "cancelled"


def test_gap_clock_sleeps_the_planned_gap_less_what_has_passed():
    sleeps: list[float] = []
    clock = GapClock(sleeps.append)
    clock.wait(TurnPlan([U1], REF, 5.0, "think"))       # nothing sent yet: no wait
    assert clock.sending() == 0.0 and sleeps == []
    clock.finished(TurnResult(sent_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)))
    clock.wait(TurnPlan([U2], REF, 5.0, "think"))
    assert len(sleeps) == 1 and 4.9 < sleeps[0] <= 5.0
    clock.wait(TurnPlan([U2], REF, 0.0, "think"))       # a gap already over: no sleep
    assert len(sleeps) == 1


class Stopped(BaseException):
    """What Locust's kill raises in a user (gevent's GreenletExit is a BaseException too)."""


class StoppingServer(FakeServer):
    """Answers the first request; the second is interrupted in flight (the user is killed)."""

    def __call__(self, url, body, headers):
        if len(self.sent) == 1:
            self.sent.append((url, body, headers))
            raise Stopped()
        return super().__call__(url, body, headers)


@pytest.mark.parametrize("second", ["turn", "fresh"])
def test_a_request_interrupted_in_flight_is_a_cancelled_row_with_its_request_id(second):
    second_turn = (TurnPlan([U2], REF, 1.0, "think") if second == "turn"
                   else TurnPlan([{"role": "user", "content": "f"}], REF, 1.0, "think", kind="fresh"))
    plan = SessionPlan("s", "src", [TurnPlan([SYS, U1], REF), second_turn, TurnPlan([U2], REF, 1.0, "think")])
    writer, server, fired = ListWriter(), StoppingServer(["a", "b"]), []
    p = player(plan, TextHistory(tokenize, "s"), server, writer)
    p.recorder.on_turn = fired.append
    with pytest.raises(Stopped):
        p.play()
    turns = writer.table("turns")
    ids = [h["x-request-id"] for _, _, h in server.sent]
    assert len(set(ids)) == 2 and all(i.startswith("lg-") and len(i) == 35 for i in ids)
    # two requests sent, two rows: the first ok, the second cancelled, each with the id it was sent with
    assert [(r["status"], r["request_id"]) for r in turns] == [("ok", ids[0]), ("cancelled", ids[1])]
    assert turns[1]["kind"] == second and turns[1]["e2e_s"] >= 0
    assert turns[1]["session_id"] == ("s" if second == "turn" else "s~fresh1")
    assert [r.row["status"] for r in fired] == ["ok", "cancelled"]  # Locust hears of both
    assert [r["status"] for r in writer.table("sessions")][-1] == "cancelled"


def looked_up(status: str | None = "client_disconnected"):
    """A look-up that answers, for any request id, a 2-block pull (256 tokens) the proxy accounted."""
    asked: list[str] = []

    def lookup(request_id):
        asked.append(request_id)
        return {"request_id": request_id, "ended": status is not None, "status": status,
                "prefill_engine": "prefill-0", "decode_engine": "decode-0",
                "turnscope": {"reuse": "hit", "remote_tokens": 256, "reused_tokens": 256,
                              "prefill_cached_tokens": 128, "recomputed_tokens": 9, "prefill_leg_s": 0.031}}
    return lookup, asked


def test_a_request_interrupted_in_flight_carries_the_proxys_facts_looked_up_by_its_id():
    plan = SessionPlan("s", "src", [TurnPlan([SYS, U1], REF), TurnPlan([U2], REF, 1.0, "think")])
    writer, server = ListWriter(), StoppingServer(["a", "b"])
    lookup, asked = looked_up()
    p = player(plan, TextHistory(tokenize, "s"), server, writer)
    p.lookup = lookup
    with pytest.raises(Stopped):
        p.play()
    ok, cancelled = writer.table("turns")
    assert asked == [server.sent[1][2]["x-request-id"]]  # only the request left in flight is asked for
    assert ok["reused_tokens"] is None  # the stub's answered turn carried no facts: none made up
    assert (cancelled["status"], cancelled["reuse"], cancelled["reused_tokens"], cancelled["remote_tokens"],
            cancelled["prefill_cached_tokens"], cancelled["recomputed_tokens"], cancelled["prefill_leg_s"],
            cancelled["prefill_engine"], cancelled["decode_engine"]) == (
        "cancelled", "hit", 256, 256, 128, 9, 0.031, "prefill-0", "decode-0")
    assert cancelled["error"].endswith("(the proxy's facts looked up: the request ended client_disconnected)")


@pytest.mark.parametrize("how", ["unknown", "interrupted"])
def test_a_lookup_that_gives_nothing_or_is_interrupted_keeps_todays_cancelled_row(how):
    plan = SessionPlan("s", "src", [TurnPlan([SYS, U1], REF), TurnPlan([U2], REF, 1.0, "think")])
    writer, server = ListWriter(), StoppingServer(["a", "b"])

    def lookup(request_id):
        if how == "interrupted":
            raise Stopped()  # a second kill of the user while it asks
        # else: a server without the route (404) gives None

    p = player(plan, TextHistory(tokenize, "s"), server, writer)
    p.lookup = lookup
    with pytest.raises(Stopped):
        p.play()
    cancelled = writer.table("turns")[1]
    assert cancelled["status"] == "cancelled" and cancelled["reuse"] is None and cancelled["reused_tokens"] is None
    assert cancelled["error"] == "the load generator stopped with the request in flight"
    assert writer.table("sessions")[-1]["status"] == "cancelled"
