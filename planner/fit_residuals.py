"""How well a fitted cost figure fits the turns it was fitted on, and over which range: stored in the
figure's ``source`` (docs/planner/profiles.md), so a profile says where a forecast extrapolates.

For the turns one figure rests on (a mode's turns for its b0, every P/D turn for P's c(x), the
aggregated worker's turns for its c(x), the text-history turns for the chat render):

* the relative residual of each turn, ``(fitted - measured) / measured`` TTFT (the held-out check's
  measure, :mod:`planner.held_out`, on the turns fitted on): median of its absolute value,
  its 90th percentile (numpy's linear interpolation) and the median signed residual (bias);
* the range fitted over: computed tokens ``n - cached`` (what c(x) is a curve of) and prompt tokens
  ``n``, minimum and maximum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Residuals:
    """Residuals and range of one fitted figure's turns (fractions; tokens)."""

    turns: int
    median_abs: float
    p90_abs: float
    median_signed: float
    computed_min: int
    computed_max: int
    prompt_min: int
    prompt_max: int

    def describe(self) -> str:
        """One clause for a figure's source, e.g. ``residuals over 40 turns: |relative TTFT error|
        median 3.1%, p90 8.0%, bias -0.4%; fitted over 120-7,800 computed tokens (prompts 130-7,900)``."""
        return (f"residuals over {self.turns} turns: |relative TTFT error| median {self.median_abs:.1%}, "
                f"p90 {self.p90_abs:.1%}, bias {self.median_signed:+.1%}; fitted over {self.computed_min:,}-"
                f"{self.computed_max:,} computed tokens (prompts {self.prompt_min:,}-{self.prompt_max:,}): "
                "extrapolated outside")


def residuals_of(relative: np.ndarray, computed_tokens: np.ndarray, prompt_tokens: np.ndarray) -> Residuals | None:
    """:class:`Residuals` of turns with relative residuals ``relative`` ((fitted - measured) /
    measured TTFT), ``computed_tokens`` (n - cached) and ``prompt_tokens`` (n), arrays of one length;
    None when there are no turns."""
    rel = np.asarray(relative, dtype=float)
    if rel.size == 0:
        return None
    comp, n = np.asarray(computed_tokens, dtype=float), np.asarray(prompt_tokens, dtype=float)
    return Residuals(turns=int(rel.size), median_abs=float(np.median(np.abs(rel))),
                     p90_abs=float(np.quantile(np.abs(rel), 0.9)), median_signed=float(np.median(rel)),
                     computed_min=int(comp.min()), computed_max=int(comp.max()),
                     prompt_min=int(n.min()), prompt_max=int(n.max()))
