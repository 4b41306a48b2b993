"""Plain text for the CLI that reads the same in an 80-column terminal and in a log file.

Rich wraps long lines at spaces wherever they fall; a list such as ``hit=3, miss_no_handle=4``
then breaks mid-item and its continuation starts at column 0. `print_list` wraps on item
boundaries with a hanging indent, at the console's width (``COLUMNS``; 80 when the output is a
file or a pipe, Rich's default).
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console


def wrap_items(head: str, items: Iterable[str], width: int, sep: str = ", ") -> list[str]:
    """`head` followed by `items` joined with `sep`, as lines of at most `width` characters where
    possible: a line breaks only between items, continuation lines are indented to the first
    item's column (or 4 spaces when `head` is wider than half the width). An item longer than a
    line gets a line of its own, unbroken."""
    items = list(items)
    indent = " " * (len(head) if len(head) <= width // 2 else 4)
    lines: list[str] = []
    line = head
    first_on_line = True
    for i, item in enumerate(items):
        piece = item + (sep.rstrip() if i < len(items) - 1 else "")
        candidate = piece if first_on_line else " " + piece
        if not first_on_line and len(line) + len(candidate) > width:
            lines.append(line)
            line, candidate = indent, piece
        line += candidate
        first_on_line = False
    lines.append(line)
    return lines


def print_list(console: Console, head: str, items: Iterable[str], sep: str = ", ") -> None:
    """Print `wrap_items` at the console's width, unwrapped by Rich (markup and highlighting off)."""
    for line in wrap_items(head, items, console.width, sep):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def print_text(console: Console, text: str, indent: str = "") -> None:
    """Print a sentence wrapped on word boundaries at the console's width, every line indented
    by `indent`."""
    print_list(console, indent, text.split(), sep=" ")
