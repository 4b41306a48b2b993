"""Reading a JSON-lines trace file: one JSON object per non-blank line, errors that name the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from loadgen.traces.errors import TraceFormatError


def iter_json_objects(path: Path, what: str = "a JSON object") -> Iterator[tuple[str, int, dict]]:
    """Yield ``(where, lineno, object)`` for each non-blank line of ``path``; ``where`` is
    ``"<path>:<lineno>"`` for the caller's own field errors. Lines are 1-based.

    Raises:
        TraceFormatError: the file cannot be read, a line is not JSON (column and message named),
            or a line is not a JSON object (``what`` says what was expected).
    """
    try:
        fh = path.open(encoding="utf-8")
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read the trace: {e}") from e
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(f"{where}: not valid JSON: column {e.colno}: {e.msg}") from e
            if not isinstance(d, dict):
                raise TraceFormatError(f"{where}: expected {what}, got {type(d).__name__}")
            yield where, lineno, d
