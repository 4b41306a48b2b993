"""The Plan page's figures (plotly), each titled as a FORECAST with its profile."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

GiB = 2**30


def frontier_figure(fr: pd.DataFrame, tag: str) -> go.Figure:
    """Hit rate against GiB-seconds held per TTL x D-space point, the current point marked."""
    df = fr.assign(space=fr["decode_kv_space_bytes"].map(lambda b: "unbounded" if pd.isna(b) else f"{b / GiB:,.0f} GiB"),
                   ttl=fr["decoder_kv_blocks_ttl_s"].map(lambda t: f"{t:,.0f} s"),
                   point=fr["current"].map({True: "current", False: "grid"}))
    fig = px.scatter(df, x="held_gib_s", y="hit_rate", color="ttl", symbol="point", facet_col="mode",
                     hover_data=["space", "ttft_saved_s", "peak_held_bytes", "d_full_events"],
                     labels={"held_gib_s": "D pinned KV (GiB-s)", "hit_rate": "hit rate (later requests)",
                             "ttl": "decoder_kv_blocks_ttl"},
                     title=f"{tag}: TTL x D memory frontier")
    fig.update_traces(marker={"size": 10})
    return fig


def check_figure(ch: pd.DataFrame) -> go.Figure:
    """Predicted against measured TTFT of every ok turn of the checked runs, per mode."""
    ok = ch[(ch["status"] == "ok") & ch["measured_ttft_s"].notna()]
    fig = px.scatter(ok, x="measured_ttft_s", y="predicted_ttft_s", color="mode",
                     labels={"measured_ttft_s": "measured TTFT (s)", "predicted_ttft_s": "forecast TTFT (s)"},
                     title="Forecast against measured TTFT, recorded runs planned from their own records")
    hi = float(max(ok["measured_ttft_s"].max(), ok["predicted_ttft_s"].max())) if len(ok) else 1.0
    fig.add_trace(go.Scatter(x=[0, hi], y=[0, hi], mode="lines", name="equal", line={"dash": "dot"}))
    return fig
