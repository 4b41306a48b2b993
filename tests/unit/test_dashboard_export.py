"""dashboard.export: one self-contained HTML file."""

from __future__ import annotations

from html.parser import HTMLParser

import pandas as pd
import plotly.graph_objects as go

from dashboard.export import Section, html_report


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_report_is_self_contained():
    figs = [go.Figure(go.Scatter(x=[1, 2], y=[3, 4])), go.Figure(go.Bar(x=["a"], y=[1]))]
    html = html_report(
        "turnscope: <runs>",
        [Section("One", ("a <b>bold</b> claim", figs[0])), Section("Two", (pd.DataFrame({"x": [1.5]}), figs[1]))],
        subtitle="store /tmp/s",
    )
    p = _Tags()
    p.feed(html)
    scripts = [a for t, a in p.tags if t == "script"]
    assert all("src" not in a for a in scripts)  # nothing loaded from the network
    assert [t for t, a in p.tags if t == "link"] == []
    assert sum(1 for t, a in p.tags if t == "div" and a.get("class") == "plotly-graph-div") == 2
    assert len(scripts) == 1 + 2  # plotly.js once, then one call per figure
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js inlined
    assert "a &lt;b&gt;bold&lt;/b&gt; claim" in html and "turnscope: &lt;runs&gt;" in html
    assert "<table" in html and "1.5" in html
