"""Memory: KV usage and live handle bytes over time next to the hit rate, the cost of reuse, and
what other decoder_kv_blocks_ttl values would have given (docs/schema/tables.md: `metric_samples`;
docs/schema/views.md: `run_kv_transfer`, `run_nixl_failures`)."""

from __future__ import annotations

import dataclasses

import streamlit as st

from core.modes import BIDIRECTIONAL_MODES
from dashboard import capacity_section, charts, context, figures, tables
from dashboard.loader import load
from planner.recorded_whatif import whatif_ttl_d_limit
from store import hit_rate, queries
from store.queries.memory import WHATIF_TTLS_S

sel = context.current()
st.title("Memory")
if not sel.run_ids:
    st.info("No runs match the sidebar's filters.")
    st.stop()
f = sel.filter
#: The serving modes whose decode worker keeps a finished turn's KV for the next one.
HANDLE_MODES = BIDIRECTIONAL_MODES
st.caption(
    f"Selection: {sel.describe()}. Scrapes are per run: the archetype and kind filters apply to the hit "
    "rate and the what-if only."
)

charts.note("memory next to reuse and the what-if TTL")
mem = load(sel.root, queries.memory_timeline, f) if charts.on() else None
charts.show(lambda: figures.memory_timeline(mem, load(sel.root, queries.hit_rate_timeline, f)), "memory_timeline")
if mem is not None and mem.empty:
    st.info(
        "No `vllm:kv_cache_usage_perc` or `turnscope_handle_bytes_live` scrapes in the selected runs "
        "(the scraper records them while a run is going)."
    )

# --- cost of reuse ----------------------------------------------------------------------------
#: Display formats of the cost table's columns that can be blank (see BLANKABLE).
COST_FORMATS = {"held (GiB·s)": "{:.4f}", "peak (MiB)": "{:.1f}", "pulled (tokens)": "{:,.0f}",
                hit_rate.LABEL: "{:.1%}", hit_rate.PREFIX_CACHE_LABEL: "{:.1%}",
                "prefill ms/1k tok": "{:.2f}", "NIXL (s)": "{:.3f}", "saved (s, est.)": "{:.3f}",
                "GiB·s per s saved": "{:.4f}"}
#: Cost-table columns that have no value for some runs (no NIXL time measured, nothing saved).
BLANKABLE = (hit_rate.LABEL, hit_rate.PREFIX_CACHE_LABEL, "prefill ms/1k tok", "NIXL (s)", "saved (s, est.)",
             "GiB·s per s saved")
st.subheader("The cost of reuse")
cost = load(sel.root, queries.reuse_cost, f)
if cost.empty:
    st.info("No selected run held handles or pulled KV from D (pd-bidir modes do).")
else:
    st.dataframe(
        # blanks, not "None", where a figure does not apply (no P, no NIXL time, nothing saved):
        # Streamlit prints None for a missing number whatever the Styler says, so those columns are text
        tables.blank_missing(tables.reuse_cost_table(cost), {c: COST_FORMATS[c] for c in BLANKABLE}),
        hide_index=True,
        key="reuse_cost",
        column_config={
            "held (GiB·s)": st.column_config.NumberColumn(
                format="%.4f", help="KV D kept pinned for the run's handles, GiB x seconds: each handle from its "
                "turn's end to its pull by the next turn or D's decoder_kv_blocks_ttl, also after the run ended "
                "(view run_handle_memory); runs recorded without handle sizes: the proxy's gauge during the run"),
            "peak (MiB)": st.column_config.NumberColumn(format="%.1f", help="peak handle KV"),
            "pulled (tokens)": st.column_config.NumberColumn(format="%d", help="tokens P pulled from D"),
            hit_rate.PREFIX_CACHE_LABEL: st.column_config.TextColumn(
                help="of the prompt tokens P looked up in its own prefix cache, the share it found there "
                     "(vLLM's prefix_cache_hits over prefix_cache_queries; view run_prefix_cache): between "
                     "'always hits' and 'evicted', where holding the turn on D has to pay"),
            "prefill ms/1k tok": st.column_config.TextColumn(
                help="P's compute time per 1,000 tokens, on turns that pulled nothing (blank: no P, aggregated)"
            ),
            "NIXL (s)": st.column_config.TextColumn(help="P's measured NIXL transfer time (blank: none measured)"),
            "saved (s, est.)": st.column_config.TextColumn(help="prefill seconds saved, estimated (blank: no P)"),
            "GiB·s per s saved": st.column_config.TextColumn(help="blank: nothing saved"),
        },
    )
    st.caption("The last column is the price: GiB of KV kept pinned for a second, per second of prefill saved.")
    with st.expander("How held KV and prefill saved are measured"):
        st.markdown(
        "KV held: each of the run's handles from its turn's end until the next turn pulled it (or, below the "
        "recompute threshold, had P tell D to free it) or D's decoder_kv_blocks_ttl freed it, also after the run ended, never another run's (view run_handle_memory; "
        "runs recorded without handle sizes: the proxy's live handle bytes over the run's scrapes). Prefill saved (estimate): tokens pulled from D × the run's compute time per token "
        "(prefill legs ÷ recomputed tokens over the turns that pulled nothing) − the measured NIXL time. "
        "The last column is the price: GiB of KV kept for a second, per second of prefill saved."
        )

# --- expired and failed pulls ----------------------------------------------------------------
st.subheader("Expired and failed pulls")
nixl = load(sel.root, queries.nixl_failures, f)
# the runs with a proxy outcome of the two or one of vLLM's NIXL counters scraped (NaN where not)
nixl = nixl[(nixl[list(tables.NIXL_OUTCOME_COUNTS)].sum(axis=1) > 0)
            | nixl[tables.nixl_counter_columns(nixl)].notna().any(axis=1)]
if nixl.empty:
    st.info("No selected run has a proxy outcome or vLLM's NIXL counters (P/D runs scraped by turnscope do).")
elif tables.no_failed_pulls(nixl):
    st.success(f"No expired or failed pulls in the {len(nixl)} run(s) that record them: the proxy's "
               "miss_expired and miss_transfer_failed and vLLM's NIXL counters on P and D all read 0.")
else:
    charts.show(lambda: figures.nixl_failures(nixl), "nixl_failures")
if not nixl.empty:
    st.dataframe(tables.nixl_failures_table(nixl), hide_index=True, key="nixl_failures_table")
    st.caption(
        "A pull the proxy's margin kept back (`miss_expired`) never reaches vLLM. A turn the proxy offered a handle "
        "for that P declined as past D's deadline is one `miss_transfer_failed` and one of P's `KV expired`: an "
        "expiry the margin (`handle_ttl_margin_s`) did not prevent. P's failed transfers are transport failures "
        "(vLLM counts an expiry apart from them). D's `KV expired` counts handles no P pulled within its TTL "
        "(a session's last turn, a miss): memory held for nothing (view run_nixl_failures, docs/monitoring.md)."
    )

# --- what-if TTL ------------------------------------------------------------------------------
st.subheader("What if the TTL were different?")
# Only the runs whose decode workers keep handles: one-way and aggregated runs hold nothing.
modes_of = dict(zip(sel.runs["run_id"], sel.runs["mode"], strict=True))
# a run's name on the page: its label, with its id where labels repeat (a demo's runs share theirs)
_labels = sel.runs["label"].fillna(sel.runs["run_id"])
_dup = _labels.map(_labels.value_counts()) > 1
labels_of = dict(zip(sel.runs["run_id"], _labels.where(~_dup, sel.runs["run_id"]), strict=True))
held_runs = tuple(r for r in f.run_ids if modes_of.get(r) in HANDLE_MODES)
f_held = dataclasses.replace(f, run_ids=held_runs)
config = load(sel.root, queries.run_config, f_held)
current = sorted({float(t) for t in config["decoder_kv_blocks_ttl_s"].dropna()})
ttls = tuple(sorted(set(WHATIF_TTLS_S) | set(current)))
whatif = load(sel.root, whatif_ttl_d_limit, f_held, ttls)
charts.show(lambda: figures.whatif_ttl(whatif, current), "whatif_ttl")
margins = sorted({float(m) for m in config["handle_ttl_margin_s"].dropna()})
margin = ", ".join(f"{m:.0f}" for m in margins) or "30"
replayed = sorted(set(whatif["run_id"])) if not whatif.empty else []
unlimited = sorted(set(whatif.loc[whatif["capacity_bytes"].isna(), "run_id"])) if not whatif.empty else []
left_out = sorted(set(held_runs) - set(replayed))
runs_text = ", ".join(f"`{labels_of.get(r, r)}`" for r in replayed) or "none"
st.caption(
    f"Runs replayed: {runs_text} ({len(replayed)} of the {len(f.run_ids)} selected: "
    f"{' and '.join(f'`{m}`' for m in HANDLE_MODES)} runs, whole). Hit rate: {hit_rate.LABEL}, per mode."
)
with st.expander("How the what-if is replayed"):
    st.markdown(
    "Only runs whose decode worker keeps handles; whole runs: the "
    "sidebar's archetype and kind filters do not apply, since D holds every turn's KV. Each run is replayed "
    "alone from its recorded turns (send times and durations) by the planner's handle ledger "
    "(`planner/pinned_kv.py`): after each ok turn D pins prompt + output − 1 tokens in whole KV "
    "blocks until the session's next turn pulls them or the TTL passes; a later turn (not `fresh`, recorded "
    f"a hit or a miss by expiry) pulls when its handle is younger than TTL − {margin} s (the proxy's margin); a "
    "miss for another reason (mismatch, below the recompute threshold, failed transfer) stays one, and a turn "
    "recorded below the threshold frees the handle it takes at that age (P reads nothing and tells D to free "
    "it, as vLLM does). The limit "
    "is D's KV space from the run's `vllm:cache_config_info` (num_gpu_blocks × block_size × kv_bytes_per_token, "
    "summed over its decode workers): a handle that does not fit next to those pinned is lost, and the "
    "session's next turn misses (the planner's `miss_d_full`; in vLLM, D would queue or preempt instead). "
    "The KV of requests running on D is not counted against the space, so the limit is an upper bound."
    )
if unlimited:
    st.caption("No `vllm:cache_config_info` from D in " + ", ".join(f"`{labels_of.get(r, r)}`" for r in unlimited)
               + ": replayed with no limit and in tokens (no block size).")
if left_out:
    st.caption("Left out (no kv_bytes_per_token in the run's config): "
               + ", ".join(f"`{labels_of.get(r, r)}`" for r in left_out) + ".")
if not whatif.empty:
    st.dataframe(
        tables.whatif_table(whatif),
        hide_index=True,
        key="whatif_table",
        column_config={
            hit_rate.LABEL: st.column_config.NumberColumn(format="percent"),
            "KV held (GiB·s)": st.column_config.NumberColumn(format="%.4f"),
        },
    )

# --- capacity -------------------------------------------------------------------------------------
capacity_section.render(sel)
