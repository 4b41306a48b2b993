"""One generate request on its way through the proxy: what it carries, and the facts it reports.

:class:`RequestFacts` is what the proxy learns about a request (reuse outcome, token counts, the
prefill leg's time, the workers) and renders it the way the wire contract says
(:mod:`core.contract`): response headers, the public ``turnscope`` field, the JSON log line.
:class:`ProxiedRequest` carries one request through the proxy's steps
(``serving.proxy.SessionProxy``). See docs/design.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.contract import (
    DECODE_ENGINE_HEADER,
    PREFILL_ENGINE_HEADER,
    PREFILL_MS_HEADER,
    PUBLIC_FACT_KEYS,
    REQUEST_ID_HEADER,
    REUSE_HEADER,
    PublicFacts,
)

#: Phases of a request, the ``phase`` label of ``turnscope_proxy_client_disconnects_total``: the
#: prefill leg (with the handle match and its render), the decode leg before the first token was
#: relayed (the whole decode leg of a non-streamed request; every phase of an aggregated one
#: before its first token), and the streamed decode after it.
PHASE_PREFILL = "prefill"
PHASE_BEFORE_FIRST_TOKEN = "before_first_token"
PHASE_STREAMING = "streaming"
PHASES = (PHASE_PREFILL, PHASE_BEFORE_FIRST_TOKEN, PHASE_STREAMING)
#: The proxy's log status of a request whose client went away before it ended.
CLIENT_DISCONNECTED = "client_disconnected"


@dataclass
class RequestFacts:
    """The facts of one request (counts in tokens, times in seconds); see
    :class:`core.contract.PublicFacts` for the meaning of each public one.

    ``prefill_engine`` is None in aggregated mode (there is no prefill leg).
    """

    request_id: str
    mode: str
    prefill_engine: str | None
    decode_engine: str
    remote_tokens: int = 0
    reused_tokens: int = 0
    prefill_cached_tokens: int = 0
    handle_age_s: float | None = None
    divergence_position: int | None = None
    handle_tokens: int | None = None
    reuse: str | None = None
    prefill_leg_s: float | None = None
    prefill_attempts: int | None = None
    recomputed_tokens: int | None = None

    def headers(self) -> dict[str, str]:
        """The response headers (known before the stream): request id, reuse outcome, the prefill
        leg's time in milliseconds (3 decimals) and engine when there was one, the decode engine."""
        out = {REQUEST_ID_HEADER: self.request_id}
        if self.reuse:
            out[REUSE_HEADER] = self.reuse
        if self.prefill_leg_s is not None:
            out[PREFILL_MS_HEADER] = f"{self.prefill_leg_s * 1000:.3f}"
            out[PREFILL_ENGINE_HEADER] = self.prefill_engine or ""
        out[DECODE_ENGINE_HEADER] = self.decode_engine
        return out

    def identity_headers(self) -> dict[str, str]:
        """The headers that name the request and its workers (sent back with a prefill failure)."""
        return {REQUEST_ID_HEADER: self.request_id, PREFILL_ENGINE_HEADER: self.prefill_engine or "",
                DECODE_ENGINE_HEADER: self.decode_engine}

    def public(self) -> PublicFacts:
        """The facts sent to the client in the final chunk's ``turnscope`` field."""
        return PublicFacts(**{k: getattr(self, k) for k in PUBLIC_FACT_KEYS})  # type: ignore[typeddict-item]

    def log_fields(self) -> dict:
        """Every fact, for the proxy's JSON log line."""
        return dataclasses.asdict(self)


@dataclass
class ProxiedRequest:
    """One generate request as the proxy's steps hand it on.

    Attributes:
        endpoint: ``/v1/chat/completions`` or ``/v1/completions``.
        body: the client's body, session key and client-supplied ``kv_transfer_params`` removed.
        session: the session key (None: the client sent none).
        prefill, decode: the workers chosen for it (``serving.proxy.Worker``).
        facts: what the proxy reports about it.
        t_arrival: ``time.perf_counter()`` when it arrived.
        waited_s: seconds spent waiting on workers before the decode leg (``/tokenize``, prefill).
        new_ids: the request's rendered ids, when a handle was matched against them.
        chain: the block hashes of the request's prompt (``serving.prefix_index.BlockChains``),
            once known; None before.
        local_estimate: tokens of the prompt the picked P's prefix cache holds, from any session,
            as the proxy knows before the prefill leg (``serving.prefix_index.PrefixIndex``).
        recorded: whether the picked P's prefix index has this request's prompt yet.
        handle_params: the (trimmed) handle offered to P; None: none.
        outcome: the reuse outcome so far.
        p_params: P's returned ``kv_transfer_params`` for D (None in aggregated mode).
        phase: where the request is (:data:`PHASES`).
        finished: whether it has ended (answered, failed, or left by its client): logged once.
    """

    endpoint: str
    body: dict
    session: str | None
    prefill: object
    decode: object
    facts: RequestFacts
    t_arrival: float
    waited_s: float = 0.0
    new_ids: Sequence[int] | None = None
    chain: list[bytes] | None = None
    local_estimate: int = 0
    recorded: bool = False
    handle_params: dict | None = None
    outcome: str | None = None
    p_params: dict | None = field(default=None)
    phase: str = PHASE_PREFILL
    finished: bool = False

    @property
    def cache_salt(self) -> str | None:
        """The body's ``cache_salt`` (vLLM's per-request prefix-cache salt; None: none or not a
        string): P's prefix cache, and so the proxy's prefix index, keeps salted prompts apart."""
        salt = self.body.get("cache_salt")
        return salt if isinstance(salt, str) and salt else None
