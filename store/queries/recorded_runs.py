"""The turns of recorded runs read back as a trace (``loadgen.traces.recorded_runs``: the
``run`` format of ``turnscope traffic`` and ``turnscope plan``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import duckdb

_SQL = """
SELECT run_id, session_id, turn_index, arrival_s, input_tokens, output_tokens, shared_prefix_tokens, e2e_s,
       measured_gap_s, gap_before_s, gap_kind, lag(arrival_s) OVER s AS prev_arrival_s, ttft_s
FROM (
    SELECT run_id, session_id, turn_index,
           epoch(sent_at) - epoch(min(sent_at) OVER (PARTITION BY run_id)) AS arrival_s,
           coalesce(prompt_tokens, 0) AS input_tokens,
           coalesce(completion_tokens, 0) AS output_tokens,
           coalesce(expected_reusable_tokens, 0) AS shared_prefix_tokens,
           e2e_s, ttft_s,
           epoch(sent_at) - epoch(lag(sent_at) OVER s) - lag(e2e_s) OVER s AS measured_gap_s,
           gap_before_s, gap_kind
    FROM turns
    WHERE sent_at IS NOT NULL {where}
    WINDOW s AS (PARTITION BY run_id, session_id ORDER BY turn_index)
)
WINDOW s AS (PARTITION BY run_id, session_id ORDER BY turn_index)
ORDER BY run_id, arrival_s, session_id, turn_index
"""


def turn_batches(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str] | None = None,
                 batch_rows: int = 10_000) -> Iterator[list[tuple]]:
    """The turns of `run_ids` (None: every run; an unknown id gives nothing), streamed in batches of
    at most `batch_rows` rows, by run, then arrival, session and turn. Each row: run_id,
    session_id, turn_index, arrival_s (seconds since the run's first send), input_tokens,
    output_tokens, shared_prefix_tokens (the client's expected reusable tokens), e2e_s (seconds,
    None when not recorded), measured_gap_s (the previous turn's end to this send, s), gap_before_s
    (planned, s), gap_kind, prev_arrival_s (None for a session's first turn), ttft_s (the recorded
    TTFT, s; None when not recorded)."""
    where, params = "", []
    if run_ids is not None:
        where = f"AND run_id IN ({', '.join('?' for _ in run_ids)})" if run_ids else "AND false"
        params = list(run_ids)
    cur = con.execute(_SQL.format(where=where), params)
    while batch := cur.fetchmany(batch_rows):
        yield batch
