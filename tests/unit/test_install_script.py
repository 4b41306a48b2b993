"""scripts/install.sh's decision: PyTorch's CPU index only when no torch 2.13.0+cpu wheel is on disk.

PyTorch's index cannot be reached from the test machine, so the script's `--print-pip-args` mode
(the options it would pass to `pip install`, installing nothing) is run against wheel folders the
test lays out, with the machine's own pip configuration switched off (PIP_CONFIG_FILE=/dev/null).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install.sh"
WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def pip_args(tmp_path: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    out = subprocess.run(
        ["bash", str(SCRIPT), "--print-pip-args", str(tmp_path / "no-venv")],
        env=clean | {"PIP_CONFIG_FILE": os.devnull} | env, capture_output=True, text=True, check=True, timeout=60,
    )
    return out.stdout.strip()


def test_no_local_wheel_adds_pytorchs_cpu_index(tmp_path):
    (tmp_path / "wheels").mkdir()
    assert pip_args(tmp_path, PIP_FIND_LINKS=str(tmp_path / "wheels")) == INDEX
    assert pip_args(tmp_path) == INDEX  # no wheel folder configured at all


def test_wheel_in_a_find_links_folder_needs_no_index(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / WHEEL).touch()
    assert pip_args(tmp_path, PIP_FIND_LINKS=str(tmp_path / "wheels")) == ""


def test_wheel_in_a_file_index_needs_no_index(tmp_path):
    (tmp_path / "simple" / "torch").mkdir(parents=True)
    (tmp_path / "simple" / "torch" / WHEEL).touch()
    assert pip_args(tmp_path, PIP_EXTRA_INDEX_URL=f"file://{tmp_path / 'simple'}") == ""


@pytest.mark.parametrize("other", ["torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                                   "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"])
def test_another_torch_build_does_not_count(tmp_path, other):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / other).touch()
    assert pip_args(tmp_path, PIP_FIND_LINKS=str(tmp_path / "wheels")) == INDEX


def test_wheel_found_through_pip_configuration_file(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / WHEEL).touch()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {tmp_path / 'wheels'}\n")
    assert pip_args(tmp_path, PIP_CONFIG_FILE=str(conf)) == ""
