"""How far to trust a forecast: the planner's forecast of recorded runs against what they
measured (``plan_checks`` rows, docs/planner.md "Checked against reality"), summed up per mode.

Pure pandas, shared by the Plan page and ``turnscope plan`` (so the page imports no planner code).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

#: The issue's bound on the median absolute relative error of forecast TTFT, per mode (25%).
MARE_BOUND = 0.25


def check_summary(checks: pd.DataFrame) -> pd.DataFrame:
    """Per mode: ok turns, outcome matches, MARE of TTFT and whether both checks pass.

    Columns: mode, ok_turns, outcome_matches, outcome_check (all match), ttft_mare, ttft_check
    (MARE <= 25%)."""
    rows = []
    for mode, g in checks[checks["status"] == "ok"].groupby("mode", sort=False):
        g = g[g["measured_ttft_s"].notna()]
        rel = (g["predicted_ttft_s"] - g["measured_ttft_s"]).abs() / g["measured_ttft_s"]
        matches = int(g["outcome_match"].astype(bool).sum())
        mare = float(rel.median()) if len(rel) else np.nan
        rows.append({"mode": mode, "ok_turns": len(g), "outcome_matches": matches,
                     "outcome_check": matches == len(g), "ttft_mare": mare, "ttft_check": bool(mare <= MARE_BOUND)})
    return pd.DataFrame(rows)
