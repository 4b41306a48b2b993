"""The session player: plays one :class:`~loadgen.session.SessionPlan` turn by turn and records it.

Three small parts do the work, the player only sequences them (docs/design.md follows one turn):

* a history strategy (:mod:`loadgen.session_history`: :class:`TextHistory` or
  :class:`TokenIdsHistory`) prepares each request's prompt and takes in what came back;
* a :class:`GapClock` sleeps out the planned gap (and a trace's arrival offset) and measures the
  gap actually left between requests; the time spent preparing the next request counts as part of
  the gap;
* a :class:`~loadgen.session_recorder.SessionRecorder` appends the ``turns`` and ``sessions`` rows.

Requests go through a ``send(url, body, headers) -> TurnResult`` callable and prompts are rendered
through a ``tokenize`` callable, so the player can be tested without a server; :func:`run_session`
wires it to :func:`loadgen.stream_client.stream_turn` and
:class:`core.tokenize_client.TokenizeClient`.

Turn kinds (:data:`core.contract.TURN_KINDS`, docs/workloads.md), all sent as real requests:

* ``turn`` / ``resume``: the history grows by the turn's new messages (a ``resume`` comes after a
  pause longer than the decode worker's KV TTL; it is played like a turn, after its gap);
* ``retry``: the previous request is sent again, same messages (or ids); its reply replaces the
  previous one in the history;
* ``edit``: the history is edited before sending (:func:`loadgen.session.apply_edit`); the edit
  stays; in ``token_ids`` mode the edited history is re-rendered from its text;
* ``fresh``: an unrelated single request under its own session id (``<session>~fresh<k>``, in the
  store and towards the proxy) with a ``sessions`` row of its own; the history is untouched.

Every request carries the session key (body :data:`~core.contract.SESSION_FIELD` and header
:data:`~core.contract.SESSION_HEADER`), a request id of its own (header
:data:`~core.contract.REQUEST_ID_HEADER`, ``lg-<32 hex>``; the proxy uses it as the request's
id, so its log and the ``turns`` row name the same request), ``return_token_ids: true``,
``max_tokens`` and ``temperature``. Every request sent gets a ``turns`` row: one interrupted in
flight (Locust stopping its users, Ctrl-C) is recorded ``cancelled`` with its request id before
the interruption goes on; the proxy's facts of it (reuse outcome, pulled tokens, engines) are asked
for by that id (:mod:`loadgen.facts_lookup`, a bounded wait) and carried by the row when the
server is turnscope's proxy. A failed turn (``error``/``timeout``) is recorded with its reason and the session
goes on, with the trace's reply standing in for the missing one. A session stops early, before
sending, when a prompt would exceed ``max_prompt_tokens``.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from core.contract import (
    HISTORY_MODES,
    REQUEST_ID_HEADER,
    SESSION_FIELD,
    SESSION_HEADER,
    RequestFactsAnswer,
    answer_as_response,
)
from core.tokenize_client import TokenizeClient
from loadgen.facts_lookup import lookup_request_facts
from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_history import (
    History,
    Prompt,
    SkipRequest,
    StopSession,
    TextHistory,
    TokenIdsHistory,
    joiner_for,
)
from loadgen.session_recorder import RowWriter, SessionRecorder, SessionResult, TurnRecord, turn_row
from loadgen.stream_client import GeventClient, TurnResult, stream_turn
from loadgen.token_prompt import TokenizeFn, TurnJoiner

log = logging.getLogger(__name__)

#: ``send(url, body, headers) -> TurnResult``: one streamed request, timed (never raises for
#: server or network misbehaviour; see :func:`loadgen.stream_client.stream_turn`).
SendFn = Callable[[str, dict[str, Any], dict[str, str]], TurnResult]
#: ``lookup(request_id) -> answer or None``: the proxy's facts of a request left in flight
#: (:func:`loadgen.facts_lookup.lookup_request_facts`; bounded, never raises for the server's sake).
LookupFn = Callable[[str], RequestFactsAnswer | None]


@dataclass(frozen=True)
class PlayerOptions:
    """The knobs of a session player.

    Attributes:
        history_mode: ``text`` or ``token_ids`` (:data:`core.contract.HISTORY_MODES`).
        max_tokens: output cap per turn, tokens (a turn's own ``max_tokens`` wins).
        max_prompt_tokens: stop the session, before sending, when a prompt would be longer
            (tokens); None: no limit.
        temperature: sampling temperature (0: greedy).
        extra_body: more request fields (e.g. ``{"ignore_eos": true}``), merged last.
        conversation_id: the session key sent to the proxy; None: ``"<run_id>/<session_id>"``.
        keep_turns: keep every :class:`TurnRecord` in the result (False: only the session row and
            ``stopped``; what a load generator with thousands of live sessions wants).
    """

    history_mode: str = "text"
    max_tokens: int = 64
    max_prompt_tokens: int | None = None
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    conversation_id: str | None = None
    keep_turns: bool = True

    def __post_init__(self) -> None:
        if self.history_mode not in HISTORY_MODES:
            raise ValueError(f"history_mode must be one of {HISTORY_MODES}, got {self.history_mode!r}")


class GapClock:
    """Waits out the gap before each request and measures the gap actually left (seconds).

    ``sleep`` is the sleep function (``time.sleep``, gevent-patched under Locust); the clock is
    ``time.perf_counter``.
    """

    def __init__(self, sleep: Callable[[float], None]):
        self.sleep = sleep
        self.first_send: float | None = None
        self.last_end: float | None = None
        self.first_sent_at: dt.datetime | None = None  # wall-clock time of the first request

    def wait(self, tp: TurnPlan) -> None:
        """Sleep out what is left of ``tp``'s gap (and of its trace arrival offset ``at_s``)."""
        if self.last_end is None:
            return
        remaining = tp.gap_before_s - (time.perf_counter() - self.last_end)
        if tp.at_s is not None and self.first_send is not None:
            remaining = max(remaining, self.first_send + tp.at_s - time.perf_counter())
        if remaining > 0:
            self.sleep(remaining)

    def sending(self) -> float:
        """Mark a request as sent now; returns the gap since the previous one finished (0 first)."""
        send = time.perf_counter()
        gap = 0.0 if self.last_end is None else send - self.last_end
        if self.first_send is None:
            self.first_send = send
        return gap

    def finished(self, result: TurnResult) -> None:
        """Mark the request as finished now."""
        self.last_end = time.perf_counter()
        if self.first_sent_at is None:
            self.first_sent_at = result.sent_at

    @property
    def task_latency_s(self) -> float:
        """First send -> last finish, seconds (0 before anything was sent)."""
        if self.first_send is None or self.last_end is None:
            return 0.0
        return self.last_end - self.first_send


@dataclass
class InFlight:
    """A request sent whose ``turns`` row is not written yet: what is needed to write it if the
    session is interrupted (``fresh_k``: the plan index of a fresh side request, else None)."""

    tp: TurnPlan
    turn_k: int
    fresh_k: int | None
    request_id: str
    gap_s: float
    sent_at: dt.datetime
    t_send: float
    result: TurnResult | None = None


def new_request_id() -> str:
    """A fresh request id, ``lg-`` + 32 hex digits (uuid4)."""
    return f"lg-{uuid.uuid4().hex}"


class SessionPlayer:
    """Plays one session: for each turn, prepare -> wait -> send -> record -> advance.

    Args:
        plan: the session.
        history: the history strategy (:class:`TextHistory` or :class:`TokenIdsHistory`).
        send: ``send(url, body, headers) -> TurnResult``.
        recorder: where the rows go.
        base_url: server root (the proxy, or a vLLM server), e.g. ``http://127.0.0.1:8000``.
        model: model name for the requests.
        run_id: the run (the default session key is ``"<run_id>/<session_id>"``).
        options: the knobs.
        sleep: the sleep function for gaps.
        lookup: asks the proxy for the facts of a request left in flight (None: none asked).
    """

    def __init__(self, plan: SessionPlan, history: History, send: SendFn, recorder: SessionRecorder, *,
                 base_url: str, model: str, run_id: str, options: PlayerOptions,
                 sleep: Callable[[float], None] = time.sleep, lookup: LookupFn | None = None):
        self.plan = plan
        self.lookup = lookup
        self.history = history
        self.send = send
        self.recorder = recorder
        self.options = options
        self.clock = GapClock(sleep)
        self.url = base_url.rstrip("/") + history.path
        self.model = model
        self.conversation_id = options.conversation_id or f"{run_id}/{plan.session_id}"
        self.run_id = run_id
        self.index = 0  # turn_index of the next own turn
        self.in_flight: InFlight | None = None  # sent, row not written yet

    def play(self) -> SessionResult:
        """Play every turn, then record the session. Returns what happened.

        Raises:
            ValueError: a ``retry`` with no earlier request to retry.
            BaseException: anything that interrupts the session (Locust killing the user, Ctrl-C)
                is re-raised after the ``cancelled`` session row is written.
        """
        try:
            for k, tp in enumerate(self.plan.turns):
                if tp.kind == "fresh":
                    self.play_fresh(k, tp)
                else:
                    self.play_turn(k, tp)
        except StopSession as stop:
            self.recorder.result.stopped = stop.reason
            if stop.failed:
                self.recorder.failed()
        except BaseException:
            self._cancel()
            raise
        return self.recorder.finish(self.clock.task_latency_s, self.clock.first_sent_at)

    def play_turn(self, k: int, tp: TurnPlan) -> None:
        """One of the session's own turns (raises :class:`StopSession` to end the session)."""
        prompt = self.history.prepare(tp, k)  # counts as part of the gap
        result, gap = self._send(tp, k, None, self.conversation_id, prompt)
        if self.index > 0:
            self.recorder.gap(tp.gap_kind, gap)
        prompt_ids = self.history.prompt_ids_of(result, prompt, k)
        expected, divergence = self.history.expected_reuse(prompt_ids)
        row = turn_row(run_id=self.run_id, session_id=self.plan.session_id, turn_index=self.index, plan=tp,
                       result=result, gap_before_s=gap, prompt_ids=prompt_ids,
                       expected_reusable_tokens=expected, divergence_position=divergence)
        self.index += 1
        self.in_flight = None
        self.recorder.own_turn(row, result, prompt_ids)
        self.history.advance(tp, prompt, result, prompt_ids, k)

    def play_fresh(self, k: int, tp: TurnPlan) -> None:
        """An unrelated single request with its own session id; the history is left alone."""
        try:
            prompt = self.history.prepare_fresh(tp, k)
        except SkipRequest:
            return
        result, gap = self._send(tp, k, k, f"{self.conversation_id}~fresh{k}", prompt)
        self.recorder.gap(tp.gap_kind, gap)  # the agent's time before its side call
        prompt_ids = self.history.prompt_ids_of(result, prompt, None)
        session_id = f"{self.plan.session_id}~fresh{k}"
        row = turn_row(run_id=self.run_id, session_id=session_id, turn_index=0, plan=tp, result=result,
                       gap_before_s=gap, prompt_ids=prompt_ids,
                       expected_reusable_tokens=None if prompt_ids is None else 0,  # nothing before it
                       divergence_position=None)
        self.in_flight = None
        self.recorder.fresh_turn(k, session_id, row, result, prompt_ids)

    def request_body(self, tp: TurnPlan, conversation_id: str, prompt: Prompt) -> dict[str, Any]:
        """The generate request's body for ``prompt``."""
        o = self.options
        body: dict[str, Any] = {"model": self.model, SESSION_FIELD: conversation_id, "return_token_ids": True,
                                "max_tokens": tp.max_tokens if tp.max_tokens is not None else o.max_tokens,
                                "temperature": o.temperature}
        body.update(self.history.request_fields(prompt))
        body.update(o.extra_body)
        return body

    def _send(self, tp: TurnPlan, k: int, fresh_k: int | None, conversation_id: str,
              prompt: Prompt) -> tuple[TurnResult, float]:
        """Sleep out the rest of the gap, send, time the turn. Returns ``(result, gap_s)``; the
        request stays :attr:`in_flight` until its row is written."""
        body = self.request_body(tp, conversation_id, prompt)
        self.clock.wait(tp)
        gap = self.clock.sending()
        request_id = new_request_id()
        self.in_flight = InFlight(tp, k, fresh_k, request_id, gap, dt.datetime.now(dt.UTC), time.perf_counter())
        result = self.send(self.url, body, {SESSION_HEADER: conversation_id, REQUEST_ID_HEADER: request_id})
        if result.request_id is None:
            result.request_id = request_id
        self.in_flight.result = result
        self.clock.finished(result)
        return result, gap

    def _record_in_flight(self) -> None:
        """Write the row of the request interrupted in flight: ``cancelled`` with the time it had
        run and the proxy's facts of it (:meth:`_looked_up`), or, when it had finished and only
        its row was missing, what it measured."""
        f = self.in_flight
        self.in_flight = None
        result = f.result
        if result is None:
            result = TurnResult(sent_at=f.sent_at, status="cancelled", request_id=f.request_id,
                                error="the load generator stopped with the request in flight",
                                e2e_s=time.perf_counter() - f.t_send)
            self._looked_up(result)
        if f.fresh_k is None:
            row = turn_row(run_id=self.run_id, session_id=self.plan.session_id, turn_index=self.index, plan=f.tp,
                           result=result, gap_before_s=f.gap_s, prompt_ids=None, expected_reusable_tokens=None,
                           divergence_position=None)
            self.index += 1
            self.recorder.own_turn(row, result, None)
        else:
            session_id = f"{self.plan.session_id}~fresh{f.fresh_k}"
            row = turn_row(run_id=self.run_id, session_id=session_id, turn_index=0, plan=f.tp, result=result,
                           gap_before_s=f.gap_s, prompt_ids=None, expected_reusable_tokens=None,
                           divergence_position=None)
            self.recorder.fresh_turn(f.fresh_k, session_id, row, result, None)

    def _looked_up(self, result: TurnResult) -> None:
        """Into a cancelled ``result``: the proxy's facts of its request (as the response would have
        carried them: :func:`core.contract.answer_as_response`, read into the row by
        :func:`core.contract.response_facts`), and how the proxy saw it end, in ``error``. Nothing
        when there is no look-up, the server does not know the request, or the look-up itself
        was interrupted (a second kill: the row is written all the same, the reason logged)."""
        if self.lookup is None or result.request_id is None:
            return
        try:
            answer = self.lookup(result.request_id)
        except BaseException as exc:  # noqa: BLE001 - the row must be written whatever interrupts the look-up
            log.warning("session %s: the facts of cancelled request %s were not looked up: %s: %s",
                        self.plan.session_id, result.request_id, type(exc).__name__, exc)
            return
        if answer is None:
            return
        result.headers, result.proxy_facts = answer_as_response(answer)
        seen = (f"ended {answer.get('status')}" if answer.get("ended")
                else "had not ended when asked")
        result.error = f"{result.error} (the proxy's facts looked up: the request {seen})"

    def _cancel(self) -> None:
        """Interrupted: keep what was measured (the request in flight's row, a ``cancelled`` session row)."""
        self.recorder.result.stopped = "cancelled"
        try:
            if self.in_flight is not None:
                self._record_in_flight()
            self.recorder.finish(self.clock.task_latency_s, self.clock.first_sent_at, "cancelled")
        except Exception:  # never mask the original exception
            log.exception("session %s: could not record the cancelled request or session",
                          self.plan.session_id)


def make_history(history_mode: str, tokenize: TokenizeFn, session_id: str, *,
                 max_prompt_tokens: int | None = None, joiner: TurnJoiner | None = None,
                 rewrite: dict[str, Any] | None = None) -> History:
    """The history strategy for ``history_mode`` (``token_ids`` needs the template's ``joiner``);
    ``rewrite``: how earlier replies are rewritten (``loadgen.session.rewrite_reply``'s keywords)."""
    if history_mode == "token_ids":
        if joiner is None:
            raise ValueError("token_ids history needs the chat template's joiner (joiner_for)")
        return TokenIdsHistory(tokenize, session_id, joiner, max_prompt_tokens, rewrite=rewrite)
    return TextHistory(tokenize, session_id, max_prompt_tokens, rewrite=rewrite)


def run_session(
    plan: SessionPlan,
    client: httpx.Client,
    base_url: str,
    model: str,
    writer: RowWriter,
    run_id: str,
    history_mode: str = "text",
    *,
    max_tokens: int = 64,
    max_prompt_tokens: int | None = None,
    timeout_s: float = 120.0,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
    conversation_id: str | None = None,
    history_rewrite: dict[str, Any] | None = None,
    on_turn: Callable[[TurnRecord], None] | None = None,
    sleep: Callable[[float], None] | None = None,
    tokenizer: TokenizeClient | None = None,
    keep_turns: bool = True,
    stream_client: httpx.Client | GeventClient | None = None,
) -> SessionResult:
    """Play ``plan`` against a server with a :class:`SessionPlayer` and return what happened.

    Args:
        plan, base_url, model, run_id: as :class:`SessionPlayer`.
        client: sync httpx client for the turns, ``/tokenize`` and the look-up of a request left
            in flight (:func:`loadgen.facts_lookup.lookup_request_facts`).
        writer: store writer; gets one ``turns`` row per sent turn and one ``sessions`` row
            (:class:`~loadgen.session_recorder.SessionRecorder` says what they hold).
        history_mode, max_tokens, max_prompt_tokens, temperature, extra_body, conversation_id,
            keep_turns: as :class:`PlayerOptions`.
        timeout_s: per-turn connect/read/total timeout, seconds (``stream_turn``).
        history_rewrite: how the client rewrites its earlier replies (the workload's
            ``history_rewrite``, ``loadgen.session.rewrite_reply``'s keywords); None: sent as returned.
        on_turn: called after each turn is recorded (e.g. to fire Locust events).
        sleep: the sleep function for gaps (default ``time.sleep``, looked up at call time so that
            gevent's patch applies).
        tokenizer: the ``/tokenize`` client (default: one on ``client``/``base_url``/``model``).
        stream_client: the client the streamed turns go through (default ``client``).

    Raises:
        ValueError: unknown ``history_mode``; a ``retry`` with no earlier request to retry.
        TemplateJoinError: ``token_ids`` and the chat template cannot be reproduced from ids.
        TokenizeError: the calibration for ``token_ids`` failed (before anything is sent).
    """
    options = PlayerOptions(history_mode=history_mode, max_tokens=max_tokens, max_prompt_tokens=max_prompt_tokens,
                            temperature=temperature, extra_body=dict(extra_body or {}),
                            conversation_id=conversation_id, keep_turns=keep_turns)
    tok = tokenizer or TokenizeClient(client, base_url.rstrip("/"), model, timeout_s=min(timeout_s, 60.0))
    joiner = joiner_for(tok) if history_mode == "token_ids" else None
    history = make_history(history_mode, tok, plan.session_id, max_prompt_tokens=max_prompt_tokens, joiner=joiner,
                           rewrite=history_rewrite)
    transport = stream_client or client

    def send(url: str, body: dict[str, Any], headers: dict[str, str]) -> TurnResult:
        return stream_turn(transport, url, body, headers=headers, timeout_s=timeout_s)

    def lookup(request_id: str) -> RequestFactsAnswer | None:
        return lookup_request_facts(client, base_url, request_id, sleep=sleep)

    recorder = SessionRecorder(writer, run_id, plan, keep_turns=keep_turns, on_turn=on_turn)
    return SessionPlayer(plan, history, send, recorder, base_url=base_url, model=model, run_id=run_id,
                         options=options, sleep=sleep or time.sleep, lookup=lookup).play()
