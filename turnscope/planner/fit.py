"""A cost profile fitted from recorded runs' own turns (the planner's "measured here" profile).

* c(x): the Sweep page's fit (``dashboard.sweep.fit_prefill``: least squares of TTFT against
  prompt tokens over the ``pd-nocache`` turns, every one a full prefill on P; quadratic with 3 or
  more prompt lengths);
* P's pull of D's KV: the Sweep page's ``dashboard.sweep.transfer_s_per_token`` (P's NIXL bytes
  over NIXL seconds in the ``pd-bidir*`` runs, vLLM's ``vllm:nixl_*`` metrics), as bandwidth;
* b0 per mode: the median, over the mode's ok turns, of TTFT minus ``c(n) - c(cached) +
  pull(pulled)`` with the turn's measured cached and pulled tokens (the fixed cost the mode adds);
  where a run did not record the worker's own prefix-cache hit (aggregated serving: vLLM reports
  ``usage.prompt_tokens_details`` only when asked), the planner's forecast of it for that run;
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
from loadgen.traces.recorded_runs import read_recorded_runs
from turnscope.planner.profile import MODES, CostProfile, Sourced
from turnscope.planner.simulate import ModePlan, PlanSettings, Traffic, plan


class FitError(ValueError):
    """The recorded runs do not hold what a fitted profile needs; the message says what."""


#: One row per turn; ``local_tokens`` is NULL where the run did not record the worker's own
#: prefix-cache hit (aggregated serving without ``usage.prompt_tokens_details``).
TURNS_SQL = """
SELECT t.run_id, r.mode, t.session_id, t.turn_index, t.status, t.ttft_s, t.e2e_s, t.tpot_s, t.prompt_tokens,
       t.completion_tokens, t.reuse, coalesce(t.reused_tokens, 0) AS reused_tokens,
       CASE WHEN t.reuse IS NOT NULL THEN coalesce(t.prefill_cached_tokens, 0) ELSE t.cached_tokens
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


def run_settings(store: Store, run_id: str) -> PlanSettings:
    """The connector and proxy settings ``run_id`` ran with (``run_config``: TTL and margin; the
    recompute threshold from ``runs.config.connector.kv_recompute_threshold``, vLLM's 64 when absent)."""
    con = store.connect()
    try:
        ttl, margin, thr = con.execute(
            "SELECT c.decoder_kv_blocks_ttl_s, c.handle_ttl_margin_s, coalesce(TRY_CAST(json_extract_string("
            "r.config, '$.connector.kv_recompute_threshold') AS INTEGER), 64) FROM run_config c JOIN runs r "
            "USING (run_id) WHERE run_id = ?", [run_id]).fetchone()
    finally:
        con.close()
    return PlanSettings(decoder_kv_blocks_ttl_s=ttl, handle_ttl_margin_s=margin, kv_recompute_threshold=thr)


def plan_recorded_run(store: Store, run_id: str, mode: str, profile: CostProfile) -> tuple[Traffic, ModePlan]:
    """``run_id``'s own turns (:mod:`loadgen.traces.recorded_runs`) planned in ``mode`` with the
    run's settings (:func:`run_settings`) and ``profile``: the traffic and the mode's forecast."""
    tr = Traffic.of(read_recorded_runs(store.root, [run_id]))
    p = plan(tr, profile, run_settings(store, run_id).model_copy(update={"modes": (mode,)}))
    return tr, p.modes[mode]


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
    prof.b0_s = _b0_per_mode(_with_forecast_local(store, turns, prof), prof, src)
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


def _with_forecast_local(store: Store, turns: pd.DataFrame, prof: CostProfile) -> pd.DataFrame:
    """``turns`` with ``local_known`` (the run recorded the worker's own-cache hit) and, where it did
    not, ``local_tokens`` taken from the planner's own forecast of that run (``prof``'s cache model)."""
    turns = turns.assign(local_known=turns["local_tokens"].notna())
    for run_id in turns.loc[~turns["local_known"], "run_id"].unique():
        mode = str(turns.loc[turns["run_id"] == run_id, "mode"].iloc[0])
        if mode not in MODES:
            continue
        tr, m = plan_recorded_run(store, str(run_id), mode, prof)
        forecast = pd.DataFrame({"run_id": run_id, "session_id": tr.session, "turn_index": tr.request_index,
                                 "forecast_local": m.local_tokens})
        turns = turns.merge(forecast, on=["run_id", "session_id", "turn_index"], how="left")
        fill = turns["local_tokens"].isna() & (turns["run_id"] == run_id)
        turns.loc[fill, "local_tokens"] = turns.loc[fill, "forecast_local"]
        turns = turns.drop(columns="forecast_local")
    return turns


def _b0_per_mode(turns: pd.DataFrame, prof: CostProfile, src: str) -> dict[str, Sourced]:
    ok = turns[(turns["status"] == "ok") & turns["ttft_s"].notna() & turns["prompt_tokens"].notna()]
    out = {}
    fit = prof.prefill_fit()
    for mode, g in ok.groupby("mode"):
        if mode not in MODES:
            continue
        n = g["prompt_tokens"].to_numpy(float)
        pulled = g["reused_tokens"].to_numpy(float)
        cached = np.minimum(g["local_tokens"].fillna(0).to_numpy(float) + pulled, n)
        model = fit.cost_s(n) - fit.cost_s(cached) + prof.pull_s(pulled)
        unknown = int((~g["local_known"]).sum())
        how = (f"; the worker's own-cache hit of {unknown} turns not recorded: the planner's forecast of it"
               if unknown else "")
        out[str(mode)] = Sourced(value=float(np.median(g["ttft_s"].to_numpy(float) - model)),
                                 source=f"{src}: median of TTFT - c(n) + c(cached) - pull over {len(g)} {mode} "
                                        f"turns{how}")
    return out
