"""The repository's copy of the handed cases (tests/cases/) holds every case of ../shared/cases/."""

from __future__ import annotations

import pytest

from tests.handed_cases import CASES, SHARED_CASES


def _files(root):
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_repository_copy_exists() -> None:
    names = set(_files(CASES))
    assert {"sse/tool_call_only_turn.json", "prometheus/per_engine_series.prom",
            "store/same_instant_offsets.jsonl", "multiturn/README.md"} <= names


@pytest.mark.skipif(not SHARED_CASES.is_dir(), reason="no ../shared/cases beside this checkout")
def test_repository_copy_holds_every_handed_case_byte_for_byte() -> None:
    handed, ours = _files(SHARED_CASES), _files(CASES)
    missing = sorted(set(handed) - set(ours))
    assert not missing, f"handed cases not copied into {CASES}: {missing}"
    differ = sorted(k for k in handed if handed[k].read_bytes() != ours[k].read_bytes())
    assert not differ, f"tests/cases differs from ../shared/cases in: {differ}"
