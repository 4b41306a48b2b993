"""core/resources.py in a checkout: the shipped files are this checkout's data/, found by name
from any directory; made files go under data/; subprocesses get this checkout's code first.
Installed from the wheel: tests/integration/test_wheel_install.py."""

from __future__ import annotations

import site
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core import resources

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"


def test_a_checkout_reads_its_own_data_folder() -> None:
    assert resources.in_checkout()
    assert resources.shipped_root() == DATA
    assert resources.schema_path() == DATA / "schema.sql" and resources.schema_path().is_file()
    assert resources.home() == DATA
    assert resources.names("profiles") == ["embedded-cpu", "vendor-h200"]
    assert "kv-cache-tester" in resources.names("traces") and "SOURCES.md" not in resources.names("traces")
    assert resources.names("topologies") == sorted(p.stem for p in (DATA / "topologies").glob("*.yaml"))


@pytest.mark.parametrize("value, kind, expected", [
    ("embedded-cpu", "profiles", "profiles/embedded-cpu.yaml"),
    ("embedded-cpu.yaml", "profiles", "profiles/embedded-cpu.yaml"),
    ("data/profiles/vendor-h200.yaml", "profiles", "profiles/vendor-h200.yaml"),
    ("mixed", "workloads", "workloads/mixed.yaml"),
    ("embedded-cpu-2p1d", "topologies", "topologies/embedded-cpu-2p1d.yaml"),
    ("kv-cache-tester", "traces", "traces/kv-cache-tester"),
    ("kv-cache-tester/trace_0036.json", "traces", "traces/kv-cache-tester/trace_0036.json"),
    ("data/traces/tracelab_round_trace.jsonl", "traces", "traces/tracelab_round_trace.jsonl"),
])
def test_a_shipped_file_is_found_by_name_from_another_directory(value, kind, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resources.find(value, kind) == DATA / expected


def test_a_file_that_exists_wins_and_an_unknown_name_comes_back_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "embedded-cpu.yaml").write_text("name: mine\n")
    assert resources.find("embedded-cpu.yaml", "profiles") == Path("embedded-cpu.yaml")
    assert resources.find("no-such-profile", "profiles") == Path("no-such-profile")
    assert resources.find_shipped("no-such-profile", "profiles") is None
    assert resources.find_shipped(str(DATA / "profiles" / "embedded-cpu.yaml"), "profiles") is None  # absolute


def test_made_path_moves_a_shipped_files_neighbour_under_home(monkeypatch, tmp_path):
    model = DATA / "topologies" / ".." / "models" / "turnscope-tiny"
    assert resources.made_path(model) == DATA / "models" / "turnscope-tiny"  # a checkout: data/ is home
    monkeypatch.setattr(resources, "home", lambda: tmp_path / "turnscope-data")  # as installed
    assert resources.made_path(model) == tmp_path / "turnscope-data" / "models" / "turnscope-tiny"
    assert resources.made_path("/models/Qwen3-32B") == Path("/models/Qwen3-32B")


def test_pythonpath_puts_this_code_first_unless_it_is_a_site_packages_folder(monkeypatch):
    assert resources.pythonpath(None) == str(REPO)
    assert resources.pythonpath("/x:/y") == f"{REPO}:/x:/y"
    assert resources.pythonpath(f"/x:{REPO}") == f"/x:{REPO}"  # already there: kept where it is
    monkeypatch.setattr(resources, "CODE_ROOT", Path(site.getsitepackages()[0]).resolve())
    assert resources.pythonpath("/x") == "/x"


def test_cli_takes_a_shipped_topology_by_name_from_another_directory(tmp_path, monkeypatch):
    from turnscope.commands import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["serve", "--topology", "embedded-cpu-2p1d", "--dry-run"], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    assert r.output.count("--model " + str(DATA / "models" / "turnscope-tiny")) == 3  # 2 P + 1 D, model under home
    r = CliRunner().invoke(app, ["serve", "--topology", "no-such-topology", "--dry-run"])
    assert r.exit_code != 0 and "no-such-topology" in r.output
