"""Play one agent session turn by turn against an OpenAI-compatible server and record it (DESIGN §4, §5).

A :class:`SessionPlan` is a list of :class:`TurnPlan` s: the messages appended before each model call
(user text, tool results), the trace's reply for that call, the gap before it and the turn's kind.
:func:`run_session` sends the turns in order, one request each, streaming with
:func:`loadgen.stream_client.stream_turn`:

* ``history_mode="text"`` (chat clients): POST ``/v1/chat/completions`` with all messages so far.
  Earlier assistant messages are the replies the server actually returned (``content`` = returned
  text, plus ``tool_calls`` if it returned any), so the server re-tokenizes its own replies.
* ``history_mode="token_ids"`` (RL rollout clients): POST ``/v1/completions`` with
  ``prompt`` = previous prompt ids + generated ids + end-of-turn + the new messages' rendered ids
  (:mod:`loadgen.token_prompt`), so the history's ids match exactly what the server computed.

Turn kinds (DESIGN §4), all sent as real requests so the proxy's outcomes show up:

* ``turn`` / ``resume``: the history grows by the turn's new messages (a ``resume`` comes after a
  pause longer than the decode worker's KV TTL; it is played like a turn, after its gap);
* ``retry``: the previous request is sent again, same messages (or ids), right after; its reply
  replaces the previous one in the history;
* ``edit``: the history is edited before sending (:func:`apply_edit`: an assistant reply
  compacted or its reasoning stripped); the edit stays; in ``token_ids`` mode the edited history
  is re-rendered from its text;
* ``fresh``: an unrelated single request under its own session id (``<session>~fresh<k>``, in
  the store and towards the proxy) with a ``sessions`` row of its own; the history is untouched.

Every request carries ``conversation_id`` (body) and ``X-Session-ID`` (header), the session key of
turnscope's proxy, ``return_token_ids: true``, ``max_tokens`` and ``temperature``. Between turns the
session sleeps the planned gap (``time.sleep``; under Locust gevent patches it), counting the time
spent preparing the next request as part of the gap. In ``text`` mode the prompt is rendered
(``/tokenize``) before sending only when an upper bound of its length (see :func:`_token_bound`)
exceeds ``max_prompt_tokens``; otherwise the ids the server reports for the prompt
(``return_token_ids``) give the expected reuse, and a server that reports none is asked
``/tokenize`` after the turn. ``token_ids`` mode always renders before sending.

Per turn one ``turns`` row is appended to the store and, at the end, one ``sessions`` row (columns of
``data/schema.sql``). A failed turn (``error``/``timeout``) is recorded with its reason and the
session goes on, with the trace's reply standing in for the missing one. A session stops early,
before sending, when a prompt would exceed ``max_prompt_tokens``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import re
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np

from loadgen.stream_client import GeventClient, TurnResult, stream_turn
from loadgen.token_prompt import (
    TemplateJoinError,
    TurnJoiner,
    calibrate_joiner,
    next_prompt_ids,
    reuse_against,
    strip_generation_prompt,
)

log = logging.getLogger(__name__)

HISTORY_MODES = ("text", "token_ids")
GAP_KINDS = ("none", "tool", "think", "pause")
TURN_KINDS = ("turn", "retry", "edit", "fresh", "resume")


class RowWriter(Protocol):
    """What :func:`run_session` needs of a store writer (``loadgen.store.ShardWriter``)."""

    def append(self, table: str, row: dict[str, Any]) -> None: ...


class TokenizeError(RuntimeError):
    """The server's ``/tokenize`` failed or answered something that is not a token list."""


# --------------------------------------------------------------------------------------- plans


EDIT_STYLES = ("compact", "strip_reasoning")
EDIT_TARGETS = ("last", "first")


@dataclass(frozen=True)
class TurnPlan:
    """One planned model call.

    Attributes:
        new_messages: OpenAI messages appended to the history right before this call (turn 0:
            system + first user message; later: a user message or tool results). For a ``retry``:
            empty (the previous request is sent again). For a ``fresh`` request: the whole,
            unrelated conversation it sends.
        reference_reply: the trace's assistant message for this call; it stands in for the reply
            when the call fails, so the history stays well-formed.
        gap_before_s: seconds to wait after the previous request finished (0 for turn 0).
        gap_kind: ``none`` (turn 0, retry) | ``tool`` | ``think`` | ``pause``.
        kind: ``turn`` | ``retry`` (the previous request again, same history) | ``edit`` (the history
            is edited before this call, see ``edit``) | ``fresh`` (an unrelated single request with
            its own session id; the session's history is untouched) | ``resume`` (the session goes on
            after a pause longer than the decode worker's KV TTL).
        max_tokens: output tokens for this call (None: the session's default).
        at_s: trace replay: send no earlier than ``at_s`` seconds after the session's first request
            was sent (the trace's arrival offset, already time-scaled); None: only the gap applies.
        edit: for ``kind="edit"``: ``{"style": "compact"|"strip_reasoning", "target": "last"|"first",
            "keep": fraction}``: the last (or first) assistant message of the history is shortened
            to ``keep`` of its characters (``compact``), or its reasoning is removed
            (``strip_reasoning``: ``reasoning_content``/``reasoning`` fields and ``<think>...</think>``
            spans; a reply without reasoning is compacted instead). See :func:`apply_edit`.
        trace_reusable_tokens: trace replay: the prompt tokens the trace says were a prefix of the
            previous request (scaled), stored as ``turns.trace_reusable_tokens``; None otherwise.
    """

    new_messages: list[dict[str, Any]]
    reference_reply: dict[str, Any]
    gap_before_s: float = 0.0
    gap_kind: str = "none"
    kind: str = "turn"
    max_tokens: int | None = None
    at_s: float | None = None
    edit: dict[str, Any] | None = None
    trace_reusable_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.gap_kind not in GAP_KINDS:
            raise ValueError(f"TurnPlan.gap_kind must be one of {GAP_KINDS}, got {self.gap_kind!r}")
        if self.kind not in TURN_KINDS:
            raise ValueError(f"TurnPlan.kind must be one of {TURN_KINDS}, got {self.kind!r}")
        if not (isinstance(self.gap_before_s, (int, float)) and self.gap_before_s >= 0):
            raise ValueError(f"TurnPlan.gap_before_s must be a number >= 0 seconds, got {self.gap_before_s!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"TurnPlan.max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.at_s is not None and not (isinstance(self.at_s, (int, float)) and self.at_s >= 0):
            raise ValueError(f"TurnPlan.at_s must be a number >= 0 seconds or None, got {self.at_s!r}")
        if self.kind == "retry" and self.new_messages:
            raise ValueError("TurnPlan.new_messages must be empty for a retry (the previous request is resent)")
        if self.kind == "fresh" and not self.new_messages:
            raise ValueError("TurnPlan.new_messages must hold the whole request for a fresh turn")
        if self.kind == "edit":
            e = self.edit or {}
            if e.get("style") not in EDIT_STYLES or e.get("target", "last") not in EDIT_TARGETS:
                raise ValueError(f"TurnPlan.edit must be {{'style': one of {EDIT_STYLES}, 'target': one of "
                                 f"{EDIT_TARGETS}, 'keep': 0..1}} for an edit, got {self.edit!r}")
            keep = e.get("keep", 0.5)
            if not (isinstance(keep, (int, float)) and 0 <= keep <= 1):
                raise ValueError(f"TurnPlan.edit.keep must be a fraction in [0, 1], got {keep!r}")
        elif self.edit is not None:
            raise ValueError(f"TurnPlan.edit is only for kind 'edit', not {self.kind!r}")


@dataclass(frozen=True)
class SessionPlan:
    """A session to play: its id (unique within a run), where it came from, and its turns.

    ``start_at_s``: trace replay: the session's first request is due this many seconds after the
    run started (already time-scaled); None: as soon as a user is free. The first turn that is not
    ``fresh`` must be a ``turn`` (there is nothing to retry, edit or resume yet).
    """

    session_id: str
    source: str
    turns: list[TurnPlan]
    archetype: str | None = None
    start_at_s: float | None = None

    def __post_init__(self) -> None:
        first = next((t for t in self.turns if t.kind != "fresh"), None)
        if first is not None and first.kind != "turn":
            raise ValueError(f"session {self.session_id}: the first turn must be of kind 'turn', got {first.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/msgpack-safe), e.g. to send from the Locust master to a worker."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(session_id=d["session_id"], source=d["source"], archetype=d.get("archetype"),
                   start_at_s=d.get("start_at_s"), turns=[TurnPlan(**t) for t in d["turns"]])


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def apply_edit(messages: Sequence[dict[str, Any]], edit: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The history with one assistant message edited (pure; ``messages`` is not modified).

    Args:
        messages: the OpenAI history.
        edit: ``{"style", "target", "keep"}`` as in :class:`TurnPlan`.

    Returns:
        ``(edited, what)``: the new list and the style actually applied (``compact`` when a
        ``strip_reasoning`` edit found no reasoning; ``none`` when there is no assistant message).
        ``compact`` keeps the first ``int(len(content) * keep)`` characters of the content (tool
        calls are kept).
    """
    out = [dict(m) for m in messages]
    idx = [i for i, m in enumerate(out) if m.get("role") == "assistant"]
    if not idx:
        return out, "none"
    m = out[idx[-1] if edit.get("target", "last") == "last" else idx[0]]
    content = m.get("content") if isinstance(m.get("content"), str) else ""
    if edit["style"] == "strip_reasoning":
        had = any(k in m for k in ("reasoning_content", "reasoning"))
        m.pop("reasoning_content", None)
        m.pop("reasoning", None)
        stripped = _THINK.sub("", content)
        if had or stripped != content:
            m["content"] = stripped
            return out, "strip_reasoning"
    m["content"] = content[: int(len(content) * float(edit.get("keep", 0.5)))]
    return out, "compact"


def plan_from_conversation(
    conv: Any,
    *,
    session_id: str | None = None,
    tool_gap_s: float = 0.0,
    think_gap_s: float = 0.0,
    archetype: str = "trace",
) -> SessionPlan:
    """Turn a trace conversation (``loadgen.traces.taubench.Conversation``) into a session plan.

    One turn per assistant message. The gap before turn k >= 1 is ``tool`` (``tool_gap_s``) when
    the messages appended since the previous reply include a tool result, else ``think``
    (``think_gap_s``, a user writing).

    Args:
        conv: has ``id``, ``source`` and ``turns()`` -> ``[(new_messages, reference_reply), ...]``.
        session_id: defaults to ``conv.id``.
        tool_gap_s, think_gap_s: seconds (>= 0).
    """
    turns: list[TurnPlan] = []
    for k, (new, ref) in enumerate(conv.turns()):
        if k == 0:
            turns.append(TurnPlan(new_messages=list(new), reference_reply=ref))
        elif any(m.get("role") == "tool" for m in new):
            turns.append(TurnPlan(list(new), ref, float(tool_gap_s), "tool"))
        else:
            turns.append(TurnPlan(list(new), ref, float(think_gap_s), "think"))
    return SessionPlan(session_id=session_id or conv.id, source=getattr(conv, "source", "") or conv.id,
                       turns=turns, archetype=archetype)


# ------------------------------------------------------------------------------------ tokenize


class Tokenizer:
    """Client of the server's vLLM-style ``/tokenize`` (chat-template renders and plain encodes).

    Args:
        client: sync httpx client.
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/tokenize`` is appended).
        model: the model name sent in each request.
        timeout_s: per request, seconds.
        retries: a request that cannot reach the server, or gets 502/503/504 (a proxy or worker
            restarting), is tried again this many times, 0.25 s after the first failure and twice
            as long after each next one (about 16 s in all by default: a ``token_ids`` session
            cannot build its next prompt without it, and would stop).
    """

    def __init__(self, client: httpx.Client, base_url: str, model: str, timeout_s: float = 30.0,
                 retries: int = 6):
        self.client = client
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s
        self.retries = retries

    def __call__(
        self,
        messages: Sequence[dict[str, Any]] | None = None,
        prompt: str | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, or of the text ``prompt``.

        Raises:
            TokenizeError: HTTP or network failure, or a response without a ``tokens`` list.
        """
        body: dict[str, Any] = {"model": self.model, "add_special_tokens": add_special_tokens}
        if messages is not None:
            body.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
        else:
            body["prompt"] = prompt
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.post(self.url, json=body, timeout=self.timeout_s)
            except httpx.TimeoutException as e:
                raise TokenizeError(f"POST {self.url}: {type(e).__name__}: {e} (timeout {self.timeout_s} s)") from e
            except httpx.TransportError as e:  # refused, reset, closed: the server may be restarting
                if attempt == self.retries:
                    raise TokenizeError(f"POST {self.url}: {type(e).__name__}: {e} "
                                        f"({attempt + 1} attempts)") from e
            except httpx.HTTPError as e:
                raise TokenizeError(f"POST {self.url}: {type(e).__name__}: {e}") from e
            else:
                if resp.status_code not in (502, 503, 504) or attempt == self.retries:
                    break
            time.sleep(0.25 * 2**attempt)  # gevent-patched under Locust
        if resp.status_code != 200:
            raise TokenizeError(f"POST {self.url}: HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            tokens = resp.json()["tokens"]
        except (ValueError, KeyError, TypeError) as e:
            raise TokenizeError(f"POST {self.url}: no 'tokens' list in the response: {resp.text[:300]}") from e
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise TokenizeError(f"POST {self.url}: 'tokens' is not a list of integers")
        return tokens


_JOINERS: dict[tuple[str, str], TurnJoiner] = {}


def joiner_for(tokenizer: Tokenizer) -> TurnJoiner:
    """The :class:`TurnJoiner` of the server's chat template, calibrated once per (URL, model).

    Raises:
        TemplateJoinError: the template cannot be reproduced from ids (see ``calibrate_joiner``).
        TokenizeError: ``/tokenize`` failed.
    """
    key = (tokenizer.url, tokenizer.model)
    if key not in _JOINERS:
        _JOINERS[key] = calibrate_joiner(tokenizer)
        log.info("token_ids joiner for %s %s: %s", *key, _JOINERS[key])
    return _JOINERS[key]


# ------------------------------------------------------------------------------------- records


def prompt_sha256(ids: Sequence[int]) -> str:
    """sha256 hex digest of the prompt ids written as ASCII decimals joined by ``,``.

    E.g. ids ``[1, 20, 300]`` hash the bytes ``b"1,20,300"`` (in DuckDB:
    ``sha256(array_to_string(ids, ','))``). Prompt text is never stored.
    """
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode("ascii")).hexdigest()


def _float_header(headers: dict[str, str], name: str, scale: float = 1.0) -> float | None:
    v = headers.get(name)
    if v in (None, ""):
        return None
    try:
        return float(v) * scale
    except ValueError:
        log.warning("header %s=%r is not a number; stored as NULL", name, v)
        return None


def _int_fact(facts: dict[str, Any], name: str) -> int | None:
    v = facts.get(name)
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    log.warning("proxy fact %s=%r is not an integer; stored as NULL", name, v)
    return None


def _float_fact(facts: dict[str, Any], name: str) -> float | None:
    v = facts.get(name)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        if v is not None:
            log.warning("proxy fact %s=%r is not a number; stored as NULL", name, v)
        return None
    return float(v)


def turn_row(
    *,
    run_id: str,
    session_id: str,
    turn_index: int,
    plan: TurnPlan,
    result: TurnResult,
    gap_before_s: float,
    prompt_ids: Sequence[int] | None,
    expected_reusable_tokens: int | None,
    divergence_position: int | None,
) -> dict[str, Any]:
    """The ``turns`` row for one finished request (all times seconds, counts tokens).

    ITL percentiles are numpy's linear-interpolation percentiles of ``result.itl_s``. The proxy's
    facts come from its headers (``x-turnscope-reuse``, ``x-turnscope-prefill-ms`` converted to
    seconds, ``x-turnscope-prefill-engine``, ``x-turnscope-decode-engine``) and from the
    ``turnscope`` field of the final chunk (``result.proxy_facts``).
    """
    itl = np.asarray(result.itl_s, dtype=float)
    p50, p90 = (np.percentile(itl, [50, 90]).tolist() if itl.size else (None, None))
    h = result.headers or {}
    facts = result.proxy_facts or {}
    return {
        "run_id": run_id,
        "session_id": session_id,
        "turn_index": turn_index,
        "request_id": result.request_id,
        "kind": plan.kind,
        "gap_before_s": float(gap_before_s),
        "gap_kind": plan.gap_kind,
        "sent_at": result.sent_at,
        "ttft_s": result.ttft_s,
        "ttfc_s": result.ttfc_s,
        "e2e_s": result.e2e_s,
        "tpot_s": result.tpot_s,
        "itl_p50_s": p50,
        "itl_p90_s": p90,
        "itl_samples": int(itl.size),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "expected_reusable_tokens": expected_reusable_tokens,
        "trace_reusable_tokens": plan.trace_reusable_tokens,
        "divergence_position": divergence_position,
        "status": result.status,
        "error": result.error,
        "http_status": result.http_status,
        "reuse": h.get("x-turnscope-reuse"),
        "prefill_leg_s": _float_header(h, "x-turnscope-prefill-ms", 1e-3),
        "prefill_engine": h.get("x-turnscope-prefill-engine"),
        "decode_engine": h.get("x-turnscope-decode-engine"),
        "prefill_cached_tokens": _int_fact(facts, "prefill_cached_tokens"),
        "remote_tokens": _int_fact(facts, "remote_tokens"),
        "reused_tokens": _int_fact(facts, "reused_tokens"),
        "recomputed_tokens": _int_fact(facts, "recomputed_tokens"),
        "handle_age_s": _float_fact(facts, "handle_age_s"),
        "prompt_sha256": prompt_sha256(prompt_ids) if prompt_ids is not None else None,
    }


@dataclass
class TurnRecord:
    """What one played turn produced: the stored row, the raw result and the prompt ids sent."""

    row: dict[str, Any]
    result: TurnResult
    prompt_ids: list[int] | None


@dataclass
class SessionResult:
    """What :func:`run_session` played: the turn records and the stored ``sessions`` row.

    ``stopped`` says why the session ended: ``complete`` (all planned turns), ``max_prompt_tokens``
    (the next prompt would have exceeded it), ``tokenize_error`` or ``cancelled``.
    """

    turns: list[TurnRecord] = field(default_factory=list)
    session_row: dict[str, Any] | None = None
    stopped: str = "complete"


# ------------------------------------------------------------------------------------- session


def _assistant_message(result: TurnResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        msg["tool_calls"] = [
            {"id": c.get("id") or f"call_{i}", "type": c.get("type") or "function", "function": c["function"]}
            for i, c in enumerate(result.tool_calls)
        ]
    return msg


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
    on_turn: Callable[[TurnRecord], None] | None = None,
    sleep: Callable[[float], None] | None = None,
    tokenizer: Tokenizer | None = None,
    keep_turns: bool = True,
    stream_client: httpx.Client | GeventClient | None = None,
) -> SessionResult:
    """Play ``plan`` turn by turn, record each turn and the session, and return what happened.

    Args:
        plan: the session (turns, gaps, reference replies).
        client: sync httpx client used for the turns and ``/tokenize``.
        base_url: server root (the proxy, or a vLLM server), e.g. ``http://127.0.0.1:8000``.
        model: model name for the requests.
        writer: store writer; receives one ``turns`` row per sent turn and one ``sessions`` row.
        run_id: the run the rows belong to.
        history_mode: ``text`` or ``token_ids`` (see module doc).
        max_tokens: output cap per turn, tokens.
        max_prompt_tokens: stop the session, before sending, when a prompt would be longer (tokens);
            None: no limit.
        timeout_s: per-turn connect/read/total timeout, seconds (``stream_turn``).
        temperature: sampling temperature (0: greedy).
        extra_body: more request fields (e.g. ``{"ignore_eos": true}``), merged last.
        conversation_id: the session key sent to the proxy; default ``"<run_id>/<session_id>"``.
        on_turn: called after each turn is recorded (e.g. to fire Locust events).
        sleep: the sleep function for gaps (default ``time.sleep``, looked up at call time so that
            gevent's patch applies).
        tokenizer: the ``/tokenize`` client (default: one on ``client``/``base_url``/``model``).
        keep_turns: keep every :class:`TurnRecord` in the result (False: only the session row and
            ``stopped``; what a load generator with thousands of live sessions wants).
        stream_client: the client the streamed turns go through (default ``client``); e.g. a
            :class:`loadgen.stream_client.GeventClient` under Locust.

    Returns:
        :class:`SessionResult` (its ``turns`` include fresh side requests). The ``sessions`` row:
        ``turns`` = the session's own turns (fresh requests have rows of their own);
        ``task_latency_s`` = first send -> last finish; ``llm_s`` = sum of E2E of its own turns;
        ``tool_wait_s``/``think_s``/``pause_s`` = sums of the measured gaps (previous finish ->
        send, fresh requests' gaps included) by kind; ``status`` ``ok`` when every sent request
        was ok, ``error`` otherwise, ``cancelled`` when interrupted (e.g. Locust stopping users).

    Raises:
        ValueError: unknown ``history_mode``.
        TemplateJoinError: ``token_ids`` mode and the server's chat template cannot be reproduced
            from ids (raised before anything is sent).
        TokenizeError: the calibration for ``token_ids`` failed (before anything is sent).
        ValueError: a ``retry`` with no earlier request to retry.
    """
    if history_mode not in HISTORY_MODES:
        raise ValueError(f"history_mode must be one of {HISTORY_MODES}, got {history_mode!r}")
    base = base_url.rstrip("/")
    tok = tokenizer or Tokenizer(client, base, model, timeout_s=min(timeout_s, 60.0))
    joiner = joiner_for(tok) if history_mode == "token_ids" else None
    url = base + ("/v1/chat/completions" if history_mode == "text" else "/v1/completions")
    conv_id = conversation_id or f"{run_id}/{plan.session_id}"
    common: dict[str, Any] = {
        "model": model,
        "conversation_id": conv_id,
        "return_token_ids": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    headers = {"X-Session-ID": conv_id}
    do_sleep = sleep or time.sleep

    out = SessionResult()
    messages: list[dict[str, Any]] = []          # text history (both modes keep it, for fallbacks)
    # Id sequences kept across turns are arrays, not lists: the garbage collector never walks
    # them (walking a thousand live sessions' ids took over 100 ms of CPU per collection, a stall
    # every user's TTFT would have measured).
    prev_prompt: array | None = None              # ids of the previous turn's prompt
    prev_generated: list[int] = []                # ids the previous turn generated (or stood in)
    prev_span: array | None = None                # previous prompt + ids actually generated
    last_messages: list[dict[str, Any]] | None = None  # what the previous request sent (for a retry)
    last_rendered: array | None = None
    gaps = {k: 0.0 for k in GAP_KINDS}
    first_send: float | None = None
    last_end: float | None = None
    first_sent_at: dt.datetime | None = None
    all_ok = True
    own_e2e: list[float] = []                     # E2E of this session's turns (fresh requests excluded)
    bound_base: int | None = None                 # upper bound of the previous prompt + reply, tokens

    def render_after(msgs: list[dict[str, Any]]) -> list[int] | None:
        """The prompt ids of a sent request the server did not report (outside the turn's timing)."""
        try:
            return tok(messages=msgs, add_generation_prompt=True)
        except TokenizeError as e:
            log.warning("session %s: %s; expected reuse not recorded", plan.session_id, e)
            return None

    def session_row(session_id: str, source: str, e2e: list[float], task: float,
                    started: dt.datetime | None, gap_sums: dict[str, float], status: str) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "session_id": session_id,
            "archetype": plan.archetype,
            "source": source,
            "started_at": started,
            "finished_at": started + dt.timedelta(seconds=task) if started else None,
            "turns": len(e2e),
            "task_latency_s": task,
            "llm_s": float(sum(e2e)),
            "tool_wait_s": gap_sums["tool"],
            "think_s": gap_sums["think"],
            "pause_s": gap_sums["pause"],
            "status": status,
        }

    def finish_session(status: str) -> None:
        task = (last_end - first_send) if (first_send is not None and last_end is not None) else 0.0
        row = session_row(plan.session_id, plan.source, own_e2e, task, first_sent_at, gaps, status)
        writer.append("sessions", row)
        out.session_row = row

    def wait_and_send(tp: TurnPlan, path_url: str, body: dict[str, Any], hdrs: dict[str, str]
                      ) -> tuple[TurnResult, float]:
        """Sleep out the rest of the gap (and the trace's arrival offset), send, time the turn."""
        nonlocal first_send, last_end, first_sent_at
        if last_end is not None:
            remaining = tp.gap_before_s - (time.perf_counter() - last_end)
            if tp.at_s is not None and first_send is not None:
                remaining = max(remaining, first_send + tp.at_s - time.perf_counter())
            if remaining > 0:
                do_sleep(remaining)
        send = time.perf_counter()
        gap = 0.0 if last_end is None else send - last_end
        if first_send is None:
            first_send = send
        result = stream_turn(stream_client or client, path_url, body, headers=hdrs, timeout_s=timeout_s)
        last_end = time.perf_counter()
        if first_sent_at is None:
            first_sent_at = result.sent_at
        return result, gap

    def request_body(tp: TurnPlan, conv: str, msgs: list[dict[str, Any]] | None,
                     prompt: list[int] | None) -> dict[str, Any]:
        body = dict(common, conversation_id=conv)
        if tp.max_tokens is not None:
            body["max_tokens"] = tp.max_tokens
        if history_mode == "text":
            body["messages"] = list(msgs or [])
        else:
            body["prompt"] = prompt
        body.update(extra_body or {})
        return body

    def play_fresh(k: int, tp: TurnPlan) -> None:
        """An unrelated single request with its own session id; the history is left alone."""
        nonlocal all_ok
        sid = f"{plan.session_id}~fresh{k}"
        conv = f"{conv_id}~fresh{k}"
        rendered_f = None
        if history_mode == "token_ids" or (max_prompt_tokens is not None
                                           and _token_bound(tp.new_messages) > max_prompt_tokens):
            try:
                rendered_f = tok(messages=tp.new_messages, add_generation_prompt=True)
            except TokenizeError as e:
                if history_mode == "token_ids":
                    log.error("session %s fresh request %d: %s; skipped", plan.session_id, k, e)
                    return
        if max_prompt_tokens is not None and rendered_f is not None and len(rendered_f) > max_prompt_tokens:
            log.info("session %s: fresh request %d skipped: %d prompt tokens > max_prompt_tokens %d",
                     plan.session_id, k, len(rendered_f), max_prompt_tokens)
            return
        body = request_body(tp, conv, tp.new_messages, rendered_f)
        result, gap = wait_and_send(tp, url, body, {"X-Session-ID": conv})
        gaps[tp.gap_kind] += gap  # the agent's time before its side call
        prompt_ids = result.prompt_token_ids if result.prompt_token_ids is not None else rendered_f
        if prompt_ids is None:
            prompt_ids = render_after(tp.new_messages)
        row = turn_row(run_id=run_id, session_id=sid, turn_index=0, plan=tp, result=result, gap_before_s=gap,
                       prompt_ids=prompt_ids, expected_reusable_tokens=None, divergence_position=None)
        writer.append("turns", row)
        rec = TurnRecord(row=row, result=result, prompt_ids=prompt_ids)
        if keep_turns:
            out.turns.append(rec)
        writer.append("sessions", session_row(sid, f"{plan.source}#fresh{k}", [result.e2e_s or 0.0],
                                              result.e2e_s or 0.0,
                                              result.sent_at, dict.fromkeys(GAP_KINDS, 0.0),
                                              "ok" if result.status == "ok" else "error"))
        if result.status != "ok":
            all_ok = False
        if on_turn is not None:
            on_turn(rec)

    k = -1
    index = 0  # turn_index of the next own turn
    try:
        for k, tp in enumerate(plan.turns):
            if tp.kind == "fresh":
                play_fresh(k, tp)
                continue
            # -- prepare the request (counts as part of the gap) ----------------------------------
            rendered: list[int] | None
            if tp.kind == "retry":
                if last_messages is None:
                    raise ValueError(f"session {plan.session_id}: turn {k} is a retry with nothing to retry")
                messages = list(last_messages)
                rendered = list(last_rendered) if last_rendered is not None else None
            else:
                messages.extend(tp.new_messages)
                rerender = False
                if tp.kind == "edit":
                    messages, applied = apply_edit(messages, tp.edit or {})
                    log.debug("session %s turn %d: history edit %s", plan.session_id, k, applied)
                    rerender = True  # token_ids: the history's ids no longer continue the previous prompt
                # text mode renders before sending only when the prompt might exceed the limit (the
                # server reports the ids it rendered; that saves a /tokenize request per turn)
                bound = (_token_bound(messages) if bound_base is None
                         else bound_base + _token_bound(tp.new_messages))
                need = history_mode == "token_ids" or (max_prompt_tokens is not None and bound > max_prompt_tokens)
                try:
                    if not need:
                        rendered = None
                    elif history_mode == "text" or prev_prompt is None or rerender:
                        rendered = tok(messages=messages, add_generation_prompt=True)
                    else:
                        new_ids = tok(messages=tp.new_messages, add_generation_prompt=True)
                        rendered = next_prompt_ids(prev_prompt, prev_generated, new_ids, joiner)
                except TokenizeError as e:
                    if history_mode == "token_ids":
                        log.error("session %s turn %d: %s; stopping the session", plan.session_id, k, e)
                        out.stopped = "tokenize_error"
                        all_ok = False
                        break
                    log.warning("session %s turn %d: %s; expected reuse not recorded", plan.session_id, k, e)
                    rendered = None
            if max_prompt_tokens is not None and rendered is not None and len(rendered) > max_prompt_tokens:
                log.info("session %s stops before turn %d: prompt of %d tokens > max_prompt_tokens %d",
                         plan.session_id, k, len(rendered), max_prompt_tokens)
                out.stopped = "max_prompt_tokens"
                break

            # -- wait out the rest of the gap, then send -------------------------------------------
            body = request_body(tp, conv_id, messages, rendered)
            sent_messages = list(messages)
            result, gap = wait_and_send(tp, url, body, headers)
            if index > 0:
                gaps[tp.gap_kind] += gap

            # -- record ------------------------------------------------------------------------
            server_prompt = result.prompt_token_ids
            if history_mode == "token_ids" and server_prompt is not None and server_prompt != rendered:
                log.warning("session %s turn %d: server reports prompt ids different from those sent "
                            "(%d vs %d ids)", plan.session_id, k, len(server_prompt), len(rendered or []))
            prompt_ids = server_prompt if server_prompt is not None else rendered
            if prompt_ids is None:
                prompt_ids = render_after(sent_messages)
            expected = divergence = None
            if prev_span is not None and prompt_ids is not None:
                expected, divergence = reuse_against(prev_span, prompt_ids)
            row = turn_row(run_id=run_id, session_id=plan.session_id, turn_index=index, plan=tp, result=result,
                           gap_before_s=gap, prompt_ids=prompt_ids,
                           expected_reusable_tokens=expected, divergence_position=divergence)
            index += 1
            writer.append("turns", row)
            rec = TurnRecord(row=row, result=result, prompt_ids=prompt_ids)
            if keep_turns:
                out.turns.append(rec)
            own_e2e.append(result.e2e_s or 0.0)
            if on_turn is not None:
                on_turn(rec)

            # -- the history the next turn continues -------------------------------------------
            last_messages, last_rendered = sent_messages, (_ids(prompt_ids) if prompt_ids is not None else None)
            prev_span = last_rendered + _ids(result.token_ids) if last_rendered is not None else None
            bound_base = None
            if prompt_ids is not None:
                sent_reply = _assistant_message(result) if result.status == "ok" else tp.reference_reply
                bound_base = len(prompt_ids) + _token_bound([sent_reply])
            if result.status == "ok":
                reply = _assistant_message(result)
                messages.append(reply)
                prev_generated = list(result.token_ids)
                if history_mode == "token_ids" and not prev_generated:
                    log.warning("session %s turn %d: the server returned no token_ids (return_token_ids "
                                "unsupported?); the reply's text stands in for them", plan.session_id, k)
                    prev_generated = _stand_in_ids(tok, reply, joiner)
            else:
                all_ok = False
                messages.append(tp.reference_reply)
                prev_generated = []
                if history_mode == "token_ids":
                    prev_generated = _stand_in_ids(tok, tp.reference_reply, joiner)
            prev_prompt = last_rendered
            if history_mode == "token_ids" and prev_prompt is not None and prev_generated is None:
                prev_prompt = None  # the stand-in could not be built from ids: re-render next turn
                prev_generated = []
    except BaseException:
        # Interrupted (Locust killing the user greenlet, Ctrl-C, a bug): keep what was measured.
        out.stopped = "cancelled"
        try:
            finish_session("cancelled")
        except Exception:  # never mask the original exception
            log.exception("session %s: could not record the cancelled session", plan.session_id)
        raise
    finish_session("ok" if all_ok else "error")
    return out


def _ids(seq: Sequence[int]) -> array:
    """Token ids as a compact ``array('q')`` (64-bit signed)."""
    return array("q", seq)


def _token_bound(messages: Sequence[dict[str, Any]]) -> int:
    """An upper bound of the tokens ``messages`` add to a rendered prompt: the UTF-8 bytes of each
    message as JSON plus 32 per message for the template's own tokens. Holds for tokenizers that
    never give more tokens than bytes (byte-level BPE, byte-fallback SentencePiece, characters)."""
    return sum(len(json.dumps(m).encode("utf-8")) + 32 for m in messages)


def _stand_in_ids(tok: Tokenizer, reply: dict[str, Any], joiner: TurnJoiner | None) -> list[int] | None:
    """Ids that stand in for a reply that was never generated (token_ids mode, failed turn).

    The reply is rendered alone by the chat template (``add_generation_prompt=False``) and the
    role header, which the previous prompt already ends with, is cut off; the trailing separator is
    cut too, since :func:`next_prompt_ids` adds it. Returns None when the template does not render
    it that way (the next turn is then rendered from the text history instead).
    """
    assert joiner is not None
    try:
        ids = strip_generation_prompt(tok(messages=[reply], add_generation_prompt=False), joiner)
    except (TemplateJoinError, TokenizeError) as e:
        log.warning("stand-in reply cannot be built from ids (%s); re-rendering the history", e)
        return None
    sep = list(joiner.separator_ids)
    if sep and ids[-len(sep):] == sep:
        ids = ids[: -len(sep)]
    return ids
