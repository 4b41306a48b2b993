"""pyproject.toml's package list: every package folder of the code is in the wheel, and data/'s
shipped folders are the package turnscope_data (core/resources.py). What the built wheel
holds and does outside the checkout: tests/integration/test_wheel_install.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

from core import resources
from tests.unit.test_layers import PACKAGES

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_of_the_code_is_listed() -> None:
    code = find_packages(str(REPO), include=[p for top in PACKAGES for p in (top, f"{top}.*")])
    listed = [p for p in CONFIG["packages"] if not p.startswith(resources.PACKAGE)]
    assert sorted(listed) == sorted(code)


def test_the_shipped_kinds_are_the_data_package_and_its_folders() -> None:
    assert CONFIG["package-dir"] == {resources.PACKAGE: "data"}
    data = sorted(p for p in CONFIG["packages"] if p.startswith(resources.PACKAGE))
    assert data == sorted([resources.PACKAGE] + [f"{resources.PACKAGE}.{k}" for k in resources.KINDS])
    assert set(CONFIG["package-data"]) == set(data)
    for kind in resources.KINDS:
        assert (REPO / "data" / kind).is_dir()
