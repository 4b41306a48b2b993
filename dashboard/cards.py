"""The speed-up card the Overview and Compare pages draw for one comparison (Streamlit).

The value is the speed-up (``analysis.speedup``: baseline / treatment median TTFT, ``1.18x``);
the chip under it is the verdict, coloured by the verdict (green faster, red slower, grey
undecided), never by the sign of the point estimate.
"""

from __future__ import annotations

from streamlit.delta_generator import DeltaGenerator

from analysis import headline, speedup
from analysis.headline import Ratio
from analysis.speedup import Verdict

_ARROWS = {Verdict.FASTER: "up", Verdict.SLOWER: "down", Verdict.UNCLEAR: "off", Verdict.TOO_FEW: "off"}


def speedup_card(col: DeltaGenerator, title: str, r: Ratio, help_: str) -> None:
    """One `st.metric` in `col`: title, the speed-up, the verdict chip; then a caption with the
    CI, medians, counts and, for an undecided verdict, the forecast sessions per side
    (``analysis.sample_size``)."""
    s = speedup.of(r)
    v = s.verdict
    col.metric(
        label=title,
        value=speedup.fmt(s.value),
        delta=v.value,
        delta_color=speedup.VERDICT_COLORS[v],
        delta_arrow=_ARROWS[v],
        help=f"{speedup.MEANING}. {help_}",
    )
    pct = round(headline.CONFIDENCE * 100)
    ci = speedup.fmt_ci(s.ci_low, s.ci_high) if s.has_ci else "n/a (fewer than 2 sessions)"
    sub = (
        f" · CI from a random {r.ci_sessions_treatment} vs {r.ci_sessions_baseline} sessions (wider than with all)"
        if r.ci_subsampled
        else ""
    )
    col.caption(
        f"{speedup.LABEL} {pct}% CI {ci} · median TTFT {r.median_treatment_s * 1e3:.1f} ms vs "
        f"{r.median_baseline_s * 1e3:.1f} ms · n = {r.n_treatment} vs {r.n_baseline} turns "
        f"({r.sessions_treatment} vs {r.sessions_baseline} sessions){sub}"
    )
    need = headline.sessions_needed(r)
    if need is not None:
        col.caption(f":material/group_add: {need.sentence()}")
    elif v is Verdict.TOO_FEW:
        col.caption(":material/group_add: Run at least 2 sessions per side for an interval, then a forecast.")

