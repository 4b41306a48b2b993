"""Plain text for the CLI that reads the same in an 80-column terminal and in a log file.

Rich wraps long lines at spaces wherever they fall; a list such as ``hit=3, miss_no_handle=4``
then breaks mid-item and its continuation starts at column 0. `print_list` wraps on item
boundaries with a hanging indent, at the console's width (``COLUMNS``; 80 when the output is a
file or a pipe, Rich's default). `print_table` prints a Rich table whole, stacked where it is wider
than the console: every CLI table goes through it.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.table import Table


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


def _plain(cell: object) -> str:
    """A table cell's text without markup (cells are markup strings or `rich.text.Text`)."""
    from rich.text import Text

    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain


def table_width(console: Console, table: Table) -> int:
    """The width (characters) `table` takes with no cell wrapped or cut (Rich's maximum measure)."""
    from rich.measure import Measurement

    return Measurement.get(console, console.options.update(width=10_000), table).maximum


def print_table(console: Console, table: Table) -> None:
    """Print `table` whole: as Rich draws it where it fits the console's width, else stacked, one
    block per row of ``header: value`` lines, so no number is ever wrapped or cut (Rich would squeeze
    its columns and print ``pd-…``, ``217…``). The same at a terminal as in a file or a pipe, where
    the width is 80 unless ``COLUMNS`` says otherwise: a log reads as the terminal does."""
    if table_width(console, table) <= console.width:
        console.print(table)
        return
    if table.title:
        print_text(console, _plain(table.title))
    headers = [_plain(c.header) for c in table.columns]
    cells = [[_plain(c) for c in col.cells] for col in table.columns]
    pad = max((len(h) for h in headers), default=0)
    rows = max((len(c) for c in cells), default=0)
    for i in range(rows):
        console.print("", soft_wrap=True)
        for h, col in zip(headers, cells, strict=True):
            value = col[i] if i < len(col) else ""
            if value:
                console.print(f"  {h.ljust(pad)}  {value}", soft_wrap=True, markup=False, highlight=False)
