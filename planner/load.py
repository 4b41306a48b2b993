"""The load a forecast is made at: a traffic is a session mix, and how fast sessions arrive is an
input that every forecast states (docs/planner/load.md).

A trace source either keeps a **shared clock** (TraceLab, Mooncake, Azure, the store's recorded
runs: every session's requests on one timeline, so the trace records its own load) or gives each
file **its own clock** (kv-cache-tester: every file is one session tree, a conversation and its
sub-agents, starting at t = 0; :attr:`loadgen.traces.formats.TraceFormat.clock`). Played as
recorded, own-clock files all start at once: 24 sessions recorded on different days become 24
sessions running together, a load no one asked for. So the load is one of (:class:`Load`):

* ``sessions_per_hour``: new sessions start as a Poisson process at that rate (exponential gaps
  between starts, seeded), each a session tree drawn at random (with replacement) from the mix,
  its requests, sub-agents and gaps kept as recorded, shifted to its start;
* ``concurrent_sessions``: a closed loop of that many session slots; each plays a drawn session
  tree and starts the next when the last request of the previous one ends, by the trace's recorded
  end (``arrival_s + server_s``; a request without a server time ends at its arrival): the
  recorded client's pace, not the forecast's (said in the label);
* ``recorded``: the trace's own shared clock, sped up by ``value`` (arrivals and gaps divided by it;
  server times kept). Refused for own-clock sources.

The session tree drawn is a source file for own-clock formats and a session for shared-clock ones
(a sub-agent of a shared-clock trace is drawn on its own: those traces do not link sub-agents to
their parents in the planner's columns). Drawn copies are told apart by ``#<copy>`` appended to
their session ids.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loadgen.traces.formats import OWN_CLOCK, trace_format
from planner import plan_store
from planner.simulate import Traffic


class LoadKind(StrEnum):
    """How sessions arrive (see the module doc); the values are the store's ``plan_fleets.load_kind``
    (:mod:`planner.plan_store`, which the dashboard reads)."""

    SESSIONS_PER_HOUR = plan_store.SESSIONS_PER_HOUR
    CONCURRENT_SESSIONS = plan_store.CONCURRENT_SESSIONS
    RECORDED = plan_store.RECORDED_CLOCK


#: The unit of each load kind's value, for tables and axes.
LOAD_UNITS = plan_store.LOAD_UNITS
#: Session trees drawn by a drawn load when the caller does not say.
DEFAULT_SESSIONS = 400


class Load(BaseModel):
    """A load: ``kind``, ``value`` (new sessions per hour; concurrent sessions, a whole number; or the
    factor the recorded clock is sped up by), ``sessions`` (session trees drawn, for the two drawn
    kinds) and ``seed`` (the draw and the Poisson starts).

    Raises ``pydantic.ValidationError`` for a value <= 0, a fractional number of concurrent
    sessions, or fewer than one session."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: LoadKind
    value: float = Field(gt=0)
    sessions: int = Field(DEFAULT_SESSIONS, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _whole_slots(self) -> Load:
        if self.kind == LoadKind.CONCURRENT_SESSIONS and self.value != int(self.value):
            raise ValueError(f"concurrent sessions must be a whole number, got {self.value}")
        return self

    @property
    def drawn(self) -> bool:
        """Whether sessions are drawn from the mix (not the recorded clock)."""
        return self.kind != LoadKind.RECORDED

    def at(self, value: float) -> Load:
        """The same load at another ``value`` (same kind, sessions and seed)."""
        return self.model_copy(update={"value": value})

    def label(self, trees: int | None = None) -> str:
        """The load in words, e.g. "100 new sessions per hour (Poisson starts, seed 0; 400 sessions
        drawn from 24 session trees)"; ``trees``: the mix's session trees."""
        mix = "" if trees is None else f" from {trees:,} session trees"
        if self.kind == LoadKind.SESSIONS_PER_HOUR:
            return (f"{self.value:,.4g} new sessions per hour (Poisson starts, seed {self.seed}; {self.sessions:,} "
                    f"sessions drawn{mix})")
        if self.kind == LoadKind.CONCURRENT_SESSIONS:
            return (f"{int(self.value):,} concurrent sessions (closed loop at the recorded pace, seed {self.seed}; "
                    f"{self.sessions:,} sessions drawn{mix})")
        return "the recorded clock" if self.value == 1 else f"the recorded clock sped up {self.value:,.4g}x"


@dataclass(frozen=True)
class LoadedTraffic:
    """A traffic at a load: ``traffic`` (its requests on the load's clock), ``load``, ``trees`` (the
    mix's session trees) and ``horizon_s`` (first to last arrival, seconds)."""

    traffic: Traffic
    load: Load
    trees: int

    @property
    def horizon_s(self) -> float:
        return float(self.traffic.arrival_s.max() - self.traffic.arrival_s.min())

    def label(self) -> str:
        """The load in words with the requests it gave and the horizon."""
        return (f"{self.load.label(self.trees)}: {len(self.traffic):,} requests over "
                f"{_duration(self.horizon_s)}")


def _duration(s: float) -> str:
    if s >= 2 * 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 120:
        return f"{s / 60:,.1f} min"
    return f"{s:,.1f} s"


class SessionMix:
    """The session trees of a traffic, each on its own clock from 0 (``tree_of``: ``"source"``, every
    source a tree, for own-clock formats; ``"session"``, every session a tree, for shared-clock
    ones). Raises ValueError for another ``tree_of``."""

    def __init__(self, tr: Traffic, tree_of: str):
        if tree_of not in ("source", "session"):
            raise ValueError(f"tree_of {tree_of!r}: expected 'source' or 'session'")
        self.tr = tr
        key = tr.source if tree_of == "source" else tr.session_code
        tree = pd.factorize(key)[0]
        self.trees = int(tree.max()) + 1
        self.order = np.argsort(tree, kind="stable")           # rows of tree 0, then 1, ... (arrival order kept)
        self.counts = np.bincount(tree, minlength=self.trees)
        self.offsets = np.concatenate(([0], np.cumsum(self.counts)[:-1]))
        start = np.full(self.trees, np.inf)
        np.minimum.at(start, tree, tr.arrival_s)
        self.rel_arrival_s = tr.arrival_s - start[tree]
        end = self.rel_arrival_s + np.nan_to_num(tr.server_s, nan=0.0)
        self.duration_s = np.zeros(self.trees)
        np.maximum.at(self.duration_s, tree, end)

    def play(self, draws: np.ndarray, starts_s: np.ndarray) -> Traffic:
        """The trees ``draws`` (indices, one per copy) started at ``starts_s`` (seconds): one
        :class:`Traffic` in arrival order, copy ``k``'s sessions renamed ``<id>#<k>``."""
        lens = self.counts[draws]
        total = int(lens.sum())
        copy = np.repeat(np.arange(len(draws)), lens)
        within = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        rows = self.order[np.repeat(self.offsets[draws], lens) + within]
        tr = self.tr
        arrival = self.rel_arrival_s[rows] + np.repeat(np.asarray(starts_s, dtype=float), lens)
        code = tr.session_code[rows].astype(np.int64) * len(draws) + copy
        sort = np.lexsort((tr.request_index[rows], code, arrival))
        rows, copy, arrival = rows[sort], copy[sort], arrival[sort]
        session = (pd.Series(tr.session[rows], dtype=str) + "#" + pd.Series(copy).astype(str)).to_numpy(object)
        codes = pd.factorize(code[sort])[0].astype(np.int64)
        return Traffic(tr.source[rows], session, codes, tr.request_index[rows], arrival, tr.input_tokens[rows],
                       tr.output_tokens[rows], tr.shared_prefix_tokens[rows], tr.server_s[rows], tr.gap_s[rows],
                       None if tr.recorded_ttft_s is None else tr.recorded_ttft_s[rows],
                       None if tr.gap_estimated is None else tr.gap_estimated[rows])


def poisson_starts(rate_per_hour: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` start times (seconds, the first at 0) of a Poisson process of ``rate_per_hour``."""
    gaps = rng.exponential(3600.0 / rate_per_hour, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def closed_loop_starts(slots: int, durations_s: np.ndarray) -> np.ndarray:
    """Start times (seconds) of sessions of ``durations_s`` played in order by ``slots`` slots, each
    starting its next session when its previous one ends (the earliest free slot takes the next)."""
    free = [(0.0, k) for k in range(slots)]
    starts = np.zeros(len(durations_s))
    for i, d in enumerate(durations_s):
        t, k = heapq.heappop(free)
        starts[i] = t
        heapq.heappush(free, (t + float(d), k))
    return starts


def apply_load(tr: Traffic, load: Load, tree_of: str) -> LoadedTraffic:
    """``tr`` at ``load`` (see the module doc; ``tree_of`` as :class:`SessionMix` takes it).

    Raises ValueError for a recorded load of an own-clock traffic (``tree_of == "source"``)."""
    mix = SessionMix(tr, tree_of)
    if load.kind == LoadKind.RECORDED:
        if tree_of == "source" and mix.trees > 1:
            raise ValueError("this traffic has no shared clock to speed up (--load-scale): each file is its own "
                             "session tree from t = 0; give a load: --sessions-per-hour or --concurrent-sessions")
        scaled = Traffic(**{**tr.__dict__, "arrival_s": tr.arrival_s / load.value, "gap_s": tr.gap_s / load.value})
        return LoadedTraffic(scaled, load, mix.trees)
    rng = np.random.default_rng(load.seed)
    draws = rng.integers(0, mix.trees, size=load.sessions)
    if load.kind == LoadKind.SESSIONS_PER_HOUR:
        starts = poisson_starts(load.value, load.sessions, rng)
    else:
        starts = closed_loop_starts(int(load.value), mix.duration_s[draws])
    return LoadedTraffic(mix.play(draws, starts), load, mix.trees)


def tree_of_formats(formats: list[str]) -> str:
    """What a session tree is for traces of ``formats`` (:class:`SessionMix`'s ``tree_of``): a
    source file for own-clock formats, a session for shared-clock ones.

    Raises ValueError when the formats mix the two clocks (forecast them separately)."""
    clocks = {trace_format(f).clock for f in formats}
    if len(clocks) > 1:
        raise ValueError(f"the traces mix formats with a shared clock and formats whose files each run on their "
                         f"own clock ({', '.join(sorted(set(formats)))}): forecast them separately")
    return "source" if clocks == {OWN_CLOCK} else "session"


def at_load(tr: Traffic, formats: list[str], load: Load | None) -> LoadedTraffic:
    """``tr`` (read from traces of ``formats``) at ``load``; None: the recorded clock, which only
    shared-clock traces have (and a single own-clock file: one session tree as recorded).

    Raises ValueError for no load on own-clock traces (naming the options that give one), a
    recorded load of them, or mixed clocks."""
    tree_of = tree_of_formats(formats)
    if load is None:
        if tree_of == "source" and len(set(tr.source)) > 1:
            raise ValueError(f"{', '.join(sorted(set(formats)))} traces record no load: every file is one session "
                             "tree on its own clock from t = 0, so played as recorded they would all start at once. "
                             "Give the load: --sessions-per-hour R (Poisson starts) or --concurrent-sessions N "
                             "(closed loop), with --sessions (trees drawn) and --load-seed")
        load = Load(kind=LoadKind.RECORDED, value=1.0)
    return apply_load(tr, load, tree_of)
