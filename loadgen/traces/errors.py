"""The one error every trace reader raises for a file it cannot read as its format."""

from __future__ import annotations


class TraceFormatError(ValueError):
    """A trace file is unreadable or not in the expected format.

    The message is one line naming the file, the line (or the request's position, e.g.
    ``requests[3].requests[0]``), the field and what was expected, e.g.
    ``trace_0282.json:1: timestamp: expected an integer >= 0, got None``. Entry points print it
    as is, without a traceback.
    """
