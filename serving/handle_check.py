"""Does the decode worker (D) return its KV handle in streamed answers? Asked at start, in words.

With ``bidirectional_kv_xfer`` D returns, when a request finishes, the handle the session's next
prefill pulls (``kv_transfer_params``). vLLM 0.32 returns it only in non-streamed answers; vLLM PR
40186 (not merged) adds it to the final streamed chunk, and turnscope's worker entry
(``python -m serving.vllm_worker``) patches it in (``serving.stream_handle_patch``). Against a stock
vLLM D every streamed turn of a bidirectional mode would read ``miss_no_handle_returned``, which
looks like a fact of the traffic, not a fault of the set-up. So before a bidirectional mode serves
anything, :func:`check_streamed_handles` sends one short streamed turn to each decode worker
through the proxy, naming the worker (``DECODE_WORKER_HEADER``: the proxy's routing is bypassed,
so a D its routing would not pick for the check's sessions is checked all the same), and refuses
the mode (:class:`StockDecodeError`, naming the worker and what to change) when a D returns no
handle.

Each check turn is followed by its session's release turn (:func:`release_turn`): P pulls the
handle, so D frees those blocks, and the release is abandoned after its first token, so D pins
nothing of the check's for ``decoder_kv_blocks_ttl`` in the KV space of the run to come.
"""

from __future__ import annotations

import json
import os
import random
import time

import httpx
from httpx_sse import SSEError, connect_sse
from prometheus_client.parser import text_string_to_metric_families

from core.contract import DECODE_ENGINE_HEADER, DECODE_WORKER_HEADER, FACTS_FIELD, SESSION_FIELD

#: Output tokens a release turn asks for: D is still decoding when the client leaves after the first.
RELEASE_MAX_TOKENS = 64
#: Seconds to wait at most for the proxy to count release turns' disconnects.
RELEASE_SETTLE_S = 5.0
#: Prompt tokens of a check turn: more than vLLM's recompute threshold (64) and one CPU KV block (128).
CHECK_PROMPT_TOKENS = 200


class StockDecodeError(RuntimeError):
    """A decode worker returns no KV handle in streamed answers: the bidirectional modes are refused."""


def release_turn(client: httpx.Client, proxy_url: str, body: dict, headers: dict[str, str] | None = None) -> str:
    """Send ``body`` as a streamed turn of at most :data:`RELEASE_MAX_TOKENS` tokens and leave after
    its first event: the proxy closes its connections to the workers (``serving.client_disconnect``)
    and vLLM aborts the request, and D frees an aborted request's blocks at once, where it pins a
    request finished by length or stop for ``decoder_kv_blocks_ttl`` (vLLM 0.32
    ``nixl/pull_scheduler.py``, ``request_finished``). The turn still takes its session's handle
    (P pulls it, or needs none of it), on which D frees that handle. Returns the reuse outcome (the
    proxy's ``x-turnscope-reuse`` header), or the error; never raises for the server's answer.
    ``headers``: added to the client's (a named decode worker)."""
    stream = body | {"stream": True, "max_tokens": RELEASE_MAX_TOKENS}
    try:
        with connect_sse(client, "POST", proxy_url + "/v1/completions", json=stream,
                         headers=dict(headers or {})) as source:
            outcome = source.response.headers.get("x-turnscope-reuse", f"http {source.response.status_code}")
            source.response.raise_for_status()
            next(source.iter_sse(), None)      # the first token; leaving the block closes the connection
    except (httpx.HTTPError, SSEError) as exc:
        return f"error {type(exc).__name__}"
    return outcome


def proxy_client_disconnects(client: httpx.Client, proxy_url: str) -> float | None:
    """turnscope's proxy's ``turnscope_proxy_client_disconnects_total`` over its phases (0 before the
    first: the proxy always exposes its unlabelled ``turnscope_handle_ttl_seconds``); None when
    ``proxy_url`` serves no turnscope proxy metrics (another proxy, a stub)."""
    try:
        r = client.get(proxy_url + "/metrics", timeout=5)
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError, TypeError, IndexError, KeyError):
        return None
    if not any(f.name.startswith("turnscope_") for f in families):
        return None
    return sum(s.value for f in families if f.name == "turnscope_proxy_client_disconnects"
               for s in f.samples if s.name.endswith("_total"))


def wait_disconnects_counted(client: httpx.Client, proxy_url: str, before: float | None, released: int) -> None:
    """Wait (at most :data:`RELEASE_SETTLE_S`) until the proxy has counted ``released`` more client
    disconnects than ``before``: the release turns have ended on the workers."""
    if before is None or not released:
        return
    deadline = time.monotonic() + RELEASE_SETTLE_S
    while (now := proxy_client_disconnects(client, proxy_url)) is not None and time.monotonic() < deadline \
            and now < before + released:
        time.sleep(0.05)


def _check_turn(client: httpx.Client, proxy_url: str, body: dict,
                headers: dict[str, str]) -> tuple[str | None, dict | None, list[int]]:
    """One streamed check turn: ``(decode worker, facts, generated ids)``. Raises RuntimeError when
    the proxy answers an HTTP error."""
    facts, gen = None, []
    with connect_sse(client, "POST", proxy_url + "/v1/completions", json=body | {"stream": True},
                     headers=dict(headers)) as source:
        if source.response.status_code != 200:
            source.response.read()
            raise RuntimeError(f"the streamed-handle check's turn was answered HTTP {source.response.status_code}: "
                               f"{source.response.text[:300]}")
        decode = source.response.headers.get(DECODE_ENGINE_HEADER)
        for event in source.iter_sse():
            if event.data == "[DONE]":
                break
            chunk = json.loads(event.data)
            facts = chunk.get(FACTS_FIELD, facts)
            for choice in chunk.get("choices") or ():
                gen.extend(choice.get("token_ids") or ())
    return decode, facts, gen


def check_streamed_handles(proxy_url: str, model: str, decode_workers: dict[str, str],
                           headers: dict[str, str] | None = None, timeout_s: float = 120.0) -> dict[str, bool]:
    """Through the proxy of a bidirectional mode, whether each decode worker returns its KV handle in
    a streamed answer: one short session per worker of ``decode_workers`` (name -> URL; a new id,
    :data:`CHECK_PROMPT_TOKENS` random token ids, 2 output tokens), sent to that worker by name
    (``DECODE_WORKER_HEADER``), then released (:func:`release_turn`, to the same worker).
    ``headers``: the proxy's client key. Returns name -> handle returned, for every worker.
    Raises StockDecodeError naming each worker that returned none, and RuntimeError when a check
    turn fails or another worker than the one named served it (a proxy that does not route by
    name)."""
    seen: dict[str, bool] = {}
    rng = random.Random(os.getpid())
    with httpx.Client(timeout=timeout_s, headers=headers or {}) as client:
        before = proxy_client_disconnects(client, proxy_url)
        released = 0
        for i, name in enumerate(decode_workers):
            named = {DECODE_WORKER_HEADER: name}
            ids = [rng.randrange(10, 2000) for _ in range(CHECK_PROMPT_TOKENS)]
            body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0,
                    SESSION_FIELD: f"turnscope-handle-check-{os.getpid()}-{i}"}
            decode, facts, gen = _check_turn(client, proxy_url, body, named)
            if decode != name:
                raise RuntimeError(f"the streamed-handle check named decode worker {name} ({DECODE_WORKER_HEADER}) "
                                   f"and {proxy_url} answered from {decode!r}: it is not a turnscope proxy that "
                                   "routes by that header")
            seen[name] = (facts or {}).get("handle_tokens") is not None
            outcome = release_turn(client, proxy_url, body | {"prompt": ids + gen + ids[:8]}, named)
            released += not outcome.startswith("error")
        wait_disconnects_counted(client, proxy_url, before, released)
    missing = [name for name, ok in seen.items() if not ok]
    if missing:
        raise StockDecodeError(stock_decode_message(missing, decode_workers))
    return seen


def stock_decode_message(names: list[str], decode_workers: dict[str, str]) -> str:
    """What to tell an operator whose decode workers ``names`` return no handle in streamed answers."""
    where = ", ".join(f"{n} ({decode_workers.get(n, '?')})" for n in names)
    return (f"decode worker {where} returned no KV handle (kv_transfer_params) in a streamed answer: it runs a "
            "vLLM without streamed handles (vLLM PR 40186, not merged as of vLLM 0.32), so every turn of a "
            "bidirectional mode would read miss_no_handle_returned. Start D with turnscope's worker entry "
            "(python -m serving.vllm_worker, roles.decode.entry: turnscope) or a vLLM that has PR 40186; the "
            "one-way modes (pd, pd-nocache) and aggregated need no handle. The bidirectional mode is refused.")
