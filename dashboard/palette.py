"""Colour by meaning: the dashboard's three palettes, and the only place that names a colour (a mode's
own colour is on its ``core.modes.ServingMode`` entry, read here).

- `MODE_COLORS`: a serving mode, and nothing else. A chart whose series are not modes (A/B sides,
  hit rate and KV held, time components) never draws them in these colours.
- `OUTCOME_COLORS`: the proxy's reuse outcomes. Outcomes that are by design (a session's first turn,
  one-way P/D's ``miss_no_handle_returned``, no outcome recorded) are quiet greys; a hit is teal; misses
  that cost a reusable prefix (expired, consumed, mismatch, failed transfer...) are loud reds and oranges.
- `TIME_COLORS`: where time goes (queue and proxy, prefill, KV transfer, decode, the gaps between turns),
  pastel hues none of which is a mode's.

Also: `NEUTRAL` greys for reference lines, `ALARM` for a limit crossed or a failure, and `AB_COLORS` for
the two sides of a comparison whose sides are not one mode each (docs/design.md).
"""

from __future__ import annotations

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
from core.modes import ATTACH_COLOUR, ATTACH_MODE, SERVING_MODES

#: The one mode -> colour map: each serving mode's own ``ServingMode.colour`` (plotly's tab10 hues;
#: ``core.modes``), and the attached server's. Every chart that tells modes apart uses it.
MODE_COLORS = {m.name: m.colour for m in SERVING_MODES} | {ATTACH_MODE: ATTACH_COLOUR}
#: Colour of a mode missing from `MODE_COLORS`.
UNKNOWN_MODE = "#7f7f7f"

#: Reuse outcome -> colour: quiet greys for what is expected, teal for a hit, loud warm hues for misses
#: that cost a prefix that could have been reused.
OUTCOME_COLORS = {
    HIT: "#00a6a6",
    MISS_FIRST_TURN: "#d9d9d9",
    MISS_NO_HANDLE_RETURNED: "#bdbdbd",
    "not recorded": "#ececec",
    MISS_BELOW_THRESHOLD: "#fdd49e",
    MISS_NO_SESSION_ID: "#fc8d59",
    MISS_EXPIRED: "#ef6548",
    MISS_CONSUMED: "#d7301f",
    MISS_MISMATCH: "#b30000",
    MISS_TRANSFER_FAILED: "#7f0000",
    MISS_DECODE_RESTARTED: "#a50f15",
}
#: Outcomes that are expected by design, drawn quiet (`OUTCOME_COLORS`).
QUIET_OUTCOMES = (MISS_FIRST_TURN, MISS_NO_HANDLE_RETURNED, "not recorded")

#: Where time goes -> colour (Turns' TTFT split, Sessions' timeline and task split, Traffic's gaps).
TIME_COLORS = {
    "proxy": "#ffd92f",  # queue, proxy and D's first token
    "prefill": "#8da0cb",
    "transfer": "#e78ac3",
    "unsplit": "#b3b3b3",  # to first token, not split (no proxy)
    "decode": "#a6d854",
    "llm": "#8da0cb",  # a session's LLM time: prefill + decode of its turns
    "tool": "#bcbd22",
    "think": "#17becf",
    "pause": "#c5b0d5",
    "unknown": "#e5c494",
    "none": "#e0e0e0",
    "other": "#e0e0e0",
}

#: Reference lines, "no difference" marks, configured settings.
NEUTRAL = "#7f7f7f"
NEUTRAL_DARK = "#262626"
#: A limit crossed, a failed turn, the share lost.
ALARM = "#d62728"
#: The two sides of a comparison when a side is not one mode (or both sides are the same mode).
AB_COLORS = {"A": "#3b3b98", "B": "#c0a062"}


def mode_color(mode: object) -> str:
    """The colour of serving mode `mode` (`UNKNOWN_MODE` for one not in `MODE_COLORS`)."""
    return MODE_COLORS.get(str(mode), UNKNOWN_MODE)


def side_colors(a_mode: object, b_mode: object) -> dict[str, str]:
    """Colours of a comparison's sides: each mode's own colour when the sides are two different known
    modes, else the neutral `AB_COLORS` (a mode's colour never stands for something else)."""
    if a_mode in MODE_COLORS and b_mode in MODE_COLORS and a_mode != b_mode:
        return {"A": MODE_COLORS[str(a_mode)], "B": MODE_COLORS[str(b_mode)]}
    return dict(AB_COLORS)
