"""Turns: latency by turn index and history length, where each turn's time went, and expected vs
measured reuse (only the modes that can reuse KV from D are listed)."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, context, figures, html_reports, tables
from dashboard.figures import traffic as traffic_figures
from dashboard.loader import load
from store import queries
from store.queries import traffic as traffic_queries

sel = context.current()
st.title("Turns")
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()
f = sel.filter
st.caption(f"Selection: {sel.describe()}. Medians over ok turns; colour is the mode (the same on every page), the marker the proxy's reuse outcome.")
charts.note("latency by turn index, where each turn's time went and expected vs measured reuse")

# --- latency ----------------------------------------------------------------------------------
@st.fragment
def _latency(root: str, f: queries.TurnFilter) -> None:
    """The latency panels and their "Latency against" choice: a fragment, so switching it reruns
    this part alone, not the page's other queries and figures."""
    by_label = charts.on() and st.segmented_control(
        "Latency against",
        ["turn index", "history length"],
        default="turn index",
        key="turns_by",
        help="History length: the turn's prompt tokens (the whole history plus the new turn), in bins.",
    )
    by = "history" if by_label == "history length" else "turn_index"
    latency = load(root, queries.latency_by, f, by) if charts.on() else None
    if latency is not None and latency.empty:
        st.info("No ok turns in the selection yet.")
    charts.show(lambda: figures.latency_panels(latency, by), "latency_panels")


_latency(sel.root, f)

# --- time split -------------------------------------------------------------------------------
st.subheader("Where each turn's time went")
kv = load(sel.root, queries.kv_transfer, f)
split = load(sel.root, queries.time_split, f, queries.xfer_rates(kv))
charts.show(lambda: figures.time_split(split), "time_split")
st.caption("Per turn: proxy = TTFT − the proxy's prefill leg; prefill leg = P's time, less the KV transfer; "
           "decode = E2E − TTFT; the KV transfer is an estimate. Means per turn.")
with st.expander("What each part holds"):
    st.markdown("Proxy: routing, queueing, D pulling P's KV and D's first token. " + html_reports.TRANSFER_NOTE)
if not split.empty and int(split["transfer_unknown_turns"].sum()):
    st.warning(
        f"{int(split['transfer_unknown_turns'].sum())} turns pulled KV in runs without a NIXL timing on the "
        "prefill worker (no vllm:nixl_xfer_time_seconds scrapes): their transfer is counted in the prefill leg."
    )

# --- expected vs measured reuse ---------------------------------------------------------------
st.subheader("Expected vs measured reuse")
min_short = st.number_input(
    "List turns reusing at least this many tokens less than expected",
    min_value=1,
    value=128,
    step=16,
    key="turns_min_shortfall",
    help="Reuse is whole KV blocks, so a shortfall below one block (128 tokens on the embedded CPU model, "
    "16 on most GPUs) is expected; set this to your block size.",
)
vs = load(sel.root, queries.reuse_vs_expected, f, int(min_short))
charts.show(lambda: figures.reuse_vs_expected(vs), "reuse_vs_expected")
st.caption(
    "Expected: the longest common prefix of the previous turn's prompt + output ids and this prompt's ids. "
    "Measured: tokens P pulled from D plus P's own prefix-cache hit (the server's cached_tokens without a proxy)."
)
covered = ", ".join(f"`{m}`" for m in queries.REUSE_FROM_D_MODES)
by_design = (
    vs[~vs["mode"].isin(queries.REUSE_FROM_D_MODES)].groupby("mode", sort=True)["short_turns"].sum()
    if not vs.empty
    else vs
)
by_design = by_design[by_design > 0] if len(by_design) else by_design
short = load(sel.root, queries.reuse_shortfalls, f, int(min_short), 200)
if short.empty:
    st.success(
        f"No ok later turn of {covered} (the modes that can reuse KV from D) reused {int(min_short)} or more "
        "tokens less than expected."
    )
else:
    total = int(short["total"].iloc[0])
    st.markdown(
        f"**{total} turn(s) of {covered} where the engine reused at least {int(min_short)} tokens less than "
        "expected**" + (f" (the {len(short)} largest shortfalls shown)" if total > len(short) else "")
        + ": the modes that can reuse KV from D, so each is a miss worth a look."
    )
    st.dataframe(
        tables.shortfall_table(short),
        hide_index=True,
        key="shortfalls",
        column_config={"gap (s)": st.column_config.NumberColumn(format="%.1f")},
    )

# --- replayed traces --------------------------------------------------------------------------
trace_turns = load(sel.root, traffic_queries.trace_reuse, tuple(sel.run_ids))
if not trace_turns.empty:
    st.subheader("Replayed traces: the trace's reuse vs the engine's")
    charts.show(lambda: traffic_figures.trace_vs_engine(trace_turns), "trace_vs_engine")
    st.caption("Replayed real traces (`kv_cache_tester`): tokens the trace says were shared with the previous "
               "request (× token_scale) against what the engine reused; compactions replay as appends.")
if len(by_design):
    st.caption(
        "Short by design, not listed: "
        + ", ".join(f"`{m}` {int(n)} turn(s)" for m, n in by_design.items())
        + ". `pd-nocache` recomputes every prompt; `pd` and `aggregated` reuse only their own prefix cache, "
        "never KV from D."
    )

# --- vLLM's own view: ITL per output event, restarts ------------------------------------------
server = load(sel.root, queries.server_side, f)
if not server.empty:
    st.subheader("vLLM's own ITL and decode restarts")
    st.dataframe(server, hide_index=True, key="server_side")
    st.caption(
        "From the workers' /metrics. vLLM's ITL histogram observes one value per streamed output event; "
        "with speculative decoding an event carries several tokens, so it is shown per event with tokens "
        "per event beside it, and per token after dividing. itl_source: the name the server exposed it under "
        "(an older vLLM's vllm:time_per_output_token_seconds is read as the same histogram). Restarts: decode "
        "lifetimes after the first (process_start_time_seconds); a turn on a handle issued before a restart "
        "cannot have pulled D's blocks, and the proxy records it as miss_decode_restarted; stale_hits counts "
        "those recorded as hits all the same."
    )
