"""Any supported trace (or the store's recorded runs) as a stream of :class:`AgentRequest`.

Formats (``FORMATS``) and what they give:

* ``kv_cache_tester`` / ``tracelab`` / ``run``: see :mod:`loadgen.traces.kv_cache_tester`,
  :mod:`loadgen.traces.tracelab`, :mod:`loadgen.traces.recorded_runs`;
* ``mooncake``: sessions inferred from the hash chains (:func:`loadgen.traces.mooncake.infer_sessions`);
  shared prefix = common leading 512-token hash ids with the session's previous request x 512,
  capped by both prompts' lengths; no server time, so ``gap_s`` is the arrival-to-arrival upper
  bound of the idle time, ``gap_estimated`` True (docs/workloads.md, "Gaps");
* ``azure``: every row a one-request session (the trace has no session ids).

:func:`detect_format` picks the format from the path: a directory holding ``turnscope.duckdb``
is a store (``run``); another directory is kv-cache-tester traces; ``.csv`` is Azure; a ``.json``
object with ``requests`` is kv-cache-tester; a ``.jsonl`` whose first line has ``hash_ids`` and
``timestamp`` is Mooncake, one with ``session_id`` and ``round_index`` is TraceLab.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from loadgen.traces.agent_request import AgentRequest
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.kv_cache_tester import common_leading

FORMATS = ("kv_cache_tester", "tracelab", "mooncake", "azure", "run")


def detect_format(path: Path | str) -> str:
    """The format of ``path`` (see the module doc).

    Raises:
        TraceFormatError: the path does not exist or its format is not recognised; the message
            names the path and the formats (and ``--format``).
    """
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"{p}: no such file or directory")
    if p.is_dir():
        return "run" if (p / "turnscope.duckdb").exists() else "kv_cache_tester"
    if p.suffix.lower() == ".csv":
        return "azure"
    try:
        with p.open(encoding="utf-8") as fh:
            head = fh.read(1 << 16)
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{p}: cannot read the trace: {e}") from e
    first = head.lstrip()[:1]
    if first == "{":
        line = head.lstrip().split("\n", 1)[0]
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            d = None  # a multi-line JSON object: a kv-cache-tester file
        if d is None or "requests" in d:
            return "kv_cache_tester"
        if "hash_ids" in d and "timestamp" in d:
            return "mooncake"
        if "session_id" in d and "round_index" in d:
            return "tracelab"
    raise TraceFormatError(f"{p}: format not recognised (expected one of {', '.join(FORMATS)}); "
                           f"name it with --format")


def _mooncake(path: Path) -> Iterator[AgentRequest]:
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


def _azure(path: Path) -> Iterator[AgentRequest]:
    from loadgen.traces.azure import load_azure

    source = f"azure:{path.stem}"
    for r in load_azure(path):
        yield AgentRequest(source, f"z{r.index}", 0, r.arrival_s, r.context_tokens, r.generated_tokens)


def iter_agent_requests(path: Path | str, format: str | None = None) -> Iterator[AgentRequest]:
    """Stream the requests of ``path`` read as ``format`` (default: :func:`detect_format`).

    Raises:
        TraceFormatError: unknown format, undetectable or malformed file (the reader's message).
        FileNotFoundError: ``run`` on a directory without a store.
    """
    p = Path(path)
    fmt = format or detect_format(p)
    if fmt == "kv_cache_tester":
        from loadgen.traces.kv_cache_tester import iter_kv_cache_tester

        return iter_kv_cache_tester(p)
    if fmt == "tracelab":
        from loadgen.traces.tracelab import read_tracelab

        return iter(read_tracelab(p))
    if fmt == "mooncake":
        return _mooncake(p)
    if fmt == "azure":
        return _azure(p)
    if fmt == "run":
        from loadgen.traces.recorded_runs import iter_recorded_runs

        return iter_recorded_runs(p)
    raise TraceFormatError(f"{p}: format {fmt!r} is not one of {', '.join(FORMATS)}")
