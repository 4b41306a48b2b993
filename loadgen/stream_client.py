"""The streaming client that times one turn (DESIGN §5).

:func:`stream_turn` POSTs one OpenAI-compatible request (``/v1/chat/completions`` or
``/v1/completions``) with streaming and per-chunk usage forced on, parses the SSE stream with
httpx-sse, and returns a :class:`TurnResult`. All durations come from ``time.perf_counter`` (a
monotonic clock) and are seconds; ``sent_at`` is the UTC wall clock when the request was sent.

Definitions (DESIGN §5):

- TTFT: sent -> first chunk that carries a token on any channel: ``delta.content``,
  ``delta.reasoning_content`` / ``delta.reasoning``, ``delta.tool_calls``, completions ``text``,
  or vLLM ``token_ids`` (a token whose text the detokenizer still holds back has still arrived).
  Role-only, empty and usage-only chunks never set it. No token at all -> status ``error``
  ("no token"), TTFT None.
- TTFC: sent -> first chunk with non-empty content (chat ``delta.content`` / completions ``text``).
- E2E: sent -> ``data: [DONE]`` (or the moment the stream ended or failed). After ``[DONE]`` the
  client reads on to the end of the response body (normally nothing but the chunked terminator),
  so the connection goes back to the pool instead of being closed.
- TPOT: (E2E - TTFT) / (completion_tokens - 1), completion_tokens from the server's usage
  (the definition of vLLM's ``benchmarks/serve``); None below 2 tokens.
- ITL, ``itl_kind == "per_token"`` when every token-carrying chunk has ``usage`` (vLLM's
  ``continuous_usage_stats``): from the first token chunk on, each chunk whose
  ``usage.completion_tokens`` rose by k after a gap g since the previous rise gives k samples of
  g / k (tokens of the first chunk have no measurable gap and give none). Otherwise
  ``"inter_chunk"``: the gaps between consecutive token-carrying chunks.

Only choice index 0 is read (n > 1 is not a workload turnscope generates). Server misbehaviour never
raises: it is reported in ``status``/``error`` with whatever was measured until then.
Sync httpx: runs in plain threads and under gevent monkey-patching (Locust).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError

_DONE = "[DONE]"
_ERROR_BODY_LIMIT = 500  # characters of a non-JSON error body kept in TurnResult.error


@dataclass
class TurnResult:
    """What one streamed turn measured. Durations in seconds, counts in tokens.

    ``status`` is ``ok`` (at least one token and ``[DONE]``), ``error``, ``timeout`` or
    ``cancelled``; ``error`` says why when not ok. Token counts come only from the server's
    ``usage`` (None when the server sent none). ``headers`` are the response headers with
    lower-cased names; ``proxy_facts`` merges the ``turnscope`` field of every chunk.
    """

    sent_at: dt.datetime
    status: str = "error"
    error: str | None = None
    http_status: int | None = None
    request_id: str | None = None
    ttft_s: float | None = None
    ttfc_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    itl_kind: str = "per_token"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    reasoning_text: str = ""
    finish_reason: str | None = None
    tool_calls: list[dict] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    proxy_facts: dict = field(default_factory=dict)
    kv_transfer_params: dict | None = None


def _nonempty(v: Any) -> bool:
    return v is not None and v != "" and v != [] and v != {}


class ChunkAccumulator:
    """Folds parsed stream chunks (dicts) and their arrival times into a :class:`TurnResult`.

    Pure (no I/O): ``add(chunk, t_s)`` with ``t_s`` seconds since the request was sent, then
    ``finish(end_s)``. Used by :func:`stream_turn`; exposed so the timing rules can be tested
    without a server.
    """

    def __init__(self, result: TurnResult):
        self.r = result
        self._token_chunk_times: list[float] = []
        self._all_token_chunks_have_usage = True
        self._usage_points: list[tuple[float, int]] = []  # (t_s, completion_tokens) at each rise
        self._tool_calls: dict[int, dict] = {}
        self._chunk_id: str | None = None

    def add(self, chunk: dict, t_s: float) -> None:
        """Account for one chunk that arrived ``t_s`` seconds after the request was sent."""
        r = self.r
        if self._chunk_id is None and isinstance(chunk.get("id"), str):
            self._chunk_id = chunk["id"]
        if isinstance(chunk.get("turnscope"), dict):
            r.proxy_facts.update(chunk["turnscope"])
        if isinstance(chunk.get("kv_transfer_params"), dict):
            r.kv_transfer_params = chunk["kv_transfer_params"]
        if r.prompt_token_ids is None and isinstance(chunk.get("prompt_token_ids"), list):
            r.prompt_token_ids = list(chunk["prompt_token_ids"])  # chat: top level, first chunk

        usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
        if usage is not None:
            if isinstance(usage.get("prompt_tokens"), int):
                r.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                r.completion_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                r.cached_tokens = details["cached_tokens"]

        choices = chunk.get("choices") or []
        choice = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if choice is None:
            return  # usage-only (or foreign-index) chunk: never a token
        if choice.get("finish_reason") is not None:
            r.finish_reason = choice["finish_reason"]
        if r.prompt_token_ids is None and isinstance(choice.get("prompt_token_ids"), list):
            r.prompt_token_ids = list(choice["prompt_token_ids"])  # completions
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list):
            r.token_ids.extend(token_ids)

        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        content = delta.get("content") if delta else choice.get("text")
        if not isinstance(content, str):
            content = ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        if not isinstance(reasoning, str):
            reasoning = ""
        tool_deltas = delta.get("tool_calls") if isinstance(delta.get("tool_calls"), list) else []
        r.text += content
        r.reasoning_text += reasoning
        for tc in tool_deltas:
            self._merge_tool_call(tc)

        carries_token = bool(content or reasoning or tool_deltas or _nonempty(token_ids))
        if carries_token:
            if r.ttft_s is None:
                r.ttft_s = t_s
            self._token_chunk_times.append(t_s)
            if usage is None or not isinstance(usage.get("completion_tokens"), int):
                self._all_token_chunks_have_usage = False
        if content and r.ttfc_s is None:
            r.ttfc_s = t_s
        if r.ttft_s is not None and usage is not None and isinstance(usage.get("completion_tokens"), int):
            n = usage["completion_tokens"]
            if not self._usage_points or n > self._usage_points[-1][1]:
                self._usage_points.append((t_s, n))

    def _merge_tool_call(self, tc: Any) -> None:
        if not isinstance(tc, dict):
            return
        idx = tc.get("index", len(self._tool_calls))
        cur = self._tool_calls.setdefault(idx, {"index": idx, "function": {"name": "", "arguments": ""}})
        for k in ("id", "type"):
            if tc.get(k):
                cur[k] = tc[k]
        fn = tc.get("function") or {}
        if isinstance(fn, dict):
            cur["function"]["name"] += fn.get("name") or ""
            cur["function"]["arguments"] += fn.get("arguments") or ""

    def finish(self, end_s: float) -> TurnResult:
        """Set E2E = ``end_s``, derive ITL and TPOT, and return the result (status untouched)."""
        r = self.r
        r.e2e_s = end_s
        if r.request_id is None:
            r.request_id = self._chunk_id
        r.tool_calls = [self._tool_calls[k] for k in sorted(self._tool_calls)]
        if self._token_chunk_times and self._all_token_chunks_have_usage:
            r.itl_kind = "per_token"
            r.itl_s = []
            for (t0, n0), (t1, n1) in zip(self._usage_points, self._usage_points[1:], strict=False):
                k = n1 - n0
                r.itl_s.extend([(t1 - t0) / k] * k)
        elif self._token_chunk_times:
            r.itl_kind = "inter_chunk"
            ts = self._token_chunk_times
            r.itl_s = [b - a for a, b in itertools.pairwise(ts)]
        if r.ttft_s is not None and r.completion_tokens is not None and r.completion_tokens >= 2:
            r.tpot_s = (end_s - r.ttft_s) / (r.completion_tokens - 1)
        return r


def _error_message(resp: httpx.Response) -> str:
    try:
        text = resp.read().decode(resp.encoding or "utf-8", errors="replace")
    except httpx.HTTPError as e:
        return f"HTTP {resp.status_code} (body unreadable: {e})"
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {resp.status_code}: {err['message']}"
        for k in ("message", "detail", "error"):
            if body.get(k):
                return f"HTTP {resp.status_code}: {body[k]}"
    return f"HTTP {resp.status_code}: {text[:_ERROR_BODY_LIMIT]}"


def stream_turn(
    client: httpx.Client,
    url: str,
    body: dict,
    *,
    headers: dict | None = None,
    timeout_s: float = 120.0,
    cancel: threading.Event | None = None,
) -> TurnResult:
    """Send one streamed request and time it; never raises for server or network misbehaviour.

    Args:
        client: a sync ``httpx.Client`` (shared by the caller; connection reuse is its business).
        url: full endpoint URL, e.g. ``http://127.0.0.1:8000/v1/chat/completions``.
        body: the OpenAI request; copied, then ``stream=True`` and ``stream_options`` with
            ``include_usage`` and ``continuous_usage_stats`` set to true are forced.
        headers: extra request headers (e.g. ``X-Session-ID``).
        timeout_s: seconds allowed for connecting and for each read of the stream (inactivity),
            and also the total deadline, checked at each event.
        cancel: when set (checked at each event), the turn stops with status ``cancelled``.

    Returns:
        A :class:`TurnResult`: ``ok``; ``error`` (non-2xx with ``http_status`` and the body's
        message, non-SSE response, a mid-stream error event, a dropped connection, a stream
        without ``[DONE]``, or no token); ``timeout`` (connect/read timeout or total deadline,
        with the reason); ``cancelled``. Measurements up to the failure are kept.

    Raises:
        Nothing for server behaviour; programming errors (e.g. a non-dict body) raise TypeError.
    """
    if not isinstance(body, dict):
        raise TypeError(f"body must be a dict, got {type(body).__name__}")
    payload = dict(body)
    payload["stream"] = True
    opts = dict(payload.get("stream_options") or {})
    opts.update(include_usage=True, continuous_usage_stats=True)
    payload["stream_options"] = opts
    req_headers = {"Accept": "text/event-stream", "Cache-Control": "no-store", **(headers or {})}

    result = TurnResult(sent_at=dt.datetime.now(dt.UTC))
    acc = ChunkAccumulator(result)
    t0 = time.perf_counter()
    done = False
    done_at = 0.0
    failure: tuple[str, str] | None = None  # (status, reason)
    try:
        with client.stream("POST", url, json=payload, headers=req_headers,
                           timeout=httpx.Timeout(timeout_s)) as resp:
            result.http_status = resp.status_code
            result.headers = {k.lower(): v for k, v in resp.headers.items()}
            result.request_id = result.headers.get("x-request-id")
            if not 200 <= resp.status_code < 300:
                failure = ("error", _error_message(resp))
            else:
                for n, sse in enumerate(EventSource(resp).iter_sse()):
                    now = time.perf_counter() - t0
                    if done:
                        break  # an event after [DONE]: stop reading (the connection is then closed)
                    data = sse.data.strip()
                    if data == _DONE:
                        done, done_at = True, now
                        continue  # read on to the end of the body, so the connection is reused
                    if data:
                        try:
                            chunk = json.loads(data)
                        except ValueError as e:
                            failure = ("error", f"event {n}: not JSON ({e}): {data[:200]!r}")
                            break
                        if not isinstance(chunk, dict):
                            failure = ("error", f"event {n}: JSON is not an object: {data[:200]!r}")
                            break
                        if chunk.get("error") and not chunk.get("choices"):
                            err = chunk["error"]
                            msg = err.get("message") if isinstance(err, dict) else err
                            failure = ("error", f"server error event {n}: {msg}")
                            break
                        acc.add(chunk, now)
                    if cancel is not None and cancel.is_set():
                        failure = ("cancelled", f"cancelled after event {n}")
                        break
                    if now > timeout_s:
                        failure = ("timeout", f"total deadline of {timeout_s} s passed after event {n}")
                        break
    except SSEError as e:
        failure = ("error", f"not an event stream: {e}")
    except httpx.TimeoutException as e:
        if not done:  # after [DONE] only the drain of the body's end failed: the turn is complete
            failure = ("timeout", f"{type(e).__name__}: {e or 'no bytes within timeout'} (timeout {timeout_s} s)")
    except httpx.HTTPError as e:  # connect errors, dropped connections, protocol errors
        if not done:
            failure = ("error", f"{type(e).__name__}: {e}")
    end = done_at if done else time.perf_counter() - t0

    acc.finish(end)
    if failure is not None:
        result.status, result.error = failure
    elif not done:
        result.status, result.error = "error", "stream ended without data: [DONE]"
    elif result.ttft_s is None:
        result.status, result.error = "error", "no token: the stream ended without any token"
    else:
        result.status, result.error = "ok", None
    return result
