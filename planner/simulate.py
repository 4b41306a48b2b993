"""The planner's simulation: what the proxy and vLLM would do with each request of a traffic, per
serving mode, and what it would cost (a FORECAST: every figure comes from a cost profile).

Input: :class:`loadgen.traces.agent_request.AgentRequest` records (any traffic source), a
:class:`planner.profile.CostProfile` and :class:`PlanSettings`. The rules are the
proxy's own (:mod:`core.reuse_rules`; the model in docs/planner/simulation.md); what the
simulation adds is time and space:

* a session's requests arrive at ``arrival_s`` (as recorded: open loop); a request finishes
  ``server_s`` later when the trace records it, else after the profile's ``pd-nocache`` TTFT plus
  ``output_tokens x decode_s_per_token`` (0 when the profile has none: said in the plan's notes);
  in a bidirectional mode with D's admission queue, at its admission on D plus its decode (next
  item but one);
* **D's pinned KV** (``pd-bidir*``): when a request finishes D pins the KV of its prompt and
  output (:func:`core.reuse_rules.handle_kv_tokens`, whole blocks) until the session's next
  request frees it (a hit, or ``miss_below_threshold``: P pulls nothing and tells D to free it,
  :func:`core.reuse_rules.d_frees_taken_handle`) or ``decoder_kv_blocks_ttl`` passes
  (:class:`planner.pinned_kv.HandleLedger`, the
  lifecycle shared with the Memory page's what-if), counted in distinct blocks (handles sharing a
  prefix hold it once: :mod:`planner.pinned_blocks`). vLLM never evicts pinned blocks;
  when the blocks already pinned leave no room in D's KV space for those a finishing turn's handle
  adds, the planner counts that turn's handle as lost (``miss_d_full`` on the session's next
  request), which D's admission queue leaves to requests larger than D's free space for good;
* **D's admission queue** (P/D modes, ``PlanSettings.queue_decode``): a request waits on D until
  D's KV space has room for its blocks next to the pinned handles and the running requests, in
  one pass over time with the handles (:mod:`planner.decode_admission`, :func:`simulate_bidir`);
  a request whose session's next request was sent after its reply (the traffic records the gap)
  ends there no later than that arrival (:meth:`Traffic.latest_end_s`), so a forecast a few ms long
  does not break the order the recorded client kept;
* **P's own prefix cache** (``pd``, ``pd-bidir``; the aggregated worker's for ``aggregated``):
  per worker, an LRU of sessions holding each one's last prompt (the aggregated worker: prompt and
  output), within the worker's KV space; a hit is the whole blocks both prompts share
  (:func:`core.reuse_rules.local_prefix_tokens`). Sessions go to workers round-robin per
  request (``routing="round-robin"``) or by session (``"session"``, the proxy's default:
  :mod:`serving.routing`; its ``prefix-aware`` policy is not modelled).

* **TTFT** (:class:`PrefillTtft`): the profile's cost of each request (:class:`ModeCost`), plus its
  FIFO wait for its prefill (or aggregated) worker (:mod:`planner.queueing`), for chat
  traffic the renders of its messages to token ids, and in P/D its wait on D for room in D's KV
  space (:mod:`planner.decode_admission`); with the profile's
  ``host_contention_per_request``, its own work slowed by the others in flight on the host
  (:mod:`planner.host_contention`).

Outcomes are the contract's (``core.contract``) plus ``miss_d_full``; ``aggregated`` has none
(the proxy does not decide reuse there) and one-way P/D's later turns are
``miss_no_handle_returned``, as the proxy records them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import reuse_rules as rules
from core.contract import (
    HIT,
    MISS_BELOW_THRESHOLD,
    MISS_CONSUMED,
    MISS_EXPIRED,
    MISS_FIRST_TURN,
    MISS_MISMATCH,
    MISS_NO_HANDLE_RETURNED,
    MISS_TRANSFER_FAILED,
    SESSION,
    Role,
)
from core.modes import AGGREGATED, BIDIRECTIONAL_MODES, RECOMPUTE_MODE, SERVING_MODES, serving_mode
from loadgen.traces.agent_request import AgentRequest
from planner import host_contention, paced_sends
from planner.decode_admission import DecodeAdmission, DecodeSpace, HandlesOnD, one_way_admission
from planner.overload import (
    Overload,
    QueueGrows,
    decode_overload,
    first_overload,
    never_drains,
    prefill_overload,
    saturated,
    window_count,
    window_s,
)
from planner.pinned_blocks import PinnedBlocks
from planner.pinned_kv import LOST, Handle, HandleLedger
from planner.profile import MODES, CostProfile, GiB
from planner.queueing import batched_step_waits, shared_core_waits

#: The new outcome: the session's handle was not kept because D's KV space was full.
MISS_D_FULL = "miss_d_full"
#: Outcome codes of the simulation (index = code); ``None`` for aggregated serving.
OUTCOMES = (None, HIT, MISS_FIRST_TURN, MISS_EXPIRED, MISS_CONSUMED, MISS_MISMATCH,
            MISS_BELOW_THRESHOLD, MISS_TRANSFER_FAILED, MISS_NO_HANDLE_RETURNED, MISS_D_FULL)
_CODE = {name: i for i, name in enumerate(OUTCOMES)}
BIDIR_MODES = BIDIRECTIONAL_MODES


class PlanSettings(BaseModel):
    """The connector's and the proxy's settings the plan applies (seconds, tokens).

    Defaults are vLLM's (``decoder_kv_blocks_ttl`` 480 s, ``kv_recompute_threshold`` 64) and the
    proxy's (margin 30 s); ``block_size`` None takes the profile's. ``shared_prefix_tokens``: tokens
    every session's first request shares with the sessions before it (a common system prompt),
    found in a worker's prefix cache once that worker has served any request (0: none).
    ``queue_prefills``: a request waits for the prompts before it on its prefill (or aggregated)
    worker (:mod:`planner.queueing`; False: every request finds its worker idle).
    ``queue_decode``: a P/D request waits on D until D's KV space has room for it next to the pinned
    handles and the requests running there (:mod:`planner.decode_admission`; False: D
    always has room). ``rendered_prompts``: the requests are chat messages the workers render to token ids (a
    ``text`` history; the profile's ``render_s_per_token``); False: token ids, nothing rendered.
    ``separate_sources``: each source of the traffic is planned alone, on its own clock and its own
    deployment (its own workers, queues, caches and D), never stacked with the other sources: recorded
    runs (each run served on its own); False: every source's requests share one clock and one
    deployment (trace files of one traffic). ``prefill_servers``: the compute each prefill worker
    runs on, one label per worker (workers pinned to the same CPU cores share a label: each takes
    its own prompts first come first served and the busy ones time-share the cores,
    :func:`planner.queueing.shared_core_waits`; each keeps its own prefix cache); None:
    each worker its own. ``stop_on_overload``: a bidirectional forecast stops at the first request
    that waits (for P, or on D) longer than a window (:func:`overload_windows`), the overload of
    :func:`planner.overload.never_drains`, and raises
    :class:`planner.overload.QueueGrows` (fleet sizing needs only that; False: every
    request is forecast). ``max_num_batched_tokens``: the prefill (and aggregated) workers' token
    budget per scheduler step (None: the profile's, :attr:`CostProfile.max_num_batched_tokens`;
    neither: first come first served). ``ttft_slo_s``: the SLO on p90 TTFT the forecast is judged
    against (seconds; None: none): a p90 past :data:`planner.overload.SATURATION` times it
    is an overload (:func:`planner.overload.saturated`). ``pace_by_replies``: a request the client sent after its
    session's previous reply (:meth:`Traffic.paced`) is sent its recorded gap after the forecast
    reply (:func:`paced_mode_plan`; False: every request at its recorded arrival, open loop).
    ``p_cache_blocks``: P's own prefix cache kept by blocks in vLLM's order
    (:func:`block_cache_hits`, looked up when P schedules the request and held until D has read
    it, from the forecast's own timings; False: an LRU of sessions, :func:`own_cache_hits`).
    Raises ``pydantic.ValidationError`` when ``prefill_servers``' length is
    not ``prefill_workers``."""

    model_config = ConfigDict(extra="forbid")
    decoder_kv_blocks_ttl_s: float = Field(480.0, gt=0)
    handle_ttl_margin_s: float = Field(30.0, ge=0)
    kv_recompute_threshold: int = Field(64, ge=0)
    block_size: int | None = Field(None, gt=0)
    prefill_workers: int = Field(1, gt=0)
    decode_workers: int = Field(1, gt=0)
    aggregated_workers: int = Field(1, gt=0)
    routing: Literal["round-robin", "session"] = SESSION
    shared_prefix_tokens: int = Field(0, ge=0)
    queue_prefills: bool = True
    queue_decode: bool = True
    rendered_prompts: bool = False
    separate_sources: bool = False
    prefill_servers: tuple[int, ...] | None = None
    modes: tuple[str, ...] = MODES
    stop_on_overload: bool = False
    max_num_batched_tokens: int | None = Field(None, gt=0)
    ttft_slo_s: float | None = Field(None, gt=0)
    pace_by_replies: bool = True
    p_cache_blocks: bool = False

    @model_validator(mode="after")
    def _servers_per_worker(self) -> PlanSettings:
        if self.prefill_servers is not None and len(self.prefill_servers) != self.prefill_workers:
            raise ValueError(f"prefill_servers: {len(self.prefill_servers)} labels for {self.prefill_workers} "
                             "prefill workers (one per worker expected)")
        return self

    @property
    def proxy_ttl_s(self) -> float:
        """The proxy's handle TTL (:func:`core.reuse_rules.proxy_handle_ttl_s`)."""
        return rules.proxy_handle_ttl_s(self.decoder_kv_blocks_ttl_s, self.handle_ttl_margin_s)


@dataclass
class Traffic:
    """AgentRequest records as columns, sorted by arrival (ties: session, request index)."""

    source: np.ndarray
    session: np.ndarray          # session ids (object)
    session_code: np.ndarray     # int per (source, session)
    request_index: np.ndarray
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    shared_prefix_tokens: np.ndarray
    server_s: np.ndarray         # NaN where unknown
    gap_s: np.ndarray            # NaN where unknown
    recorded_ttft_s: np.ndarray | None = None   # NaN where unknown; None: none known
    gap_estimated: np.ndarray | None = None     # bool; None: every gap measured

    @classmethod
    def of(cls, requests: Iterable[AgentRequest]) -> Traffic:
        """Columns of ``requests``. Raises ValueError when there are none."""
        rows = list(requests)
        if not rows:
            raise ValueError("no requests to plan")
        df = pd.DataFrame({
            "source": [r.source for r in rows], "session": [r.session_id for r in rows],
            "request_index": np.fromiter((r.request_index for r in rows), np.int64, len(rows)),
            "arrival_s": np.fromiter((r.arrival_s for r in rows), float, len(rows)),
            "input_tokens": np.fromiter((r.input_tokens for r in rows), np.int64, len(rows)),
            "output_tokens": np.fromiter((r.output_tokens for r in rows), np.int64, len(rows)),
            "shared_prefix_tokens": np.fromiter((r.shared_prefix_tokens for r in rows), np.int64, len(rows)),
            "server_s": np.fromiter((np.nan if r.server_s is None else r.server_s for r in rows), float, len(rows)),
            "gap_s": np.fromiter((np.nan if r.gap_s is None else r.gap_s for r in rows), float, len(rows)),
            "recorded_ttft_s": np.fromiter((np.nan if r.ttft_s is None else r.ttft_s for r in rows), float, len(rows)),
            "gap_estimated": np.fromiter((r.gap_estimated for r in rows), bool, len(rows)),
        })
        return cls.of_frame(df)

    @classmethod
    def of_frame(cls, df: pd.DataFrame) -> Traffic:
        """Columns of a frame with AgentRequest's field names (``session`` for ``session_id``)."""
        # arrival_s is per source file: make sessions of different files sort on one clock each
        df = df.sort_values(["arrival_s", "session", "request_index"], kind="stable").reset_index(drop=True)
        # a session is (source, session id): two traces (or two recorded runs) may reuse an id
        codes = df.groupby(["source", "session"], sort=False).ngroup().to_numpy(np.int64)
        return cls(df["source"].to_numpy(), df["session"].to_numpy(), codes,
                   df["request_index"].to_numpy(np.int64), df["arrival_s"].to_numpy(float),
                   df["input_tokens"].to_numpy(np.int64), df["output_tokens"].to_numpy(np.int64),
                   df["shared_prefix_tokens"].to_numpy(np.int64), df["server_s"].to_numpy(float),
                   df["gap_s"].to_numpy(float),
                   df["recorded_ttft_s"].to_numpy(float) if "recorded_ttft_s" in df else None,
                   df["gap_estimated"].to_numpy(bool) if "gap_estimated" in df else None)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def select(self, rows: np.ndarray) -> Traffic:
        """The requests at positions ``rows`` (ascending), in their order, sessions renumbered."""
        codes = pd.factorize(self.session_code[rows])[0].astype(np.int64)
        return Traffic(self.source[rows], self.session[rows], codes, self.request_index[rows],
                       self.arrival_s[rows], self.input_tokens[rows], self.output_tokens[rows],
                       self.shared_prefix_tokens[rows], self.server_s[rows], self.gap_s[rows],
                       None if self.recorded_ttft_s is None else self.recorded_ttft_s[rows],
                       None if self.gap_estimated is None else self.gap_estimated[rows])

    def previous(self) -> np.ndarray:
        """Each request's session's previous request (by ``request_index``), its position; -1 for a
        session's first request."""
        prev = np.full(len(self), -1)
        order = np.lexsort((self.request_index, self.session_code))
        same = self.session_code[order][1:] == self.session_code[order][:-1]
        prev[order[1:][same]] = order[:-1][same]
        return prev

    def paced(self) -> np.ndarray:
        """Which requests a client sent after its session's previous reply: a follow-up whose gap
        the traffic measured (``gap_s`` known, not estimated: the client's time from that reply's
        end). A session's first request, and a follow-up of an open-loop trace or with an
        estimated gap, keeps its recorded arrival."""
        estimated = np.zeros(len(self), bool) if self.gap_estimated is None else self.gap_estimated
        return (self.previous() >= 0) & ~np.isnan(self.gap_s) & ~estimated

    def reply_decode_s(self, profile: CostProfile) -> np.ndarray:
        """The part of each request's reply after its first token, seconds: the recorded server
        time less the recorded TTFT where the traffic has both (the store's runs), else the
        profile's decode (:func:`decode_times`)."""
        forecast = decode_times(self, profile)
        if self.recorded_ttft_s is None:
            return forecast
        recorded = self.server_s - self.recorded_ttft_s
        return np.where(np.isnan(recorded), forecast, np.maximum(recorded, 0.0))

    def paced_arrivals(self, ttft_s: np.ndarray, decode_s: np.ndarray) -> np.ndarray:
        """Each request's send, seconds on the traffic's clock, with every :meth:`paced` request
        placed its ``gap_s`` after its session's previous reply ends: that request's (placed) send
        plus its forecast TTFT (``ttft_s``) plus ``decode_s``; other requests keep ``arrival_s``. A
        reply forecast ``x`` seconds later than recorded moves every later send of its session by ``x``."""
        prev, paced = self.previous(), self.paced()
        out = self.arrival_s.astype(float).copy()
        order = np.lexsort((self.request_index, self.session_code))
        prev_l, paced_l, gap = prev.tolist(), paced.tolist(), self.gap_s.tolist()
        reply = (np.asarray(ttft_s, float) + np.asarray(decode_s, float)).tolist()
        vals = out.tolist()
        for i in order.tolist():
            if paced_l[i]:
                j = prev_l[i]
                vals[i] = vals[j] + reply[j] + gap[i]
        return np.asarray(vals)

    @property
    def horizon_s(self) -> float:
        """First to last arrival, seconds (0 without requests)."""
        return float(self.arrival_s.max() - self.arrival_s.min()) if len(self) else 0.0

    def latest_end_s(self) -> np.ndarray:
        """The latest each request can have ended, seconds on the traffic's clock: its session's
        next arrival where the traffic records the gap before that arrival (``gap_s``: the client
        sent it after this request's reply, closed loop), else ``inf`` (the last request of a
        session, or an open-loop trace)."""
        latest = np.full(len(self), np.inf)
        order = np.lexsort((self.request_index, self.arrival_s, self.session_code))
        same = self.session_code[order][1:] == self.session_code[order][:-1]
        nxt = order[1:][same]
        closed = ~np.isnan(self.gap_s[nxt])
        latest[order[:-1][same][closed]] = self.arrival_s[nxt[closed]]
        return latest

    def source_rows(self) -> list[np.ndarray]:
        """The positions of each source's requests (ascending), sources in order of first arrival."""
        return [np.asarray(ix) for ix in pd.Series(self.source).groupby(self.source, sort=False).indices.values()]


@dataclass
class ModePlan:
    """One mode's forecast, one entry per request of the :class:`Traffic` (its order).

    ``outcome`` holds codes into :data:`OUTCOMES`; tokens are counts; ``ttft_s`` seconds (of
    which ``queue_wait_s`` waiting for the prefill worker, ``decode_wait_s`` for room in D's KV
    space: :mod:`planner.decode_admission`, empty where not modelled, and ``contention_s``
    host contention: :mod:`planner.host_contention`, empty where the profile has none); ``handle_age_s``
    NaN where no handle was taken. ``held_t_s``/``held_bytes``: D's pinned KV
    after each change (bidirectional modes; empty otherwise); ``d_full_events``: handles lost;
    ``d_peak_in_use_bytes``: the most KV in use on D at once, pinned handles plus running requests
    (:attr:`planner.decode_admission.DecodeAdmission.peak_in_use_blocks`; NaN where D's
    queue is not modelled), what ``vllm:kv_cache_usage_perc`` measures. ``arrival_s``: each
    request's send in this forecast, seconds on the traffic's clock (the recorded one, or placed
    after the forecast reply of its session's previous request: :func:`paced_mode_plan`)."""

    mode: str
    outcome: np.ndarray
    pulled_tokens: np.ndarray
    local_tokens: np.ndarray
    ttft_s: np.ndarray
    handle_age_s: np.ndarray
    queue_wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    held_t_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    held_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    d_full_events: int = 0

    prompt_tokens: np.ndarray | None = None
    decode_wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    d_peak_in_use_bytes: float = np.nan
    overload: Overload | None = None
    contention_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    arrival_s: np.ndarray | None = None

    @property
    def recomputed_tokens(self) -> np.ndarray:
        """Prompt tokens computed (not pulled, not from the worker's own cache)."""
        return self.prompt_tokens - self.pulled_tokens - self.local_tokens

    @property
    def queued_s(self) -> np.ndarray:
        """Of each TTFT, the seconds spent queueing: for the prefill worker and on D."""
        return self.queue_wait_s + self.decode_wait_s if self.decode_wait_s.size else self.queue_wait_s

    def outcome_names(self) -> np.ndarray:
        """The outcome of each request as text (None for aggregated serving)."""
        return np.asarray(OUTCOMES, dtype=object)[self.outcome]

    def peak_held_bytes(self) -> float:
        """The most KV D held pinned at once, bytes (0 when none)."""
        return float(self.held_bytes.max()) if self.held_bytes.size else 0.0

    def held_gib_s(self) -> float:
        """The integral of D's pinned KV over time, GiB-seconds."""
        if self.held_bytes.size < 2:
            return 0.0
        return float(np.sum(self.held_bytes[:-1] * np.diff(self.held_t_s)) / GiB)

    @classmethod
    def merged(cls, parts: list[tuple[np.ndarray, ModePlan]], n: int) -> ModePlan:
        """One mode's plans of separate parts of a traffic (``(rows, plan)``: the part's positions in
        the whole traffic of ``n`` requests) as one plan of the whole: per-request arrays put back
        at their rows; D's pinned KV of each part laid end to end in time (each part had its own D:
        the peak is the largest part's, the GiB-seconds their sum); handles lost summed; D's peak
        in use the largest part's."""
        mode = parts[0][1].mode
        out = cls(mode, np.zeros(n, np.int8), np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n),
                  np.full(n, np.nan), np.zeros(n), prompt_tokens=np.zeros(n, np.int64))
        held_t, held_b, end = [], [], 0.0
        for rows, m in parts:
            for name in ("outcome", "pulled_tokens", "local_tokens", "ttft_s", "handle_age_s", "queue_wait_s",
                         "prompt_tokens"):
                getattr(out, name)[rows] = getattr(m, name)
            if m.arrival_s is not None:
                if out.arrival_s is None:
                    out.arrival_s = np.full(n, np.nan)
                out.arrival_s[rows] = m.arrival_s
            for name in ("decode_wait_s", "contention_s"):
                if getattr(m, name).size:
                    if not getattr(out, name).size:
                        setattr(out, name, np.zeros(n))
                    getattr(out, name)[rows] = getattr(m, name)
            if m.held_t_s.size:
                held_t.append(m.held_t_s - m.held_t_s[0] + end)
                held_b.append(m.held_bytes)
                end = float(held_t[-1][-1])
            out.d_full_events += m.d_full_events
            out.overload = first_overload(out.overload, m.overload)
            if not np.isnan(m.d_peak_in_use_bytes):
                out.d_peak_in_use_bytes = float(np.nanmax([out.d_peak_in_use_bytes, m.d_peak_in_use_bytes]))
        if held_t:
            out.held_t_s, out.held_bytes = np.concatenate(held_t), np.concatenate(held_b)
        return out


@dataclass
class Plan:
    """A whole forecast: the traffic, the profile and settings, and one :class:`ModePlan` per mode."""

    traffic: Traffic
    profile: CostProfile
    settings: PlanSettings
    modes: dict[str, ModePlan]
    notes: list[str]


def _worker_of(i: int, session_code: int, workers: int, routing: str) -> int:
    return session_code % workers if routing == SESSION else i % workers


def workers_of(tr: Traffic, workers: int, routing: str) -> np.ndarray:
    """The worker each request of ``tr`` goes to (as :func:`own_cache_hits` routes it)."""
    return tr.session_code % workers if routing == SESSION else np.arange(len(tr)) % workers


#: Renders of a chat request's messages to token ids before its first token, per mode: the
#: aggregated worker's; P's and D's (each gets the chat request: ``serving.proxy`` prefill and
#: decode legs). A request that takes a handle is rendered once more by the proxy to match it
#: against D's ids (``SessionProxy.rendered_ids``: P's ``/tokenize`` or the in-process renderer).
RENDERS = {m.name: 2 if m.disaggregated else 1 for m in SERVING_MODES}
#: Outcomes of a request that took a handle (the proxy rendered its ids to fit it).
TOOK_HANDLE = (HIT, MISS_BELOW_THRESHOLD, MISS_MISMATCH, MISS_TRANSFER_FAILED)


@dataclass
class ModeCost:
    """A request's cost in ``mode`` before any queueing, from the profile: called with request
    positions ``rows`` and their tokens from P's own cache (``local``), pulled from D (``pulled``)
    and whether it took a handle (``took``: the proxy renders its ids once more), it returns
    (seconds to the first token: ``profile.ttft_s`` plus the chat renders, :data:`RENDERS`, when
    ``settings.rendered_prompts``; seconds of the prefill worker's time, ``c(n) - c(cached)``: a
    pull does not hold the worker, vLLM waits for remote KV outside the running batch). The ledger
    adds its host tier's reads (:class:`planner.ledger.StrategyCost`)."""

    tr: Traffic
    profile: CostProfile
    settings: PlanSettings
    mode: str

    def __call__(self, rows: np.ndarray, local: np.ndarray, pulled: np.ndarray,
                 took: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.tr.input_tokens[rows]
        cached = local + pulled
        ttft = self.profile.ttft_s(self.mode, n, cached, pulled)
        if self.settings.rendered_prompts:
            ttft = ttft + self.profile.render_s(n, RENDERS[self.mode] + took)
        return ttft, self.profile.prefill_compute_s(self.mode, n, cached)


class PrefillTtft:
    """A mode's TTFT before any wait on D, seconds: each request's cost (``cost``, a
    :class:`ModeCost`) plus its wait for its prefill (or aggregated) worker, first come first served
    (:mod:`planner.queueing`; none when ``settings.queue_prefills`` is off). For the whole
    traffic at once (:meth:`all`), or request by request in arrival order (:meth:`next`: the handle
    simulation learns a request's tokens when it arrives, and D's queue needs its TTFT then). P
    workers that share their compute (``settings.prefill_servers``) time-share it
    (:func:`planner.queueing.shared_core_waits`), and with an engine token budget prompts
    share scheduler steps (:func:`planner.queueing.batched_step_waits`): :meth:`next` then
    gives each request a provisional wait (one FIFO queue per server: what is known at its arrival;
    D's admission queue sees that one) and :meth:`settled_waits` the waits once every request is
    known (:attr:`provisional`)."""

    def __init__(self, tr: Traffic, settings: PlanSettings, mode: str, cost: ModeCost):
        aggregated = mode == AGGREGATED
        workers = settings.aggregated_workers if aggregated else settings.prefill_workers
        self.tr, self.cost, self.queue = tr, cost, settings.queue_prefills
        self.worker = workers_of(tr, workers, settings.routing)
        self.server = self.worker
        if not aggregated and settings.prefill_servers is not None:
            self.server = np.asarray(settings.prefill_servers)[self.worker]
        self.shares_servers = bool(self.queue) and len(np.unique(self.server)) < len(np.unique(self.worker))
        self.budget = settings.max_num_batched_tokens or (
            int(cost.profile.max_num_batched_tokens.value) if cost.profile.max_num_batched_tokens else None)
        self.steps = bool(self.queue) and self.budget is not None and not self.shares_servers
        #: :meth:`next`'s waits are provisional (one FIFO queue), :meth:`settled_waits` the real ones
        self.provisional = self.shares_servers or self.steps
        self._free_at: dict[int, float] = {}
        self._compute = np.zeros(len(tr))
        self._cached = np.zeros(len(tr), dtype=np.int64)
        self._pre: dict | None = None   # the costs :meth:`prepare` looked up ahead

    def waits(self, compute: np.ndarray, cached: np.ndarray) -> np.ndarray:
        """Each request's wait for (and slowdown on) its prefill worker, seconds, given every
        request's compute (seconds of the worker's time) and its tokens not computed (``cached``);
        0s when queueing is off. With an engine token budget (:attr:`budget`: the settings'
        ``max_num_batched_tokens``, else the profile's) and no shared cores, the engine's scheduler
        steps (:func:`planner.queueing.batched_step_waits`), unless the first-come waits
        already make the worker overloaded (:mod:`planner.overload`: a setting reported
        as overloaded has no TTFT, so its waits are left first come first served, the steps'
        cost saved); else first come first served
        per worker, time-shared where workers share cores
        (:func:`planner.queueing.shared_core_waits`)."""
        if not self.queue:
            return np.zeros(len(self.tr))
        if self.steps:
            fifo, overloaded = self.fifo_overloaded(compute)
            if overloaded:
                return fifo   # overloaded on P by :mod:`planner.overload`'s rules: no latency to refine
            fit = self.cost.profile.prefill_fit(self.cost.mode)
            return batched_step_waits(self.tr.arrival_s, cached, self.tr.input_tokens, fit.a1_s, fit.a2_s,
                                      self.budget, self.worker)
        return shared_core_waits(self.tr.arrival_s, compute, self.worker, self.server)

    def fifo_overloaded(self, compute: np.ndarray) -> tuple[np.ndarray, bool]:
        """(The first-come-first-served waits of every request given its ``compute``, seconds;
        whether they make P overloaded by :mod:`planner.overload`'s rules: a wait past a window, or
        more work than a window holds): the test :meth:`waits` takes before P's scheduler steps."""
        fifo = shared_core_waits(self.tr.arrival_s, compute, self.worker, self.server)
        windows = overload_windows(self.tr)
        overloaded = never_drains(self.tr.arrival_s, fifo, fifo, np.zeros(0), windows=windows) is not None or \
            prefill_overload(self.tr.arrival_s, compute, self.server, windows=windows) is not None
        return fifo, overloaded

    def all(self, local: np.ndarray, pulled: np.ndarray, took: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(TTFT, of which the wait for the prefill worker) of every request, seconds."""
        ttft, compute = self.cost(np.arange(len(self.tr)), local, pulled, took)
        wait = self.waits(compute, np.minimum(np.asarray(local) + np.asarray(pulled), self.tr.input_tokens))
        return ttft + wait, wait

    def prepare(self, local: np.ndarray, pulled_if_hit: np.ndarray) -> None:
        """Cost every request at once for the cases :meth:`next` will meet: nothing pulled, without
        and with a handle taken, and ``pulled_if_hit`` tokens pulled (the session's previous turn's
        handle, :func:`pull_if_hit`); ``local``: P's own-cache hits. :meth:`next` then looks the
        cost up (the same figures as costing one request at a time), and costs any other case alone."""
        n = len(self.tr)
        rows, zeros = np.arange(n), np.zeros(n, dtype=np.int64)
        no, yes = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)
        self._pre = {"local": local.tolist(), "pull": pulled_if_hit.tolist(), "server": self.server.tolist(),
                     "arrival": self.tr.arrival_s.tolist()}
        for case, (pulled, took) in {"miss": (zeros, no), "took": (zeros, yes), "pulled": (pulled_if_hit, yes)}.items():
            ttft, compute = self.cost(rows, local, pulled, took)
            self._pre[case] = (ttft.tolist(), compute.tolist())

    def _cost_of(self, i: int, local: int, pulled: int, took: bool) -> tuple[float, float]:
        pre = self._pre
        if pre is not None and pre["local"][i] == local:
            case = ("took" if took else "miss") if pulled == 0 else ("pulled" if pre["pull"][i] == pulled else None)
            if case is not None:
                ttft, compute = pre[case]
                return ttft[i], compute[i]
        ttft, compute = self.cost(np.array([i]), np.array([local]), np.array([pulled]), np.array([took]))
        return float(ttft[0]), float(compute[0])

    def next(self, i: int, local: int, pulled: int, took: bool) -> tuple[float, float]:
        """(TTFT, of which the wait for the prefill worker) of request ``i``, seconds; requests in
        arrival order (Lindley's recursion one step at a time: the same waits as :meth:`all` when no
        worker shares its compute, else provisional: :meth:`settled_waits`)."""
        ttft, compute = self._cost_of(i, local, pulled, took)
        self._compute[i] = compute
        self._cached[i] = local + pulled
        wait = 0.0
        if self.queue:
            if self._pre is not None:
                w, arrival = self._pre["server"][i], self._pre["arrival"][i]
            else:
                w, arrival = int(self.server[i]), float(self.tr.arrival_s[i])
            start = max(arrival, self._free_at.get(w, arrival))
            wait = start - arrival
            self._free_at[w] = start + compute
        return ttft + wait, wait

    def settled_waits(self) -> np.ndarray:
        """The waits of every request :meth:`next` has seen, with all of them known, seconds."""
        return self.waits(self._compute, np.minimum(self._cached, self.tr.input_tokens))


def own_cache_hits(tr: Traffic, capacity_tokens: int | None, block_size: int, workers: int, routing: str,
                   with_output: bool, shared_prefix_tokens: int = 0) -> np.ndarray:
    """Each request's hit in its worker's own prefix cache, tokens: an LRU per worker of the
    sessions' last prompts (plus outputs when ``with_output``: the aggregated worker keeps the
    KV it decoded), ``capacity_tokens`` per worker (None: unbounded). A session's first request on a
    worker that served any request before hits the whole blocks of ``shared_prefix_tokens`` (a
    system prompt all sessions share; held once per worker, outside the LRU's accounting)."""
    caches = [OrderedDict() for _ in range(workers)]
    totals = [0] * workers
    served = [False] * workers
    hits = np.zeros(len(tr), dtype=np.int64)
    n_arr, shared, out = tr.input_tokens, tr.shared_prefix_tokens, tr.output_tokens
    codes = tr.session_code
    for i in range(len(tr)):
        s = int(codes[i])
        w = _worker_of(i, s, workers, routing)
        cache = caches[w]
        n = int(n_arr[i])
        held = cache.get(s)
        if held is not None:
            hits[i] = rules.local_prefix_tokens(held, int(shared[i]), block_size, n)
            totals[w] -= held
        elif shared_prefix_tokens and served[w]:
            hits[i] = rules.local_prefix_tokens(shared_prefix_tokens, shared_prefix_tokens, block_size, n)
        served[w] = True
        keep = n + int(out[i]) if with_output else n
        cache[s] = keep
        cache.move_to_end(s)
        totals[w] += keep
        if capacity_tokens is not None:
            while totals[w] > capacity_tokens and cache:
                _, evicted = cache.popitem(last=False)
                totals[w] -= evicted
    return hits


def pull_if_hit(tr: Traffic, local: np.ndarray, block_size: int, threshold: int) -> np.ndarray:
    """Tokens each request would pull from D were it to find its session's previous request's handle
    (the rules of :func:`simulate_bidir`, vectorised: :func:`core.reuse_rules.usable_handle_tokens`
    then :func:`~core.reuse_rules.tokens_to_pull`); 0 for a session's first request. A
    lookup only: :meth:`PrefillTtft.next` uses the cost it prepared with these only where the pass's
    own count (the scalar rules) equals it."""
    n = len(tr)
    order = np.lexsort((tr.request_index, tr.arrival_s, tr.session_code))
    prev = np.full(n, -1)
    same = tr.session_code[order][1:] == tr.session_code[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    has = prev >= 0
    p = np.maximum(prev, 0)
    kv = rules.handle_kv_tokens(tr.input_tokens[p], tr.output_tokens[p])
    shared = tr.shared_prefix_tokens
    usable = np.where(shared >= kv, kv, (shared // block_size) * block_size)
    count = np.minimum(usable, tr.input_tokens) - local
    skip = (count <= 0) | ((threshold > 0) & (count > 0) & (count < threshold)) | ~has
    return np.where(skip, 0, count).astype(np.int64)


class BidirResult(NamedTuple):
    """:func:`simulate_bidir`'s results, one entry per request: outcome codes, pulled and local
    tokens, handle ages (NaN: none taken), TTFT (seconds), of which the wait for the prefill worker
    and the wait on D; D's pinned KV; handles lost to a full D; D's peak blocks in use (pinned plus
    running; NaN without D's queue)."""

    outcome: np.ndarray
    pulled: np.ndarray
    local: np.ndarray
    ages: np.ndarray
    ttft_s: np.ndarray
    queue_wait_s: np.ndarray
    decode_wait_s: np.ndarray
    pinned: PinnedBlocks
    d_full: int
    d_peak_in_use_blocks: float


def decode_space(tr: Traffic, profile: CostProfile, settings: PlanSettings) -> DecodeSpace | None:
    """D's KV space and what each request takes of it (:class:`planner.decode_admission.DecodeSpace`),
    or None when D's queue is not modelled (``settings.queue_decode`` off, or no D space in the profile)."""
    cap = decode_capacity_blocks(profile, settings)
    if not settings.queue_decode or cap is None:
        return None
    return DecodeSpace.of(cap, settings.block_size or profile.block_size, tr.input_tokens, tr.output_tokens,
                          settings.shared_prefix_tokens, decode_times(tr, profile))


def decode_capacity_blocks(profile: CostProfile, settings: PlanSettings) -> int | None:
    """The decode workers' KV space in whole blocks, as one pool: the profile's space of one D times
    ``settings.decode_workers`` (sessions spread over them); None when the profile has none
    (unbounded)."""
    if profile.decode_kv_space_bytes is None:
        return None
    block = settings.block_size or profile.block_size
    return int(profile.decode_kv_space_bytes.value * settings.decode_workers // (block * profile.kv_bytes_per_token.value))


def simulate_bidir(tr: Traffic, profile: CostProfile, settings: PlanSettings, local_hits: np.ndarray | None,
                   finish_s: np.ndarray, prefill: PrefillTtft) -> BidirResult:
    """The handle rules over the traffic, one bidirectional mode (``local_hits``: P's own-cache
    hits of each request, None when P's prefix cache is off), with each request's TTFT
    (``prefill``) and D's admission queue (:mod:`planner.decode_admission`) in one pass
    over time: a request reaches D when its first token is due and waits for room next to the
    pinned handles and the running requests; its handle is pinned when it ends there, its
    admission plus its decode (:class:`planner.decode_admission.HandlesOnD`). Without D's
    queue (:func:`decode_space` None) every request ends at ``finish_s`` (the traffic's end,
    recorded or forecast) and waits nothing on D."""
    block = settings.block_size or profile.block_size
    threshold = settings.kv_recompute_threshold
    d_ttl = settings.decoder_kv_blocks_ttl_s
    proxy_ttl = settings.proxy_ttl_s
    kv_bytes = profile.kv_bytes_per_token.value
    pinned = PinnedBlocks(decode_capacity_blocks(profile, settings), block, block * kv_bytes,
                          settings.shared_prefix_tokens // block)
    ledger = HandleLedger(pinned, d_ttl)
    space = decode_space(tr, profile, settings)
    on_d = None if space is None else HandlesOnD(ledger, pinned, tr.latest_end_s())
    queue = None if space is None else DecodeAdmission(space.capacity_blocks, on_d)
    n_req = len(tr)
    outcome = np.zeros(n_req, dtype=np.int8)
    pulled = np.zeros(n_req, dtype=np.int64)
    local = np.zeros(n_req, dtype=np.int64) if local_hits is None else local_hits.copy()
    ages = np.full(n_req, np.nan)
    ttft = np.zeros(n_req)
    p_wait = np.zeros(n_req)
    seen: set[int] = set()
    # plain lists: indexing them is several times faster than indexing numpy arrays one item at a time
    codes, n_arr, out_arr = tr.session_code.tolist(), tr.input_tokens.tolist(), tr.output_tokens.tolist()
    shared, arrival, local_at = tr.shared_prefix_tokens.tolist(), tr.arrival_s.tolist(), local.tolist()
    need_at = None if space is None else space.need_blocks.tolist()
    hold_at = None if space is None else space.hold_s.tolist()
    finish_at = finish_s.tolist()
    c_hit, c_first, c_exp, c_cons = _CODE[HIT], _CODE[MISS_FIRST_TURN], _CODE[MISS_EXPIRED], _CODE[MISS_CONSUMED]
    c_mis, c_below, c_fail, c_full = (_CODE[MISS_MISMATCH], _CODE[MISS_BELOW_THRESHOLD],
                                      _CODE[MISS_TRANSFER_FAILED], _CODE[MISS_D_FULL])
    took_codes = {_CODE[o] for o in TOOK_HANDLE}
    prefill.prepare(local, pull_if_hit(tr, local, block, threshold))
    stop_after_s = window_s(tr.arrival_s, overload_windows(tr)) if settings.stop_on_overload else None
    if queue is not None:
        queue.stop_after_s = stop_after_s
    for i in range(n_req):
        t = arrival[i]
        s = codes[i]
        n = n_arr[i]
        if queue is not None:
            queue.advance(t)        # D's admissions, ends, pins and TTLs up to this arrival
        taken = ledger.take(t, s)   # pins the turns finished before this arrival, frees expired ones
        if s not in seen:
            seen.add(s)
            outcome[i] = c_first
        elif isinstance(taken, Handle):
            age = t - taken.created_s
            ages[i] = age
            if rules.handle_expired(age, proxy_ttl):
                outcome[i] = c_exp
            elif rules.p_declines_read(age, d_ttl):
                outcome[i] = c_fail
            else:
                usable = rules.usable_handle_tokens(taken.kv_tokens, shared[i], block)
                if usable == 0:
                    outcome[i] = c_mis
                else:
                    count = rules.tokens_to_pull(usable, n, local_at[i], threshold)
                    if count == 0:
                        outcome[i] = c_below
                    else:
                        outcome[i] = c_hit
                        pulled[i] = count
            if rules.d_frees_taken_handle(OUTCOMES[outcome[i]]):
                ledger.read(t, taken)   # P pulled it, or told D it needs none of it; else pinned to the TTL
                if queue is not None:
                    queue.advance(t)    # what that made room for
        elif taken is LOST:
            outcome[i] = c_full
        else:
            outcome[i] = c_cons
        code = int(outcome[i])
        first_token_s, wait_s = prefill.next(i, local_at[i], int(pulled[i]), code in took_codes)
        ttft[i], p_wait[i] = first_token_s, wait_s
        if stop_after_s is not None and wait_s > stop_after_s and not prefill.shares_servers:
            raise QueueGrows(Role.PREFILL, wait_s, stop_after_s)
        kv = rules.handle_kv_tokens(n, out_arr[i])
        ordinal = pinned.add_request(s, kv, shared[i])   # its place in the session's chain of prefixes
        blocks = rules.blocks_of(kv, block)
        handle = {"session": s, "kv_tokens": kv, "nbytes": blocks * block * kv_bytes, "ordinal": ordinal,
                  "blocks": blocks}   # HandleLedger.finished's arguments
        if queue is None:
            ledger.finished(finish_at[i], i, **handle)
        else:
            on_d.expect(i, handle)
            queue.arrive(i, t + first_token_s, need_at[i], hold_at[i])
    if prefill.provisional:                      # time-shared compute or engine steps, with every request known
        settled = prefill.settled_waits()
        ttft, p_wait = ttft - p_wait + settled, settled
    d_wait = np.zeros(n_req)
    if queue is not None:
        queue.close()
        d_wait = np.array([queue.wait_s[i] for i in range(n_req)])
    ledger.close()                               # the last turns of each session: pinned until TTL
    peak = np.nan if queue is None else queue.peak_in_use_blocks
    return BidirResult(outcome, pulled, local, ages, ttft + d_wait, p_wait, d_wait, pinned, ledger.lost_handles, peak)


class OneWayDecode(NamedTuple):
    """:func:`one_way_decode`'s results: each request's wait on D (seconds) and D's peak blocks in use
    (running requests; NaN when D's queue is not modelled)."""

    wait_s: np.ndarray
    peak_in_use_blocks: float


def one_way_decode(tr: Traffic, profile: CostProfile, settings: PlanSettings, ttft_s: np.ndarray) -> OneWayDecode:
    """A one-way P/D's D: its running requests only (nothing is pinned); waits of 0 s and no peak
    when :func:`decode_space` is None. A request reaches D when its first token is due
    (``arrival_s + ttft_s``) and holds its blocks for its decode (:func:`decode_times`)."""
    space = decode_space(tr, profile, settings)
    if space is None:
        return OneWayDecode(np.zeros(len(tr)), np.nan)
    queue = one_way_admission(tr.arrival_s + ttft_s, space.need_blocks, space.hold_s, space.capacity_blocks)
    return OneWayDecode(np.array([queue.wait_s[j] for j in range(len(tr))]), queue.peak_in_use_blocks)


def mode_overload(tr: Traffic, profile: CostProfile, settings: PlanSettings, mode: str, compute_s: np.ndarray,
                  server: np.ndarray, ttft_s: np.ndarray, queue_wait_s: np.ndarray,
                  decode_wait_s: np.ndarray, held_t_s: np.ndarray | None = None,
                  held_bytes: np.ndarray | None = None) -> Overload | None:
    """Whether ``mode``'s deployment keeps up with ``tr`` (:mod:`planner.overload`): its
    prefill (or aggregated) servers by the compute each request holds them for (``compute_s``,
    seconds; ``server``: each request's compute server, :attr:`PrefillTtft.server`), its D by KV
    space (P/D modes where D's queue is modelled; ``held_t_s``/``held_bytes``: D's pinned KV over
    time in bidirectional modes), every wait within a window (:func:`overload_windows`), and with
    ``settings.ttft_slo_s`` the p90 TTFT within :data:`planner.overload.SATURATION` times
    it. None: it keeps up."""
    kind = serving_mode(mode)
    role = Role.PREFILL if kind.disaggregated else Role.AGGREGATED
    windows = overload_windows(tr)
    found = [prefill_overload(tr.arrival_s, compute_s, server, role, windows)]
    space = decode_space(tr, profile, settings) if kind.disaggregated else None
    if space is not None:
        block_bytes = (settings.block_size or profile.block_size) * profile.kv_bytes_per_token.value
        held = None if held_bytes is None else np.asarray(held_bytes, dtype=float) / block_bytes
        found.append(decode_overload(tr.arrival_s, space.need_blocks, space.hold_s, space.capacity_blocks,
                                     held_t_s, held, windows))
    found.append(never_drains(tr.arrival_s, ttft_s, queue_wait_s, decode_wait_s, role, windows))
    found.append(saturated(ttft_s, queue_wait_s, decode_wait_s, settings.ttft_slo_s, role))
    return first_overload(*found)


def overload_windows(tr: Traffic) -> int:
    """The windows :mod:`planner.overload` judges ``tr`` over
    (:func:`planner.overload.window_count`: sized to its sessions' activity, a session
    ending at its last request's recorded end, ``arrival_s + server_s``)."""
    return window_count(tr.arrival_s, tr.session_code, tr.arrival_s + np.nan_to_num(tr.server_s, nan=0.0))


def host_contention_s(tr: Traffic, profile: CostProfile, finish_s: np.ndarray, ttft_s: np.ndarray,
                      queue_wait_s: np.ndarray, decode_wait_s: np.ndarray) -> np.ndarray:
    """Each request's host contention, seconds (:mod:`planner.host_contention`), to add to
    its TTFT; empty when the profile has no ``host_contention_per_request``. Requests are in flight
    by ``finish_s`` (the traffic's own ends, as the handles' pins take them); the own work is
    ``ttft_s`` less both waits. The engine's events keep the uncontended times: only the client's
    TTFT takes the term (every forecast of a mode, :func:`plan` and the ledger's, adds it here)."""
    beta = profile.host_contention_per_request
    if beta is None:
        return np.zeros(0)
    return host_contention.contention_s(beta.value, tr.arrival_s, finish_s, ttft_s - queue_wait_s - decode_wait_s)


def finish_times(tr: Traffic, profile: CostProfile) -> np.ndarray:
    """When each request finishes, seconds on the traffic's clock (see the module doc)."""
    nocache = profile.ttft_s(RECOMPUTE_MODE, tr.input_tokens, np.zeros(len(tr)), np.zeros(len(tr)))
    decode = profile.decode_s_per_token.value if profile.decode_s_per_token else 0.0
    e2e = np.where(np.isnan(tr.server_s), nocache + tr.output_tokens * decode, tr.server_s)
    return tr.arrival_s + e2e


def decode_times(tr: Traffic, profile: CostProfile) -> np.ndarray:
    """How long each request decodes once it is on D, seconds: ``output_tokens x
    decode_s_per_token``; without a decode time in the profile, what its recorded server time
    leaves after the profile's TTFT of the whole prompt (0 when it has none)."""
    if profile.decode_s_per_token is not None:
        return tr.output_tokens * profile.decode_s_per_token.value
    nocache = profile.ttft_s(RECOMPUTE_MODE, tr.input_tokens, np.zeros(len(tr)), np.zeros(len(tr)))
    return np.where(np.isnan(tr.server_s), 0.0, np.maximum(tr.server_s - nocache, 0.0))


def plan(requests: Iterable[AgentRequest] | Traffic, profile: CostProfile,
         settings: PlanSettings | None = None) -> Plan:
    """Forecast every request of ``requests`` in each of ``settings.modes``.

    With ``settings.separate_sources`` each source is planned alone (:func:`plan_each_source`).
    With ``settings.pace_by_replies`` (the default) each mode's paced requests (:meth:`Traffic.paced`)
    are sent their recorded gap after that mode's forecast reply (:func:`paced_mode_plan`).
    Raises ValueError for no requests or an unknown mode."""
    settings = settings or PlanSettings()
    tr = requests if isinstance(requests, Traffic) else Traffic.of(requests)
    if settings.separate_sources and len(set(tr.source)) > 1:
        return plan_each_source(tr, profile, settings)
    unknown = sorted(set(settings.modes) - set(MODES))
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; modes are {', '.join(MODES)}")
    notes = []
    if profile.decode_kv_space_bytes is None:
        notes.append("D's KV space is not in the profile: pinned KV is unbounded (no miss_d_full).")
    if np.isnan(tr.server_s).any() and profile.decode_s_per_token is None:
        notes.append("Some requests have no server time and the profile no decode time per token: they "
                     "finish at their forecast TTFT (handles pinned earlier than in reality).")
    pace = settings.pace_by_replies and bool(tr.paced().any())
    shared = _SharedWork(tr, profile, settings)
    out: dict[str, ModePlan] = {}
    for mode in settings.modes:
        # one pass where it covers the mode (checked), else the forecast re-made round by round
        one = _one_pass(tr, profile, settings, mode, notes) if pace and ONE_PASS and paced_sends.applies(tr, profile, settings, mode) \
            else None
        out[mode] = one or paced_mode_plan(tr, profile, settings, mode,
                                           _plan_mode(tr, profile, settings, mode, shared, notes), notes)
    if pace:
        notes.append(f"{int(tr.paced().sum())} of {len(tr)} requests sent their recorded gap after the forecast "
                     "reply of their session's previous request (each mode its own sends); sessions' first requests "
                     "at their recorded starts.")
    return Plan(tr, profile, settings, out, notes)


class _SharedWork:
    """What every mode of one traffic shares (computed once): when each request finishes by the
    traffic's own record (:func:`finish_times`), P's own-cache hits (P/D modes with P's prefix
    cache), each session's first request."""

    def __init__(self, tr: Traffic, profile: CostProfile, settings: PlanSettings, p_hits: np.ndarray | None = None):
        self.finish = finish_times(tr, profile)
        self.first_seen = ~pd.Series(tr.session_code).duplicated().to_numpy()
        self.p_hits = p_hits
        if p_hits is None and any(serving_mode(m).disaggregated and serving_mode(m).prefill_prefix_cache for m in settings.modes):
            self.p_hits = p_cache_hits(tr, profile, settings)


def p_cache_hits(tr: Traffic, profile: CostProfile, settings: PlanSettings, start_s: np.ndarray | None = None,
                 hold_s: np.ndarray | None = None) -> np.ndarray:
    """Each request's hit in P's own prefix cache, tokens: by blocks (:func:`block_cache_hits`,
    looked up at ``start_s`` and held ``hold_s``; None: at the arrival, held 0 s) with
    ``settings.p_cache_blocks``, else by sessions (:func:`own_cache_hits`)."""
    block = settings.block_size or profile.block_size
    capacity = profile.capacity_tokens(Role.PREFILL)
    if settings.p_cache_blocks:
        start = tr.arrival_s if start_s is None else start_s
        hold = np.zeros(len(tr)) if hold_s is None else hold_s
        return block_cache_hits(tr, capacity, block, settings.prefill_workers, settings.routing, start, hold,
                                settings.shared_prefix_tokens)
    return own_cache_hits(tr, capacity, block, settings.prefill_workers, settings.routing, with_output=False,
                          shared_prefix_tokens=settings.shared_prefix_tokens)


def block_cache_hits(tr: Traffic, capacity_tokens: int | None, block_size: int, workers: int, routing: str,
                     start_s: np.ndarray, hold_s: np.ndarray, shared_prefix_tokens: int = 0) -> np.ndarray:
    """Each request's hit in its prefill worker's own prefix cache, tokens, kept by blocks as vLLM
    keeps them: :func:`analysis.p_cache_replay.replay_hits` (a freed request's last blocks
    evicted first, a running request's blocks kept, the hit at most the prompt less its last
    token) per worker, on ``capacity_tokens // block_size`` blocks less vLLM's null block (None:
    unbounded). A request is looked up at ``start_s`` (when P schedules it: its arrival plus its
    wait for P) and holds its blocks ``hold_s`` seconds (until D has read them); a session's block
    past its ``shared_prefix_tokens`` with its previous request is new content."""
    from analysis.p_cache_replay import replay_hits

    hits = np.zeros(len(tr), dtype=np.int64)
    worker = workers_of(tr, workers, routing)
    total_blocks = int(np.sum(tr.input_tokens // block_size)) + 1
    blocks = total_blocks if capacity_tokens is None else max(capacity_tokens // block_size - 1, 1)
    for w in range(workers):
        rows = np.nonzero(worker == w)[0]
        if not rows.size:
            continue
        df = pd.DataFrame({"session_id": tr.session_code[rows], "sent_s": np.asarray(start_s, float)[rows],
                           "prompt_tokens": tr.input_tokens[rows], "hold_s": np.asarray(hold_s, float)[rows],
                           "reusable_tokens": tr.shared_prefix_tokens[rows]})
        hits[rows] = replay_hits(df, blocks, block_size, shared_prefix_tokens, hold_until="hold_s")
    return hits


#: Whether :func:`plan` places paced sends in one pass where it covers the mode
#: (:func:`planner.paced_sends.applies`); False: round by round only, the route before it
#: (``bench/fleet_search.py --compare-rounds`` times both in one run).
ONE_PASS = True

#: Rounds of :func:`paced_mode_plan` at most, and the largest change of a send (seconds) it stops at.
PACE_ROUNDS, PACE_TOLERANCE_S = 12, 1e-4


def paced_mode_plan(tr: Traffic, profile: CostProfile, settings: PlanSettings, mode: str, first: ModePlan,
                    notes: list[str]) -> ModePlan:
    """``mode``'s forecast settled on its own timings (``first``: the forecast at the recorded sends,
    with P's cache looked up at the arrivals).

    * Sends (``settings.pace_by_replies``): each paced request (:meth:`Traffic.paced`) is sent
      ``gap_s`` after its session's previous reply as forecast (:meth:`Traffic.paced_arrivals`:
      forecast TTFT plus the reply's decode, :meth:`Traffic.reply_decode_s`), so late replies make
      late turns and a busy worker's queue builds as a waiting client's did.
    * P's cache by blocks (``settings.p_cache_blocks``, P/D modes with P's prefix cache): each
      request is looked up when P schedules it (its send plus its wait for P) and holds its blocks
      until D has read them (its TTFT less its wait for P and D's first step: through a wait on D
      for room, D reads them once it admits the request), :func:`p_cache_hits`.

    A reply's TTFT depends on the sends and hits before it, and they on the replies: the forecast is
    re-made on what its own timings give until no send moves by more than
    :data:`PACE_TOLERANCE_S` and no hit changes (a first-come-first-served queue settles in as many
    rounds as a session has turns), at most :data:`PACE_ROUNDS` rounds (said in ``notes`` when
    reached). Returns the plan in ``tr``'s order, with ``arrival_s``: each request's forecast send."""
    kind = serving_mode(mode)
    pace = settings.pace_by_replies and bool(tr.paced().any())
    blocks = settings.p_cache_blocks and kind.disaggregated and kind.prefill_prefix_cache
    if not (pace or blocks):
        return first
    decode = tr.reply_decode_s(profile)
    first_step = profile.handoff_s(mode)[1]
    mp, sends = first, tr.arrival_s
    hits = first.local_tokens.copy() if blocks else None   # P's hits of ``first``: looked up at the arrivals
    for _ in range(PACE_ROUNDS):
        new_sends = tr.paced_arrivals(mp.ttft_s, decode) if pace else sends
        new_hits = hits
        if blocks:
            # P keeps a finished prefill's blocks until D has read them, so through a wait on D for room:
            # NixlConnector's request_finished delays their free until D, once it admits the request, reads them
            hold = np.maximum(mp.ttft_s - mp.queue_wait_s - first_step, 0.0)
            # on the traffic in the order of those sends, as the plan routed it (round-robin counts requests)
            at = Traffic(**{**tr.__dict__, "arrival_s": sends})
            order = np.lexsort((at.request_index, at.session, at.arrival_s))
            new_hits = np.empty(len(tr), dtype=np.int64)
            new_hits[order] = p_cache_hits(at.select(order), profile, settings, (sends + mp.queue_wait_s)[order],
                                           hold[order])
        if np.max(np.abs(new_sends - sends)) <= PACE_TOLERANCE_S and (not blocks or np.array_equal(new_hits, hits)):
            break
        sends, hits = new_sends, new_hits
        mp = _plan_at(tr, profile, settings, mode, sends, hits)
    else:
        notes.append(f"{mode}: the forecast's sends and P's cache hits, re-made on its own timings, still moved "
                     f"after {PACE_ROUNDS} rounds (the last round's forecast is given).")
    mp.arrival_s = sends
    return mp


def _plan_at(tr: Traffic, profile: CostProfile, settings: PlanSettings, mode: str, sends: np.ndarray,
             hits: np.ndarray | None = None, notes: list[str] | None = None) -> ModePlan:
    """``mode``'s forecast of ``tr`` sent at ``sends`` (P's own-cache hits ``hits``; None: looked up
    in the order of the sends), in ``tr``'s order; its notes go to ``notes`` (None: dropped)."""
    moved = Traffic(**{**tr.__dict__, "arrival_s": sends})
    order = np.lexsort((moved.request_index, moved.session, moved.arrival_s))
    sub = moved.select(order)
    work = _SharedWork(sub, profile, settings, None if hits is None else hits[order])
    return _in_order_of(_plan_mode(sub, profile, settings, mode, work, [] if notes is None else notes), order,
                        len(tr))


def _one_pass(tr: Traffic, profile: CostProfile, settings: PlanSettings, mode: str,
              notes: list[str]) -> ModePlan | None:
    """``mode``'s paced forecast by :func:`planner.paced_sends.paced_sends` (one pass), checked: the
    whole forecast made at those sends must place every paced send where it is, within
    :data:`PACE_TOLERANCE_S` (:meth:`Traffic.paced_arrivals`). With an engine token budget P's
    scheduler steps are tried first, then first come first served (a P that :mod:`planner.overload`
    finds overloaded under first-come waits is forecast with them: :meth:`PrefillTtft.waits`); first
    come first served first where P is so overloaded at the recorded sends (the steps' pass, the
    longer one, then mostly spared). None when neither checks (the caller re-makes the forecast
    round by round)."""
    n = len(tr)
    decode = tr.reply_decode_s(profile)
    zeros = np.zeros(n, dtype=np.int64)
    cost = ModeCost(tr, profile, settings, mode)
    ttft0, compute = cost(np.arange(n), zeros, zeros, np.zeros(n, dtype=bool))
    prefill = PrefillTtft(tr, settings, mode, cost)
    fit = profile.prefill_fit(mode)
    space = decode_space(tr, profile, settings)
    tries = (True,)
    if prefill.steps:
        tries = (True, False) if prefill.fifo_overloaded(compute)[1] else (False, True)
    for fifo in tries:
        sends, _ = paced_sends.paced_sends(tr, settings, ttft0, compute, fifo, fit.a1_s, fit.a2_s, prefill.budget,
                                           decode, space)
        said: list[str] = []
        mp = _plan_at(tr, profile, settings, mode, sends, notes=said)
        if np.max(np.abs(tr.paced_arrivals(mp.ttft_s, decode) - sends)) <= PACE_TOLERANCE_S:
            mp.arrival_s = sends
            notes.extend(said)
            return mp
    return None


def _in_order_of(mp: ModePlan, order: np.ndarray, n: int) -> ModePlan:
    """``mp`` (a plan of the requests at positions ``order`` of a traffic of ``n``, in that order)
    with its per-request arrays put back at those positions; D's pinned KV over time as it was."""
    out = ModePlan.merged([(order, mp)], n)
    out.held_t_s, out.held_bytes = mp.held_t_s, mp.held_bytes
    return out


def _plan_mode(tr: Traffic, profile: CostProfile, settings: PlanSettings, mode: str, shared: _SharedWork,
               notes: list[str]) -> ModePlan:
    """One mode's forecast of ``tr`` at its sends (``tr.arrival_s``)."""
    block = settings.block_size or profile.block_size
    n = tr.input_tokens
    zeros = np.zeros(len(tr), dtype=np.int64)
    no_age = np.full(len(tr), np.nan)
    finish, first_seen, p_hits = shared.finish, shared.first_seen, shared.p_hits
    kind = serving_mode(mode)
    p_cache = p_hits if kind.prefill_prefix_cache else None
    held_t, held_b, d_full, ages, pulled, d_peak = np.zeros(0), np.zeros(0), 0, no_age, zeros, np.nan
    if not kind.disaggregated:
        local = own_cache_hits(tr, profile.capacity_tokens(Role.AGGREGATED), block, settings.aggregated_workers,
                               settings.routing, with_output=True,
                               shared_prefix_tokens=settings.shared_prefix_tokens)
        outcome = np.zeros(len(tr), dtype=np.int8)
    elif not kind.bidirectional:
        local = zeros if p_cache is None else p_cache
        outcome = np.where(first_seen, _CODE[MISS_FIRST_TURN], _CODE[MISS_NO_HANDLE_RETURNED]).astype(np.int8)
    prefill = PrefillTtft(tr, settings, mode, ModeCost(tr, profile, settings, mode))
    if kind.bidirectional:
        r = simulate_bidir(tr, profile, settings, p_cache, finish, prefill)
        outcome, pulled, local, ages, d_full = r.outcome, r.pulled, r.local, r.ages, r.d_full
        ttft, wait, d_wait = r.ttft_s, r.queue_wait_s, r.decode_wait_s
        held_t, held_b, d_peak = np.asarray(r.pinned.t), np.asarray(r.pinned.b), r.d_peak_in_use_blocks
    else:
        ttft, wait = prefill.all(local, pulled, np.zeros(len(tr), dtype=bool))
        d_wait = np.zeros(len(tr))
        if kind.disaggregated:
            d_wait, d_peak = one_way_decode(tr, profile, settings, ttft)
        ttft = ttft + d_wait
    contention = host_contention_s(tr, profile, finish, ttft, wait, d_wait)
    if contention.size:
        ttft = ttft + contention
    if (d_wait > 0).any():
        notes.append(f"{mode}: {int((d_wait > 0).sum())} of {len(tr)} requests wait on D for room in its KV space "
                     f"(mean {d_wait.mean():,.2f} s, longest {d_wait.max():,.1f} s). Where the traffic does not "
                     "record that a client waited for the reply (open loop), a request that arrives while its "
                     "session's previous one is still being served (queued on P or D) finds no handle "
                     "(miss_consumed).")
    compute = profile.prefill_compute_s(mode, n, local + pulled)
    mp = ModePlan(mode, outcome, pulled, local, ttft, ages, wait, held_t, held_b, d_full, decode_wait_s=d_wait,
                  d_peak_in_use_bytes=d_peak * block * profile.kv_bytes_per_token.value,
                  overload=mode_overload(tr, profile, settings, mode, compute, prefill.server, ttft, wait, d_wait,
                                         held_t, held_b), contention_s=contention)
    mp.prompt_tokens = n
    mp.arrival_s = tr.arrival_s
    return mp


def plan_each_source(tr: Traffic, profile: CostProfile, settings: PlanSettings) -> Plan:
    """Each source of ``tr`` planned alone (its own clock, workers, queues, caches and D: a recorded
    run as it was served), merged into one :class:`Plan` of the whole traffic
    (:meth:`ModePlan.merged`); the notes are the parts' (each said once)."""
    alone = settings.model_copy(update={"separate_sources": False})
    parts = [(rows, plan(tr.select(rows), profile, alone)) for rows in tr.source_rows()]
    modes = {mode: ModePlan.merged([(rows, p.modes[mode]) for rows, p in parts], len(tr)) for mode in alone.modes}
    notes = list(dict.fromkeys(n for _, p in parts for n in p.notes))
    notes.append(f"Each of the {len(parts)} sources (recorded runs) planned alone, on its own clock and deployment.")
    return Plan(tr, profile, settings, modes, notes)
