"""The proxy's facts reach the store once, from one place, as numbers (loadgen/session_recorder.py,
core.contract.response_facts): every fact the proxy sends has a ``turns`` column, the in-band
value is stored as the proxy had it (not re-parsed from a header's rounded text), and a stream that
ended before its facts keeps what the headers said."""

from __future__ import annotations

import datetime as dt

from core.contract import (
    DECODE_ENGINE_HEADER,
    PREFILL_ENGINE_HEADER,
    PREFILL_MS_HEADER,
    PUBLIC_FACT_KEYS,
    REUSE_HEADER,
    response_facts,
)
from loadgen.session import TurnPlan
from loadgen.session_recorder import FACT_COLUMNS, turn_row
from loadgen.stream_client import TurnResult
from store.writer import load_schema

#: Distinct values for every fact, as the proxy would send them (none equal to another).
FACTS = {"reuse": "hit", "prefill_cached_tokens": 16, "remote_tokens": 448, "reused_tokens": 432,
         "recomputed_tokens": 21, "handle_age_s": 3.25, "divergence_position": 453,
         "prefill_leg_s": 0.0123456789, "prefill_attempts": 2, "handle_tokens": 470}
#: The headers the proxy sent before the stream for those facts (the leg rounded to 1 us, ms).
HEADERS = {REUSE_HEADER: "hit", PREFILL_MS_HEADER: "12.346", PREFILL_ENGINE_HEADER: "prefill-0",
           DECODE_ENGINE_HEADER: "decode-0"}


def _row(headers: dict, facts: dict) -> dict:
    result = TurnResult(sent_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC), status="ok", headers=headers,
                        proxy_facts=facts)
    return turn_row(run_id="r", session_id="s", turn_index=1, plan=TurnPlan(new_messages=[], reference_reply={}), result=result,
                    gap_before_s=0.0, prompt_ids=None, expected_reusable_tokens=None, divergence_position=7)


def test_every_fact_the_proxy_sends_has_a_turns_column() -> None:
    assert sorted(FACT_COLUMNS) == sorted(PUBLIC_FACT_KEYS) == sorted(FACTS)
    turns = {c.name for c in load_schema().tables["turns"].columns}
    assert set(FACT_COLUMNS.values()) <= turns


def test_the_in_band_facts_are_stored_as_sent() -> None:
    row = _row(HEADERS, FACTS)
    assert {key: row[column] for key, column in FACT_COLUMNS.items()} == FACTS
    assert row["prefill_leg_s"] == 0.0123456789           # the proxy's float, not 12.346 ms / 1000
    assert row["divergence_position"] == 7                # the client's own, beside the proxy's
    assert (row["prefill_engine"], row["decode_engine"]) == ("prefill-0", "decode-0")


def test_a_stream_that_ended_before_its_facts_keeps_the_headers() -> None:
    row = _row(HEADERS, {})
    assert row["reuse"] == "hit"
    assert row["prefill_leg_s"] == 12.346 / 1000
    assert row["prefill_attempts"] is None and row["reused_tokens"] is None


def test_response_facts_ignores_what_is_no_fact_and_a_leg_that_is_no_number() -> None:
    facts = response_facts({PREFILL_MS_HEADER: "n/a"}, {"reuse": "hit", "stray": 1})
    assert facts == {"prefill_engine": None, "decode_engine": None, "reuse": "hit", "prefill_leg_s": None}
