"""Where turnscope's shipped files are, and where the files it makes go by default.

Shipped, read-only: the repository's ``data/`` folder minus what turnscope writes there, installed
by the wheel as the package ``turnscope_data`` (pyproject.toml, ``[tool.setuptools]``):

* ``schema.sql``: the store's contract (docs/schema/overview.md);
* ``profiles/*.yaml``: cost profiles (docs/planner/profiles.md);
* ``topologies/*.yaml``: worker layouts (serving/topology.py);
* ``workloads/*.yaml``: workloads (docs/workloads.md);
* ``traces/``: the shipped traces, their sources and licences in ``traces/SOURCES.md``.

Every module that reads one asks this module (:func:`shipped`, :func:`schema_path`, :func:`find`),
never a path relative to its own file. In a checkout (plain, or the editable install) they are the
checkout's ``data/`` next to the code that runs, so a second worktree reads its own files, not
those of the checkout the editable install points at (whose ``turnscope_data`` mapping, a
namespace package behind setuptools' placeholder path, ``importlib.resources`` cannot read on
Python 3.11 either); installed from the wheel, they are read through ``importlib.resources``. An installation must be unzipped (pip's default): the files are
handed to DuckDB, subprocesses and YAML readers as paths.

Made, read-write (:func:`home`): the store, the embedded model and the logs go by default under the
checkout's ``data/`` (git-ignored: ``turnscope.duckdb``, ``runs/``, ``rollups/``, ``models/``) or,
installed outside a checkout, under ``turnscope-data/`` of the current directory. The settings
``store`` and ``model`` (``TURNSCOPE_STORE``, ``TURNSCOPE_MODEL``, docs/configuration.md) put them
elsewhere.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import site
from pathlib import Path

#: The package the wheel installs ``data/``'s shipped files as.
PACKAGE = "turnscope_data"
#: The folder holding turnscope's top-level packages (core, store, serving, loadgen, ..., turnscope): a
#: checkout's root, or the site-packages (or ``--target``) folder it was installed into.
CODE_ROOT = Path(__file__).resolve().parents[1]
#: Shipped kinds: folder under the shipped root -> the suffix a bare name gets (None: names are
#: taken as they are, e.g. ``kv-cache-tester`` or ``tracelab_round_trace.jsonl``).
KINDS: dict[str, str | None] = {"profiles": ".yaml", "topologies": ".yaml", "workloads": ".yaml", "traces": None}
#: The folder of the current directory that holds the store and the model when installed.
HOME_NAME = "turnscope-data"
#: How the repository, its docs and its workload files spell a shipped file: ``data/<kind>/<name>``.
REPO_DATA = "data"


def in_checkout() -> bool:
    """Whether this code runs from a checkout of the repository (its ``pyproject.toml`` and
    ``data/schema.sql`` beside the packages), plain or installed editable."""
    return (CODE_ROOT / "pyproject.toml").is_file() and (CODE_ROOT / REPO_DATA / "schema.sql").is_file()


@functools.cache
def shipped_root() -> Path:
    """The folder of the shipped files: the checkout's ``data/``, else the installed package's.

    Raises:
        ModuleNotFoundError: neither a checkout nor an installation with ``turnscope_data``.
    """
    if in_checkout():
        return CODE_ROOT / REPO_DATA
    # A folder without __init__.py installs as a namespace package, whose Traversable is not a Path;
    # a file in it is.
    return Path(str(importlib.resources.files(PACKAGE).joinpath("schema.sql"))).parent


def shipped(*parts: str) -> Path:
    """The shipped file or folder at ``parts`` under the shipped root, e.g.
    ``shipped("traces", "kv-cache-tester")``; not checked for existence (a reader's error names it)."""
    return shipped_root().joinpath(*parts)


def schema_path() -> Path:
    """The store's contract, ``schema.sql``."""
    return shipped("schema.sql")


def names(kind: str) -> list[str]:
    """The shipped names of ``kind`` (a key of :data:`KINDS`), sorted: file stems for the YAML
    kinds (``embedded-cpu``), file and folder names for traces (``kv-cache-tester``, ``SOURCES.md``
    excluded)."""
    suffix = KINDS[kind]
    folder = shipped(kind)
    if suffix:
        return sorted(p.stem for p in folder.glob(f"*{suffix}"))
    return sorted(p.name for p in folder.iterdir() if p.name != "SOURCES.md")


def find(value: str | os.PathLike, kind: str) -> Path:
    """A file the user named for a shipped ``kind``: ``value`` itself when it exists; else the
    shipped file it names, spelled as a name (``embedded-cpu``), a file name under the kind's
    folder (``embedded-cpu.yaml``, ``kv-cache-tester/trace_0036.json``) or the repository's path
    (``data/profiles/embedded-cpu.yaml``, as the docs write it), so that a command works the same
    from any directory and installed. Else ``value`` unchanged (the caller says it does not exist).
    """
    given = Path(value).expanduser()
    if given.exists():
        return given
    return find_shipped(given, kind) or given


def find_shipped(value: str | os.PathLike, kind: str) -> Path | None:
    """The shipped file of ``kind`` that ``value`` names (the spellings of :func:`find`), or None."""
    given = Path(value)
    if given.is_absolute():
        return None
    root, suffix = shipped_root(), KINDS[kind]
    candidates = [root.joinpath(kind, given)]
    if given.parts and given.parts[0] == REPO_DATA and len(given.parts) > 1:
        candidates.insert(0, root.joinpath(*given.parts[1:]))
    if suffix and not given.suffix:
        candidates.append(root.joinpath(kind, given.with_name(given.name + suffix)))
    return next((c for c in candidates if c.exists()), None)


def home() -> Path:
    """Where turnscope writes by default (absolute): the checkout's ``data/``, else
    ``./turnscope-data`` of the current directory."""
    return CODE_ROOT / REPO_DATA if in_checkout() else Path.cwd() / HOME_NAME


def made_path(path: str | os.PathLike) -> Path:
    """``path`` of a made file that a shipped file names relative to its own folder (a topology's
    ``model: ../models/turnscope-tiny``): installed, the same place under :func:`home`, since the
    installed package is no place to write; a path outside the shipped files is returned as is."""
    p = Path(path)
    try:
        rel = p.resolve().relative_to(shipped_root().resolve())
    except ValueError:
        return p
    return home() / rel  # in a checkout the same path: the shipped root is home()


def pythonpath(existing: str | None = None) -> str:
    """The ``PYTHONPATH`` of a subprocess that must import this turnscope (a worker, the proxy,
    Locust): :data:`CODE_ROOT` first, so that it runs the same code as its parent (a checkout that
    is not the editable install's), then ``existing``. Installed into a site-packages folder,
    :data:`CODE_ROOT` is left out: the interpreter finds it there already, and on ``PYTHONPATH`` it
    would come before the standard library."""
    parts = [p for p in (existing or "").split(os.pathsep) if p]
    site_dirs = {str(Path(d).resolve()) for d in [*site.getsitepackages(), site.getusersitepackages()]}
    if str(CODE_ROOT) not in site_dirs and str(CODE_ROOT) not in parts:
        parts.insert(0, str(CODE_ROOT))
    return os.pathsep.join(parts)
