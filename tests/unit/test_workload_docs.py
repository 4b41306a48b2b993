"""docs/workloads.md against the workload models: every field of every model is documented, every
documented key is a real field, and the doc's YAML example validates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from loadgen.workload import (
    Archetype,
    Constant,
    Empirical,
    Exponential,
    HistoryRewrite,
    LogNormal,
    MixEntry,
    Sweep,
    TraceSource,
    Uniform,
    Workload,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "workloads.md"


def section(title: str) -> str:
    """The text of the ``## <title>`` section."""
    parts = re.split(r"^## ", DOC.read_text(), flags=re.MULTILINE)
    (body,) = [p for p in parts if p.startswith(title)]
    return body


def table_keys(text: str) -> set[str]:
    """Keys in the first column of the section's tables (``| `a`, `b` | ...``)."""
    keys: set[str] = set()
    for first in re.findall(r"^\| ([^|]+) \|", text, flags=re.MULTILINE):
        keys |= set(re.findall(r"`(\w+)`", first))
    return keys - {"key", "kind"}


@pytest.mark.parametrize("title, models", [
    ("Top level", [Workload]),
    ("`mix`", [MixEntry, Archetype]),
    ("`traces`", [TraceSource]),
    ("`sweep`", [Sweep]),
    ("`history_rewrite`", [HistoryRewrite]),
])
def test_every_field_documented_and_every_documented_key_real(title, models):
    keys = table_keys(section(title))
    fields = set().union(*(m.model_fields for m in models))
    assert fields - keys == set(), f"fields missing from docs/workloads.md '{title}'"
    assert keys - fields == set(), f"docs/workloads.md '{title}' documents keys that are not fields"


def test_distribution_table_names_each_kind_and_its_keys():
    text = section("Distributions")
    for model in (Constant, Uniform, LogNormal, Exponential, Empirical):
        kind = model.model_fields["kind"].default if model is Constant else model.model_fields["kind"].annotation.__args__[0]
        row = re.search(rf"^\| `{kind}` \|(.*)$", text, flags=re.MULTILINE)
        assert row, f"kind {kind} not in the distributions table"
        for f in set(model.model_fields) - {"kind", "min", "max"}:
            assert f"`{f}`" in row.group(1), f"{kind}: key {f} not documented"


def test_doc_yaml_example_validates():
    (block,) = re.findall(r"^```yaml\n(.*?)^```", section("Distributions"), flags=re.DOTALL | re.MULTILINE)
    example = yaml.safe_load(block)
    arch = Archetype.model_validate({"name": "doc", "first_prompt_tokens": 100, "output_tokens": 50,
                                     "new_tokens": {"tool": 100, "think": 20}, **example})
    assert arch.turns.median == 12 and arch.gaps["tool"].seconds.field == "gap_s"
