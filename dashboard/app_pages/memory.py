"""Memory: KV usage and live handle bytes over time next to the hit rate, the cost of reuse, and
what other decoder_kv_blocks_ttl values would have given (DESIGN §5 Memory, §7)."""

from __future__ import annotations

import streamlit as st

from dashboard import capacity_section, context, figures, tables
from dashboard.loader import load

#: TTLs (seconds) the what-if replays, besides the runs' own (at or below the proxy's 30 s margin nothing
#: could ever hit).
WHATIF_TTLS_S = (60.0, 120.0, 240.0, 480.0, 900.0, 1800.0, 3600.0)

sel = context.current()
st.title("Memory")
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()
f = sel.filter
st.caption(
    f"Selection: {sel.describe()}. Scrapes are per run: the archetype and kind filters apply to the hit "
    "rate and the what-if only."
)

mem = load(sel.root, "memory_timeline", f)
hits = load(sel.root, "hit_rate_timeline", f)
st.plotly_chart(figures.memory_timeline(mem, hits), key="memory_timeline")
if mem.empty:
    st.info(
        "No `vllm:kv_cache_usage_perc` or `turnscope_handle_bytes_live` scrapes in the selected runs "
        "(the scraper records them while a run is going)."
    )

# --- cost of reuse ----------------------------------------------------------------------------
st.subheader("The cost of reuse")
cost = load(sel.root, "reuse_cost", f)
if cost.empty:
    st.info("No selected run held handles or pulled KV from D (pd-bidir modes do).")
else:
    st.dataframe(
        tables.reuse_cost_table(cost),
        hide_index=True,
        key="reuse_cost",
        column_config={
            "held (GiB·s)": st.column_config.NumberColumn(format="%.4f", help="handle KV held, GiB x seconds"),
            "peak (MiB)": st.column_config.NumberColumn(format="%.1f", help="peak handle KV"),
            "pulled (tokens)": st.column_config.NumberColumn(format="%d", help="tokens P pulled from D"),
            "prefill ms/1k tok": st.column_config.NumberColumn(
                format="%.2f", help="P's compute time per 1,000 tokens, on turns that pulled nothing"
            ),
            "NIXL (s)": st.column_config.NumberColumn(format="%.3f", help="P's measured NIXL transfer time"),
            "saved (s, est.)": st.column_config.NumberColumn(format="%.3f", help="prefill seconds saved, estimated"),
            "GiB·s per s saved": st.column_config.NumberColumn(format="%.4f"),
        },
    )
    st.caption(
        "KV held: the proxy's live handle bytes integrated over the run's scrapes (each value held until the "
        "next scrape). Prefill saved (estimate): tokens pulled from D × the run's compute time per token "
        "(prefill legs ÷ recomputed tokens over the turns that pulled nothing) − the measured NIXL time. "
        "The last column is the price: GiB of KV kept for a second, per second of prefill saved."
    )

# --- what-if TTL ------------------------------------------------------------------------------
st.subheader("What if the TTL were different?")
config = load(sel.root, "run_config", f)
current = sorted({float(t) for t in config["decoder_kv_blocks_ttl_s"].dropna()})
ttls = tuple(sorted(set(WHATIF_TTLS_S) | set(current)))
whatif = load(sel.root, "whatif_ttl", f, ttls)
st.plotly_chart(figures.whatif_ttl(whatif, current), key="whatif_ttl")
margins = sorted({float(m) for m in config["handle_ttl_margin_s"].dropna()})
margin = ", ".join(f"{m:.0f}" for m in margins) or "30"
st.caption(
    f"Replayed from the recorded gaps between turns: a later turn (not `fresh`) would hit when its gap is "
    f"below TTL − {margin} s (the proxy's margin); after each ok turn D holds its prompt + output tokens "
    "for min(gap to the next turn, TTL), the whole TTL after a session's last turn; KV bytes from each "
    "run's kv_bytes_per_token. Other misses (mismatch, failed transfer) are not modelled."
)
if not whatif.empty and int(whatif["turns_without_kv_bytes"].max()):
    st.caption("Some runs have no kv_bytes_per_token in their config: their KV is left out of the GiB·s.")
st.dataframe(
    tables.whatif_table(whatif),
    hide_index=True,
    key="whatif_table",
    column_config={
        "hit rate": st.column_config.NumberColumn(format="percent"),
        "KV held (GiB·s)": st.column_config.NumberColumn(format="%.4f"),
        "KV held (Mtoken·s)": st.column_config.NumberColumn(format="%.3f"),
    },
)

# --- capacity -------------------------------------------------------------------------------------
capacity_section.render(sel)
