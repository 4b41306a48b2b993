"""What every page's figures share: the mode order and the one mode -> colour map, reuse
outcome colours and markers, the empty figure, the legend band and the turn axis.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from turnscope.contract import ATTACH_MODE, MODES

#: Serving modes in display order (README, "What each mode compares"); unknown modes sort after these.
MODE_ORDER = [*MODES, ATTACH_MODE]
#: The one mode -> colour map: every chart that tells modes apart uses it (sweep_figures too), and
#: uses another channel (marker symbol, facet) for anything else, such as the reuse outcome.
MODE_COLORS = {
    "aggregated": "#4c4c4c",
    "pd": "#1f77b4",
    "pd-bidir": "#2ca02c",
    "pd-nocache": "#ff7f0e",
    "pd-bidir-nocache": "#9467bd",
    "attach": "#8c564b",
}
#: Reuse outcomes of the proxy (docs/schema.md, ``turns.reuse``), hit first.
OUTCOME_ORDER = [
    "hit",
    "miss_first_turn",
    "miss_no_session_id",
    "miss_expired",
    "miss_consumed",
    "miss_mismatch",
    "miss_below_threshold",
    "miss_transfer_failed",
    "miss_no_handle_returned",
    "miss_decode_restarted",
    "not recorded",
]
#: Colour per reuse outcome, where colour means the outcome (bars of outcomes per mode). None of
#: them is a mode's colour (`MODE_COLORS`), so green never means both "hit" and `pd-bidir`.
OUTCOME_COLORS = {
    "hit": "#00a6a6",
    "miss_first_turn": "#aec7e8",
    "miss_no_session_id": "#c49c94",
    "miss_expired": "#ffbb78",
    "miss_consumed": "#f7b6d2",
    "miss_mismatch": "#d62728",
    "miss_below_threshold": "#dbdb8d",
    "miss_transfer_failed": "#7f2704",
    "miss_no_handle_returned": "#e7298a",
    "miss_decode_restarted": "#6a3d9a",
    "not recorded": "#c7c7c7",
}


#: Marker per reuse outcome, where colour already means the mode: filled for a hit, open for the
#: misses an operator expects (first turn), crossed and other shapes for the rest.
OUTCOME_SYMBOLS = {
    "hit": "circle",
    "miss_first_turn": "circle-open",
    "miss_no_session_id": "square-open",
    "miss_expired": "hourglass",
    "miss_consumed": "diamond-open",
    "miss_mismatch": "x",
    "miss_below_threshold": "triangle-down",
    "miss_transfer_failed": "cross",
    "miss_no_handle_returned": "square",
    "miss_decode_restarted": "star",
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
        base = MODE_COLORS.get(str(mode), "#7f7f7f").lstrip("#")
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


def _ordered(values: pd.Series, order: list[str]) -> list[str]:
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
