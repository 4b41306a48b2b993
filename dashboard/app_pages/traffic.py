"""Traffic: what a trace says about KV reuse across turns, before anything is served.

Shows one traffic report (``turnscope traffic PATH...``; docs/schema/traffic.md):
sessions and requests, the gap distribution by kind against TTLs (the configured one marked),
reusable vs new input tokens, context growth per session, sessions overlapping in time, and one
session's timeline with its sub-agents.
"""

from __future__ import annotations

import streamlit as st

from dashboard import charts, context
from dashboard.figures import traffic as figs
from dashboard.loader import load
from store.queries import traffic

sel = context.current()
root = sel.root
st.title("Traffic")
reports = load(root, traffic.reports)
if reports.empty:
    st.info("No traffic report in this store yet: run `turnscope traffic data/traces/kv-cache-tester` "
            "(or any trace file, or a store directory for its recorded runs).")
    st.stop()
names = {r.traffic_id: traffic.report_name(r.label, r.inputs, r.created_at, r.traffic_id)
         for r in reports.itertuples()}
tid = st.selectbox(f"Report ({len(names)} in the store, newest first)", list(names), format_func=names.get)
rep = reports.loc[reports["traffic_id"] == tid].iloc[0]
ttl_s = float(rep["ttl_s"])
threshold = int(rep["recompute_threshold_tokens"])
st.markdown(f"Showing **{names[tid]}** (id `{tid}`).")
st.caption(f"Configured TTL {ttl_s:g} s; recompute threshold {threshold} tokens. Inputs: "
           + "; ".join(traffic.input_paths(rep["inputs"])))

s = load(root, traffic.summary, tid).iloc[0]
reuse = load(root, traffic.reuse, tid)
total = reuse[reuse["format"].isna()].iloc[0]
c = st.columns(5)
c[0].metric("Sessions", f"{int(s['sessions']):,}", help=f"{int(s['sub_agents'])} of them sub-agents (own sessions)")
c[1].metric("Requests", f"{int(s['requests']):,}")
c[2].metric("Reusable input", f"{100 * total['reusable_share']:.1f}%",
            help="Input tokens that were a prefix of the session's previous request")
c[3].metric(f"Reusable within {ttl_s:g} s", f"{100 * total['reusable_in_ttl_share']:.1f}%",
            help=f"Also within the TTL and at least {threshold} tokens: what bidirectional P/D could pull back")
c[4].metric("Overlapping sessions", f"{int(s['overlapping_sessions'] or 0):,}",
            help=f"Most active at once in one source: {s['max_active_sessions']}")

st.subheader("Gaps against the TTL")
ttl = load(root, traffic.ttl, tid)
charts.note()
charts.show(lambda: figs.ttl_shares(ttl), "traffic_ttl")
conf = ttl[ttl["configured"] & (ttl["gap_kind"] == "all")]
gaps = load(root, traffic.gaps, tid)
if not conf.empty:
    st.caption(f"{100 * conf['share_within_ttl'].iloc[0]:.1f}% of {int(conf['follow_ups'].iloc[0]):,} follow-ups "
               f"arrive within the configured {ttl_s:g} s: their KV would still be on the decode worker. "
               "A gap is the end of one request to the session's next, never longer than start to start; "
               f"{int(gaps['gap_estimated'].sum()):,} gaps estimated where the trace does not say when the previous "
               "request ended (start to start, an upper bound: Mooncake, kv-cache-tester after a request "
               "without api_time).")
charts.show(lambda: figs.gap_histogram(gaps, ttl_s), "traffic_gaps")

st.subheader("Reusable vs new input tokens")
charts.show(lambda: figs.reuse_split(reuse), "traffic_reuse")

st.subheader("Context growth")
charts.show(lambda: figs.context_growth(load(root, traffic.context_growth, tid)), "traffic_growth")

st.subheader("One session's timeline")
sess = load(root, traffic.sessions, tid)
top = sess[sess["parent_session_id"].isna()]
keys = [f"{r.source}|{r.session_id}" for r in top.itertuples()]
labels = {f"{r.source}|{r.session_id}": f"{r.session_id} · {r.requests} requests · up to {r.max_input_tokens:,} tokens"
          for r in top.itertuples()}
pick = st.selectbox("Session (most requests first; sub-agents are drawn with their parent)", keys,
                    format_func=labels.get)
if pick:
    source, sid = pick.split("|", 1)
    charts.show(lambda: figs.session_timeline(load(root, traffic.timeline, tid, source, sid)), "traffic_timeline")
    st.caption("Requests are the server's time; tool and think are the client's waits before a request; a pause "
               f"is a wait over the {ttl_s:g} s TTL (the decode worker's KV has expired by then).")
