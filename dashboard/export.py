"""One self-contained HTML file from a page's content: headings, text, tables and Plotly figures.

plotly.js is inlined once (no CDN, no network: the file opens offline and can be mailed or
archived with a run); every figure keeps its interactivity. Pure: content in, HTML text out.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import get_plotlyjs

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #262730; line-height: 1.45; padding: 0 1rem; }
h1 { font-size: 1.8rem; margin-bottom: 0.2rem; } h2 { font-size: 1.3rem; margin-top: 2rem; }
p.meta { color: #6b6f76; font-size: 0.9rem; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0 1rem; }
th, td { border: 1px solid #e0e0e0; padding: 3px 8px; text-align: right; }
th { background: #f6f6f8; } td:first-child, th:first-child { text-align: left; }
.figure { margin: 0.5rem 0 1.5rem; }
"""


@dataclass(frozen=True)
class Section:
    """A heading followed by its items, each a str (one paragraph of plain text), a
    `go.Figure`, or a `pd.DataFrame` (a table, drawn without its index)."""

    heading: str
    items: tuple[str | go.Figure | pd.DataFrame, ...]


def _table(df: pd.DataFrame) -> str:
    return df.to_html(index=False, border=0, na_rep="", float_format=lambda v: f"{v:,.4g}", escape=True)


def html_report(title: str, sections: Iterable[Section], subtitle: str = "") -> str:
    """The whole report as one HTML document (str, UTF-8 text), plotly.js inlined once.

    `title`: the page title and heading; `subtitle`: one line under it (e.g. the store and the
    selection); a generation timestamp (UTC) is added.
    """
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>',
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    meta = f"{subtitle} · generated {stamp} by turnscope" if subtitle else f"generated {stamp} by turnscope"
    parts.append(f'<p class="meta">{html.escape(meta)}</p>')
    n = 0
    for section in sections:
        parts.append(f"<h2>{html.escape(section.heading)}</h2>")
        for item in section.items:
            if isinstance(item, go.Figure):
                n += 1
                div = pio.to_html(
                    item, include_plotlyjs=False, full_html=False, div_id=f"figure-{n}", config={"responsive": True}
                )
                parts.append(f'<div class="figure">{div}</div>')
            elif isinstance(item, pd.DataFrame):
                parts.append(_table(item))
            else:
                parts.append(f"<p>{html.escape(str(item))}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
