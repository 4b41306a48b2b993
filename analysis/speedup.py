"""The one way a comparison of two serving modes is shown: a speed-up, as the vendor reports it.

``speed-up = TTFT(baseline) / TTFT(treatment)``: above 1 the treatment (bidirectional KV transfer)
is faster; "1.6x" reads as the vLLM blog's "1.6x lower TTFT" (docs/sweep.md). Every place that
shows a comparison (the CLI's bottom line, the Overview cards, Compare, Sweep, the HTML exports)
formats it with `fmt` / `fmt_ci`, names it `LABEL`, and colours it by its `Verdict` (whether the
confidence interval excludes 1), never by the sign of the point estimate.

The headline's statistics are computed as ratios treatment / baseline (``analysis.headline``);
`of` turns one into the speed-up: the point estimate and the interval's ends are inverted (a
percentile interval maps through the monotone ``1/x`` exactly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

#: The name of the number, in every table header, card and sentence.
LABEL = "speed-up"
#: What it is, in one line (captions, CLI footers, help texts).
MEANING = "speed-up = baseline TTFT / bidirectional TTFT (above 1: bidirectional is faster)"


class Verdict(StrEnum):
    """What the confidence interval of a speed-up says."""

    FASTER = "faster"  # the CI lies above 1
    SLOWER = "slower"  # the CI lies below 1
    UNCLEAR = "no clear difference"  # the CI includes 1
    TOO_FEW = "too few sessions"  # no CI (fewer than 2 sessions on a side)

    @property
    def decided(self) -> bool:
        """True when the interval excludes 1 (faster or slower)."""
        return self in (Verdict.FASTER, Verdict.SLOWER)


#: Streamlit colour names (``:green[...]`` markdown, st.badge) per verdict.
VERDICT_COLORS: dict[Verdict, str] = {
    Verdict.FASTER: "green",
    Verdict.SLOWER: "red",
    Verdict.UNCLEAR: "gray",
    Verdict.TOO_FEW: "gray",
}
#: The same colours as hex, for plotly figures and HTML.
VERDICT_HEX: dict[Verdict, str] = {
    Verdict.FASTER: "#2ca02c",
    Verdict.SLOWER: "#d62728",
    Verdict.UNCLEAR: "#7f7f7f",
    Verdict.TOO_FEW: "#7f7f7f",
}


def verdict_of(ci_low: float, ci_high: float) -> Verdict:
    """The `Verdict` of a speed-up's confidence interval (dimensionless; NaN ends: no CI)."""
    if math.isnan(ci_low) or math.isnan(ci_high):
        return Verdict.TOO_FEW
    if ci_low > 1:
        return Verdict.FASTER
    if ci_high < 1:
        return Verdict.SLOWER
    return Verdict.UNCLEAR


@dataclass(frozen=True)
class Speedup:
    """A speed-up (dimensionless, baseline / treatment) with its confidence interval (NaN: none)."""

    value: float
    ci_low: float
    ci_high: float

    @property
    def verdict(self) -> Verdict:
        """`verdict_of` this speed-up's interval."""
        return verdict_of(self.ci_low, self.ci_high)

    @property
    def has_ci(self) -> bool:
        """False when either end of the interval is NaN (fewer than 2 sessions on a side)."""
        return not (math.isnan(self.ci_low) or math.isnan(self.ci_high))


def from_ratio(ratio: float, ci_low: float, ci_high: float) -> Speedup:
    """The `Speedup` of a treatment / baseline TTFT ratio and its CI: ``1/ratio``, ``(1/ci_high,
    1/ci_low)``."""
    return Speedup(1 / ratio, 1 / ci_high, 1 / ci_low)


def of(r) -> Speedup:
    """The `Speedup` of a ``analysis.headline.Ratio`` (treatment / baseline)."""
    return from_ratio(r.ratio, r.ci_low, r.ci_high)


def fmt(value: float) -> str:
    """A speed-up as shown everywhere: two decimals and ``x`` (``1.18x``); ``n/a`` for NaN."""
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def fmt_ci(ci_low: float, ci_high: float) -> str:
    """A speed-up's interval as shown everywhere (``0.65-1.77x``); ``n/a`` without one."""
    if math.isnan(ci_low) or math.isnan(ci_high):
        return "n/a"
    return f"{ci_low:.2f}-{ci_high:.2f}x"
