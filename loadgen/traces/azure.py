"""Read the Azure LLM inference trace (conversation service) as arrivals and lengths (docs/workloads.md).

File format (``data/AzureLLMInferenceTrace_conv.csv`` of Azure/AzurePublicDataset, shipped as
``data/traces/AzureLLMInferenceTrace_conv.csv``, CC-BY-4.0): a CSV with a header row and columns

* ``TIMESTAMP``: arrival, ``YYYY-MM-DD HH:MM:SS.fffffff`` (7 fractional digits, no zone);
* ``ContextTokens``: prompt tokens; ``GeneratedTokens``: output tokens.

The trace has no session ids and no content: each row is replayed as a single request of its own
(kind ``fresh``), at its arrival offset, with synthesized text of ``ContextTokens`` tokens.
Parsing is the standard library's ``csv`` and ``datetime``.
"""

from __future__ import annotations

import csv
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core import resources
from loadgen.session import SessionPlan, TurnPlan
from loadgen.synth_text import TextSynth
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.replay import (
    ReplaySource,
    ReplayWorkload,
    in_window,
    reference_reply,
)

#: The shipped copy (CC-BY-4.0, see data/traces/SOURCES.md).
DEFAULT_TRACE = resources.shipped("traces", "AzureLLMInferenceTrace_conv.csv")
_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class AzureRequest:
    """One row: ``index`` (0-based row order), ``arrival_s`` (seconds after the first row's
    TIMESTAMP), ``context_tokens`` and ``generated_tokens``."""

    index: int
    arrival_s: float
    context_tokens: int
    generated_tokens: int


def _parse_ts(s: str) -> dt.datetime:
    # 7 fractional digits (100 ns ticks) do not fit %f's 6: keep microseconds, drop the last digit.
    head, _, frac = s.strip().partition(".")
    base = dt.datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    if frac:
        if not frac.isdigit():
            raise ValueError(f"fractional seconds {frac!r} are not digits")
        base += dt.timedelta(microseconds=int(frac[:6].ljust(6, "0")))
    return base


def load_azure(path: Path | str = DEFAULT_TRACE, *, limit: int | None = None) -> list[AzureRequest]:
    """Read the CSV (at most ``limit`` rows), in row order, arrivals relative to the first row.

    Raises:
        TraceFormatError: unreadable file, missing columns, a bad timestamp or a non-integer /
            negative token count, e.g. ``.../x.csv:5: ContextTokens: expected an integer >= 0``;
            decreasing timestamps.
    """
    path = Path(path)
    out: list[AzureRequest] = []
    try:
        fh = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read the trace: {e}") from e
    with fh:
        reader = csv.DictReader(fh)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(f"{path}:1: header: missing column(s) {', '.join(missing)}; "
                                   f"got {reader.fieldnames}")
        t0: dt.datetime | None = None
        prev: dt.datetime | None = None
        for row in reader:
            if limit is not None and len(out) >= limit:
                break
            where = f"{path}:{reader.line_num}"
            try:
                ts = _parse_ts(row["TIMESTAMP"])
            except (ValueError, AttributeError) as e:
                raise TraceFormatError(f"{where}: TIMESTAMP: {row['TIMESTAMP']!r}: {e}") from e
            vals = {}
            for c in ("ContextTokens", "GeneratedTokens"):
                try:
                    vals[c] = int(row[c])
                except (TypeError, ValueError):
                    raise TraceFormatError(f"{where}: {c}: expected an integer >= 0, got {row[c]!r}") from None
                if vals[c] < 0:
                    raise TraceFormatError(f"{where}: {c}: expected an integer >= 0, got {vals[c]}")
            if prev is not None and ts < prev:
                raise TraceFormatError(f"{where}: TIMESTAMP: {ts} is before the previous row's {prev}")
            t0 = t0 or ts
            prev = ts
            out.append(AzureRequest(len(out), (ts - t0).total_seconds(), vals["ContextTokens"],
                                    vals["GeneratedTokens"]))
    return out


def plan_azure(src: ReplaySource, si: int, w: ReplayWorkload, synth: TextSynth, time_scale: float) -> list[SessionPlan]:
    """Every Azure row in the window as a one-turn session at its arrival offset."""

    rows = load_azure(src.path or DEFAULT_TRACE)
    s = src.token_scale
    name = src.name or "trace-azure"
    plans: list[SessionPlan] = []
    for r in rows:
        if src.sessions is not None and len(plans) >= src.sessions:
            break
        if not in_window(r.arrival_s, src):
            continue
        sid = f"z{si}-{len(plans):05d}-r{r.index}"
        n_in = max(1, round(r.context_tokens * s))
        n_out = max(1, round(r.generated_tokens * s))
        turn = TurnPlan([{"role": "user", "content": synth.text(n_in, f"{sid}/0/user")}],
                        reference_reply(synth.text(n_out, f"{sid}/0/ref")), max_tokens=n_out)
        start = (r.arrival_s - src.start_s) * time_scale if src.replay_timestamps else None
        plans.append(SessionPlan(sid, f"azure:r{r.index}", [turn], archetype=name, start_at_s=start))
    return plans


def empirical_values(field: str) -> tuple[float, ...]:
    """The values of ``field`` in the shipped trace, for a workload's ``kind: empirical`` distribution
    (``loadgen.workload.empirical_values``): per row ``context_tokens``/``generated_tokens``;
    ``interarrival_s`` between consecutive rows."""
    rows = load_azure()
    if field == "interarrival_s":
        return tuple(float(x) for x in np.diff([r.arrival_s for r in rows]))
    return tuple(float(getattr(r, field)) for r in rows)
