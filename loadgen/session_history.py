"""How a session's history becomes the next prompt: two strategies of the session player.

* :class:`TextHistory` (chat clients, ``history_mode="text"``): the request carries all messages so
  far; earlier assistant messages are the replies the server actually returned (``content`` =
  returned text, plus ``tool_calls`` if it returned any), so the server re-tokenizes its own
  replies. The prompt is rendered (``/tokenize``) before sending only when an upper bound of its
  length (:func:`token_bound`) exceeds ``max_prompt_tokens``.
* :class:`TokenIdsHistory` (RL rollout clients, ``history_mode="token_ids"``): the request's
  ``prompt`` is the previous prompt ids + generated ids + end-of-turn + the new messages' rendered
  ids (:mod:`loadgen.token_prompt`), so the history's ids match exactly what the server computed.
  It always renders before sending.

Each has two steps: :meth:`History.prepare` (the next request's messages and ids, before the gap
ends) and :meth:`History.advance` (take in what came back). Both keep the text history (the
``token_ids`` one for retries and re-renders after an edit). Neither does HTTP itself: rendering
goes through a ``tokenize`` callable (:class:`core.tokenize_client.TokenizeClient` in a run).
See docs/design.md for where they sit in a turn.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.tokenize_client import TokenizeClient, TokenizeError
from loadgen.session import TurnPlan, apply_edit, rewrite_reply
from loadgen.stream_client import TurnResult
from loadgen.token_prompt import (
    TemplateJoinError,
    TokenizeFn,
    TurnJoiner,
    calibrate_joiner,
    next_prompt_ids,
    reuse_against,
    strip_generation_prompt,
)

log = logging.getLogger(__name__)


class StopSession(Exception):
    """The session cannot go on; ``reason`` is :attr:`SessionResult.stopped`'s value, ``failed``
    whether that makes the session's status ``error``."""

    def __init__(self, reason: str, failed: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.failed = failed


class SkipRequest(Exception):
    """A fresh side request cannot be sent (it is skipped; the session goes on)."""


@dataclass
class Prompt:
    """One request's prompt: the messages sent and their rendered ids (None: not rendered)."""

    messages: list[dict[str, Any]]
    ids: list[int] | None


class History:
    """The shared part of both strategies: the text history, retries, edits, expected reuse.

    Args:
        tokenize: ``tokenize(messages=..., add_generation_prompt=True) -> ids`` (raises
            :class:`TokenizeError`).
        session_id: for log lines.
        max_prompt_tokens: prompts longer than this (tokens) stop the session; None: no limit.
        rewrite: how each reply is rewritten as it joins the history (the keywords of
            :func:`loadgen.session.rewrite_reply`: reasoning stripped, tool calls re-rendered);
            None: replies go back as returned.
    """

    #: The generate endpoint this history's requests go to.
    path = "/v1/chat/completions"

    def __init__(self, tokenize: TokenizeFn, session_id: str, max_prompt_tokens: int | None = None,
                 rewrite: dict[str, Any] | None = None):
        self.tokenize = tokenize
        self.rewrite = rewrite                            # rewrite_reply's keywords, or None
        self.rewritten = False                            # the last reply joined the history rewritten
        self.session_id = session_id
        self.max_prompt_tokens = max_prompt_tokens
        self.messages: list[dict[str, Any]] = []          # the text history
        self.last: Prompt | None = None                   # what the previous request sent (for a retry)
        # Id sequences kept across turns are arrays, not lists: the garbage collector never walks
        # them (walking a thousand live sessions' ids took over 100 ms of CPU per collection).
        self.last_ids: array | None = None                # ids of the previous prompt
        self.prev_span: array | None = None               # previous prompt + ids actually generated
        self.bound_base: int | None = None                # upper bound of previous prompt + reply, tokens

    # -- prepare ------------------------------------------------------------------------------

    def prepare(self, tp: TurnPlan, k: int) -> Prompt:
        """The next request's messages and ids (turn ``k`` of the plan).

        Raises:
            ValueError: a ``retry`` with nothing to retry.
            StopSession: the ids cannot be built (``token_ids``: ``tokenize_error``), or the prompt
                exceeds ``max_prompt_tokens`` (``max_prompt_tokens``).
        """
        if tp.kind == "retry":
            if self.last is None:
                raise ValueError(f"session {self.session_id}: turn {k} is a retry with nothing to retry")
            self.messages = list(self.last.messages)
            prompt = Prompt(list(self.messages), list(self.last_ids) if self.last_ids is not None else None)
        else:
            self.messages.extend(tp.new_messages)
            rerender = False
            if tp.kind == "edit":
                self.messages, applied = apply_edit(self.messages, tp.edit or {})
                log.debug("session %s turn %d: history edit %s", self.session_id, k, applied)
                rerender = True  # token_ids: the history's ids no longer continue the previous prompt
            bound = (token_bound(self.messages) if self.bound_base is None
                     else self.bound_base + token_bound(tp.new_messages))
            prompt = Prompt(list(self.messages), self._render(tp, k, bound, rerender))
        if self._too_long(prompt.ids):
            log.info("session %s stops before turn %d: prompt of %d tokens > max_prompt_tokens %d",
                     self.session_id, k, len(prompt.ids or ()), self.max_prompt_tokens)
            raise StopSession("max_prompt_tokens")
        return prompt

    def prepare_fresh(self, tp: TurnPlan, k: int) -> Prompt:
        """The prompt of a fresh side request (its own whole conversation; the history is untouched).

        Raises:
            SkipRequest: it cannot be rendered (``token_ids``) or exceeds ``max_prompt_tokens``.
        """
        ids = None
        if self._needs_render(token_bound(tp.new_messages)):
            try:
                ids = self.tokenize(messages=tp.new_messages, add_generation_prompt=True)
            except TokenizeError as e:
                self._fresh_tokenize_failed(e, k)
        if self._too_long(ids):
            log.info("session %s: fresh request %d skipped: %d prompt tokens > max_prompt_tokens %d",
                     self.session_id, k, len(ids or ()), self.max_prompt_tokens)
            raise SkipRequest
        return Prompt(tp.new_messages, ids)

    def request_fields(self, prompt: Prompt) -> dict[str, Any]:
        """The body fields that carry the prompt: ``messages``."""
        return {"messages": list(prompt.messages or [])}

    # -- advance ------------------------------------------------------------------------------

    def prompt_ids_of(self, result: TurnResult, prompt: Prompt, k: int | None) -> list[int] | None:
        """The ids the turn's prompt had: as the server reported them, else as rendered, else
        rendered now (``/tokenize``, outside the turn's timing); None when that fails too.
        ``k``: the turn's index in the plan (None: a fresh side request)."""
        if result.prompt_token_ids is not None:
            return result.prompt_token_ids
        if prompt.ids is not None:
            return prompt.ids
        try:
            return self.tokenize(messages=prompt.messages, add_generation_prompt=True)
        except TokenizeError as e:
            log.warning("session %s: %s; expected reuse not recorded", self.session_id, e)
            return None

    def expected_reuse(self, prompt_ids: list[int] | None) -> tuple[int | None, int | None]:
        """``(expected_reusable_tokens, divergence_position)`` against the previous turn's span
        (its prompt + the ids it generated): ``(0, None)`` for the session's first request
        (nothing before it), ``(None, None)`` when this prompt's or the previous span's ids are
        unknown."""
        if prompt_ids is None:
            return None, None
        if self.last is None:
            return 0, None
        if self.prev_span is None:
            return None, None
        return reuse_against(self.prev_span, prompt_ids)

    def advance(self, tp: TurnPlan, prompt: Prompt, result: TurnResult, prompt_ids: list[int] | None,
                k: int) -> None:
        """Take in what came back: the reply (or the trace's stand-in on failure) joins the history."""
        self.last = prompt
        self.last_ids = array("q", prompt_ids) if prompt_ids is not None else None
        self.prev_span = self.last_ids + array("q", result.token_ids) if self.last_ids is not None else None
        reply = assistant_message(result) if result.status == "ok" else tp.reference_reply
        if self.rewrite:
            sent_back = rewrite_reply(reply, **self.rewrite)
            self.rewritten, reply = sent_back != reply, sent_back
        self.bound_base = len(prompt_ids) + token_bound([reply]) if prompt_ids is not None else None
        self.messages.append(reply)

    # -- strategy hooks -----------------------------------------------------------------------

    def _needs_render(self, bound: int) -> bool:
        return self.max_prompt_tokens is not None and bound > self.max_prompt_tokens

    def _render(self, tp: TurnPlan, k: int, bound: int, rerender: bool) -> list[int] | None:
        if not self._needs_render(bound):
            return None  # the server reports the ids it rendered: that saves a /tokenize per turn
        try:
            return self.tokenize(messages=self.messages, add_generation_prompt=True)
        except TokenizeError as e:
            log.warning("session %s turn %d: %s; expected reuse not recorded", self.session_id, k, e)
            return None

    def _fresh_tokenize_failed(self, e: TokenizeError, k: int) -> None:
        """Text mode: send without ids."""

    def _too_long(self, ids: list[int] | None) -> bool:
        return self.max_prompt_tokens is not None and ids is not None and len(ids) > self.max_prompt_tokens


class TextHistory(History):
    """Chat clients: every request re-sends the messages (see the module doc)."""


class TokenIdsHistory(History):
    """RL rollout clients: every request's ``prompt`` continues the previous one's ids.

    Args:
        joiner: the chat template's glue (:func:`joiner_for`).
        (others as :class:`History`)
    """

    path = "/v1/completions"

    def __init__(self, tokenize: TokenizeFn, session_id: str, joiner: TurnJoiner,
                 max_prompt_tokens: int | None = None, rewrite: dict[str, Any] | None = None):
        super().__init__(tokenize, session_id, max_prompt_tokens, rewrite)
        self.joiner = joiner
        self.prev_prompt: array | None = None   # ids of the previous prompt (None: re-render next turn)
        self.prev_generated: list[int] = []     # ids the previous turn generated (or stood in)

    def request_fields(self, prompt: Prompt) -> dict[str, Any]:
        """The body fields that carry the prompt: ``prompt`` (ids)."""
        return {"prompt": prompt.ids}

    def prompt_ids_of(self, result: TurnResult, prompt: Prompt, k: int | None) -> list[int] | None:
        server = result.prompt_token_ids
        if k is not None and server is not None and server != prompt.ids:
            log.warning("session %s turn %d: server reports prompt ids different from those sent "
                        "(%d vs %d ids)", self.session_id, k, len(server), len(prompt.ids or []))
        return super().prompt_ids_of(result, prompt, k)

    def advance(self, tp: TurnPlan, prompt: Prompt, result: TurnResult, prompt_ids: list[int] | None,
                k: int) -> None:
        """As :meth:`History.advance`, and the generated ids (or a stand-in's) for the next prompt."""
        super().advance(tp, prompt, result, prompt_ids, k)
        if result.status == "ok":
            generated: list[int] | None = list(result.token_ids)
            if not generated:
                log.warning("session %s turn %d: the server returned no token_ids (return_token_ids "
                            "unsupported?); the reply's text stands in for them", self.session_id, k)
                generated = stand_in_ids(self.tokenize, self.messages[-1], self.joiner)
        else:
            generated = stand_in_ids(self.tokenize, tp.reference_reply, self.joiner)
        self.prev_prompt, self.prev_generated = self.last_ids, generated or []
        if self.prev_prompt is not None and generated is None:
            self.prev_prompt = None  # the stand-in could not be built from ids: re-render next turn
        if self.rewritten:
            self.prev_prompt = None  # the reply goes back rewritten: the history is rendered from its text

    def _needs_render(self, bound: int) -> bool:
        return True

    def _render(self, tp: TurnPlan, k: int, bound: int, rerender: bool) -> list[int] | None:
        try:
            if self.prev_prompt is None or rerender:
                return self.tokenize(messages=self.messages, add_generation_prompt=True)
            new_ids = self.tokenize(messages=tp.new_messages, add_generation_prompt=True)
            return next_prompt_ids(self.prev_prompt, self.prev_generated, new_ids, self.joiner)
        except TokenizeError as e:
            log.error("session %s turn %d: %s; stopping the session", self.session_id, k, e)
            raise StopSession("tokenize_error", failed=True) from e

    def _fresh_tokenize_failed(self, e: TokenizeError, k: int) -> None:
        log.error("session %s fresh request %d: %s; skipped", self.session_id, k, e)
        raise SkipRequest from e


# -------------------------------------------------------------------------------------- helpers


_JOINERS: dict[tuple[str, str], TurnJoiner] = {}


def joiner_for(tokenizer: TokenizeClient) -> TurnJoiner:
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


def assistant_message(result: TurnResult) -> dict[str, Any]:
    """The assistant message a turn's reply adds to the history (text, and tool calls if any)."""
    msg: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        msg["tool_calls"] = [
            {"id": c.get("id") or f"call_{i}", "type": c.get("type") or "function", "function": c["function"]}
            for i, c in enumerate(result.tool_calls)
        ]
    return msg


def token_bound(messages: Sequence[dict[str, Any]]) -> int:
    """An upper bound of the tokens ``messages`` add to a rendered prompt: the UTF-8 bytes of each
    message as JSON plus 32 per message for the template's own tokens. Holds for tokenizers that
    never give more tokens than bytes (byte-level BPE, byte-fallback SentencePiece, characters)."""
    return sum(len(json.dumps(m).encode("utf-8")) + 32 for m in messages)


def stand_in_ids(tokenize: TokenizeFn, reply: dict[str, Any], joiner: TurnJoiner) -> list[int] | None:
    """Ids that stand in for a reply that was never generated (token_ids mode, failed turn).

    The reply is rendered alone by the chat template (``add_generation_prompt=False``) and the
    role header, which the previous prompt already ends with, is cut off; the trailing separator is
    cut too, since :func:`next_prompt_ids` adds it. Returns None when the template does not render
    it that way (the next turn is then rendered from the text history instead).
    """
    try:
        ids = strip_generation_prompt(tokenize(messages=[reply], add_generation_prompt=False), joiner)
    except (TemplateJoinError, TokenizeError) as e:
        log.warning("stand-in reply cannot be built from ids (%s); re-rendering the history", e)
        return None
    sep = list(joiner.separator_ids)
    if sep and ids[-len(sep):] == sep:
        ids = ids[: -len(sep)]
    return ids
