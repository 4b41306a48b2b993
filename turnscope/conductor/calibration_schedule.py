"""The calibration run's schedule: which sessions it sends, to which mode, in which order
(``turnscope calibrate``, docs/planner/calibration.md).

A **point** is one two-turn session: turn 0 is ``prefix_tokens`` tokens of fresh content (a full
prefill: the session has a ``cache_salt`` of its own, so no prefix cache holds it), turn 1 appends
``extra_tokens`` new tokens to turn 0's prompt and reply (in a bidirectional mode P pulls turn 0's
KV from D and computes the rest; in the aggregated worker and a P with its prefix cache on, its own
cache holds it; in ``pd-nocache`` everything is computed again). Points are sent as ``token_ids``
or, for the chat render's cost, as ``text`` history.

The order: ``repeats`` blocks, each holding every point once, in an order shuffled by numpy's
``Generator.permutation`` seeded with ``seed`` (one generator for the whole schedule, so each block
has its own order and the same seed gives the same schedule). Each point is sent to every mode, the
modes strictly alternated (``A B C A B C ...``: no two consecutive sends to one mode), block ``b``
starting with mode ``b mod len(modes)`` so that no mode always goes first. A slow minute of a shared
machine thus falls on every mode and every length alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Prompt-template and reply allowance (tokens) kept free below the model's length limit: the chat
#: template's tokens around two user messages and the generation prompt (16 with the embedded
#: tokenizer's ChatML) with room to spare.
TEMPLATE_ALLOWANCE = 64


@dataclass(frozen=True)
class CalPoint:
    """One two-turn session (tokens of content, excluding the chat template's): ``prefix_tokens``
    in turn 0, ``extra_tokens`` more in turn 1; ``history`` ``token_ids`` or ``text``; ``repeat``
    (the block it belongs to)."""

    prefix_tokens: int
    extra_tokens: int
    history: str
    repeat: int

    @property
    def session_id(self) -> str:
        """Unique within a run: ``cal-p<prefix>-e<extra>-r<repeat>``."""
        return f"cal-p{self.prefix_tokens}-e{self.extra_tokens}-r{self.repeat}"


@dataclass(frozen=True)
class Send:
    """One point sent to one mode, in block ``block`` (the speed probes bracket each block)."""

    block: int
    mode: str
    point: CalPoint


def default_lengths(max_model_len: int, max_tokens: int, smallest: int = 128) -> list[int]:
    """Turn-0 prompt lengths from ``smallest`` doubling up to the model's limit, the last one the
    longest whose turn 1 (plus 128 extra tokens and the reply) still fits ``max_model_len``
    (tokens), e.g. 128, 256, ..., 4096, 7936 for 8,192 and 16-token replies."""
    top = max_model_len - 2 * max_tokens - 128 - TEMPLATE_ALLOWANCE
    top -= top % 128
    out, x = [], smallest
    while x < top:
        out.append(x)
        x *= 2
    return out + [top] if top >= smallest else out


def points(lengths: Sequence[int], extras: Sequence[int], text_lengths: Sequence[int], repeat: int,
           max_model_len: int, max_tokens: int) -> list[CalPoint]:
    """The points of one block: every (length, extra) as ``token_ids`` and every (text length,
    smallest extra) as ``text``, leaving out a session whose turn 1 would not fit
    ``max_model_len`` (prefix + extra + two replies + :data:`TEMPLATE_ALLOWANCE`)."""
    def fits(p: int, e: int) -> bool:
        return p + e + 2 * max_tokens + TEMPLATE_ALLOWANCE <= max_model_len

    out = [CalPoint(p, e, "token_ids", repeat) for p in lengths for e in extras if fits(p, e)]
    out += [CalPoint(p, min(extras), "text", repeat) for p in text_lengths if fits(p, min(extras))]
    return out


def schedule(modes: Sequence[str], block_points: Sequence[Sequence[CalPoint]], seed: int) -> list[list[Send]]:
    """The sends, block by block (see the module doc): block b's points in a seeded shuffled order,
    each sent to every mode, modes in the cyclic order starting at ``modes[b % len(modes)]``.
    Raises ValueError for no modes or a mode named twice."""
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"modes must be distinct and at least one, got {list(modes)}")
    rng = np.random.default_rng(seed)
    blocks = []
    for b, pts in enumerate(block_points):
        k = b % len(modes)
        order = list(modes[k:]) + list(modes[:k])
        blocks.append([Send(b, m, pts[int(i)]) for i in rng.permutation(len(pts)) for m in order])
    return blocks
