"""The known-answer canary: a fixed two-turn session answered greedily by a reference worker and by
the serving path through the proxy, compared token by token (docs/reliability.md).

Why: a P/D path can answer HTTP 200 with wrong tokens. vLLM issue 49250 (``kv_load_failure_policy:
recompute`` logs "Recovered" while one runner's output is garbage), and a deployment whose UCX
connection dropped kept answering 200 with corrupted tokens until restarted. Status codes prove
nothing; a known answer does.

The canary (:func:`run_canary`):

1. turn 0: :data:`CANARY_PROMPT_TOKENS` fixed token ids (:func:`canary_prompt_ids`), turn 1: turn
   0's prompt + the ids the serving path generated + :data:`CANARY_FOLLOW_UP_TOKENS` fixed ids, in
   one session (its own ``conversation_id``), so that in ``pd-bidir`` turn 1's prefill pulls D's
   blocks of turn 0 (``hit``): the bidirectional pull is on the path the canary checks;
2. each turn sent through the proxy's own app (every step a client's request takes: admission, the
   handle, the prefill and decode legs) and straight to the reference worker (the proxy's
   ``canary_reference``, default its first prefill or aggregated worker: P alone), greedily
   (``temperature`` 0, ``seed`` :data:`CANARY_SEED`, ``ignore_eos``, ``max_tokens`` from
   :func:`canary_max_tokens`: enough that turn 1 pulls), with ``return_token_ids``;
3. each side with a ``cache_salt`` of its own, new per canary: the reference never reads KV the
   serving path left in P's prefix cache (a corrupted pull would otherwise poison P's cache and
   the reference with it), and the serving path starts cold each time (the same fixed prompt
   would else be in P's cache from the last canary, and turn 1 would pull nothing);
4. the generated ids compared token by token: ``match``, ``mismatch`` (the first index where they
   differ is reported) or ``error`` (a request failed: a status code already says that).

Greedy decoding on one machine is deterministic: the embedded model's P/D path with a
bidirectional pull gives the reference worker's tokens exactly
(tests/integration/test_pd_bidir_vllm.py, tests/integration/test_canary_vllm.py).
"""

from __future__ import annotations

import uuid
from typing import Literal

import httpx
from pydantic import BaseModel

from core.contract import REQUEST_ID_HEADER, REUSE_HEADER, SESSION_FIELD

#: Prompt tokens of the canary's first turn: more than two KV blocks of 128 (vLLM's CPU block
#: size), so that the second turn pulls at least one whole block from D.
CANARY_PROMPT_TOKENS = 300
#: New prompt tokens of the second turn.
CANARY_FOLLOW_UP_TOKENS = 40
#: Tokens generated per turn at least (``ignore_eos``: exactly :func:`canary_max_tokens`).
CANARY_MIN_TOKENS = 16
#: Tokens the second turn's pull exceeds vLLM's ``kv_recompute_threshold`` by (slack).
PULL_MARGIN_TOKENS = 8
#: The sampling seed sent with every canary request (greedy decoding does not draw; the seed
#: keeps the request reproducible should a backend sample anyway).
CANARY_SEED = 0
#: Request ids of the canary's requests start with this (the soak tells them from the load's).
CANARY_REQUEST_PREFIX = "canary-"

CanaryResult = Literal["match", "mismatch", "error"]


def canary_prompt_ids(n: int = CANARY_PROMPT_TOKENS, offset: int = 0) -> list[int]:
    """``n`` fixed token ids (``10 + (13 (i + offset) + 5) mod 1000``: ordinary vocabulary ids of
    any tokenizer, no special tokens)."""
    return [10 + (13 * (i + offset) + 5) % 1000 for i in range(n)]


def canary_max_tokens(block_size: int, kv_recompute_threshold: int,
                      prompt_tokens: int = CANARY_PROMPT_TOKENS) -> int:
    """Tokens each canary turn generates: enough that turn 1 really pulls from D. With P's prefix
    cache on, turn 1 pulls only what P does not hold: D's KV of turn 0 (prompt + generated - 1
    tokens) past P's whole blocks of the prompt, ``prompt mod block + generated - 1`` tokens, and P
    recomputes instead below ``kv_recompute_threshold`` (vLLM's NixlConnector). So at least
    ``threshold + 1 - prompt mod block`` + :data:`PULL_MARGIN_TOKENS`, and
    :data:`CANARY_MIN_TOKENS`: 29 with vLLM's CPU blocks of 128 and threshold 64 (a pull of 72),
    61 with blocks of 16."""
    return max(CANARY_MIN_TOKENS,
               kv_recompute_threshold + 1 - prompt_tokens % block_size + PULL_MARGIN_TOKENS)


def first_mismatch(reference: list[int], served: list[int]) -> int | None:
    """The first index where ``served`` differs from ``reference`` (a missing or extra token
    counts: the shorter length), or None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, served, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(served) else min(len(reference), len(served))


class CanaryTurn(BaseModel):
    """One turn of the canary: what each side generated (token ids) and where they first differ."""

    turn: int
    prompt_tokens: int
    reuse: str | None = None            # the proxy's reuse outcome for the serving path's request
    reference_ids: list[int] = []
    served_ids: list[int] = []
    first_mismatch: int | None = None


class CanaryReport(BaseModel):
    """A canary's outcome (:func:`run_canary`); ``error`` says which request failed and how."""

    result: CanaryResult
    reference: str                      # the reference worker's name
    session: str | None = None          # the canary's session id (its requests' ids start with it)
    turns: list[CanaryTurn] = []
    error: str | None = None

    @property
    def matched(self) -> bool:
        return self.result == "match"


class CanaryRequestFailed(Exception):
    """A canary request did not come back with generated ids (an HTTP error, no ``token_ids``)."""


def _body(model: str, prompt: list[int], salt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "seed": CANARY_SEED, "ignore_eos": True, "return_token_ids": True, "stream": False,
            "cache_salt": salt}


async def _generated(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str],
                     side: str) -> tuple[list[int], httpx.Response]:
    r = await client.post(url, json=body, headers=headers, timeout=300)
    if r.status_code != 200:
        raise CanaryRequestFailed(f"{side}: HTTP {r.status_code}: {r.text[:300]}")
    choice = (r.json().get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise CanaryRequestFailed(f"{side}: no token_ids in the answer (return_token_ids unsupported?)")
    return [int(t) for t in ids], r


async def run_canary(served: httpx.AsyncClient, reference: httpx.AsyncClient, reference_url: str,
                     reference_name: str, model: str, max_tokens: int = CANARY_MIN_TOKENS,
                     served_headers: dict[str, str] | None = None,
                     reference_headers: dict[str, str] | None = None) -> CanaryReport:
    """Run the canary (module doc) and compare. Never raises for a failed request: the report's
    ``result`` is ``error`` and ``error`` says which side failed.

    Args:
        served: a client whose base URL is the serving path (the proxy's app).
        reference: a client for the reference worker at ``reference_url`` (its base URL).
        reference_name: the reference worker's name, for the report.
        model: the served model's name.
        max_tokens: tokens each turn generates (:func:`canary_max_tokens`).
        served_headers / reference_headers: headers for each side (API keys).
    """
    tag = uuid.uuid4().hex[:12]
    session = f"{CANARY_REQUEST_PREFIX}{tag}"
    served_salt, reference_salt = f"canary-served-{tag}", f"canary-reference-{tag}"
    report = CanaryReport(result="match", reference=reference_name, session=session)
    prompt = canary_prompt_ids()
    try:
        for turn in range(2):
            if turn == 1:
                prompt = prompt + report.turns[0].served_ids + canary_prompt_ids(CANARY_FOLLOW_UP_TOKENS, 500)
            headers = {REQUEST_ID_HEADER: f"{session}-{turn}"} | (served_headers or {})
            got, r = await _generated(served, "/v1/completions",
                                      _body(model, prompt, served_salt, max_tokens) | {SESSION_FIELD: session}, headers,
                                      "serving path")
            ref, _ = await _generated(reference, reference_url + "/v1/completions",
                                      _body(model, prompt, reference_salt, max_tokens), reference_headers or {},
                                      f"reference {reference_name}")
            t = CanaryTurn(turn=turn, prompt_tokens=len(prompt), reuse=r.headers.get(REUSE_HEADER),
                           reference_ids=ref, served_ids=got, first_mismatch=first_mismatch(ref, got))
            report.turns.append(t)
            if t.first_mismatch is not None:
                report.result = "mismatch"
    except (httpx.HTTPError, CanaryRequestFailed, ValueError) as exc:
        report.result, report.error = "error", f"{type(exc).__name__}: {exc}"
    return report
