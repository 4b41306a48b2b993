"""What every page's figures share: the mode order, the reuse outcomes' order and markers (their
colours and the modes' are ``dashboard.palette``'s), the empty figure, the legend band and the turn axis.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from core.contract import (
    HIT,
    MISS_BELOW_THRESHOLD,
    MISS_CONSUMED,
    MISS_DECODE_RESTARTED,
    MISS_EXPIRED,
    MISS_FIRST_TURN,
    MISS_MISMATCH,
    MISS_NO_HANDLE_RETURNED,
    MISS_NO_SESSION_ID,
    MISS_TRANSFER_FAILED,
)
from core.modes import ATTACH_MODE, MODES
from dashboard.palette import MODE_COLORS, OUTCOME_COLORS, mode_color  # noqa: F401  (re-exported)

#: Serving modes in display order (``core.modes.SERVING_MODES``); unknown modes sort after these.
MODE_ORDER = [*MODES, ATTACH_MODE]
# The mode and outcome colours live in ``dashboard.palette`` (re-exported above, with mode_color).
#: Reuse outcomes of the proxy (docs/schema/tables.md, ``turns.reuse``): hit first, then the misses that cost
#: (loud), then those expected by design (quiet, last; ``dashboard.palette.QUIET_OUTCOMES``).
OUTCOME_ORDER = [
    HIT,
    MISS_EXPIRED,
    MISS_CONSUMED,
    MISS_MISMATCH,
    MISS_TRANSFER_FAILED,
    MISS_DECODE_RESTARTED,
    MISS_NO_SESSION_ID,
    MISS_BELOW_THRESHOLD,
    MISS_FIRST_TURN,
    MISS_NO_HANDLE_RETURNED,
    "not recorded",
]

#: Marker per reuse outcome, where colour already means the mode: filled for a hit, open for the
#: misses an operator expects (first turn), crossed and other shapes for the rest.
OUTCOME_SYMBOLS = {
    HIT: "circle",
    MISS_FIRST_TURN: "circle-open",
    MISS_NO_SESSION_ID: "square-open",
    MISS_EXPIRED: "hourglass",
    MISS_CONSUMED: "diamond-open",
    MISS_MISMATCH: "x",
    MISS_BELOW_THRESHOLD: "triangle-down",
    MISS_TRANSFER_FAILED: "cross",
    MISS_NO_HANDLE_RETURNED: "square",
    MISS_DECODE_RESTARTED: "star",
    "not recorded": "diamond",
}


def run_colors(run_modes: pd.Series) -> dict[str, str]:
    """A colour per run (`run_modes`: mode indexed by run_id) in its mode's colour (`MODE_COLORS`):
    the first run of a mode in the mode's own colour, later runs of the same mode in lighter shades
    of it, so a mode keeps its colour on every page and its runs stay apart."""
    out: dict[str, str] = {}
    seen: dict[str, int] = {}
    for run_id, mode in run_modes.items():
        k = seen.get(mode, 0)
        seen[mode] = k + 1
        base = mode_color(mode).lstrip("#")
        rgb = [int(base[i : i + 2], 16) for i in (0, 2, 4)]
        mix = min(0.6, 0.3 * k)  # 0, 30%, 60% towards white
        out[str(run_id)] = "#" + "".join(f"{int(c + (255 - c) * mix + 0.5):02x}" for c in rgb)
    return out


def legend_below(fig: go.Figure, height: int | None = None) -> go.Figure:
    """Put `fig`'s legend in a horizontal band under the plot, inside the figure's own area (a
    legend on the right is clipped in narrow columns); `height` in pixels, if given."""
    fig.update_layout(legend={"orientation": "h", "yanchor": "top", "y": -0.22, "xanchor": "left", "x": 0},
                      margin={"b": 40})
    if height is not None:
        fig.update_layout(height=height)
    return fig


def turn_axis(fig: go.Figure, max_turn: float, min_turn: float = 0, **kwargs) -> None:
    """A turn-index x axis from `min_turn` to `max_turn` with half a turn of room on both sides,
    so markers at the first and the last turn are drawn whole; one tick per turn up to 20 turns."""
    fig.update_xaxes(range=[float(min_turn) - 0.5, float(max_turn) + 0.5], dtick=1 if max_turn <= 20 else None,
                     **kwargs)


def zero_based(values: pd.Series, headroom: float = 0.08) -> list[float]:
    """An axis range from 0 to the largest finite of `values` plus `headroom` (a fraction of it).

    Written out instead of plotly's ``rangemode='tozero'``: on facets whose axes are matched
    (``matches='y'``, as plotly express makes them) plotly.js ignores the data under ``tozero`` and
    fixes the range at [0, 4], which draws the panels blank."""
    top = pd.to_numeric(values, errors="coerce").max()
    top = float(top) if pd.notna(top) and top > 0 else 1.0
    return [0.0, top * (1 + headroom)]


def log_ticks(values: pd.Series) -> tuple[list[float], list[str]]:
    """Tick values and texts for a log axis over the positive finite `values`: 1-2-5 steps per decade
    written as whole numbers ("1", "2", "5", "10", "20", "50", "100", "1,000"; below 1 as "0.5",
    "0.2"), instead of plotly's "5, 2, 100, 5, 2"; every value spanned has a tick below and above."""
    v = pd.to_numeric(values, errors="coerce")
    v = v[(v > 0) & np.isfinite(v)]
    if v.empty:
        return [], []
    lo, hi = int(np.floor(np.log10(v.min()))), int(np.ceil(np.log10(v.max())))
    ticks = [m * 10.0**e for e in range(lo, hi + 1) for m in (1, 2, 5)]
    below = [t for t in ticks if t <= v.min()]
    above = [t for t in ticks if t >= v.max()]
    ticks = [t for t in ticks if (below[-1] if below else ticks[0]) <= t <= (above[0] if above else ticks[-1])]
    if len(ticks) > 12:  # many decades: one tick per decade
        ticks = [10.0**e for e in range(lo, hi + 1)]
    return ticks, [f"{t:,.0f}" if t >= 1 else f"{t:g}" for t in ticks]


def ordered_present(values: pd.Series, order: list[str]) -> list[str]:
    """The distinct values of ``values`` (as strings) in ``order``, the others after them, sorted."""
    present = [str(v) for v in pd.unique(values.dropna())]
    return [v for v in order if v in present] + sorted(v for v in present if v not in order)


def empty_figure(message: str) -> go.Figure:
    """A blank figure carrying `message` in its middle."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(height=260, margin={"l": 10, "r": 10, "t": 30, "b": 10})
    return fig
