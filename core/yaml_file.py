"""Reading a YAML file of settings into a pydantic model, with errors that name the file and line.

One reader for every YAML input turnscope takes (topologies, cost profiles, workloads, the
settings file), so a bad file reads the same way whichever it is:

    <path>: line L, column C: not valid YAML: <what PyYAML found>
    <path>: expected a mapping at the top level, got list
    <path>: line L: topology field a.b.0: <pydantic's message>
    <path>: topology: <pydantic's message about the whole file>

Parsing is PyYAML's (``yaml.safe_load``, ``yaml.compose`` for the line of each key) and the
checks are pydantic's; this module only words their errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""


def parse_mapping(text: str, path: Path, what: str, error: type[Exception]) -> dict[str, Any]:
    """Parse `text` (the content of `path`) as a YAML mapping.

    Args:
        text: the file's content.
        path: where it came from (for messages only).
        what: what the file holds, for messages (e.g. "topology").
        error: the exception class to raise (a ValueError subclass of the caller's module).

    Returns:
        The top-level mapping; an empty file gives ``{}``.

    Raises:
        error: not valid YAML (with PyYAML's line and column, 1-based) or not a mapping at the top.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}:{_yaml_where(exc)} not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of {what} fields at the top level, got {type(data).__name__}")
    return data


def read_mapping(path: Path, what: str, error: type[Exception]) -> dict[str, Any]:
    """Read `path` (UTF-8) and :func:`parse_mapping` it.

    Raises:
        error: the file cannot be read (the OS's reason), or as :func:`parse_mapping`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read the {what}: {exc.strerror or exc}") from None
    return parse_mapping(text, path, what, error)


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Key path -> 1-based line where the YAML `text` sets it (list items by index as a string:
    ``("mix", "0", "weight")``). Empty when the text is not valid YAML."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    out: dict[tuple[str, ...], int] = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                loc = (*prefix, str(key.value))
                out[loc] = key.start_mark.line + 1
                walk(value, loc)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out[(*prefix, str(i))] = item.start_mark.line + 1
                walk(item, (*prefix, str(i)))

    walk(root, ())
    return out


def line_of(loc: tuple[str, ...], lines: Mapping[tuple[str, ...], int]) -> int | None:
    """The line of `loc` in `lines` (:func:`key_lines`), or of its nearest parent that has one
    (pydantic adds locations such as a union member's name that are not keys of the file)."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return None


def describe_validation(path: Path, exc: ValidationError, what: str, text: str | None = None) -> str:
    """Every problem pydantic found, one line each: ``<path>: line L: <what> field a.b: message``
    (``<path>: <what>: message`` for a problem of the whole file).

    `text`: the file's content, to find each field's line (re-read from `path` when None; the
    line is left out where none is found, e.g. a field that is missing from the file).
    """
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError:
            text = ""
    lines = key_lines(text)
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        line = line_of(loc, lines)
        where = f" line {line}:" if line is not None else ""
        field = f" field {'.'.join(loc)}" if loc else ""
        out.append(f"{path}:{where} {what}{field}: {err['msg']}")
    return "\n".join(out)


def load_model(path: Path, model: type, what: str, error: type[Exception],
               context: dict[str, Any] | None = None) -> Any:
    """Read `path` and validate it as pydantic `model` (``model.model_validate``).

    Returns:
        The validated model instance.

    Raises:
        error: as :func:`read_mapping`, or the model refuses a field (:func:`describe_validation`).
    """
    path = Path(path)
    data = read_mapping(path, what, error)
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise error(describe_validation(path, exc, what)) from None
