"""A cost profile fitted from recorded runs' own turns (the planner's "measured here" profile).

* c(x): the Sweep page's fit (``dashboard.sweep.fit_prefill``: least squares of TTFT against
  prompt tokens over the ``pd-nocache`` turns, every one a full prefill on P; quadratic with 3 or
  more prompt lengths);
* P's pull of D's KV: the Sweep page's ``dashboard.sweep.transfer_s_per_token`` (P's NIXL bytes
  over NIXL seconds in the ``pd-bidir*`` runs, vLLM's ``vllm:nixl_*`` metrics), as bandwidth;
* b0 per mode: the median, over the mode's ok turns, of TTFT minus ``c(n) - c(cached) +
  pull(pulled)`` with the turn's measured cached and pulled tokens (the fixed cost the mode adds);
* KV space of each role: ``num_gpu_blocks x block_size`` of vLLM's ``vllm:cache_config_info``
  gauge on that role's workers, times the model's KV bytes per token;
* decode time per token: the median TPOT of the runs' ok turns.

Raises :class:`FitError` when the runs cannot give a figure the planner needs (no ``pd-nocache``
turns at 2+ prompt lengths, no timed KV transfer, no KV bytes per token).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from dashboard import sweep
from loadgen.store import Store
from turnscope.planner.profile import MODES, CostProfile, Sourced


class FitError(ValueError):
    """The recorded runs do not hold what a fitted profile needs; the message says what."""


TURNS_SQL = """
SELECT t.run_id, r.mode, t.session_id, t.turn_index, t.status, t.ttft_s, t.e2e_s, t.tpot_s, t.prompt_tokens,
       t.completion_tokens, t.reuse, coalesce(t.reused_tokens, 0) AS reused_tokens,
       CASE WHEN t.reuse IS NOT NULL THEN coalesce(t.prefill_cached_tokens, 0) ELSE coalesce(t.cached_tokens, 0)
            END AS local_tokens,
       t.expected_reusable_tokens
FROM turns t JOIN runs r USING (run_id)
WHERE t.run_id IN ({ids})
ORDER BY t.run_id, t.session_id, t.turn_index
"""


def recorded_turns(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """The turns of ``run_ids`` with their run's mode (columns of :data:`TURNS_SQL`)."""
    con = store.connect()
    try:
        return con.execute(TURNS_SQL.format(ids=", ".join("?" for _ in run_ids)), list(run_ids)).df()
    finally:
        con.close()


def _transfer(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    con = store.connect()
    try:
        return con.execute(
            f"SELECT r.mode, 0 AS prefix_tokens, x.xfer_s, x.xfer_bytes, x.reused_tokens, c.kv_bytes_per_token "
            f"FROM run_kv_transfer x JOIN runs r USING (run_id) JOIN run_config c USING (run_id) "
            f"WHERE run_id IN ({', '.join('?' for _ in run_ids)})", list(run_ids)).df()
    finally:
        con.close()


def _kv_space(store: Store, run_ids: Sequence[str]) -> dict[str, int]:
    """Role -> tokens of KV space (num_gpu_blocks x block_size of vllm:cache_config_info)."""
    con = store.connect()
    try:
        rows = con.execute(
            "SELECT role, any_value(labels) FROM metric_samples WHERE name = 'vllm:cache_config_info' "
            f"AND run_id IN ({', '.join('?' for _ in run_ids)}) GROUP BY role", list(run_ids)).fetchall()
    finally:
        con.close()
    out = {}
    for role, labels in rows:
        lab = json.loads(labels) if isinstance(labels, str) else (labels or {})
        try:
            out[role] = int(lab["num_gpu_blocks"]) * int(lab["block_size"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def fit_profile(store: Store, run_ids: Sequence[str], name: str = "fitted") -> CostProfile:
    """The profile of the deployment that recorded ``run_ids`` (see the module doc). Raises FitError."""
    turns = recorded_turns(store, run_ids)
    if turns.empty:
        raise FitError(f"no turns recorded for runs {', '.join(run_ids)}")
    where = f"runs {', '.join(sorted(set(turns['run_id'])))}"
    fit = sweep.fit_prefill(turns)
    if fit is None:
        raise FitError(f"{where}: the prefill fit needs ok pd-nocache turns at 2 or more prompt lengths")
    transfer = _transfer(store, run_ids)
    per = sweep.transfer_s_per_token(transfer)
    kv = transfer["kv_bytes_per_token"].dropna()
    if kv.empty:
        raise FitError(f"{where}: KV bytes per token unknown (runs.config.kv_bytes_per_token)")
    kv_bytes = float(kv.iloc[0])
    if per.empty or math.isnan(float(per["bandwidth_bytes_per_s"].iloc[0])):
        raise FitError(f"{where}: no pd-bidir* run recorded a NIXL transfer on P (vllm:nixl_* metrics)")
    bandwidth = float(per["bandwidth_bytes_per_s"].iloc[0])
    src = f"fitted from {where}"
    prof = CostProfile(
        name=name, description=f"Fitted from the recorded runs' own turns ({where}).",
        block_size=_block_size(store, run_ids),
        kv_bytes_per_token=Sourced(value=kv_bytes, source=f"{src} (runs.config.kv_bytes_per_token)"),
        prefill_a1_s_per_token=Sourced(value=fit.a1_s, source=f"{src}: dashboard.sweep.fit_prefill over "
                                                            f"{fit.turns} pd-nocache turns"),
        prefill_a2_s_per_token2=Sourced(value=fit.a2_s, source=f"{src}: dashboard.sweep.fit_prefill"),
        b0_default_s=Sourced(value=fit.b0_s, source=f"{src}: the pd-nocache fit's intercept"),
        pull_bandwidth_bytes_per_s=Sourced(value=bandwidth, source=f"{src}: P's vllm:nixl_bytes_transferred "
                                                                   "over vllm:nixl_xfer_time_seconds"),
        left_out=["pull_latency_s: not separable from the bandwidth in these runs (0)"])
    prof.b0_s = _b0_per_mode(turns, prof, src)
    space = _kv_space(store, run_ids)
    for role, field in (("prefill", "prefill_kv_space_bytes"), ("decode", "decode_kv_space_bytes"),
                        ("aggregated", "aggregated_kv_space_bytes")):
        if role in space:
            setattr(prof, field, Sourced(value=space[role] * kv_bytes,
                                         source=f"{src}: vllm:cache_config_info num_gpu_blocks x block_size"))
    tpot = turns.loc[(turns["status"] == "ok"), "tpot_s"].dropna()
    if not tpot.empty:
        prof.decode_s_per_token = Sourced(value=float(tpot.median()), source=f"{src}: median TPOT")
    return prof


def _block_size(store: Store, run_ids: Sequence[str]) -> int:
    con = store.connect()
    try:
        row = con.execute(
            "SELECT any_value(labels) FROM metric_samples WHERE name = 'vllm:cache_config_info' "
            f"AND run_id IN ({', '.join('?' for _ in run_ids)})", list(run_ids)).fetchone()
    finally:
        con.close()
    try:
        return int(json.loads(row[0])["block_size"])
    except (TypeError, KeyError, ValueError, json.JSONDecodeError):
        return 128  # vLLM's CPU backend


def _b0_per_mode(turns: pd.DataFrame, prof: CostProfile, src: str) -> dict[str, Sourced]:
    ok = turns[(turns["status"] == "ok") & turns["ttft_s"].notna() & turns["prompt_tokens"].notna()]
    out = {}
    for mode, g in ok.groupby("mode"):
        if mode not in MODES:
            continue
        n = g["prompt_tokens"].to_numpy(float)
        pulled = g["reused_tokens"].to_numpy(float)
        cached = np.minimum(g["local_tokens"].to_numpy(float) + pulled, n)
        fit = prof.prefill_fit()
        model = fit.cost_s(n) - fit.cost_s(cached) + prof.pull_s(pulled)
        out[str(mode)] = Sourced(value=float(np.median(g["ttft_s"].to_numpy(float) - model)),
                                 source=f"{src}: median of TTFT - c(n) + c(cached) - pull over {len(g)} {mode} turns")
    return out
