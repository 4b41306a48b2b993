"""Mooncake and Azure traces as streams of :class:`AgentRequest` (the formats whose reader modules
give their own records; registered in :mod:`loadgen.traces.formats`).

* ``mooncake``: sessions inferred from the hash chains (:func:`loadgen.traces.mooncake.infer_sessions`);
  shared prefix = common leading 512-token hash ids with the session's previous request x 512,
  capped by both prompts' lengths; no server time, so ``gap_s`` is the arrival-to-arrival upper
  bound of the idle time, ``gap_estimated`` True (docs/workloads.md);
* ``azure``: every row a one-request session (the trace has no session ids).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from loadgen.traces.agent_request import AgentRequest
from loadgen.traces.kv_cache_tester import common_leading


def mooncake_requests(path: Path) -> Iterator[AgentRequest]:
    """The Mooncake trace ``path``'s requests, session by session (see the module doc)."""
    from loadgen.traces.mooncake import BLOCK_TOKENS, infer_sessions, load_mooncake

    reqs = load_mooncake(path)
    sessions, _, _ = infer_sessions(reqs)
    source = f"mooncake:{path.stem}"
    for s in sessions:
        sid = f"m{s.requests[0]}"
        prev = None
        prev_arrival = 0.0
        for k, i in enumerate(s.requests):
            r = reqs[i]
            arrival = r.timestamp_ms / 1000.0
            shared = 0
            gap = None
            if prev is not None:
                shared = min(r.input_length, prev.input_length,
                             common_leading(list(prev.hash_ids), list(r.hash_ids)) * BLOCK_TOKENS)
                gap = arrival - prev_arrival  # no server time: the start-to-start bound, estimated
            yield AgentRequest(source, sid, k, arrival, r.input_length, r.output_length,
                               shared_prefix_tokens=shared, gap_s=gap, gap_estimated=prev is not None)
            prev = r
            prev_arrival = arrival


def azure_requests(path: Path) -> Iterator[AgentRequest]:
    """The Azure trace ``path``'s rows, each a one-request session."""
    from loadgen.traces.azure import load_azure

    source = f"azure:{path.stem}"
    for r in load_azure(path):
        yield AgentRequest(source, f"z{r.index}", 0, r.arrival_s, r.context_tokens, r.generated_tokens)
