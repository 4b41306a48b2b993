"""Installed, not only checked out: the wheel built from this tree runs outside the checkout.

The tree's sources (and data/ with decoys of what turnscope writes there: a store, a run, a model)
are copied to a temporary folder and built into a wheel with the venv's own setuptools (no build
isolation, no index). The wheel goes into a fresh venv whose only other entry on ``sys.path`` is
this venv's site-packages, for the dependencies: a path line of a ``.pth`` file, so the editable
install's finder is not loaded there and the checkout cannot answer for the installed package.
From another directory, ``turnscope --help`` runs and ``turnscope traffic`` reads a shipped trace
by its name; the report's figures are checked against the trace file counted here, and the store
lands in ``./turnscope-data`` (docs/layout.md). The installed dashboard
script then renders its Traffic page over that store.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.unit.test_layers import PACKAGES

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.install
#: What turnscope writes under data/ (git-ignored) and the wheel must not ship.
MADE = ("runs", "rollups", "models", "turnscope.duckdb", "turnscope.duckdb.wal")
TRACE = "tracelab_round_trace.jsonl"


def _copy_sources(dst: Path) -> None:
    """The files a wheel is built from; data/ without what turnscope made there, plus decoys of it."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in PACKAGES:
        shutil.copytree(REPO / part, dst / part, ignore=skip)
    shutil.copytree(REPO / "data", dst / "data", ignore=lambda d, names: [
        n for n in names if n in MADE and Path(d) == REPO / "data"] + list(skip(d, names)))
    for decoy in ("turnscope.duckdb", "runs/r1/turns/part-0.parquet", "rollups/r1.parquet",
                  "models/turnscope-tiny/config.json"):
        (dst / "data" / decoy).parent.mkdir(parents=True, exist_ok=True)
        (dst / "data" / decoy).write_text("{}")


def _run(argv: list, cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, f"{argv}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the wheel, install it into a fresh venv; the venv, the wheel's file names, the
    shipped files of the copy, a clean environment and the seconds each step took."""
    if int(metadata.version("setuptools").split(".")[0]) < 77:  # built without isolation: this venv's
        pytest.skip("pyproject.toml's build needs setuptools >= 77 in this venv (project.license)")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TURNSCOPE_")}
    secs = {}
    t0 = time.monotonic()
    _copy_sources(src)
    shipped = {p.relative_to(src / "data").as_posix() for p in (src / "data").rglob("*") if p.is_file()
               and p.relative_to(src / "data").parts[0] not in MADE}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", dist, src], tmp, env)
    secs["build"] = time.monotonic() - t0
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    purelib = Path(_run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        tmp, env).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    assert ours in map(Path, site.getsitepackages())
    (purelib / "turnscope_test_deps.pth").write_text(f"{ours}\n")  # a path line: its .pth files are not run
    (wheel,) = dist.glob("turnscope-*.whl")
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
          "--no-index", wheel], tmp, env)
    secs["install"] = time.monotonic() - t0
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {"venv": venv, "purelib": purelib, "names": zipfile.ZipFile(wheel).namelist(), "shipped": shipped,
            "env": env, "secs": secs}


def test_wheel_ships_every_shipped_file_and_nothing_turnscope_made(installed):
    names = set(installed["names"])
    data = {n.removeprefix("turnscope_data/") for n in names if n.startswith("turnscope_data/")}
    assert "schema.sql" in data and f"traces/{TRACE}" in data and "traces/SOURCES.md" in data
    assert data == installed["shipped"], "a shipped file missing from pyproject's package-data, or a made one shipped"
    assert {"turnscope/commands/app.py", "core/resources.py", "dashboard/app.py", "dashboard/pages.py",
            "dashboard/app_pages/overview.py", "loadgen/locustfile.py", "serving/vllm_worker.py"} <= names


def test_installed_turnscope_runs_from_another_directory(installed, tmp_path):
    env, python = installed["env"], installed["venv"] / "bin" / "python"
    code = ("import turnscope, dashboard; from core import resources; print(turnscope.__file__, "
            "dashboard.__file__, resources.shipped_root(), resources.in_checkout(), resources.home())")
    where = _run([python, "-c", code], tmp_path, env).stdout.split()
    purelib = installed["purelib"]
    assert [Path(where[0]).parent.parent, Path(where[1]).parent.parent] == [purelib, purelib], where  # not the checkout
    assert Path(where[2]) == purelib / "turnscope_data", where
    assert where[3:] == ["False", str(tmp_path / "turnscope-data")]

    t0 = time.monotonic()
    help_text = _run([installed["venv"] / "bin" / "turnscope", "--help"], tmp_path, env).stdout
    installed["secs"]["help"] = time.monotonic() - t0
    assert "traffic" in help_text and "demo" in help_text

    # Independent truth: the trace file counted here, one JSON object per line.
    rows = [json.loads(line) for line in (REPO / "data" / "traces" / TRACE).read_text().splitlines() if line.strip()]
    sessions = len({r["session_id"] for r in rows})
    tokens = sum(r["input_tokens_total"] for r in rows)
    t0 = time.monotonic()
    report = _run([installed["venv"] / "bin" / "turnscope", "traffic", TRACE], tmp_path, env).stdout
    installed["secs"]["traffic"] = time.monotonic() - t0
    assert f"{sessions} sessions (0 sub-agents), {len(rows)} requests" in report, report
    assert f"of {tokens:,} input tokens" in report, report
    assert (tmp_path / "turnscope-data" / "turnscope.duckdb").is_file()  # the installed default store

    # The installed dashboard script, over that store: only a traffic report, so the Traffic page.
    t0 = time.monotonic()
    page = _run([python, "-c", (
        "import sys; from streamlit.testing.v1 import AppTest; import dashboard.app_pages as p; "
        "from pathlib import Path; "
        "at = AppTest.from_file(str(Path(p.__file__).parent.parent / 'app.py'), default_timeout=90).run(); "
        "assert not at.exception, at.exception; "
        "print('\\n'.join(m.value for m in at.markdown) + '\\n'.join(c.value for c in at.caption))")],
        tmp_path, env | {"TURNSCOPE_STORE": str(tmp_path / "turnscope-data")}).stdout
    installed["secs"]["dashboard"] = time.monotonic() - t0
    assert "No recorded runs in this store" in page, page
    print(f"wheel install: {installed['secs']}")
