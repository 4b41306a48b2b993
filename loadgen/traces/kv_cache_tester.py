"""Read kv-cache-tester traces (anonymised Claude Code sessions) as :class:`AgentRequest` records.

File format (``traces/trace_*.json`` of callanjfox/kv-cache-tester, 24 of them shipped under
``data/traces/kv-cache-tester/``, Apache-2.0, see data/traces/SOURCES.md): one JSON object per
conversation with ``id``, ``block_size`` (64) and ``requests``, a list of

* requests: ``t`` (seconds since the conversation's start), ``in`` / ``out`` (prompt and output
  tokens), ``hash_ids`` (one id per *full* ``block_size``-token block of the prompt,
  ``floor(in / block_size)`` of them; ids are scoped to the conversation and a sub-agent shares its
  parent's namespace), ``api_time`` (the server's time for the request, seconds; absent on some
  streamed requests), ``think_time`` (the client's time before it, seconds), ``input_types`` (what
  the prompt ends with: ``tool_result`` or ``text``), ``stop``, ``model``;
* sub-agents: ``{"type": "subagent", "t", "agent_id", "requests": [...]}``, ``t`` on the parent's
  clock, its requests' ``t`` relative to the sub-agent's own start (nesting allowed).

What is read (docs/workloads.md):

* every conversation is a session (id: the trace's ``id``); every sub-agent is a session of its
  own (``<parent session>/<agent_id>``), starting at the parent's clock ``t`` plus its own offset
  and running concurrently with the parent (``parent_session_id`` names the parent);
* ``arrival_s`` = the sub-agent offsets plus ``t``, one clock per file (the conversation's start);
* ``server_s`` = ``api_time``; ``gap_s`` = ``t - (t_prev + api_time_prev)`` (the client's time: a
  tool or the human), clipped to ``[0, t - t_prev]`` (``t`` is in whole seconds, ``api_time`` in
  hundredths, so the difference can dip below 0);
* when the previous request has no ``api_time`` (a streamed request, often) the trace does not
  say when it ended: ``gap_s`` = ``t - t_prev``, the start-to-start upper bound, with
  ``gap_estimated`` True. ``think_time`` is not used: it counts from the end of the last request
  that *had* an ``api_time`` (on the 24 shipped traces, within a second in all 101 such cases),
  so after a run of streamed requests it exceeds the time between the two requests (trace_0183:
  445 s for requests 31 s apart). The upper bound is the rule that never credits reuse the
  trace does not prove: a follow-up counted within a TTL is within it whatever the previous
  request's server time was (docs/workloads.md);
* ``shared_prefix_tokens`` = (leading hash ids in common with the session's previous request) x
  ``block_size``, capped by ``in``: the prompt tokens the previous request already held, exact to
  the block (the partial last block has no id, so up to ``block_size - 1`` more may be shared);
* ``gap_kind`` = ``tool`` when ``input_types`` holds ``tool_result`` (the gap was a tool's run),
  ``think`` otherwise (a user message).

Errors (:class:`TraceFormatError`) name the file, the JSON line of a syntax error or the request's
position (``requests[12].requests[3]``) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from core import resources
from loadgen.session import SessionPlan, TurnPlan
from loadgen.synth_text import TextSynth
from loadgen.traces.agent_request import AgentRequest, bounded_gap
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.replay import (
    ReplaySource,
    ReplayWorkload,
    in_window,
    reference_reply,
)

#: The shipped copies (Apache-2.0, see data/traces/SOURCES.md).
DEFAULT_DIR = resources.shipped("traces", "kv-cache-tester")
#: Tokens per hash block when the file does not say (``block_size``).
BLOCK_TOKENS = 64
FORMAT = "kv_cache_tester"


def trace_files(path: Path | str) -> list[Path]:
    """The trace files under ``path``: the file itself, or a directory's ``*.json`` in name order.

    Raises:
        TraceFormatError: ``path`` does not exist, or is a directory without ``*.json`` files.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.json"))
        if not files:
            raise TraceFormatError(f"{p}: no *.json kv-cache-tester trace files in this directory")
        return files
    if not p.exists():
        raise TraceFormatError(f"{p}: no such file or directory")
    return [p]


def common_leading(a: list[int], b: list[int]) -> int:
    """How many leading elements ``a`` and ``b`` share (list slices compared in C, then bisection)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    if n and a[: n - 1] == b[: n - 1]:
        return n - 1
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi] holds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _FieldError(ValueError):
    """A field's problem, without its location (added by the caller, only when raised)."""


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if type(v) is not int or v < 0:
        raise _FieldError(f"{key}: expected an integer >= 0, got {v!r:.60}")
    return v


def _num(d: dict[str, Any], key: str, *, required: bool) -> float | None:
    v = d.get(key)
    if v is None and not required:
        return None
    if type(v) not in (int, float) or v < 0:
        raise _FieldError(f"{key}: expected a number >= 0 (seconds), got {v!r:.60}")
    return float(v)


class _FileReader:
    """Reads one trace file into AgentRequests (state: the file, its trace id and block size)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TraceFormatError(f"{path}: cannot read the trace: {e}") from e
        try:
            self.doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}:{e.lineno}: not valid JSON: column {e.colno}: {e.msg}") from e
        if not isinstance(self.doc, dict):
            raise TraceFormatError(f"{path}: expected a JSON object with 'requests' (a kv-cache-tester "
                                   f"trace), got {type(self.doc).__name__}")
        tid = self.doc.get("id", path.stem)
        if not isinstance(tid, str) or not tid:
            raise TraceFormatError(f"{path}: id: expected a non-empty string, got {tid!r:.60}")
        self.trace_id = tid
        bs = self.doc.get("block_size", BLOCK_TOKENS)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise TraceFormatError(f"{path}: block_size: expected an integer > 0, got {bs!r:.60}")
        self.block = bs
        self.source = f"kv-cache-tester:{tid}"

    def requests(self) -> list[AgentRequest]:
        """All requests of the file, parent and sub-agents, ordered by arrival (then session)."""
        reqs = self.doc.get("requests")
        if not isinstance(reqs, list):
            raise TraceFormatError(f"{self.path}: requests: expected a list, got {type(reqs).__name__}")
        out: list[AgentRequest] = []
        self._session(reqs, "requests", self.trace_id, None, 0.0, out)
        out.sort(key=lambda r: (r.arrival_s, r.session_id, r.request_index))
        return out

    def _session(self, items: list[Any], where: str, sid: str, parent: str | None, base_s: float,
                 out: list[AgentRequest]) -> None:
        prev: dict[str, Any] | None = None
        prev_ids: list[int] = []
        prev_t = 0.0
        prev_api: float | None = None
        index = 0
        subs = 0
        for i, r in enumerate(items):
            try:
                if not isinstance(r, dict):
                    raise _FieldError(f"expected a JSON object, got {type(r).__name__}")
                t = _num(r, "t", required=True)
                if r.get("type") == "subagent":
                    subs += 1
                    sub_reqs = r.get("requests")
                    if not isinstance(sub_reqs, list):
                        raise _FieldError(f"requests: expected the sub-agent's list of requests, "
                                          f"got {type(sub_reqs).__name__}")
                    agent = r.get("agent_id") or f"sub{subs}"
                    if not isinstance(agent, str):
                        raise _FieldError(f"agent_id: expected a string, got {agent!r:.60}")
                    self._session(sub_reqs, f"{where}[{i}].requests", f"{sid}/{agent}", sid, base_s + t, out)
                    continue
                n_in = _int(r, "in")
                n_out = _int(r, "out")
                ids = r.get("hash_ids")
                if type(ids) is not list:
                    raise _FieldError(f"hash_ids: expected a list of integers, got {ids!r:.60}")
                if len(ids) != n_in // self.block:
                    raise _FieldError(f"hash_ids: expected {n_in // self.block} ids (one per full "
                                      f"{self.block}-token block of in={n_in}), got {len(ids)}")
                api = _num(r, "api_time", required=False)
                _num(r, "think_time", required=False)  # validated; not read (see the module doc)
                if prev is not None and t < prev_t:
                    raise _FieldError(f"t: {t} is before the previous request's {prev_t} "
                                      f"(expected non-decreasing times within a session)")
                types = r.get("input_types") or ()
                if type(types) not in (list, tuple):
                    raise _FieldError(f"input_types: expected a list of strings, got {types!r:.60}")
            except _FieldError as e:
                raise TraceFormatError(f"{self.path}: {where}[{i}]: {e}") from None
            arrival = base_s + t
            if prev is None:
                gap = None
                shared = 0
                kind = None
                estimated = False
            else:
                start_to_start = arrival - (base_s + prev_t)
                estimated = prev_api is None
                gap = bounded_gap(start_to_start if estimated else t - prev_t - prev_api, start_to_start)
                shared = min(n_in, common_leading(prev_ids, ids) * self.block)
                kind = "tool" if "tool_result" in types else "think"
            out.append(AgentRequest(self.source, sid, index, arrival, n_in, n_out, shared, parent, api, gap,
                                    None, kind, estimated))
            index += 1
            prev = r
            prev_t = t
            prev_api = api
            prev_ids = ids


def read_kv_cache_tester_file(path: Path | str) -> list[AgentRequest]:
    """One trace file's requests (see the module doc), ordered by arrival.

    Raises:
        TraceFormatError: unreadable file, invalid JSON, or a request with a missing or mistyped
            field; the message names the file, the request's position and the field.
    """
    return _FileReader(Path(path)).requests()


def iter_kv_cache_tester(paths: Path | str | Iterable[Path | str] = DEFAULT_DIR) -> Iterator[AgentRequest]:
    """Stream the requests of every trace file under ``paths`` (files or directories), one file at a
    time (memory: one file's requests), each file's in arrival order.

    Raises:
        TraceFormatError: as :func:`read_kv_cache_tester_file`, or a path without trace files.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for p in paths:
        for f in trace_files(p):
            yield from read_kv_cache_tester_file(f)


def read_kv_cache_tester(paths: Path | str | Iterable[Path | str] = DEFAULT_DIR) -> list[AgentRequest]:
    """All requests of the trace files under ``paths`` (default: the 24 shipped traces), file by
    file in name order, each file's in arrival order. Raises as :func:`iter_kv_cache_tester`."""
    return list(iter_kv_cache_tester(paths))


def plan_kv_cache_tester(src: ReplaySource, si: int, w: ReplayWorkload, synth: TextSynth,
                         time_scale: float) -> list[SessionPlan]:
    """Sessions of kv-cache-tester traces (:mod:`loadgen.traces.kv_cache_tester`), scaled.

    Every conversation and every sub-agent is its own session (sub-agents start at their offset
    on the conversation's clock, concurrently with their parent). Per request k of a session, with
    ``s`` = ``token_scale``: the first prompt is ``round(in_0 * s)`` tokens of text; a later request
    appends ``round(new_k * s) - out_{k-1}`` tokens (at least ``min_new_tokens``) after the
    previous reply of ``round(out_{k-1} * s)`` tokens, so its prompt keeps the trace's split
    between the prefix the previous request already had (``shared_prefix_tokens * s``, recorded
    as ``turns.trace_reusable_tokens``) and the new tokens. A compaction in the trace (a prompt
    that keeps less than the previous one) is replayed as an append: the replayed history only
    grows, so on those turns the engine can reuse more than ``trace_reusable_tokens``. Gaps: the
    trace's client time (``gap_s``; the start-to-start bound where the trace does not say when the
    previous request ended, docs/workloads.md) as ``gap_before_s`` and, with ``replay_timestamps``, the
    arrival offset as ``at_s`` (both times ``time_scale``); a gap over ``w.ttl_s`` makes a
    ``resume``. Text is :class:`TextSynth`'s, keyed by session and request.
    """

    s = src.token_scale
    name = src.name or "trace-kv-cache-tester"
    files = trace_files(src.path or DEFAULT_DIR)
    if src.sessions is not None:
        files = files[: src.sessions]
    by_session: dict[str, list[Any]] = {}
    for r in iter_kv_cache_tester(files):
        by_session.setdefault(f"{r.source}|{r.session_id}", []).append(r)
    plans: list[SessionPlan] = []
    for reqs in by_session.values():
        reqs.sort(key=lambda r: r.request_index)
        reqs = reqs[: src.max_turns]
        t0 = reqs[0].arrival_s
        if len(reqs) < src.min_turns or not in_window(t0, src):
            continue
        sid = f"k{si}-{len(plans):05d}-{reqs[0].session_id.replace('/', '-')}"
        turns: list[TurnPlan] = []
        prev_out = 0
        for k, r in enumerate(reqs):
            n_out = max(1, round(r.output_tokens * s))
            ref = reference_reply(synth.text(n_out, f"{sid}/{k}/ref"))
            if k == 0:
                msg = {"role": "user", "content": synth.text(max(1, round(r.input_tokens * s)), f"{sid}/0/user")}
                turns.append(TurnPlan([msg], ref, max_tokens=n_out, trace_reusable_tokens=0))
                prev_out = n_out
                continue
            n_new = max(src.min_new_tokens, round(r.new_tokens * s) - prev_out)
            text = synth.text(n_new, f"{sid}/{k}/new")
            msg = ({"role": "tool", "tool_call_id": f"call_{k}", "content": text} if r.gap_kind == "tool"
                   else {"role": "user", "content": text})
            gap = r.gap_s if r.gap_s is not None else r.arrival_s - reqs[k - 1].arrival_s
            kind, gkind = ("resume", "pause") if gap > w.ttl_s else ("turn", r.gap_kind or "think")
            at = (r.arrival_s - t0) * time_scale if src.replay_timestamps else None
            turns.append(TurnPlan([msg], ref, max(gap, 0.0) * time_scale, gkind, kind, max_tokens=n_out, at_s=at,
                                  trace_reusable_tokens=round(r.shared_prefix_tokens * s)))
            prev_out = n_out
        start = (t0 - src.start_s) * time_scale if src.replay_timestamps else None
        plans.append(SessionPlan(sid, f"{reqs[0].source}/{reqs[0].session_id}", turns, archetype=name,
                                 start_at_s=start))
    return plans
