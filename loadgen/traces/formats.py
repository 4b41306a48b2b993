"""The one place trace formats are registered: each :class:`TraceFormat` names how a file of it is
recognised, read and replayed, and every part finds it here (``turnscope traffic`` and ``turnscope
plan`` stream :class:`~loadgen.traces.agent_request.AgentRequest` records; a workload's ``traces:``
entry is checked before a run and replayed as session plans; :func:`detect_format` picks a format
from a path).

Readers are named ``"module:function"`` and imported when first used, so reading one format never
imports the others (nor the workload planner, which imports this module). Adding a format is its
reader module plus one :func:`register` call below (docs/design.md).

What each format gives (see its reader module):

* ``kv_cache_tester`` / ``tracelab`` / ``run``: :mod:`loadgen.traces.kv_cache_tester`,
  :mod:`loadgen.traces.tracelab`, :mod:`loadgen.traces.recorded_runs` (the store's recorded runs);
* ``mooncake``: sessions inferred from the hash chains (:mod:`loadgen.traces.mooncake`,
  :func:`loadgen.traces.agent_sources.mooncake_requests`);
* ``azure``: every row a one-request session (the trace has no session ids);
* ``taubench``, ``vllm_multiturn``: full conversation text, replayed only (no request stream).

Detection (:func:`detect_format`), in registration order: a directory holding ``turnscope.duckdb``
is a store (``run``); ``.csv`` is Azure; another directory, a multi-line JSON file or a ``.json``
object with ``requests`` is kv-cache-tester; a ``.jsonl`` whose first line has ``hash_ids`` and
``timestamp`` is Mooncake, one with ``session_id`` and ``round_index`` is TraceLab.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from loadgen.traces.agent_request import AgentRequest
from loadgen.traces.errors import TraceFormatError

#: Bytes of a file read to recognise its format.
SNIFF_BYTES = 1 << 16


class Sniff:
    """What detection looks at in ``path``: whether it is a directory, its suffix, and (read on first
    use, at most :data:`SNIFF_BYTES`) whether it starts with a JSON object and that first line's object.

    Raises TraceFormatError (from :attr:`head`) when the file cannot be read as text."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.is_dir = path.is_dir()
        self.suffix = path.suffix.lower()

    @cached_property
    def head(self) -> str:
        """The file's first bytes, leading whitespace stripped."""
        try:
            with self.path.open(encoding="utf-8") as fh:
                return fh.read(SNIFF_BYTES).lstrip()
        except (OSError, UnicodeDecodeError) as e:
            raise TraceFormatError(f"{self.path}: cannot read the trace: {e}") from e

    @property
    def is_json_object(self) -> bool:
        """The file starts with ``{``."""
        return not self.is_dir and self.head[:1] == "{"

    @cached_property
    def first_object(self) -> dict[str, Any] | None:
        """The JSON object on the file's first line; None when that line is not one whole object."""
        if not self.is_json_object:
            return None
        try:
            d = json.loads(self.head.split("\n", 1)[0])
        except json.JSONDecodeError:
            return None
        return d if isinstance(d, dict) else None

    def first_has(self, *keys: str) -> bool:
        """The first line's object has every one of ``keys``."""
        d = self.first_object
        return d is not None and all(k in d for k in keys)


@dataclass(frozen=True)
class TraceFormat:
    """One trace format. ``name``: what ``--format`` and a workload's ``traces[].format`` call it.
    ``detect``: whether a path is of this format (None: never picked by detection). ``requests``:
    ``"module:function"`` streaming the path's AgentRequests (None: replay only). ``check``:
    ``"module:function"`` reading a whole trace file (called with the path, or with no argument
    for the shipped default) so a run fails before it starts. ``replay``: ``"module:function"``
    planning a workload's trace source as sessions (``loadgen.workload.plan_trace``'s arguments);
    None: not replayable by a workload. ``shipped``: a copy is shipped (``check`` and ``replay`` read
    it when no path is given); False: a workload's ``traces:`` entry must name a path.
    ``empirical``: ``"module:function"`` giving the values of one of ``empirical_fields`` in the
    shipped copy (a workload's ``kind: empirical`` distribution with ``trace: <name>``); None: none.
    ``clock``: :data:`SHARED_CLOCK` (every session of a file on one timeline: the trace records its
    own load) or :data:`OWN_CLOCK` (each file one session tree from t = 0: the load is the
    operator's input, ``planner.load``). ``sessions``: the format says which requests
    belong to one session (False: every row is its own one-request session, reuse unknown)."""

    name: str
    detect: Callable[[Sniff], bool] | None = None
    requests: str | None = None
    check: str | None = None
    replay: str | None = None
    shipped: bool = True
    empirical: str | None = None
    empirical_fields: tuple[str, ...] = ()
    clock: str = "shared"
    sessions: bool = True


#: A format whose files put every session on one timeline (the trace records its load).
SHARED_CLOCK = "shared"
#: A format whose every file is one session tree on its own clock from t = 0 (no recorded load).
OWN_CLOCK = "own"

_FORMATS: dict[str, TraceFormat] = {}


def register(fmt: TraceFormat) -> TraceFormat:
    """Add ``fmt`` to the registry (detection tries formats in registration order).
    Raises ValueError if its name is taken."""
    if fmt.name in _FORMATS:
        raise ValueError(f"trace format {fmt.name!r} is registered twice")
    _FORMATS[fmt.name] = fmt
    return fmt


def resolve(ref: str) -> Callable[..., Any]:
    """The function a ``"module:function"`` reference names (its module imported now)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


#: The format of a turnscope store's recorded runs (a directory holding ``turnscope.duckdb``).
RECORDED_RUNS = "run"

register(TraceFormat(RECORDED_RUNS, detect=lambda s: s.is_dir and (s.path / "turnscope.duckdb").exists(),
                     requests="loadgen.traces.recorded_runs:iter_recorded_runs"))
register(TraceFormat("azure", detect=lambda s: not s.is_dir and s.suffix == ".csv",
                     requests="loadgen.traces.agent_sources:azure_requests",
                     check="loadgen.traces.azure:load_azure", replay="loadgen.traces.azure:plan_azure",
                     empirical="loadgen.traces.azure:empirical_values",
                     empirical_fields=("context_tokens", "generated_tokens", "interarrival_s"), sessions=False))
register(TraceFormat("kv_cache_tester",
                     detect=lambda s: s.is_dir or (s.is_json_object and (s.first_object is None
                                                                           or "requests" in s.first_object)),
                     requests="loadgen.traces.kv_cache_tester:iter_kv_cache_tester",
                     check="loadgen.traces.kv_cache_tester:read_kv_cache_tester",
                     replay="loadgen.traces.kv_cache_tester:plan_kv_cache_tester", clock=OWN_CLOCK))
register(TraceFormat("mooncake", detect=lambda s: s.first_has("hash_ids", "timestamp"),
                     requests="loadgen.traces.agent_sources:mooncake_requests",
                     check="loadgen.traces.mooncake:load_mooncake", replay="loadgen.traces.mooncake:plan_mooncake",
                     empirical="loadgen.traces.mooncake:empirical_values",
                     empirical_fields=("input_length", "output_length", "gap_s", "turns", "new_tokens")))
register(TraceFormat("tracelab", detect=lambda s: s.first_has("session_id", "round_index"),
                     requests="loadgen.traces.tracelab:read_tracelab"))
register(TraceFormat("taubench", check="loadgen.traces.taubench:load_taubench",
                     replay="loadgen.traces.taubench:plan_taubench"))
register(TraceFormat("vllm_multiturn", check="loadgen.traces.vllm_multiturn:load_vllm_multiturn",
                     replay="loadgen.traces.vllm_multiturn:plan_vllm_multiturn", shipped=False))

#: Formats whose requests stream to ``turnscope traffic`` and ``turnscope plan`` (``--format``).
REQUEST_FORMATS: tuple[str, ...] = tuple(f.name for f in _FORMATS.values() if f.requests)
#: Formats a workload's ``traces:`` entry can replay (``loadgen.workload.TraceSource.format``).
REPLAY_FORMATS: tuple[str, ...] = tuple(f.name for f in _FORMATS.values() if f.replay)
#: Formats whose shipped copy a workload's ``kind: empirical`` distribution can resample (``trace:``).
EMPIRICAL_TRACES: tuple[str, ...] = tuple(f.name for f in _FORMATS.values() if f.empirical)
#: Every registered format, in registration order.
FORMATS: tuple[str, ...] = tuple(_FORMATS)


def trace_format(name: str) -> TraceFormat:
    """The registered format called ``name``. Raises TraceFormatError naming the known formats."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise TraceFormatError(f"format {name!r} is not one of {', '.join(_FORMATS)}") from None


def detect_format(path: Path | str) -> str:
    """The format of ``path``: the first registered format whose ``detect`` accepts it (see the
    module doc).

    Raises:
        TraceFormatError: the path does not exist, cannot be read, or its format is not recognised;
            the message names the path and the formats (and ``--format``).
    """
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"{p}: no such file or directory")
    sniff = Sniff(p)
    for fmt in _FORMATS.values():
        if fmt.detect is not None and fmt.detect(sniff):
            return fmt.name
    raise TraceFormatError(f"{p}: format not recognised (expected one of {', '.join(REQUEST_FORMATS)}); "
                           f"name it with --format")


def iter_agent_requests(path: Path | str, format: str | None = None) -> Iterator[AgentRequest]:
    """Stream the requests of ``path`` read as ``format`` (default: :func:`detect_format`).

    Raises:
        TraceFormatError: unknown format, one without a request stream, undetectable or malformed
            file (the reader's message).
        FileNotFoundError: ``run`` on a directory without a store.
    """
    p = Path(path)
    name = format or detect_format(p)
    fmt = _FORMATS.get(name)
    if fmt is None or fmt.requests is None:
        raise TraceFormatError(f"{p}: format {name!r} is not one of {', '.join(REQUEST_FORMATS)}")
    return iter(resolve(fmt.requests)(p))


def check_trace(name: str, path: str | None) -> None:
    """Read the whole trace ``path`` (None: the format's shipped default) of format ``name``, as a
    run would, and drop it. Raises TraceFormatError (the reader's message) or FileNotFoundError."""
    reader = resolve(trace_format(name).check)
    reader(path) if path else reader()
