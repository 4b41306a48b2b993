"""A prefix sweep as ``turnscope sweep`` records it, written with store.writer's real writer, every
value a formula below (independent of the dashboard's code), for the Sweep page's tests.

- Sweep ``SWEEP_ID`` (``vendor-sweep``, default scale, history ``token_ids``): points
  ``PREFIXES`` = 1000 and 2000 tokens, the five modes, ``SESSIONS`` conversations of ``TURNS``
  turns per run. One extra turn fails (``pd-nocache`` at 1000, session 0, turn 3: a timeout).
- ``OLD_SWEEP``: an older sweep, one point (500) in ``pd-nocache`` only: it must not mix in.
- ``plain-1``: a plain ``turnscope eval`` run (no sweep): not a sweep point.

Turn k of a conversation at prefix P has n = 64 + P + 200 k prompt tokens and, from k = 1, can
reuse r = n - 152 (the previous prompt and its 48-token reply). With c(x) = A1 x + A2 x^2, TTFT is
(seconds, session s = 0, 1, 2):

- pd-nocache:       B0 + c(n), every turn, every session (a full prefill each time)
- pd-bidir-nocache: turn 0 B0 + c(n) + 0.01 s; later B0 + c(n) - c(r) + r T_X[P] + 0.01 s (hits)
- pd:               turn 0 B0 + c(n); later B0 + 0.02 + c(n) - c(r)
- pd-bidir:         turn 0 B0 + c(n) + 0.01 s; later B0 + 0.015 + c(n) - c(r) + 0.004 s (hits)
- aggregated:       turn 0 0.04 + c(n); later 0.04 + c(n) - c(r)

P's NIXL counters in both ``pd-bidir*`` runs of a point rise by 0.1 s and 0.1 s x BANDWIDTH[P]
bytes, so with KV_BYTES_PER_TOKEN the pull costs T_X[P] = 4096 / BANDWIDTH[P] s per token; their
external_kv_transfer counter rises by the hits' reused tokens.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from store.writer import Store

T0 = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
SWEEP_ID = "sweep-20261130T120000"
OLD_SWEEP = "sweep-20261129T090000"
PREFIXES = (1000, 2000)
MODES = ("pd-nocache", "pd-bidir-nocache", "pd", "pd-bidir", "aggregated")
SESSIONS = 3
TURNS = 3
SYSTEM, NEW, REPLY = 64, 152, 48
B0, A1, A2 = 0.05, 3e-4, 2e-8
KV_BYTES_PER_TOKEN = 4096
BANDWIDTH = {1000: 40.96e6, 2000: 81.92e6}  # bytes/s
T_X = {p: KV_BYTES_PER_TOKEN / bw for p, bw in BANDWIDTH.items()}  # 1e-4 and 5e-5 s/token
FAILED = ("pd-nocache", 1000, 0, 3)  # (mode, prefix, session, turn_index) of the timed-out turn
PFX_COUNTER = "vllm:prompt_tokens_by_source_total"


def c(x: float) -> float:
    return A1 * x + A2 * x * x


def prompt(prefix: int, turn: int) -> int:
    return SYSTEM + prefix + (NEW + REPLY) * turn


def reusable(prefix: int, turn: int) -> int | None:
    return None if turn == 0 else prompt(prefix, turn) - NEW


def ttft_s(mode: str, prefix: int, session: int, turn: int) -> float:
    n = prompt(prefix, turn)
    if mode == "pd-nocache":
        return B0 + c(n)
    if mode == "aggregated":
        return 0.04 + c(n) - (c(reusable(prefix, turn)) if turn else 0.0)
    if turn == 0:
        return B0 + c(n) + (0.01 * session if mode.startswith("pd-bidir") else 0.0)
    r = reusable(prefix, turn)
    if mode == "pd-bidir-nocache":
        return B0 + c(n) - c(r) + r * T_X[prefix] + 0.01 * session
    if mode == "pd":
        return B0 + 0.02 + c(n) - c(r)
    return B0 + 0.015 + c(n) - c(r) + 0.004 * session  # pd-bidir


def hit(mode: str, turn: int) -> bool:
    return mode.startswith("pd-bidir") and turn > 0


def run_id(sweep_id: str, mode: str, prefix: int) -> str:
    return f"{sweep_id}-{mode}-token_ids-p{prefix}"


def reused_by_run(mode: str, prefix: int) -> int:
    """Tokens the hits of one run pulled: sum of r over later turns and sessions."""
    return sum(reusable(prefix, t) for _ in range(SESSIONS) for t in range(1, TURNS)) if mode.startswith("pd-bidir") else 0


def _run_row(rid: str, mode: str, sweep_id: str, prefix: int | None, index: int, start: dt.datetime) -> dict:
    spec = {"sessions": SESSIONS, "users": 2, "max_prompt_tokens": 8144}
    if prefix is not None:
        values = list(PREFIXES) if sweep_id == SWEEP_ID else [500]
        spec["sweep"] = {"name": "vendor-sweep", "id": sweep_id, "field": "first_prompt_tokens",
                         "prefix_tokens": prefix, "index": index, "values": values, "scale": "default",
                         "sessions": SESSIONS, "users": 2}
    return {"run_id": rid, "label": "sweep", "mode": mode, "workload": "vendor-sweep", "workload_spec": spec,
            "history_mode": "token_ids", "model": "turnscope-tiny", "config": {"kv_bytes_per_token": KV_BYTES_PER_TOKEN},
            "started_at": start, "status": "complete", "finished_at": start + dt.timedelta(seconds=50),
            "updated_at": start + dt.timedelta(seconds=50)}


def _turns(w, rid: str, mode: str, prefix: int, start: dt.datetime) -> None:
    for s in range(SESSIONS):
        for t in range(TURNS):
            r = reusable(prefix, t)
            w.append("turns", {
                "run_id": rid, "session_id": f"a{s:05d}-vendor-multiturn", "turn_index": t, "kind": "turn",
                "gap_before_s": 0.0, "gap_kind": "none" if t == 0 else "think",
                "sent_at": start + dt.timedelta(seconds=10 * s + t), "ttft_s": ttft_s(mode, prefix, s, t),
                "e2e_s": ttft_s(mode, prefix, s, t) + 0.5, "prompt_tokens": prompt(prefix, t), "completion_tokens": 48,
                "expected_reusable_tokens": r, "status": "ok",
                "reuse": None if mode == "aggregated" else ("hit" if hit(mode, t) else
                                                            "miss_first_turn" if t == 0 else "miss_no_handle_returned"),
                "reused_tokens": (r if hit(mode, t) else 0) if mode != "aggregated" else None})
    if (mode, prefix) == FAILED[:2]:
        w.append("turns", {"run_id": rid, "session_id": f"a{FAILED[2]:05d}-vendor-multiturn", "turn_index": FAILED[3],
                           "kind": "turn", "sent_at": start + dt.timedelta(seconds=40), "ttft_s": None,
                           "e2e_s": 120.0, "status": "timeout", "error": "timeout: total deadline of 120.0 s passed",
                           "expected_reusable_tokens": reusable(prefix, FAILED[3]), "reuse": "hit"})


def _metrics(w, rid: str, mode: str, prefix: int, start: dt.datetime, counter: bool = True) -> None:
    p = "http://127.0.0.1:8100"
    labels = {"model_name": "turnscope-tiny", "engine": "0"}
    reused = reused_by_run(mode, prefix)
    for i, frac in enumerate((0.0, 0.5, 1.0)):
        at = start + dt.timedelta(seconds=20 * i)
        role = "aggregated" if mode == "aggregated" else "prefill"
        if counter:
            w.append("metric_samples", {"run_id": rid, "scraped_at": at, "endpoint": p, "role": role,
                                        "name": PFX_COUNTER, "labels": labels | {"source": "external_kv_transfer"},
                                        "value": 7.0 + frac * reused})
        if mode.startswith("pd-bidir"):
            for name, total in (("vllm:nixl_xfer_time_seconds_sum", 0.1),
                                ("vllm:nixl_bytes_transferred_sum", 0.1 * BANDWIDTH[prefix])):
                w.append("metric_samples", {"run_id": rid, "scraped_at": at, "endpoint": p, "role": "prefill",
                                            "name": name, "labels": labels, "value": 3.0 + frac * total})


def build(root: Path, no_counter: tuple[str, ...] = ()) -> Path:
    """Write the store under `root`; returns `root`. The modes in `no_counter` get no
    external_kv_transfer samples (P not scraped)."""
    store = Store(root)
    store.init()
    rid = run_id(OLD_SWEEP, "pd-nocache", 500)
    with store.writer(rid, "test") as w:
        start = T0 - dt.timedelta(days=1)
        w.append("runs_log", _run_row(rid, "pd-nocache", OLD_SWEEP, 500, 0, start))
        _turns(w, rid, "pd-nocache", 500, start)
    with store.writer("plain-1", "test") as w:
        start = T0 - dt.timedelta(hours=1)
        w.append("runs_log", _run_row("plain-1", "pd", "", None, 0, start))
        _turns(w, "plain-1", "pd", 1000, start)
    k = 0
    for mode in MODES:
        for index, prefix in enumerate(PREFIXES):
            rid = run_id(SWEEP_ID, mode, prefix)
            start = T0 + dt.timedelta(minutes=k)
            k += 1
            with store.writer(rid, "test") as w:
                w.append("runs_log", _run_row(rid, mode, SWEEP_ID, prefix, index, start))
                _turns(w, rid, mode, prefix, start)
                _metrics(w, rid, mode, prefix, start, counter=mode not in no_counter)
    return root
