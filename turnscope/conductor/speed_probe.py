"""The speed probe: a small fixed prefill sent at a run's start and end, so a forecast of the run
can be put on that run's machine speed from a measurement that is not the turns being forecast
(docs/planner/calibration.md).

One probe = one streamed ``/v1/completions`` request of :data:`PROBE_TOKENS` fixed token ids
(:func:`probe_ids`, the same every time), ``max_tokens`` 1, temperature 0, sent straight to the
run's prefill worker (P/D modes) or aggregated worker, with a ``cache_salt`` of its own so that
no prefix cache holds it (vLLM adds the salt to the first block's hash): every probe is a full
prefill of the same prompt. Its TTFT is the time from sending to the first streamed token
(``httpx_sse``). It is sent before the run's metrics scraper starts and after it stops, so the
run's counters do not count it. Rows: the store's ``run_probes`` table (docs/schema/tables.md).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Mapping, Sequence

import httpx
from httpx_sse import SSEError, connect_sse

from core.contract import COMPUTE_PROBE_TOKENS, PROBE_TOKENS, Role

#: The lengths sent at each phase, in this order, :data:`PROBES_PER_PHASE` times.
PROBE_LENGTHS = (PROBE_TOKENS, COMPUTE_PROBE_TOKENS)
#: Seconds a probe may take before it is recorded as an error.
PROBE_TIMEOUT_S = 60.0
#: Probes sent back to back at each phase of a run: the run's factor is the median of its probes,
#: so one probe caught by a transient (15-25 ms on a 45 ms probe, measured: docs/log/calibration.md)
#: cannot move it.
PROBES_PER_PHASE = 3
#: Roles a probe goes to, in order of preference (the first a run's workers have).
PROBE_ROLES = (Role.PREFILL, Role.AGGREGATED)


def probe_ids(tokens: int = PROBE_TOKENS) -> list[int]:
    """The probe's prompt: ``tokens`` fixed token ids (10 + 7 i mod 1000: ordinary vocabulary ids
    of any tokenizer, no special tokens)."""
    return [10 + (7 * i) % 1000 for i in range(tokens)]


def probe_target(endpoints: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The (url, role) a probe goes to: the first ``prefill`` worker, else the first ``aggregated``
    one; None when the run has neither (e.g. an attached deployment seen only through its proxy)."""
    for role in PROBE_ROLES:
        for url, r in endpoints:
            if r == role:
                return url, r
    return None


def probe(url: str, model: str, salt: str, tokens: int = PROBE_TOKENS,
          timeout_s: float = PROBE_TIMEOUT_S, headers: dict[str, str] | None = None, verify: object = True) -> dict:
    """Send one probe to the worker at ``url`` (with its ``headers``: its API key; ``verify``: its TLS
    verification); returns a ``run_probes`` row without ``run_id``/``phase``:
    sent_at, endpoint, prompt_tokens, ttft_s (None on error), status (``ok`` | ``error``), error.
    Never raises for a network or HTTP failure (the row says it)."""
    body = {"model": model, "prompt": probe_ids(tokens), "max_tokens": 1, "temperature": 0, "stream": True,
            "cache_salt": salt}
    row = {"sent_at": dt.datetime.now(dt.UTC), "endpoint": url, "prompt_tokens": tokens, "ttft_s": None,
           "status": "error", "error": None}
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout_s, headers=headers or {}, verify=verify) as client, \
                connect_sse(client, "POST", url + "/v1/completions", json=body) as source:
            source.response.raise_for_status()
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    break
                choices = json.loads(event.data).get("choices") or []
                if any(c.get("text") or c.get("token_ids") for c in choices):
                    row |= {"ttft_s": time.perf_counter() - t0, "status": "ok"}
                    break
            else:
                row["error"] = "the stream ended without a token"
    except (httpx.HTTPError, SSEError, ValueError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    if row["status"] == "error" and row["error"] is None:
        row["error"] = "no token before [DONE]"
    return row


def probe_run(writer, run_id: str, phase: str, endpoints: Sequence[tuple[str, str]], model: str,
              probes: int = PROBES_PER_PHASE, headers: Mapping[str, dict[str, str]] | None = None,
              verify: object = True, lengths: Sequence[int] = PROBE_LENGTHS) -> list[dict]:
    """Probe the run's target worker (:func:`probe_target`) ``probes`` times back to back, each time
    one probe of each of ``lengths`` (prompt tokens: the short probe, then the compute probe), each
    with a salt of its own, and append one ``run_probes`` row per probe (``phase``: ``start`` | ``end``)
    with ``writer`` (a store writer of the run); returns the rows (none when the run has no worker
    to probe). ``headers``: per base URL, what a request to it carries (its API key); ``verify``:
    TLS verification."""
    target = probe_target(endpoints)
    if target is None:
        return []
    url, role = target
    rows = []
    for k in range(probes):
        for tokens in lengths:
            salt = f"turnscope-probe-{run_id}-{phase}-{k}" + ("" if tokens == PROBE_TOKENS else f"-{tokens}")
            row = {"run_id": run_id, "phase": phase, "target": role} | probe(
                url, model, salt=salt, tokens=tokens, headers=(headers or {}).get(url), verify=verify)
            writer.append("run_probes", row)
            rows.append(row)
    return rows
