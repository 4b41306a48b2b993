"""The wire contract between the load generator and the proxy, and the names every part shares.

One definition of each name that ``serving/`` (the proxy), ``loadgen/`` (the session player) and
``dashboard/`` (the store's readers) have in common; see docs/design.md.
This module imports nothing of theirs, so importing it never imports them (checked by
``tests/unit/test_contract.py``).

A generate request (``POST /v1/chat/completions`` or ``/v1/completions``) names its session in the
body field :data:`SESSION_FIELD` or the header :data:`SESSION_HEADER` (and may name its decode
worker in :data:`DECODE_WORKER_HEADER`). The proxy answers with
headers known before the stream (:data:`REQUEST_ID_HEADER`, :data:`REUSE_HEADER`,
:data:`PREFILL_MS_HEADER`, :data:`PREFILL_ENGINE_HEADER`, :data:`DECODE_ENGINE_HEADER`) and, in the
finishing chunk, a :data:`FACTS_FIELD` object of :class:`PublicFacts`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal, TypedDict
from urllib.parse import quote

import numpy as np

# -- request: the session key --------------------------------------------------------------------

#: Body field that names the session (popped by the proxy before the workers see the request).
SESSION_FIELD = "conversation_id"
#: Header that names the session when the body does not (HTTP headers are case-insensitive).
SESSION_HEADER = "X-Session-ID"
#: Header that names the decode worker (its name in the proxy's configuration, ``decode-0``) that
#: must serve the request, whatever the routing policy; an unknown name is answered 400. The
#: streamed-handle check reaches every D by it (``serving.handle_check``).
DECODE_WORKER_HEADER = "x-turnscope-decode-worker"

# -- request: the client's API key ---------------------------------------------------------------

#: The environment variable turnscope's clients (Locust, ``turnscope eval``'s warm-up and runs) read
#: the proxy's API key from (as the OpenAI SDK reads ``OPENAI_API_KEY``); unset: they send none. The
#: proxy demands it when its topology's ``proxy.api_key`` is set (``serving.api_keys``).
CLIENT_KEY_ENV = "TURNSCOPE_API_KEY"


def client_auth_headers() -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` for the key in :data:`CLIENT_KEY_ENV`, or ``{}``."""
    key = os.environ.get(CLIENT_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


# -- response headers (lower case, as httpx and Starlette hand them out) ---------------------------

REQUEST_ID_HEADER = "x-request-id"
#: The request's reuse outcome, one of :data:`OUTCOMES` (absent in aggregated mode).
REUSE_HEADER = "x-turnscope-reuse"
#: The prefill leg's wall time, milliseconds written with 3 decimals (``"12.345"``).
PREFILL_MS_HEADER = "x-turnscope-prefill-ms"
#: Name of the prefill worker that served the request.
PREFILL_ENGINE_HEADER = "x-turnscope-prefill-engine"
#: Name of the decode worker that served the request.
DECODE_ENGINE_HEADER = "x-turnscope-decode-engine"

# -- response body: the facts of the final chunk ---------------------------------------------------

#: Field added to the stream chunk where choice 0 finishes and to the chunk that carried D's handle
#: (or to a non-streamed response) that holds :class:`PublicFacts` (an additive field only).
FACTS_FIELD = "turnscope"


class PublicFacts(TypedDict):
    """What the proxy tells the client about one request (counts in tokens, times in seconds).

    ``reuse``: one of :data:`OUTCOMES`, None in aggregated mode. ``prefill_cached_tokens``: P's
    local prefix-cache hits. ``remote_tokens``: tokens of D's KV offered to P (whole blocks).
    ``reused_tokens``: tokens P pulled from D. ``recomputed_tokens``: prompt tokens P computed.
    ``handle_age_s``: age of the handle offered. ``divergence_position``: first index where the
    prompt differs from the ids D holds KV for (:func:`common_prefix_length`), None if none.
    ``prefill_leg_s``: the prefill leg's wall time. ``prefill_attempts``: 1, or 2 when a leg
    carrying a handle failed and was retried as a plain recompute. ``handle_tokens``: tokens of KV D
    kept for this request's own handle (D's ``remote_num_tokens``), pinned on D until the session's
    next prefill pulls them (or, below ``kv_recompute_threshold``, frees them unread: ``reuse_rules.d_frees_taken_handle``)
    or ``decoder_kv_blocks_ttl`` passes (vLLM ``nixl/pull_scheduler.py``
    ``request_finished``, ``_reap_expired_send_leases``); None when D returned no handle.
    """

    reuse: str | None
    prefill_cached_tokens: int
    remote_tokens: int
    reused_tokens: int
    recomputed_tokens: int | None
    handle_age_s: float | None
    divergence_position: int | None
    prefill_leg_s: float | None
    prefill_attempts: int | None
    handle_tokens: int | None


#: The keys of :class:`PublicFacts`, in wire order.
PUBLIC_FACT_KEYS: tuple[str, ...] = tuple(PublicFacts.__annotations__)


def response_facts(headers: dict[str, str], in_band: dict[str, Any]) -> dict[str, Any]:
    """The proxy's facts of one response, from one place: :class:`PublicFacts`' keys plus
    ``prefill_engine`` and ``decode_engine``, numbers as the proxy had them.

    The in-band facts (:data:`FACTS_FIELD`, as sent) win; a response whose stream ended before
    them (a failure mid-stream) keeps what its headers said before the stream: ``reuse``
    (:data:`REUSE_HEADER`) and ``prefill_leg_s`` (:data:`PREFILL_MS_HEADER` / 1000, seconds; None
    when it is not a number). The engines' names are sent only as headers
    (:data:`PREFILL_ENGINE_HEADER`, :data:`DECODE_ENGINE_HEADER`). ``headers``: lower-case names.
    """
    out: dict[str, Any] = {"prefill_engine": headers.get(PREFILL_ENGINE_HEADER),
                           "decode_engine": headers.get(DECODE_ENGINE_HEADER),
                           "reuse": headers.get(REUSE_HEADER) or None}
    ms = headers.get(PREFILL_MS_HEADER)
    try:
        out["prefill_leg_s"] = float(ms) / 1000 if ms not in (None, "") else None
    except ValueError:
        out["prefill_leg_s"] = None
    return out | {k: v for k, v in in_band.items() if k in PUBLIC_FACT_KEYS}

# -- the facts of a request by its id (the proxy's look-up route) -----------------------------------

#: The proxy's route that answers the facts of one of its recent requests by request id
#: (:data:`REQUEST_ID_HEADER`, the client's own or the proxy's ``ts-<uuid>``), behind the same API
#: key as its other ``/v1`` routes: a :class:`RequestFactsAnswer`, or 404 when the proxy does not
#: know the id (never seen, or dropped as the oldest of the few thousand it keeps). For a client
#: that left before the facts reached it (``loadgen.facts_lookup``).
REQUEST_FACTS_ROUTE = "/v1/turnscope/requests/{request_id}"


def request_facts_path(request_id: str) -> str:
    """:data:`REQUEST_FACTS_ROUTE` for ``request_id`` (URL-quoted: any character a header may hold)."""
    return REQUEST_FACTS_ROUTE.format(request_id=quote(request_id, safe=""))


class RequestFactsAnswer(TypedDict):
    """The answer of :data:`REQUEST_FACTS_ROUTE` (JSON): what the proxy knows of one request now.

    ``ended``: whether the request has ended (answered, failed, or left by its client); ``status``:
    how (the proxy's log status: ``ok``, ``client_disconnected``, ``prefill_failed``, ``rejected``,
    ``http_<code>`` for D's HTTP error, ``incomplete`` for D's stream ending without ``[DONE]``,
    ``error: <exception>``), None while it runs. ``prefill_engine`` / ``decode_engine``: the workers
    picked (what :data:`PREFILL_ENGINE_HEADER` / :data:`DECODE_ENGINE_HEADER` say; no prefill
    engine in aggregated mode). ``turnscope`` (:data:`FACTS_FIELD`): the :class:`PublicFacts` so
    far; in a P/D mode, until P's answer was accounted (``prefill_leg_s`` None: the client left
    during P's leg, or P failed) ``reused_tokens``, ``prefill_cached_tokens`` and
    ``recomputed_tokens`` are None (unknown), not 0.
    """

    request_id: str
    ended: bool
    status: str | None
    prefill_engine: str | None
    decode_engine: str | None
    turnscope: PublicFacts


def answer_as_response(answer: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """A :class:`RequestFactsAnswer` as the response it stands for: ``(headers, in_band)``, the two
    arguments of :func:`response_facts` (lower-case header names: the request id and the engines;
    the in-band facts as sent). So a row built from a looked-up answer goes through the one place
    facts become row fields."""
    headers = {REQUEST_ID_HEADER: answer.get("request_id"), PREFILL_ENGINE_HEADER: answer.get("prefill_engine"),
               DECODE_ENGINE_HEADER: answer.get("decode_engine")}
    in_band = answer.get(FACTS_FIELD)
    return ({k: v for k, v in headers.items() if isinstance(v, str)},
            dict(in_band) if isinstance(in_band, dict) else {})

# -- reuse outcomes: exactly one per proxied request ------------------------------------------------

HIT = "hit"
MISS_FIRST_TURN = "miss_first_turn"
MISS_NO_SESSION_ID = "miss_no_session_id"
MISS_EXPIRED = "miss_expired"
MISS_CONSUMED = "miss_consumed"
MISS_MISMATCH = "miss_mismatch"
MISS_BELOW_THRESHOLD = "miss_below_threshold"
MISS_TRANSFER_FAILED = "miss_transfer_failed"
MISS_NO_HANDLE_RETURNED = "miss_no_handle_returned"
#: The session's handle was issued by a decode worker that has restarted since: its blocks went with
#: the old engine (vLLM refuses a NIXL handshake whose engine id changed), so the proxy dropped it.
MISS_DECODE_RESTARTED = "miss_decode_restarted"
OUTCOMES = (HIT, MISS_FIRST_TURN, MISS_NO_SESSION_ID, MISS_EXPIRED, MISS_CONSUMED, MISS_MISMATCH,
            MISS_BELOW_THRESHOLD, MISS_TRANSFER_FAILED, MISS_NO_HANDLE_RETURNED, MISS_DECODE_RESTARTED)

# -- roles: what a worker (or a scraped endpoint) is -------------------------------------------------


class Role(StrEnum):
    """A role: the three kinds of worker (``serving.topology.Topology``'s lists and ``roles:`` keys,
    ``core.modes.ServingMode.roles``) and the proxy, which is no worker but one more
    endpoint a scrape reads (``serving.prometheus_config``, ``loadgen.scraper``). A member equals
    its string (``Role.PREFILL == "prefill"``), so the store's columns and YAML keys read as before;
    its repr is its value's (``'prefill'``), so messages naming one read as before too."""

    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"
    PROXY = "proxy"

    def __repr__(self) -> str:
        return repr(self.value)


#: The roles of workers, in a topology's order (P, D, aggregated).
WORKER_ROLES: tuple[Role, ...] = (Role.PREFILL, Role.DECODE, Role.AGGREGATED)
#: The roles of the endpoints a scrape reads (``/metrics`` of the workers and of the proxy).
ENDPOINT_ROLES: tuple[Role, ...] = (*WORKER_ROLES, Role.PROXY)

# -- the connector's defaults every part reasons with ------------------------------------------------

#: vLLM's ``decoder_kv_blocks_ttl`` default, seconds: how long D keeps a finished request's KV
#: blocks for P to pull (NixlConnector ``kv_connector_extra_config``, vLLM 0.32).
DECODER_KV_BLOCKS_TTL_S = 480
#: vLLM's ``kv_recompute_threshold`` default, tokens: below this many tokens to pull, P recomputes.
KV_RECOMPUTE_THRESHOLD_TOKENS = 64

# -- routing: how the proxy picks a worker of a role (serving.routing) ------------------------------

ROUND_ROBIN, SESSION, PREFIX_AWARE = "round-robin", "session", "prefix-aware"
#: The routing policies a run may choose, for P and for D (docs/configuration.md).
ROUTING_POLICIES = (ROUND_ROBIN, SESSION, PREFIX_AWARE)
RoutingPolicy = Literal["round-robin", "session", "prefix-aware"]

# -- histories, turns, gaps (the serving modes: core.modes) ----------------------------------

#: How the session player keeps a session's history (docs/workloads.md): re-sent messages, or ids.
HISTORY_MODES = ("text", "token_ids")
#: Kinds of turn (``turns.kind``, docs/schema/tables.md).
TURN_KINDS = ("turn", "retry", "edit", "fresh", "resume")
#: Kinds of gap before a turn (``turns.gap_kind``, docs/schema/tables.md).
GAP_KINDS = ("none", "tool", "think", "pause")


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix of two sequences (e.g. token ids).

    The one definition of a divergence position: the proxy trims a handle with it
    (``serving.handles.fit_handle``) and the session player computes the expected reuse with it
    (``loadgen.token_prompt.reuse_against``). Compared as numpy arrays (one vectorised pass: about
    0.1 ms for 128k int64 ids already in arrays, where a Python loop took milliseconds).
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


#: Characters of a non-JSON error body kept by :func:`error_body_text`.
ERROR_BODY_LIMIT = 500


def error_body_text(status: int, text: str) -> str:
    """``HTTP <status>: <message>`` from an HTTP error body: OpenAI's ``error.message``, or a
    top-level ``message``, ``detail`` or ``error``; else the body's first :data:`ERROR_BODY_LIMIT`
    characters. The one reading of a worker's or the proxy's error body (the streaming client
    stores it in ``turns.error``; the proxy quotes P's with it)."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return f"HTTP {status}: {err['message']}"
        for k in ("message", "detail", "error"):
            if body.get(k):
                return f"HTTP {status}: {body[k]}"
    return f"HTTP {status}: {text[:ERROR_BODY_LIMIT]}"


# -- the speed probes (``run_probes``): written by the conductor, read by the planner -------------

#: Prompt tokens of the speed probe (a short prefill: fast on any machine, long enough to be compute).
PROBE_TOKENS = 256
#: Prompt tokens of the **compute probe**, sent beside the short one: its TTFT less the short
#: probe's is the compute of the tokens between the two lengths, without the fixed cost both pay
#: (HTTP, the engine's frontend, a step). The short probe alone is mostly fixed cost on a small
#: model (44 ms, of which c(256) is 18 ms, on the embedded profile) and reads a busy machine's
#: compute slowdown short (docs/planner/concurrency.md).
COMPUTE_PROBE_TOKENS = 2048
#: Prompt tokens of the **cached-prefix probe**, sent right after each compute probe with the same
#: salt: the compute probe's ids plus ``PROBE_TOKENS`` more, so the worker finds the compute probe's
#: whole blocks in its prefix cache and computes ``PROBE_TOKENS`` new tokens on a 2,048-token
#: cached context, what a later turn costs. Its TTFT less the short probe's is attention's
#: context term alone: c(2304) - c(2048) - c(256) = a2 x 2^20 (the linear terms cancel).
CACHED_PROBE_TOKENS = COMPUTE_PROBE_TOKENS + PROBE_TOKENS
#: The ``run_probes.target`` of the **path probe**: the short probe's prompt (``PROBE_TOKENS`` fresh
#: ids, a salt of its own) sent through the run's proxy, the way a turn goes (P's prefill, the
#: hand-off and D's first step in a P/D mode; the aggregated worker in ``aggregated``). Its TTFT
#: holds every fixed cost of the turn's path (the proxy's hops, both workers' frontends) on the
#: run's machine and code, which the short probe, sent straight to the prefill worker, does not see.
PATH_PROBE_TARGET = Role.PROXY
