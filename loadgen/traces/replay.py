"""What every trace format's replay planning shares: the interfaces of a workload's trace source
and of the workload itself (so a reader's ``plan_<format>`` depends on no planner), seeded draws,
the reference reply, the source's window, a gap's turn kind, and conversations as session plans.

Each format's ``plan_<format>(src, si, w, synth, time_scale) -> list[SessionPlan]`` lives beside its
reader (``loadgen/traces/<format>.py``) and is registered as the format's ``replay``
(``loadgen/traces/formats.py``); ``loadgen.workload.plan_trace`` calls it (docs/design.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from loadgen.session import SessionPlan, TurnPlan, plan_from_conversation
from loadgen.synth_text import TextSynth


class ReplaySource(Protocol):
    """A workload's ``traces[]`` entry as replay planning reads it (``loadgen.workload.TraceSource``;
    docs/workloads.md): seconds, tokens and counts as there."""

    format: str
    path: Any
    name: str | None
    sessions: int | None
    min_turns: int
    max_turns: int | None
    start_s: float
    duration_s: float | None
    token_scale: float
    replay_timestamps: bool
    min_new_tokens: int
    output_tokens: Any
    gaps: dict[str, Any]


class ReplayWorkload(Protocol):
    """What replay planning reads of the workload (``loadgen.workload.Workload``): its seed and
    the TTL (seconds) past which a gap makes a resume."""

    seed: int
    ttl_s: float


def seeded_rng(*parts: int) -> np.random.Generator:
    """A generator seeded by ``parts`` (each taken mod 2**32): the same draws for the same parts."""
    return np.random.default_rng(np.random.SeedSequence([int(x) & 0xFFFFFFFF for x in parts]))


def reference_reply(text: str) -> dict[str, Any]:
    """The reference assistant message of a planned turn (what the recorded session answered)."""
    return {"role": "assistant", "content": text}


def in_window(t_s: float, src: ReplaySource) -> bool:
    """Whether ``t_s`` (seconds on the trace's clock) lies in the source's window."""
    return t_s >= src.start_s and (src.duration_s is None or t_s < src.start_s + src.duration_s)


def gap_turn(gap_s: float, ttl_s: float) -> tuple[str, str]:
    """``(turn kind, gap kind)`` of a turn after ``gap_s`` seconds: a resume past ``ttl_s``, else a turn."""
    return ("resume", "pause") if gap_s > ttl_s else ("turn", "think")


def plan_conversations(convs: list[Any], src: ReplaySource, si: int, prefix: str, w: ReplayWorkload,
                       synth: TextSynth, time_scale: float, reply_tokens: bool) -> list[SessionPlan]:
    """Session plans of recorded conversations (tau-bench, vLLM multi-turn): their text, each turn's
    output tokens from ``src.output_tokens`` (or the reply's own count with ``reply_tokens``) and
    gaps drawn from ``src.gaps``; a gap past ``w.ttl_s`` makes a resume."""
    name = src.name or f"trace-{src.format}"
    plans: list[SessionPlan] = []
    for j, conv in enumerate(convs):
        if src.sessions is not None and len(plans) >= src.sessions:
            break
        if conv.turn_count < src.min_turns:
            continue
        rng = seeded_rng(w.seed, 3 + si, j)
        base = plan_from_conversation(conv, session_id=f"{prefix}{si}-{len(plans):05d}-{conv.id}", archetype=name)
        turns = []
        for k, tp in enumerate(base.turns):
            if src.output_tokens is not None:
                out: int | None = src.output_tokens.sample_int(rng, low=1)
            elif reply_tokens:
                (out,) = synth.counter.count([tp.reference_reply.get("content") or ""])
                out = max(out, 1)
            else:
                out = None
            gap = 0.0
            kind = "turn"
            gkind = tp.gap_kind
            if k > 0:
                dist = src.gaps.get(tp.gap_kind) if tp.gap_kind in ("tool", "think") else None
                gap = max(dist.sample(rng), 0.0) if dist is not None else 0.0
                if gap > w.ttl_s:
                    kind, gkind = "resume", "pause"
            turns.append(TurnPlan(tp.new_messages, tp.reference_reply, gap * time_scale, gkind, kind,
                                  max_tokens=out))
        plans.append(SessionPlan(base.session_id, base.source, turns, archetype=name))
    return plans
