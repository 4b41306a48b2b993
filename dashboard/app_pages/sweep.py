"""Sweep: the vendor's prefix-length sweep (``turnscope sweep``), next to the real baselines.

TTFT (mean and p90) against prefix length per mode, the speed-up of bidirectional KV transfer
against ``pd-nocache`` (the vendor's comparison), ``pd`` and ``aggregated`` with 95% CIs, and
the per-turn ideal (prefill of the new tokens only plus the KV pull at the measured bandwidth).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from analysis import speedup, sweep_stats
from core.modes import BIDIRECTIONAL_MODES
from dashboard import charts, context, sweep_figures
from dashboard.loader import load
from store import db, queries

#: The vendor's published numbers (vLLM blog 2026-10-12, 1P1D on 2 x p5en.48xlarge, 8 x H200 each,
#: TP 8, NIXL LIBFABRIC on EFA; P's prefix cache off): TTFT (ms) of the benchmark's stats with
#: bidirectional transfer off and on, at the shortest and longest prefixes; speed-up = off / on.
VENDOR = pd.DataFrame([
    {"model": "Qwen3-32B", "prefix tokens": 2000, "off (ms)": 158, "on (ms)": 122, "speed-up": 158 / 122},
    {"model": "Qwen3-32B", "prefix tokens": 24000, "off (ms)": 778, "on (ms)": 460, "speed-up": 778 / 460},
    {"model": "GLM-5-FP8", "prefix tokens": 2000, "off (ms)": 500, "on (ms)": 358, "speed-up": 500 / 358},
    {"model": "GLM-5-FP8", "prefix tokens": 20000, "off (ms)": 2334, "on (ms)": 702, "speed-up": 2334 / 702},
])


@st.cache_data(ttl=db.CACHE_TTL_S, show_spinner="Bootstrapping the speed-ups' confidence intervals…")
def _speedups(turns: pd.DataFrame, stat: str, min_turn_index: int) -> pd.DataFrame:
    return sweep_stats.speedups(turns, stat=stat, min_turn_index=min_turn_index)


def _sweep_name(points: pd.DataFrame, sweep_id: str) -> str:
    g = points[points["sweep_id"] == sweep_id]
    modes = len(g["mode"].unique())
    values = sorted(int(v) for v in g["prefix_tokens"].dropna().unique())
    return (f"{sweep_id} · {g['sweep_name'].iloc[0]} · {g['sweep_scale'].iloc[0]} scale · "
            f"{len(values)} points · {modes} modes")


sel = context.current()
st.title("Sweep")
st.caption(
    "The vendor's benchmark (vLLM blog 2026-10-12: a prefix swept over lengths, 1P1D, P's prefix cache off) run by "
    "`turnscope sweep`, next to the real baselines `pd` and `aggregated`; each point is its own run per mode."
)
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()

points = load(sel.root, queries.sweep_points, sel.run_ids)
if points.empty:
    st.info("No sweep among the selected runs: run `turnscope sweep` (the vendor's benchmark scaled to the "
            "embedded default takes about 13 minutes), then refresh.")
    st.stop()

sweep_ids = list(dict.fromkeys(points["sweep_id"]))  # newest first
sweep_id = st.selectbox("Sweep", sweep_ids, format_func=lambda s: _sweep_name(points, s), key="sweep_id")
mine = points[points["sweep_id"] == sweep_id]
histories = sorted(str(h) for h in mine["history_mode"].dropna().unique())
c1, c2, c3 = st.columns(3)
history = c1.radio("History mode", histories, horizontal=True, key="sweep_history") if len(histories) > 1 \
    else histories[0]
which = c2.radio("Turns", ["every request (the vendor's count)", "from the second turn"], horizontal=True,
                 key="sweep_turns", index=1, help="The vendor's benchmark averages over every request, the first turn of "
                                         "each conversation (nothing to reuse yet) included.")
min_turn = 0 if which.startswith("every") else 1
stat = c3.radio("Speed-up of", list(sweep_stats.STATS), horizontal=True, key="sweep_stat",
                help="The median from the second turn is the dashboard's convention (as on the Overview); the "
                     "vendor reports the mean over every request; p90 shows the tail.")

turns = load(sel.root, queries.sweep_turns, sel.filter, sweep_id)
turns = turns[turns["history_mode"] == history]
transfer = load(sel.root, queries.sweep_transfer, sel.run_ids, sweep_id)
transfer = transfer[transfer["history_mode"] == history]
mine = mine[mine["history_mode"] == history]

field = str(mine["swept_field"].iloc[0])
x_title = ("prefix tokens per conversation (its own context)" if field == "first_prompt_tokens"
           else "prefix tokens shared by all conversations")
row = mine.iloc[0]
st.caption(
    f"`{row['sweep_name']}`, {row['sweep_scale']} scale: {field} = "
    + ", ".join(f"{int(v):,}" for v in sorted(mine["prefix_tokens"].dropna().unique()))
    + (f" tokens; {int(row['sessions'])} conversations x {int(row['users'])} concurrent per point; "
       if pd.notna(row["sessions"]) and pd.notna(row["users"]) else " tokens; ")
    + f"history `{history}`; {len(mine)} runs ({', '.join(sorted(mine['status'].unique()))})."
)

stats = sweep_stats.point_stats(turns, min_turn)
fit = sweep_stats.fit_prefill(turns)
per_token = sweep_stats.transfer_s_per_token(transfer)
ideal_turns = sweep_stats.ideal_turns(turns, fit, per_token, min_turn) if fit is not None else pd.DataFrame()
ideal = sweep_stats.ideal_stats(ideal_turns) if not ideal_turns.empty else pd.DataFrame()

charts.note()
charts.show(lambda: sweep_figures.ttft_vs_prefix(stats, ideal, x_title), "sweep_ttft")

sp = _speedups(turns, stat, min_turn)
limit = sweep_stats.ideal_speedup(stats, ideal, stat) if not ideal.empty else None
for line in sweep_stats.verdicts(sp, stat):
    st.markdown(line)
charts.show(lambda: sweep_figures.speedup_vs_prefix(sp, limit, stat, x_title), "sweep_speedup")

# --- did reuse really happen ------------------------------------------------------------------
ext = transfer.groupby(["prefix_tokens", "mode"], as_index=False)[["external_kv_tokens", "reused_tokens"]].sum()
for mode in sorted(m for m in stats["mode"].unique() if m in BIDIRECTIONAL_MODES):
    hits = int(stats.loc[stats["mode"] == mode, "hits"].sum())
    pulled = int(ext.loc[ext["mode"] == mode, "external_kv_tokens"].sum())
    if hits == 0:
        st.warning(f"`{mode}` reused nothing from the decode worker in this sweep (no hit; {pulled} "
                   "external_kv_transfer tokens on P): it measured recomputation only.")
    elif pulled == 0:
        st.warning(f"`{mode}` has {hits} hits by the proxy's account, but the prefill worker's "
                   "external_kv_transfer counter did not rise (was P scraped?): check before trusting its numbers.")

st.subheader("Per point and mode")
table = stats.merge(ext, on=["prefix_tokens", "mode"], how="left")
st.dataframe(
    pd.DataFrame({
        "prefix tokens": table["prefix_tokens"], "mode": table["mode"], "turns": table["turns"],
        "sessions": table["sessions"], "TTFT mean (ms)": table["ttft_mean_s"] * 1e3,
        "TTFT p90 (ms)": table["ttft_p90_s"] * 1e3, "hits": table["hits"], "failed": table["failed"],
        "P external_kv_transfer tokens": table["external_kv_tokens"], "proxy reused tokens": table["reused_tokens"],
    }),
    hide_index=True, key="sweep_points_table",
    column_config={"TTFT mean (ms)": st.column_config.NumberColumn(format="%.1f"),
                   "TTFT p90 (ms)": st.column_config.NumberColumn(format="%.1f"),
                   "P external_kv_transfer tokens": st.column_config.NumberColumn(format="%d"),
                   "proxy reused tokens": st.column_config.NumberColumn(format="%d")},
)
st.caption("Reuse really happened where the proxy's hits and reused tokens match the prefill worker's own "
           '`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` increase.')

st.subheader("Speed-ups")
st.dataframe(
    pd.DataFrame({
        "pair": sp["pair"], "prefix tokens": sp["prefix_tokens"],
        f"bidirectional {stat} (ms)": sp["treatment_s"] * 1e3, f"baseline {stat} (ms)": sp["baseline_s"] * 1e3,
        speedup.LABEL: sp["speedup"], "95% CI low": sp["ci_low"], "95% CI high": sp["ci_high"],
        "verdict": [speedup.verdict_of(lo, hi).value for lo, hi in zip(sp["ci_low"], sp["ci_high"], strict=True)],
        "turns (bidir / baseline)": sp["n_treatment"].astype(str) + " / " + sp["n_baseline"].astype(str),
    }),
    hide_index=True, key="sweep_speedups_table",
    column_config={c: st.column_config.NumberColumn(format="%.2fx") for c in (speedup.LABEL, "95% CI low", "95% CI high")}
    | {c: st.column_config.NumberColumn(format="%.1f")
       for c in (f"bidirectional {stat} (ms)", f"baseline {stat} (ms)")},
)

st.subheader("The ideal")
if fit is None:
    st.info("No ideal: it needs `pd-nocache` turns at 2 or more prompt lengths (the prefill fit).")
elif ideal.empty:
    st.info("No ideal: no `pd-bidir*` run of this sweep recorded a NIXL transfer on the prefill worker "
            "(`vllm:nixl_xfer_time_seconds_sum`), so the KV pull's cost is unknown.")
else:
    longest = int(stats["prefix_tokens"].max())
    st.caption(
        f"Per turn of `pd-nocache`: b0 + c(n) − c(r) + r × KV bytes per token / bandwidth, with n its prompt "
        f"tokens and r the tokens its previous turn left to reuse. Prefill fit over {fit.turns} `pd-nocache` "
        f"turns ({fit.prompt_min:,}-{fit.prompt_max:,} prompt tokens, {'quadratic' if fit.degree == 2 else 'linear'}"
        f"): b0 = {fit.b0_s * 1e3:.1f} ms, {fit.marginal_s_per_token(0) * 1e3:.3f} ms/token at the start, "
        f"{fit.marginal_s_per_token(longest) * 1e3:.3f} ms/token after {longest:,} tokens. The fit is made at the "
        "sweep's concurrency, queueing included."
    )
    shown = per_token.merge(ideal, on="prefix_tokens", how="inner")
    st.dataframe(
        pd.DataFrame({
            "prefix tokens": shown["prefix_tokens"],
            "bandwidth (GB/s)": shown["bandwidth_bytes_per_s"] / 1e9,
            "KV bytes/token": shown["kv_bytes_per_token"],
            "pull (ms/1k tokens)": shown["s_per_token"] * 1e6,
            "ideal mean (ms)": shown["ideal_mean_s"] * 1e3, "ideal p90 (ms)": shown["ideal_p90_s"] * 1e3,
            "of which prefill (ms)": shown["prefill_mean_s"] * 1e3,
            "of which KV pull (ms)": shown["transfer_mean_s"] * 1e3,
        }),
        hide_index=True, key="sweep_ideal_table",
        column_config={c: st.column_config.NumberColumn(format="%.3f" if c == "bandwidth (GB/s)" else "%.1f")
                       for c in ("bandwidth (GB/s)", "pull (ms/1k tokens)", "ideal mean (ms)", "ideal p90 (ms)",
                                 "of which prefill (ms)", "of which KV pull (ms)")},
    )
    if shown["bandwidth_bytes_per_s"].isna().any() or shown["kv_bytes_per_token"].isna().any():
        st.caption("Bandwidth or KV bytes per token unknown for some points: their pull time per token is P's "
                   "NIXL seconds over the proxy's reused tokens instead.")

with st.expander("The vendor's numbers (vLLM blog 2026-10-12)"):
    st.dataframe(VENDOR, hide_index=True, key="sweep_vendor",
                 column_config={"speed-up": st.column_config.NumberColumn(format="%.2fx")})
    st.caption("1P1D on two p5en.48xlarge (8 x H200 each, TP 8), NIXL LIBFABRIC over EFA, vLLM 0.29.0, P's prefix "
               "cache off in both legs; TTFT of vLLM's multi-turn benchmark (10 conversations, 5 requests each, "
               "150-token user turns, 300-token replies). The blog's headline says up to 1.6x for Qwen3-32B (an "
               "earlier draft 1.7x); its 778 / 460 ms at 24,000 tokens is 1.69x.")
