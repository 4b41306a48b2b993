"""The planner at scale: 1,000,000 synthetic agent requests planned in every mode (target < 60 s on
the project's 2-core machine). Prints wall time, peak memory (RSS high-water mark) and the ratio to
the target. Run: ``.venv/bin/python bench/plan_scale.py``.

Traffic: 50,000 sessions of 20 requests, 4,000-token first prompts growing by 600 tokens a turn
(the previous prompt + a 200-token reply + 400 new tokens), gaps of 5-600 s (some past the TTL),
one request in 50 an edit that keeps only 1,000 tokens; profile data/profiles/vendor-h200.yaml.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.profile import load_profile
from planner.simulate import PlanSettings, Traffic, plan

TARGET_S = 60.0


def traffic(sessions: int = 50_000, turns: int = 20, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    k = np.tile(np.arange(turns), sessions)
    s = np.repeat(np.arange(sessions), turns)
    n = 4000 + 600 * k
    shared = np.where(k == 0, 0, n - 400)
    edit = (rng.random(len(k)) < 0.02) & (k > 0)
    shared = np.where(edit, 1000, shared)
    gaps = rng.choice([5.0, 30.0, 120.0, 600.0], size=len(k), p=[0.6, 0.3, 0.08, 0.02])
    start = np.repeat(rng.uniform(0, 3600, sessions), turns)
    arrival = start + np.cumsum(np.where(k == 0, 0, gaps + 2.0).reshape(sessions, turns), axis=1).ravel()
    return pd.DataFrame({"source": "bench", "session": s.astype(str), "request_index": k, "arrival_s": arrival,
                         "input_tokens": n, "output_tokens": 200, "shared_prefix_tokens": shared,
                         "server_s": 2.0, "gap_s": np.where(k == 0, np.nan, gaps)})


def main() -> None:
    df = traffic()
    profile = load_profile(REPO / "data" / "profiles" / "vendor-h200.yaml")
    t0 = time.perf_counter()
    tr = Traffic.of_frame(df)
    p = plan(tr, profile, PlanSettings())
    wall = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    hits = int((p.modes["pd-bidir-nocache"].outcome_names() == "hit").sum())
    print(f"requests planned: {len(tr):,} in {len(p.modes)} modes ({hits:,} pd-bidir-nocache hits)")
    print(f"wall time: {wall:.1f} s   target: {TARGET_S:.0f} s   ratio: {wall / TARGET_S:.2f}x of the target")
    print(f"peak memory (RSS high-water mark): {peak_mib:,.0f} MiB")


if __name__ == "__main__":
    main()
