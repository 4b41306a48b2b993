"""Read the Mooncake conversation trace and infer its sessions from the hash chains (docs/workloads.md).

File format (JSON lines, ``FAST25-release/traces/conversation_trace.jsonl`` of kvcache-ai/Mooncake,
shipped as ``data/traces/conversation_trace.jsonl``): one request per line with

* ``timestamp``: arrival, milliseconds since the trace start (non-decreasing);
* ``input_length``, ``output_length``: prompt and output tokens;
* ``hash_ids``: one id per 512-token block of the prompt, ``ceil(input_length / 512)`` of them. An id
  stands for the block *and everything before it* (chained hashing), so two requests with the same
  id at position i share their first ``(i + 1) * 512`` tokens. The last block is partial unless
  ``input_length`` is a multiple of 512; its id is of the partial content, so when a later request
  fills that block the block gets a new id ("re-hashed").

The trace has no session ids. :func:`infer_sessions` links a request R to the earlier request P
whose hash chain R extends:

* ``exact``: all of P's ids are R's first ids (P ended on a full block, or R repeats P's prompt);
* ``rehash``: P's last block is partial, all of P's *other* ids are R's first ids and R is longer
  than P's full blocks: R filled P's partial block, which was re-hashed.

Among several such P, the one with the longest chain wins, then the latest. A link must share at
least one block beyond the trace's *common prefix* (ids that at least ``common_fraction`` of all
requests start with: in this trace block 0, the shared system prompt, in all 12,031 requests);
otherwise every request would extend every two-block request. A request without a parent starts
a session; a session is a parent's chain of children (a parent with several children, a fork,
keeps the earliest child in its session and starts a new session for each other one).
:class:`ChainReport` says how many sessions were found, how deep the chains are, and the gaps
between a parent's and its child's arrivals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core import resources
from loadgen.session import SessionPlan, TurnPlan
from loadgen.synth_text import TextSynth
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.jsonl import iter_json_objects
from loadgen.traces.replay import (
    ReplaySource,
    ReplayWorkload,
    gap_turn,
    in_window,
    reference_reply,
)

#: The shipped copy (Apache-2.0, see data/traces/SOURCES.md).
DEFAULT_TRACE = resources.shipped("traces", "conversation_trace.jsonl")
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MooncakeRequest:
    """One line of the trace: ``index`` (0-based line order), ``timestamp_ms``, token lengths and the
    prompt's block hash ids (``BLOCK_TOKENS`` tokens per block)."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def partial_last_block(self) -> bool:
        """True when the last block holds fewer than ``BLOCK_TOKENS`` tokens."""
        return self.input_length % BLOCK_TOKENS != 0


def load_mooncake(path: Path | str = DEFAULT_TRACE, *, limit: int | None = None) -> list[MooncakeRequest]:
    """Read the trace (at most ``limit`` requests, from the start), in line order.

    Raises:
        TraceFormatError: unreadable file, a line that is not a JSON object, a missing or
            mistyped field, decreasing timestamps, or a hash_ids count that is not
            ``ceil(input_length / 512)``; e.g. ``.../x.jsonl:17: hash_ids: expected 3 ids ...``.
    """
    path = Path(path)
    out: list[MooncakeRequest] = []
    for where, _, d in iter_json_objects(path):
        if limit is not None and len(out) >= limit:
            break
        for k in ("timestamp", "input_length", "output_length"):
            v = d.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TraceFormatError(f"{where}: {k}: expected an integer >= 0, got {v!r}")
        h = d.get("hash_ids")
        if not isinstance(h, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in h):
            raise TraceFormatError(f"{where}: hash_ids: expected a list of integers, got {h!r:.80}")
        need = -(-d["input_length"] // BLOCK_TOKENS)
        if len(h) != need:
            raise TraceFormatError(f"{where}: hash_ids: expected {need} ids for input_length "
                                   f"{d['input_length']} ({BLOCK_TOKENS}-token blocks), got {len(h)}")
        if out and d["timestamp"] < out[-1].timestamp_ms:
            raise TraceFormatError(f"{where}: timestamp: {d['timestamp']} is before the previous "
                                   f"line's {out[-1].timestamp_ms}")
        out.append(MooncakeRequest(len(out), d["timestamp"], d["input_length"], d["output_length"], tuple(h)))
    return out


@dataclass
class ChainReport:
    """What :func:`infer_sessions` found. Counts are requests or sessions; gaps are seconds.

    Attributes:
        requests: requests read.
        sessions: sessions inferred (a request without a parent starts one).
        multi_turn_sessions: sessions of 2 or more requests.
        linked: requests with a parent; ``links_exact`` + ``links_rehash`` of them.
        repeats: exact links whose request repeats its parent's prompt (same hash ids and input
            length): the same turn sent again (replayed as a ``retry``).
        ambiguous_links: links where more than one earlier request had the same chain (the latest won).
        forks: parents with more than one child (the later children start sessions of their own).
        forks_midchain: requests sharing blocks beyond the common prefix with an earlier one without
            extending any earlier request's chain (a branch inside someone's history); new sessions.
        common_only: requests that share nothing but the common prefix with any earlier request.
        common_prefix_ids: the hash ids treated as the trace-wide common prefix.
        turns_per_session: Counter of session length (requests) -> sessions.
        max_chain_depth: longest parent chain (a session of n requests has depth n - 1).
        gaps_s: arrival(child) - arrival(parent) for every link, seconds (in link order).
        new_tokens: child input_length - (parent input_length + parent output_length) per link.
    """

    requests: int = 0
    sessions: int = 0
    multi_turn_sessions: int = 0
    linked: int = 0
    links_exact: int = 0
    links_rehash: int = 0
    repeats: int = 0
    ambiguous_links: int = 0
    forks: int = 0
    forks_midchain: int = 0
    common_only: int = 0
    common_prefix_ids: tuple[int, ...] = ()
    turns_per_session: Counter = field(default_factory=Counter)
    max_chain_depth: int = 0
    gaps_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    new_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))

    def summary(self) -> str:
        """A few human-readable lines (percentiles: numpy's linear interpolation)."""
        lines = [
            (f"{self.requests} requests -> {self.sessions} sessions ({self.multi_turn_sessions} with 2+ turns); "
             f"{self.linked} links ({self.links_exact} exact of which {self.repeats} repeat the parent's prompt, "
             f"{self.links_rehash} re-hashed partial block, "
             f"{self.ambiguous_links} ambiguous), {self.forks} forks, {self.forks_midchain} mid-chain branches, "
             f"{self.common_only} sharing only the common prefix {list(self.common_prefix_ids)}"),
            (f"turns per session: {dict(sorted(self.turns_per_session.items()))}; "
             f"max chain depth {self.max_chain_depth}"),
        ]
        if self.gaps_s.size:
            p = np.percentile(self.gaps_s, [5, 25, 50, 75, 95, 99])
            lines.append("parent->child arrival gap s: " + " ".join(
                f"{n} {v:.0f}" for n, v in zip(("p5", "p25", "p50", "p75", "p95", "p99"), p, strict=True))
                + f" max {self.gaps_s.max():.0f}")
            nt = self.new_tokens
            lines.append(f"child input - (parent input + output), tokens: p50 {np.percentile(nt, 50):.0f}, "
                         f"negative in {int((nt < 0).sum())} of {nt.size} links")
        return "\n".join(lines)


@dataclass(frozen=True)
class MooncakeSession:
    """One inferred session: the requests' indices in order (each the previous one's child)."""

    requests: tuple[int, ...]


def common_prefix(requests: list[MooncakeRequest], common_fraction: float = 0.5) -> tuple[int, ...]:
    """The longest run of leading hash ids that at least ``common_fraction`` of requests start with."""
    if not requests:
        return ()
    prefix: list[int] = []
    pos = 0
    while True:
        c = Counter(r.hash_ids[pos] for r in requests if len(r.hash_ids) > pos and
                    list(r.hash_ids[:pos]) == prefix)
        if not c:
            break
        hid, n = c.most_common(1)[0]
        if n < common_fraction * len(requests):
            break
        prefix.append(hid)
        pos += 1
    return tuple(prefix)


def infer_sessions(requests: list[MooncakeRequest], common_fraction: float = 0.5
                   ) -> tuple[list[MooncakeSession], dict[int, int], ChainReport]:
    """Link each request to the earlier one whose hash chain it extends (see the module doc).

    Returns:
        ``(sessions, parent, report)``: sessions ordered by their first request, ``parent`` maps a
        child request index to its parent's, and the :class:`ChainReport`.
    """
    common = common_prefix(requests, common_fraction)
    ncommon = len(common)
    full_chain: dict[tuple[int, ...], list[int]] = {}    # a request's whole chain -> requests
    partial_head: dict[tuple[int, ...], list[int]] = {}  # chain without a partial last block -> requests
    seen: set[int] = set()
    parent: dict[int, int] = {}
    rep = ChainReport(requests=len(requests), common_prefix_ids=common)
    gaps: list[float] = []
    new_tokens: list[int] = []
    children: Counter = Counter()
    by_index = {r.index: r for r in requests}
    for r in requests:
        h = r.hash_ids
        k = 0
        while k < len(h) and h[k] in seen:
            k += 1
        # the longest earlier chain that R extends: an exact chain of m <= k ids, or the full part
        # (m - 1 <= k ids) of a chain whose partial last block R re-hashed
        found = None
        for m in range(min(k, len(h)), ncommon, -1):
            key = tuple(h[:m])
            if key in full_chain:
                found = ("exact", full_chain[key])
                break
            if m < len(h) and key in partial_head:
                found = ("rehash", partial_head[key])
                break
        if found is not None:
            kind, cands = found
            p = cands[-1]
            parent[r.index] = p
            children[p] += 1
            rep.linked += 1
            rep.links_exact += kind == "exact"
            rep.links_rehash += kind == "rehash"
            rep.ambiguous_links += len(cands) > 1
            pr = by_index[p]
            rep.repeats += pr.hash_ids == r.hash_ids and pr.input_length == r.input_length
            gaps.append((r.timestamp_ms - pr.timestamp_ms) / 1000.0)
            new_tokens.append(r.input_length - pr.input_length - pr.output_length)
        elif k > ncommon:
            rep.forks_midchain += 1
        else:
            rep.common_only += 1
        full_chain.setdefault(h, []).append(r.index)
        if r.partial_last_block:
            partial_head.setdefault(h[:-1], []).append(r.index)
        seen.update(h)

    # sessions: follow each parent's first child; later children start sessions of their own
    first_child: dict[int, int] = {}
    for c in sorted(parent):
        first_child.setdefault(parent[c], c)
    rep.forks = sum(1 for n in children.values() if n > 1)
    sessions: list[MooncakeSession] = []
    for r in requests:
        i = r.index
        if i in parent and first_child[parent[i]] == i:
            continue  # continues its parent's session
        chain = [i]
        while chain[-1] in first_child:
            chain.append(first_child[chain[-1]])
        sessions.append(MooncakeSession(tuple(chain)))
    rep.sessions = len(sessions)
    rep.turns_per_session = Counter(len(s.requests) for s in sessions)
    rep.multi_turn_sessions = sum(1 for s in sessions if len(s.requests) > 1)
    depth: dict[int, int] = {}
    for r in requests:
        depth[r.index] = depth[parent[r.index]] + 1 if r.index in parent else 0
    rep.max_chain_depth = max(depth.values(), default=0)
    rep.gaps_s = np.asarray(gaps, dtype=float)
    rep.new_tokens = np.asarray(new_tokens, dtype=int)
    return sessions, parent, rep


if __name__ == "__main__":  # python -m loadgen.traces.mooncake [file]: print the chain report
    import sys

    reqs = load_mooncake(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TRACE)
    print(infer_sessions(reqs)[2].summary())


def plan_mooncake(src: ReplaySource, si: int, w: ReplayWorkload, synth: TextSynth, time_scale: float) -> list[SessionPlan]:
    """Sessions of the Mooncake trace (see :mod:`loadgen.traces.mooncake`), text per hash block."""

    reqs = load_mooncake(src.path or DEFAULT_TRACE)
    sessions, _, _ = infer_sessions(reqs)
    s = src.token_scale
    block = max(1, round(BLOCK_TOKENS * s))
    name = src.name or "trace-mooncake"
    plans: list[SessionPlan] = []
    for sess in sessions:
        if src.sessions is not None and len(plans) >= src.sessions:
            break
        rs = [reqs[i] for i in sess.requests][: src.max_turns]
        t0 = rs[0].timestamp_ms / 1000.0
        if len(rs) < src.min_turns or not in_window(t0, src):
            continue
        sid = f"m{si}-{len(plans):05d}-r{rs[0].index}"
        turns: list[TurnPlan] = []
        prev_in = prev_out = 0
        for k, r in enumerate(rs):
            cap = len(r.hash_ids) * block
            n_in = min(max(1, round(r.input_length * s)), cap)
            n_out = max(1, round(r.output_length * s))
            # the trace repeats the parent's prompt: the same turn sent again (a retry)
            repeat = k > 0 and r.hash_ids == rs[k - 1].hash_ids and r.input_length == rs[k - 1].input_length
            if k == 0:
                text = synth.chain_text(r.hash_ids, 0, n_in, block)
            elif repeat:
                text = ""
            else:
                a = prev_in + prev_out
                if n_in - a >= src.min_new_tokens:
                    text = synth.chain_text(r.hash_ids, a, n_in, block)
                else:  # the trace's child is shorter than parent + output: append the minimum
                    text = synth.text(src.min_new_tokens, f"{sid}/{k}/new")
            msg = [{"role": "user", "content": text}]
            ref = reference_reply(synth.text(n_out, f"{sid}/{k}/ref"))
            if k == 0:
                turns.append(TurnPlan(msg, ref, max_tokens=n_out))
                prev_in, prev_out = n_in, n_out
                continue
            gap = (r.timestamp_ms - rs[k - 1].timestamp_ms) / 1000.0
            kind, gkind = gap_turn(gap, w.ttl_s)
            if repeat:
                kind, msg = "retry", []
            if src.replay_timestamps:
                turns.append(TurnPlan(msg, ref, 0.0, gkind, kind, max_tokens=n_out,
                                      at_s=(r.timestamp_ms / 1000.0 - t0) * time_scale))
            else:
                turns.append(TurnPlan(msg, ref, gap * time_scale, gkind, kind, max_tokens=n_out))
            prev_in, prev_out = n_in, n_out
        start = (t0 - src.start_s) * time_scale if src.replay_timestamps else None
        plans.append(SessionPlan(sid, f"mooncake:r{rs[0].index}", turns, archetype=name, start_at_s=start))
    return plans


def empirical_values(field: str) -> tuple[float, ...]:
    """The values of ``field`` in the shipped trace, for a workload's ``kind: empirical`` distribution
    (``loadgen.workload.empirical_values``): per request ``input_length``/``output_length`` (tokens);
    per inferred link ``gap_s`` (parent -> child arrival, seconds) and ``new_tokens`` (child input -
    parent input - parent output); per inferred session ``turns``."""
    reqs = load_mooncake()
    if field in ("input_length", "output_length"):
        return tuple(float(getattr(r, field)) for r in reqs)
    sessions, _, rep = infer_sessions(reqs)
    if field == "gap_s":
        return tuple(rep.gaps_s.tolist())
    if field == "new_tokens":
        return tuple(float(x) for x in rep.new_tokens)
    return tuple(float(len(s.requests)) for s in sessions)
