"""A run's known-answer canaries: ask the proxy for one (``POST /canary``, ``serving.canary``) and
record its turns in the store's ``run_canaries`` table (docs/schema/tables.md).

``turnscope eval`` runs one in each P/D run after the scraper's last scrape (so the run's counters
do not count the canary's requests);
``bench/soak.py`` also every few minutes under load; ``turnscope check`` on demand. A run with a
mismatch fails its P/D check (``analysis.pd_check``).
"""

from __future__ import annotations

import datetime as dt
import uuid

import httpx

from serving.canary import CanaryReport

#: Seconds a canary may take (four short requests, two of them through P and D).
CANARY_TIMEOUT_S = 300.0


def request_canary(proxy_url: str, model: str | None = None, headers: dict[str, str] | None = None,
                   verify: object = True, timeout_s: float = CANARY_TIMEOUT_S) -> CanaryReport:
    """One canary from the proxy at ``proxy_url`` (``headers``: its client key). Never raises for a
    network or HTTP failure: the report's ``result`` is then ``error``."""
    try:
        r = httpx.post(proxy_url.rstrip("/") + "/canary", json={"model": model} if model else {},
                       headers=headers or {}, verify=verify, timeout=timeout_s)
        if r.status_code != 200:
            return CanaryReport(result="error", reference="", error=f"POST /canary: HTTP {r.status_code}: {r.text[:300]}")
        return CanaryReport.model_validate(r.json())
    except (httpx.HTTPError, ValueError) as exc:
        return CanaryReport(result="error", reference="", error=f"POST /canary: {type(exc).__name__}: {exc}")


def canary_rows(report: CanaryReport, run_id: str, phase: str, sent_at: dt.datetime) -> list[dict]:
    """The ``run_canaries`` rows of ``report``: one per turn, or one with ``turn`` NULL when it
    failed before any turn finished."""
    base = {"run_id": run_id, "phase": phase, "sent_at": sent_at, "canary_id": uuid.uuid4().hex[:12],
            "result": report.result, "reference": report.reference, "error": report.error}
    if not report.turns:
        return [base | {"turn": None, "prompt_tokens": None, "reuse": None, "first_mismatch": None,
                        "reference_ids": None, "served_ids": None}]
    return [base | {"turn": t.turn, "prompt_tokens": t.prompt_tokens, "reuse": t.reuse,
                    "first_mismatch": t.first_mismatch, "reference_ids": t.reference_ids,
                    "served_ids": t.served_ids} for t in report.turns]


def canary_run(writer, run_id: str, phase: str, proxy_url: str, model: str | None = None,
               headers: dict[str, str] | None = None, verify: object = True) -> CanaryReport:
    """Ask the proxy for one canary and append its ``run_canaries`` rows to ``writer``."""
    sent_at = dt.datetime.now(dt.UTC)
    report = request_canary(proxy_url, model, headers, verify)
    for row in canary_rows(report, run_id, phase, sent_at):
        writer.append("run_canaries", row)
    writer.flush()
    return report


def describe(report: CanaryReport) -> str:
    """One line for the console: the result, where the tokens first differed, the reuse outcomes."""
    if report.result == "error":
        return f"error: {report.error}"
    turns = ", ".join(f"turn {t.turn} ({t.reuse or 'no outcome'}): "
                      + ("same ids" if t.first_mismatch is None else f"ids differ from token {t.first_mismatch}")
                      for t in report.turns)
    return f"{report.result} against {report.reference}: {turns}"
