"""Recorded runs as ``turnscope eval`` records them, written with store.writer's real writer, for the
planner's fit and check (planner/fit.py, check.py). Every value is a formula below,
independent of the planner's code, so the tests' truths are hand computations.

Five runs (``RUNS``: one per mode), token_ids history, ``SESSIONS`` = 2 sessions of ``TURNS`` = 4
turns, one at a time (no overlap). Session s, turn k: n = 1000 + 300 k + 100 s prompt tokens,
``OUT`` = 32 completion tokens; from k = 1 the prompt starts with the previous prompt and its 32
generated ids (``expected_reusable_tokens`` = previous n + 32). Session s starts at 100 s x s; a turn
ends ``ttft + 1`` s after it is sent (e2e), the next is sent ``GAP_S`` later, except session 1's last
turn, sent ``LONG_GAP_S`` after (past the proxy's handle TTL: ``TTL_S`` - ``MARGIN_S`` = 15 s).

Deployment: KV blocks of ``BLOCK`` tokens, ``KV_BYTES`` bytes per token, ``NUM_BLOCKS`` blocks per
worker (vllm:cache_config_info), c(x) = A1 x + A2 x^2, pulls cost ``PULL_S_PER_TOKEN`` (P's NIXL
counters rise by 0.5 s and 0.5 s x ``BANDWIDTH`` bytes in each pd-bidir* run), TPOT ``TPOT_S``.
TTFT = B0[mode] + c(n) - c(local + pulled) + pulled x PULL_S_PER_TOKEN with the tokens below:

- pd-nocache: local 0, no pull; outcomes miss_first_turn, then miss_no_handle_returned.
  Session 1's last turn times out (not checked, not fitted).
- pd: P's own cache would hold the previous prompt, but the recording says P found nothing
  (``prefill_cached_tokens`` 0: P's cache lost it), so TTFT is a full prefill: the planner's
  forecast (whole blocks of the previous prompt) is too fast there; ``pd_relative_errors`` gives each
  turn's error by hand.
- pd-bidir: local = whole blocks of the previous prompt; pull = previous n + 31 (D's handle: prompt +
  output - 1) - local, recomputed instead when below 64 (``miss_below_threshold``): session 0 turn 2
  (1331 - 1280 = 51). Session 1's last turn: ``miss_expired``.
- pd-bidir-nocache: every later turn pulls previous n + 31 (``hit``), but session 0 turn 2 recorded
  ``miss_transfer_failed`` (a NIXL read failed: full prefill) where the rules say ``hit``: the one
  outcome the check must list. Session 1's last turn: ``miss_expired``.
- aggregated: local = whole blocks of previous n + 32 (the worker keeps its output's KV), ``reuse``
  NULL, ``cached_tokens`` = local.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from store.writer import Store

T0 = dt.datetime(2026, 11, 30, 9, 0, tzinfo=dt.UTC)
MODES = ("pd-nocache", "pd", "pd-bidir", "pd-bidir-nocache", "aggregated")
RUNS = {mode: f"eval-20261130T090000-{mode}-token_ids" for mode in MODES}
SESSIONS, TURNS, OUT = 2, 4, 32
BLOCK, KV_BYTES, NUM_BLOCKS = 128, 4096, 1000
A1, A2 = 2e-4, 5e-8
B0 = {"pd-nocache": 0.050, "pd": 0.060, "pd-bidir": 0.070, "pd-bidir-nocache": 0.080, "aggregated": 0.030}
BANDWIDTH = 40.96e6  # bytes/s
PULL_S_PER_TOKEN = KV_BYTES / BANDWIDTH  # 1e-4 s
TTL_S, MARGIN_S, THRESHOLD = 20.0, 5.0, 64
GAP_S, LONG_GAP_S = 2.0, 20.0
TPOT_S = 0.03
PROBE_TOKENS = 256
TRANSFER_FAILED = ("pd-bidir-nocache", 0, 2)
TIMED_OUT = ("pd-nocache", 1, 3)
EXPIRED = (1, 3)  # (session, turn) sent LONG_GAP_S after the previous turn ended


def c(x: float) -> float:
    return A1 * x + A2 * x * x


def prompt(s: int, k: int) -> int:
    return 1000 + 300 * k + 100 * s


def whole_blocks(x: int) -> int:
    return x // BLOCK * BLOCK


def recorded(mode: str, s: int, k: int) -> tuple[str | None, int, int]:
    """(reuse outcome, local tokens, pulled tokens) as the run recorded them."""
    if k == 0:
        return (None if mode == "aggregated" else "miss_first_turn"), 0, 0
    prev = prompt(s, k - 1)
    if mode == "aggregated":
        return None, whole_blocks(prev + OUT), 0
    if mode in ("pd-nocache", "pd"):
        return "miss_no_handle_returned", 0, 0
    local = whole_blocks(prev) if mode == "pd-bidir" else 0
    if (s, k) == EXPIRED:
        return "miss_expired", local, 0
    if (mode, s, k) == TRANSFER_FAILED:
        return "miss_transfer_failed", 0, 0
    pull = prev + OUT - 1 - local
    if pull < THRESHOLD:
        return "miss_below_threshold", local, 0
    return "hit", local, pull


def ttft_s(mode: str, s: int, k: int) -> float:
    _, local, pulled = recorded(mode, s, k)
    return B0[mode] + c(prompt(s, k)) - c(local + pulled) + pulled * PULL_S_PER_TOKEN


def failed(mode: str, s: int, k: int) -> bool:
    return (mode, s, k) == TIMED_OUT


def pd_relative_errors() -> list[float]:
    """|forecast - measured| / measured of every ok pd turn: the forecast's P cache holds whole blocks
    of the previous prompt (b0 fits exactly: the recording's residuals are all B0['pd'])."""
    out = []
    for s in range(SESSIONS):
        for k in range(TURNS):
            local = whole_blocks(prompt(s, k - 1)) if k else 0
            out.append(c(local) / (B0["pd"] + c(prompt(s, k))))
    return out


def _turns(w, mode: str, aggregated_cached: bool, overlap_s: float | None = None, slow: float = 1.0) -> None:
    """The run's turns. Sessions start 100 s apart (one at a time), or ``overlap_s`` apart: then a
    turn sent while the other session's prompt is being computed waits for it (one worker, first
    come first served: an event loop here, the worker busy for c(n) - c(local + pulled) per turn)."""
    rid = RUNS[mode]
    start = 100.0 if overlap_s is None else overlap_s
    send = {s: start * s for s in range(SESSIONS)}
    turn = dict.fromkeys(range(SESSIONS), 0)
    free = 0.0
    while send:
        s = min(send, key=lambda x: (send[x], x))
        t, k = send[s], turn[s]
        n = prompt(s, k)
        reuse, local, pulled = recorded(mode, s, k)
        gap = 0.0 if k == 0 else (LONG_GAP_S if (s, k) == EXPIRED else GAP_S)
        row = {"run_id": rid, "session_id": f"s{s}", "turn_index": k, "kind": "turn",
               "gap_before_s": gap, "gap_kind": "none" if k == 0 else "tool", "sent_at": T0 + dt.timedelta(seconds=t),
               "expected_reusable_tokens": prompt(s, k - 1) + OUT if k else None, "reuse": reuse}
        if failed(mode, s, k):
            w.append("turns", row | {"e2e_s": 120.0, "status": "timeout", "error": "timeout"})
            del send[s]
            continue
        begin = max(t, free)
        free = begin + c(n) - c(local + pulled)
        ttft = slow * ttft_s(mode, s, k) - (slow - 1) * pulled * PULL_S_PER_TOKEN + (begin - t)
        WAITS[(mode, s, k)] = begin - t
        row |= {"ttft_s": ttft, "e2e_s": ttft + 1.0, "tpot_s": TPOT_S, "prompt_tokens": n,
                "completion_tokens": OUT, "status": "ok"}
        if mode == "aggregated":
            row["cached_tokens"] = local if aggregated_cached else None
        else:
            row |= {"prefill_cached_tokens": local, "reused_tokens": pulled,
                    "recomputed_tokens": n - local - pulled}
        w.append("turns", row)
        turn[s] = k + 1
        if turn[s] == TURNS:
            del send[s]
        else:
            send[s] = t + ttft + 1.0 + (LONG_GAP_S if (s, k + 1) == EXPIRED else GAP_S)


#: (mode, session, turn) -> seconds the turn waited for the worker in the last :func:`build`.
WAITS: dict[tuple[str, int, int], float] = {}


def _metrics(w, mode: str) -> None:
    rid = RUNS[mode]
    roles = {"aggregated": "http://127.0.0.1:8300"} if mode == "aggregated" else {
        "prefill": "http://127.0.0.1:8100", "decode": "http://127.0.0.1:8200"}
    base = {"engine": "0", "model_name": "turnscope-tiny"}
    for i, frac in enumerate((0.0, 0.5, 1.0)):
        at = T0 + dt.timedelta(seconds=100 * i)
        for role, url in roles.items():
            w.append("metric_samples", {"run_id": rid, "scraped_at": at, "endpoint": url, "role": role,
                                        "name": "vllm:cache_config_info", "value": 1.0,
                                        "labels": base | {"block_size": str(BLOCK), "num_gpu_blocks": str(NUM_BLOCKS)}})
        if mode.startswith("pd-bidir"):
            for name, total in (("vllm:nixl_xfer_time_seconds_sum", 0.5),
                                ("vllm:nixl_bytes_transferred_sum", 0.5 * BANDWIDTH)):
                w.append("metric_samples", {"run_id": rid, "scraped_at": at, "endpoint": roles["prefill"],
                                            "role": "prefill", "name": name, "labels": base,
                                            "value": 2.0 + frac * total})


def build(root: Path, aggregated_cached: bool = True, overlap_s: float | None = None,
          slow: float | dict[str, float] = 1.0,
          probe_s: tuple[float, float] | dict[str, tuple[float, float]] | None = None) -> Path:
    """Write the store under ``root``; returns ``root``. ``aggregated_cached`` False: the aggregated
    run's ``cached_tokens`` are NULL (vLLM without ``usage.prompt_tokens_details``). ``overlap_s``:
    session 1 starts that long after session 0 (default: 100 s, one session at a time). ``slow``:
    every TTFT's compute (all but the pull) is ``slow`` times the formula's (a slower machine; the
    network as fast; without overlap), or per mode
    (a dict; absent modes 1). ``probe_s``: every run (or per mode) records the speed probe's TTFT at
    its start and end (``run_probes``)."""
    WAITS.clear()
    store = Store(root)
    store.init()
    config = {"connector": {"decoder_kv_blocks_ttl": TTL_S, "kv_recompute_threshold": THRESHOLD},
              "handle_ttl_margin_s": MARGIN_S, "kv_bytes_per_token": KV_BYTES}
    for i, mode in enumerate(MODES):
        start = T0 + dt.timedelta(minutes=i)
        with store.writer(RUNS[mode], "test") as w:
            w.append("runs_log", {"run_id": RUNS[mode], "label": "eval", "mode": mode, "workload": "planner-fixture",
                                  "history_mode": "token_ids", "model": "turnscope-tiny", "config": config,
                                  "started_at": start, "finished_at": start + dt.timedelta(seconds=300),
                                  "updated_at": start + dt.timedelta(seconds=300), "status": "complete"})
            _turns(w, mode, aggregated_cached, overlap_s, slow.get(mode, 1.0) if isinstance(slow, dict) else slow)
            probes = probe_s.get(mode) if isinstance(probe_s, dict) else probe_s
            for when, ttft in zip(("start", "end"), probes or (), strict=False):
                w.append("run_probes", {"run_id": RUNS[mode], "phase": when, "sent_at": start, "prompt_tokens": PROBE_TOKENS,
                                        "ttft_s": ttft, "status": "ok", "target": "prefill"})
            _metrics(w, mode)
    return root


# -- a fleet plan, written by hand ---------------------------------------------------------------
# Fleet sizing at 100 new sessions per hour against an SLO of p90 TTFT <= 1 s, one row per strategy
# (planner.plan_store.write_fleet_plan), and each strategy's fleet at five loads. Every
# figure is typed here, none computed: the Plan page's tests read them back as the truth.
# recompute's 2P 2D is overloaded (P at 3.4x its capacity: 0.85x at 25/h, linear in the load);
# pd-bidir+host misses the SLO (1.12 s); pd-bidir (32 GPUs) is the cheapest that meets it, and
# its fleet is overloaded (D) from 200/h on. GPUs: the vendor profile's 8 per worker.

FLEET_PLAN_ID = "plan-20261201T090000-f1ee75"
FLEET_LABEL = "fleet"
FLEET_LOAD = ("sessions_per_hour", 100.0,
              "100 new sessions per hour (Poisson starts, seed 0), 800 sessions drawn from 24 session trees")
FLEET_SLO_S = 1.0
GiB = 2**30
_FLEET_COLS = ("strategy", "prefill_workers", "decode_workers", "decode_kv_bytes_per_worker", "gpus", "ttft_p50_s",
               "ttft_p90_s", "hit_rate", "p_cache_gib_s", "d_pinned_gib_s", "host_gib_s", "prefill_gpu_s_saved",
               "usd_per_m_tokens", "meets_slo", "overloaded", "overload_role", "overload_factor", "recommended",
               "fleets_searched")
FLEET_ROWS = [
    ("recompute", 2, 2, None, 32.0, None, None, 0.0, 0.0, 0.0, 0.0, 0.0, 2.91, False, True, "prefill", 3.4, False, 9),
    ("pd", 3, 3, None, 48.0, 0.42, 0.93, 0.61, 1250.4, 0.0, 0.0, 5400.0, 4.12, True, False, None, None, False, 12),
    ("pd+host", 3, 2, None, 40.0, 0.38, 0.88, 0.78, 1250.4, 0.0, 86400.0, 7900.0, 3.55, True, False, None, None,
     False, 12),
    ("pd-bidir", 2, 2, 512 * GiB, 32.0, 0.31, 0.74, 0.86, 1100.2, 5200.7, 0.0, 8600.0, 2.74, True, False, None, None,
     True, 10),
    ("pd-bidir+host", 2, 2, 256 * GiB, 32.0, 0.45, 1.12, 0.88, 1100.2, 2600.3, 43000.0, 8800.0, 2.80, False, False,
     None, None, False, 16),
]
CURVE_LOADS = (25.0, 50.0, 100.0, 200.0, 400.0)
#: strategy -> per load of CURVE_LOADS: (p50 s, p90 s) or ("prefill" | "decode", overload factor).
CURVE = {
    "recompute": [(0.55, 1.20), ("prefill", 1.7), ("prefill", 3.4), ("prefill", 6.8), ("prefill", 13.6)],
    "pd": [(0.30, 0.55), (0.33, 0.62), (0.42, 0.93), ("prefill", 1.15), ("prefill", 2.30)],
    "pd+host": [(0.28, 0.50), (0.30, 0.58), (0.38, 0.88), (0.95, 2.90), ("prefill", 1.70)],
    "pd-bidir": [(0.22, 0.41), (0.25, 0.48), (0.31, 0.74), ("decode", 1.05), ("decode", 2.10)],
    "pd-bidir+host": [(0.24, 0.45), (0.28, 0.56), (0.45, 1.12), (1.10, 3.40), ("decode", 1.25)],
}


#: strategy -> (overload in words, p90 / SLO, within 25% of the SLO), typed: the margins are the p90s
#: over the 1 s SLO; 0.74 is 0.26 from it, not close.
FLEET_VERDICTS = {"recompute": ("overloaded: P at 3.40x its capacity", None, False), "pd": (None, 0.93, True),
                  "pd+host": (None, 0.88, True), "pd-bidir": (None, 0.74, False), "pd-bidir+host": (None, 1.12, True)}
#: strategy -> the lowest SLO it reaches where none of its fleets meets the SLO (seconds): the p90 of its
#: row's fleet, the largest in the limits (pd-bidir+host misses at 1.12 s; recompute's is overloaded: none).
FLEET_LOWEST = {"pd-bidir+host": 1.12}
#: strategy -> its fleet's knee on CURVE (the highest load meeting the 1 s SLO, every lower one too).
CURVE_KNEES = {"recompute": None, "pd": 100.0, "pd+host": 100.0, "pd-bidir": 100.0, "pd-bidir+host": 50.0}


def fleet_rows() -> list[dict]:
    """``FLEET_ROWS`` as write_fleet_plan's ``fleets`` (every column of plan_fleets but plan_id)."""
    kind, value, label = FLEET_LOAD
    return [{"load_kind": kind, "load_value": value, "load_label": label, "slo_ttft_p90_s": FLEET_SLO_S}
            | dict(zip(_FLEET_COLS, r, strict=True))
            | dict(zip(("overload", "ttft_p90_over_slo", "close_to_slo"), FLEET_VERDICTS[r[0]], strict=True))
            | {"lowest_ttft_p90_s": FLEET_LOWEST.get(r[0])} for r in FLEET_ROWS]


def curve_rows() -> list[dict]:
    """``CURVE`` as write_fleet_plan's ``curve``: each strategy's fleet of ``FLEET_ROWS`` at ``CURVE_LOADS``."""
    fleet = {r[0]: r for r in FLEET_ROWS}
    out = []
    for strategy, points in CURVE.items():
        _, p, d, kv, *_ = fleet[strategy]
        for load, point in zip(CURVE_LOADS, points, strict=True):
            over = isinstance(point[0], str)
            out.append({"strategy": strategy, "prefill_workers": p, "decode_workers": d,
                        "decode_kv_bytes_per_worker": kv, "load_kind": FLEET_LOAD[0], "load_value": load,
                        "ttft_p50_s": None if over else point[0], "ttft_p90_s": None if over else point[1],
                        "overloaded": over, "overload_role": point[0] if over else None,
                        "overload_factor": point[1] if over else None, "slo_ttft_p90_s": FLEET_SLO_S,
                        "overload": f"overloaded: {'P' if point[0] == 'prefill' else 'D'} at {point[1]:.2f}x its "
                                    "capacity" if over else None,
                        "knee": CURVE_KNEES[strategy] == load})
    return out


def build_fleet_plan(root: Path, plan_id: str = FLEET_PLAN_ID, fleets: list[dict] | None = None,
                     curve: list[dict] | None = None) -> Path:
    """Write the hand-made fleet plan (``fleet_rows``, ``curve_rows``: or the given rows) to the store
    under ``root`` with the real writer and the vendor-h200 profile; returns ``root``."""
    from planner.plan_store import write_fleet_plan
    from planner.profile import load_profile
    from planner.simulate import PlanSettings

    profile = load_profile(Path(__file__).resolve().parents[1] / "data" / "profiles" / "vendor-h200.yaml")
    write_fleet_plan(Store(root), plan_id=plan_id, label=FLEET_LABEL, inputs=[{"path": "traces", "format": "agent"}],
                     profile=profile, settings=PlanSettings(), notes=["Sessions drawn with replacement."],
                     requests=9600, fleets=fleet_rows() if fleets is None else fleets,
                     curve=curve_rows() if curve is None else curve)
    return root
