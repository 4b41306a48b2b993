"""The streaming client that times one turn (docs/design.md).

:func:`stream_turn` POSTs one OpenAI-compatible request (``/v1/chat/completions`` or
``/v1/completions``) with streaming and per-chunk usage forced on, parses the SSE stream with
httpx-sse, and returns a :class:`TurnResult`. All durations come from ``time.perf_counter`` (a
monotonic clock) and are seconds; ``sent_at`` is the UTC wall clock when the request was sent.

Definitions (docs/design.md):

- TTFT: sent -> first chunk that carries a token on any channel: ``delta.content``,
  ``delta.reasoning_content`` / ``delta.reasoning``, ``delta.tool_calls``, completions ``text``,
  or vLLM ``token_ids`` (a token whose text the detokenizer still holds back has still arrived).
  Role-only, empty and usage-only chunks never set it. No token at all -> status ``error``
  ("no token"), TTFT None.
- TTFC: sent -> first chunk with non-empty content (chat ``delta.content`` / completions ``text``).
- Last token: sent -> the last chunk of choice 0 that carries a token or whose
  ``usage.completion_tokens`` rose (a stop token without text). A usage-only chunk (no choices)
  never sets it, however late it comes (handed case ``sse/late_usage_chunk.json``, vllm#55508).
- E2E: sent -> ``data: [DONE]`` (or the moment the stream ended or failed). After ``[DONE]`` the
  client reads on to the end of the response body (normally nothing but the chunked terminator),
  so the connection goes back to the pool instead of being closed.
- TPOT: (last token - TTFT) / (completion_tokens - 1), completion_tokens from the server's usage
  (vLLM ``benchmarks/serve``'s definition, measured to the last token so that a trailing usage
  chunk does not inflate it: vllm#55508); None below 2 tokens.
- An SSE event whose JSON is a top-level ``error`` object (no choices) after HTTP 200 is an
  in-band server error (vllm#57519): status ``error`` with the server's message; the tokens and
  times measured before it stay on the result, and, as with every non-``ok`` turn, the turn is
  left out of latency percentiles and throughput.
- ITL, ``itl_kind == "per_token"`` when every token-carrying chunk has ``usage`` (vLLM's
  ``continuous_usage_stats``): from the first token chunk on, each chunk whose
  ``usage.completion_tokens`` rose by k after a gap g since the previous rise gives k samples of
  g / k (tokens of the first chunk have no measurable gap and give none). Otherwise
  ``"inter_chunk"``: the gaps between consecutive token-carrying chunks.

Only choice index 0 is read (n > 1 is not a workload turnscope generates). Server misbehaviour never
raises: it is reported in ``status``/``error`` with whatever was measured until then.
Two transports give the same results: a sync ``httpx.Client`` (plain threads, and gevent) and
:class:`GeventClient` (geventhttpclient, for Locust processes: a third of the CPU per turn). Either
way the SSE stream is parsed by httpx-sse.
"""

from __future__ import annotations

import codecs
import datetime as dt
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
from httpx_sse import EventSource, SSEError

from core.contract import FACTS_FIELD, REQUEST_ID_HEADER, error_body_text

_DONE = "[DONE]"


@dataclass
class TurnResult:
    """What one streamed turn measured. Durations in seconds, counts in tokens.

    ``status`` is ``ok`` (at least one token and ``[DONE]``), ``error``, ``timeout`` or
    ``cancelled``; ``error`` says why when not ok. Token counts come only from the server's
    ``usage`` (None when the server sent none). ``headers`` are the response headers with
    lower-cased names; ``proxy_facts`` merges the ``turnscope`` field of every chunk.
    ``last_token_s`` is when the last token arrived (None without tokens); ``tool_calls`` are the
    streamed calls of choice 0 reassembled by ``index`` (``{"index", "id", "type", "function":
    {"name", "arguments"}}``), so a turn that answers only with a tool call is ``ok`` with empty
    ``text`` and ``finish_reason`` ``tool_calls``.
    """

    sent_at: dt.datetime
    status: str = "error"
    error: str | None = None
    http_status: int | None = None
    request_id: str | None = None
    ttft_s: float | None = None
    ttfc_s: float | None = None
    last_token_s: float | None = None
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

    @property
    def counts_for_latency(self) -> bool:
        """Whether the turn enters latency percentiles and throughput: only ``ok`` turns do. An
        error (in-band or not), timeout or cancellation keeps its partial measurements on the row
        but is counted apart (the store's views and the dashboard filter on ``status = 'ok'``)."""
        return self.status == "ok"


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
        if isinstance(chunk.get(FACTS_FIELD), dict):
            r.proxy_facts.update(chunk[FACTS_FIELD])
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
            return  # usage-only (or foreign-index) chunk: never a token, no ITL sample, no token time
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
            r.last_token_s = t_s
        if content and r.ttfc_s is None:
            r.ttfc_s = t_s
        if r.ttft_s is not None and usage is not None and isinstance(usage.get("completion_tokens"), int):
            n = usage["completion_tokens"]
            if not self._usage_points or n > self._usage_points[-1][1]:
                self._usage_points.append((t_s, n))
                r.last_token_s = t_s  # a rise without text: the stop token

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
        """Set E2E = ``end_s``, derive ITL and TPOT (to the last token), and return the result
        (status untouched)."""
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
        if (r.ttft_s is not None and r.last_token_s is not None and r.completion_tokens is not None
                and r.completion_tokens >= 2):
            r.tpot_s = (r.last_token_s - r.ttft_s) / (r.completion_tokens - 1)
        return r


def _error_message(resp: httpx.Response) -> str:
    try:
        text = resp.read().decode(resp.encoding or "utf-8", errors="replace")
    except httpx.HTTPError as e:
        return f"HTTP {resp.status_code} (body unreadable: {e})"
    return error_body_text(resp.status_code, text)


class GeventClient:
    """A streaming HTTP/1.1 client on geventhttpclient (Locust's FastHttpUser engine, a C parser).

    For Locust processes (gevent): per streamed turn it costs about a third of the CPU of
    ``httpx`` (measured 0.48 vs 1.29 ms per 16-token turn), and at a thousand sessions the CPU the
    load generator spends is what delays the moment a token is timestamped. Give it to
    :func:`stream_turn` instead of an ``httpx.Client``; SSE is still parsed by httpx-sse.

    One connection pool per (origin, timeout), ``concurrency`` connections each. Connections idle
    for ``keepalive_s`` are dropped before they are used again (uvicorn, under vLLM and the proxy,
    closes idle connections after 5 s; a request sent on one as it closes would fail). A request
    whose pooled connection still turns out closed before any byte of the response is sent once
    more on a new connection, as Go's net/http does for reused connections; any other failure is
    reported, never retried.

    Args:
        concurrency: connections per origin (a session streams one turn at a time: a few suffice).
        ssl_context: TLS context for ``https`` origins (shared, so none is built per connection).
        keepalive_s: idle seconds after which pooled connections are not reused.
        headers: sent with every request (e.g. the proxy's API key), under the call's own.
    """

    def __init__(self, concurrency: int = 4, ssl_context: Any = None, keepalive_s: float = 4.0,
                 headers: dict[str, str] | None = None):
        self.headers = dict(headers or {})
        self.concurrency = concurrency
        self.ssl_context = ssl_context
        self.keepalive_s = keepalive_s
        self._pools: dict[tuple[str, str, int, float], Any] = {}
        self._last_used: dict[tuple[str, str, int, float], float] = {}
        self._in_flight: dict[tuple[str, str, int, float], int] = {}

    def _pool(self, url: str, timeout_s: float) -> tuple[Any, str, tuple[str, str, int, float]]:
        from geventhttpclient import HTTPClient
        from geventhttpclient.url import URL

        u = URL(url)
        key = (u.scheme, u.host, u.port, float(timeout_s))
        now = time.monotonic()
        pool = self._pools.get(key)
        if (pool is not None and not self._in_flight.get(key)
                and now - self._last_used.get(key, now) > self.keepalive_s):
            pool.close()  # its idle connections may be closing on the server's side: start afresh
            del self._pools[key]
            pool = None
        self._last_used[key] = now
        if pool is None:
            kw: dict[str, Any] = {"concurrency": self.concurrency, "connection_timeout": timeout_s,
                                  "network_timeout": timeout_s}
            if u.scheme == "https" and self.ssl_context is not None:
                ctx = self.ssl_context
                kw["ssl_context_factory"] = lambda *a, **k: ctx
            pool = self._pools[key] = HTTPClient.from_url(u, **kw)
            # The pool resolves its host for every new connection, on gevent's resolver thread
            # pool (about 0.1 ms, and a wait on the event loop under load), inside the turn's
            # timing. Resolve once per pool instead; an internal of geventhttpclient, used only
            # when present.
            cp = getattr(pool, "_connection_pool", None)
            if cp is not None and callable(getattr(cp, "_resolve", None)):
                addresses = cp._resolve()
                cp._resolve = lambda: addresses
        return pool, u.request_uri, key

    def post(self, url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Any:
        """POST and return the response once its headers are in (the body is read by the caller,
        who calls :meth:`done` with it afterwards)."""
        from geventhttpclient.response import HTTPConnectionClosed

        pool, uri, key = self._pool(url, timeout_s)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            try:
                resp = pool.request("POST", uri, body=body, headers=self.headers | headers)
            except HTTPConnectionClosed:
                resp = pool.request("POST", uri, body=body, headers=self.headers | headers)
        except BaseException:
            self._release_key(key)
            raise
        resp._turnscope_pool_key = key
        return resp

    def _release_key(self, key: tuple[str, str, int, float]) -> None:
        self._in_flight[key] = max(self._in_flight.get(key, 1) - 1, 0)
        self._last_used[key] = time.monotonic()

    def done(self, resp: Any) -> None:
        """Release ``resp``'s connection (pooled when its body was read to the end, else closed)."""
        try:
            resp.release()
        finally:
            key = getattr(resp, "_turnscope_pool_key", None)
            if key is not None:
                self._release_key(key)

    def close(self) -> None:
        """Close every pooled connection."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._last_used.clear()
        self._in_flight.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _GeventSSE:
    """What ``httpx_sse.EventSource`` reads of a response (``headers.get``, ``iter_text``), over a
    geventhttpclient response: each line of the body is handed on as soon as it is complete.

    Lines are cut at LF, so a stream whose lines end in CR alone (allowed by SSE, sent by no
    OpenAI-compatible server turnscope knows) is parsed right but handed on only at its end: its
    times would be late (tests/integration/test_stream_splits.py checks the parse)."""

    def __init__(self, resp: Any):
        self.resp = resp
        self.headers = {k.lower(): v for k, v in resp.items()}

    def iter_text(self) -> Any:
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            line = self.resp.readline(b"\n")
            if not line:
                break
            yield dec.decode(line)
        rest = self.resp.read()  # a last line without a newline
        tail = dec.decode(rest, final=True)
        if tail:
            yield tail


@dataclass
class _Stream:
    done: bool = False
    done_at: float = 0.0
    failure: tuple[str, str] | None = None  # (status, reason)


def _consume(events: Any, acc: ChunkAccumulator, t0: float, timeout_s: float,
             cancel: threading.Event | None, st: _Stream) -> None:
    """Fold SSE events into ``acc`` until ``[DONE]`` and the end of the body, or a failure."""
    for n, sse in enumerate(events):
        now = time.perf_counter() - t0
        if st.done:
            break  # an event after [DONE]: stop reading (the connection is then closed)
        data = sse.data.strip()
        if data == _DONE:
            st.done, st.done_at = True, now
            continue  # read on to the end of the body, so the connection is reused
        if data:
            try:
                chunk = json.loads(data)
            except ValueError as e:
                st.failure = ("error", f"event {n}: not JSON ({e}): {data[:200]!r}")
                break
            if not isinstance(chunk, dict):
                st.failure = ("error", f"event {n}: JSON is not an object: {data[:200]!r}")
                break
            if chunk.get("error") and not chunk.get("choices"):
                err = chunk["error"]
                msg = err.get("message") if isinstance(err, dict) else err
                st.failure = ("error", f"server error event {n}: {msg}")
                break
            acc.add(chunk, now)
        if cancel is not None and cancel.is_set():
            st.failure = ("cancelled", f"cancelled after event {n}")
            break
        if now > timeout_s:
            st.failure = ("timeout", f"total deadline of {timeout_s} s passed after event {n}")
            break


def _exchange_httpx(client: httpx.Client, url: str, payload: dict, req_headers: dict, timeout_s: float,
                    cancel: threading.Event | None, t0: float, result: TurnResult, acc: ChunkAccumulator,
                    st: _Stream) -> None:
    try:
        with client.stream("POST", url, json=payload, headers=req_headers,
                           timeout=httpx.Timeout(timeout_s)) as resp:
            result.http_status = resp.status_code
            result.headers = {k.lower(): v for k, v in resp.headers.items()}
            result.request_id = result.headers.get(REQUEST_ID_HEADER)
            if not 200 <= resp.status_code < 300:
                st.failure = ("error", _error_message(resp))
            else:
                _consume(EventSource(resp).iter_sse(), acc, t0, timeout_s, cancel, st)
    except SSEError as e:
        st.failure = ("error", f"not an event stream: {e}")
    except httpx.TimeoutException as e:
        if not st.done:  # after [DONE] only the drain of the body's end failed: the turn is complete
            st.failure = ("timeout", f"{type(e).__name__}: {e or 'no bytes within timeout'} (timeout {timeout_s} s)")
    except httpx.HTTPError as e:  # connect errors, dropped connections, protocol errors
        if not st.done:
            st.failure = ("error", f"{type(e).__name__}: {e}")


def _exchange_gevent(client: GeventClient, url: str, payload: dict, req_headers: dict, timeout_s: float,
                     cancel: threading.Event | None, t0: float, result: TurnResult, acc: ChunkAccumulator,
                     st: _Stream) -> None:
    """The exchange on :class:`GeventClient`; failure reasons are named as httpx names them
    (``ConnectError``, ``ReadTimeout``, ``ReadError``), so both transports read the same."""
    from geventhttpclient.response import HTTPParseError

    resp = None
    headers_in = False
    try:
        data = json.dumps(payload).encode("utf-8")
        resp = client.post(url, data, {**req_headers, "Content-Type": "application/json"}, timeout_s)
        headers_in = True
        result.http_status = resp.status_code
        result.headers = {k.lower(): v for k, v in resp.items()}
        result.request_id = result.headers.get(REQUEST_ID_HEADER)
        if not 200 <= resp.status_code < 300:
            text = resp.read().decode("utf-8", errors="replace")
            st.failure = ("error", error_body_text(resp.status_code, text))
        else:
            _consume(EventSource(_GeventSSE(resp)).iter_sse(), acc, t0, timeout_s, cancel, st)
    except SSEError as e:
        st.failure = ("error", f"not an event stream: {e}")
    except TimeoutError as e:  # socket.timeout (gevent's too) is TimeoutError
        if not st.done:
            what = "ReadTimeout" if headers_in else "Timeout (connecting or awaiting the response headers)"
            st.failure = ("timeout", f"{what}: {e or 'no bytes within timeout'} (timeout {timeout_s} s)")
    except ConnectionRefusedError as e:
        st.failure = ("error", f"ConnectError: {e}")
    except (HTTPParseError, OSError) as e:  # resets, closed streams, bad HTTP
        if not st.done:
            st.failure = ("error", f"ReadError: {type(e).__name__}: {e}")
    finally:
        if resp is not None:
            client.done(resp)  # back to the pool when the body was read to its end, else closed


def stream_turn(
    client: httpx.Client | GeventClient,
    url: str,
    body: dict,
    *,
    headers: dict | None = None,
    timeout_s: float = 120.0,
    cancel: threading.Event | None = None,
) -> TurnResult:
    """Send one streamed request and time it; never raises for server or network misbehaviour.

    Args:
        client: a sync ``httpx.Client`` or a :class:`GeventClient` (shared by the caller;
            connection reuse is its business). Both give the same results; the latter costs less
            CPU under gevent.
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
    st = _Stream()
    t0 = time.perf_counter()
    exchange = _exchange_gevent if isinstance(client, GeventClient) else _exchange_httpx
    exchange(client, url, payload, req_headers, timeout_s, cancel, t0, result, acc, st)
    end = st.done_at if st.done else time.perf_counter() - t0

    acc.finish(end)
    if st.failure is not None:
        result.status, result.error = st.failure
    elif not st.done:
        result.status, result.error = "error", "stream ended without data: [DONE]"
    elif result.ttft_s is None:
        result.status, result.error = "error", "no token: the stream ended without any token"
    else:
        result.status, result.error = "ok", None
    return result
