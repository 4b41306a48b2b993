"""loadgen.workload: validation errors name the field, distributions are numpy's, plans are seeded
and follow the archetype rules, token counts are exact, time scaling is exact."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer

from loadgen.synth_text import LocalTokenizer, TextSynth
from loadgen.workload import (
    WORKLOAD_DIR,
    Archetype,
    Constant,
    Empirical,
    Exponential,
    LogNormal,
    Uniform,
    Workload,
    WorkloadError,
    empirical_values,
    load_workload,
    plan_workload,
)
from tests.embedded_tokenizer import tokenizer_json

SHIPPED = ["coding-agent", "research-assistant", "support-agent", "analyst-approval", "mixed"]


@pytest.fixture(scope="module")
def synth() -> TextSynth:
    return TextSynth(LocalTokenizer(tokenizer_json()), seed=0)


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_json()))


def tokens(hf: Tokenizer, text: str) -> int:
    return len(hf.encode(text, add_special_tokens=False).ids)


def arch(**kw) -> dict:
    base = {"name": "t", "turns": 6, "first_prompt_tokens": 50, "new_tokens": {"tool": 20, "think": 10},
            "output_tokens": 8, "gaps": {"tool": {"p": 0.5, "seconds": 2}, "think": {"p": 0.5, "seconds": 30}}}
    base.update(kw)
    return base


def workload(tmp_path: Path, **kw) -> Workload:
    a = kw.pop("archetype", arch())
    doc = {"name": "w", "seed": 5, "sessions": 4, "mix": [{"archetype": a}], **kw}
    p = tmp_path / "w.yaml"
    p.write_text(yaml.safe_dump(doc))
    return load_workload(p)


# -------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_workloads_validate_and_plan_the_same_for_the_same_seed(name, synth):
    w = load_workload(WORKLOAD_DIR / f"{name}.yaml")
    assert w.name == name
    a = plan_workload(w, synth, time_scale=0.01, sessions=3)
    b = plan_workload(load_workload(name), synth, time_scale=0.01, sessions=3)
    assert [p.to_dict() for p in a] == [p.to_dict() for p in b]
    assert len({p.session_id for p in a}) == len(a)


def test_a_different_seed_gives_different_plans(synth):
    w = load_workload("coding-agent")
    a = plan_workload(w, synth, sessions=3)
    b = plan_workload(w.model_copy(update={"seed": w.seed + 1}), synth, sessions=3)
    assert [p.to_dict() for p in a] != [p.to_dict() for p in b]


def test_mixed_includes_the_four_archetypes_with_normalised_weights():
    w = load_workload("mixed")
    weights = {a.name: wt for wt, a in w.archetypes()}
    # mixed.yaml: 0.35, 0.25, 0.25, 0.15 of single-archetype files
    assert weights == pytest.approx({"coding-agent": 0.35, "research-assistant": 0.25,
                                     "support-agent": 0.25, "analyst-approval": 0.15})
    assert [t.format for t in w.traces] == ["mooncake", "taubench"]
    assert all(Path(t.path).is_absolute() for t in w.traces if t.path)


@pytest.mark.parametrize("patch, field", [
    ({"turns": {"kind": "poisson", "lam": 3}}, "mix.0.archetype.turns"),
    ({"gaps": {"tool": {"p": 1.5, "seconds": 1}}}, "mix.0.archetype.gaps.tool.p"),
    ({"gaps": {"tool": {"p": 0.5, "seconds": 1}}}, "mix.0.archetype.gaps"),
    ({"retry_p": -0.1}, "mix.0.archetype.retry_p"),
    ({"output_tokens": {"kind": "uniform", "low": 9, "high": 2}}, "mix.0.archetype.output_tokens.uniform"),
    ({"colour": "red"}, "mix.0.archetype.colour"),
    ({"new_tokens": {"tool": 5}}, "mix.0.archetype"),
    ({"first_prompt_tokens": {"kind": "lognormal", "median": 0, "sigma": 1}},
     "mix.0.archetype.first_prompt_tokens.lognormal.median"),
])
def test_errors_name_the_file_and_the_field(tmp_path, patch, field):
    with pytest.raises(WorkloadError) as e:
        workload(tmp_path, archetype=arch(**patch))
    assert re.search(rf"w.yaml: line \d+: workload field {re.escape(field)}:", str(e.value)), str(e.value)


@pytest.mark.parametrize("key, value", [("colour", "red"), ("retry_p", -0.1)])
def test_errors_name_the_line_that_sets_the_field(tmp_path, key, value):
    with pytest.raises(WorkloadError) as e:
        workload(tmp_path, archetype=arch(**{key: value}))
    text = (tmp_path / "w.yaml").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if t.strip().startswith(f"{key}:"))
    assert f"w.yaml: line {line}: workload field mix.0.archetype.{key}:" in str(e.value)


def test_yaml_syntax_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nmix:\n  - weight: [1\n")
    with pytest.raises(WorkloadError, match=r"bad.yaml: line \d+, column \d+: not valid YAML"):
        load_workload(p)


def test_include_cycles_and_missing_traces_are_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\nmix: [{include: b.yaml}]\n")
    (tmp_path / "b.yaml").write_text("name: b\nmix: [{include: a.yaml}]\n")
    with pytest.raises(WorkloadError, match="include cycle"):
        load_workload(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("name: c\ntraces: [{format: azure, path: nowhere.csv}]\n")
    with pytest.raises(WorkloadError, match=r"c.yaml: traces.0.path: nowhere.csv: no such file"):
        load_workload(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("name: d\ntraces: [{format: vllm_multiturn}]\n")
    with pytest.raises(WorkloadError, match=r"d.yaml: line 2: workload field traces.0: .*'path' is required"):
        load_workload(tmp_path / "d.yaml")


# ----------------------------------------------------------------------------- distributions


def test_distributions_are_numpys_generator_draws():
    def rng():
        return np.random.default_rng(42)

    assert LogNormal(kind="lognormal", median=20, sigma=0.7).sample(rng(), 5).tolist() == \
        rng().lognormal(math.log(20), 0.7, 5).tolist()
    assert Exponential(kind="exponential", mean=3).sample(rng(), 5).tolist() == rng().exponential(3, 5).tolist()
    assert Uniform(kind="uniform", low=1, high=4).sample(rng(), 5).tolist() == rng().uniform(1, 4, 5).tolist()
    assert Constant(value=7).sample(rng(), 3).tolist() == [7.0, 7.0, 7.0]
    clipped = LogNormal(kind="lognormal", median=20, sigma=2, min=5, max=30).sample(rng(), 2000)
    assert clipped.min() >= 5 and clipped.max() <= 30


def test_lognormal_median_and_exponential_mean_match_their_definitions():
    # definition: median of a log-normal is exp(mu) = `median`; mean of an exponential is `mean`
    x = LogNormal(kind="lognormal", median=40, sigma=1.0).sample(np.random.default_rng(1), 200_000)
    assert np.median(x) == pytest.approx(40, rel=0.02)
    y = Exponential(kind="exponential", mean=12).sample(np.random.default_rng(1), 200_000)
    assert y.mean() == pytest.approx(12, rel=0.02)


def test_empirical_resamples_the_values_or_the_shipped_trace():
    d = Empirical(kind="empirical", values=[1, 5, 9])
    assert set(d.sample(np.random.default_rng(0), 100).tolist()) <= {1.0, 5.0, 9.0}
    t = Empirical(kind="empirical", trace="azure", field="generated_tokens")
    vals = set(empirical_values("azure", "generated_tokens"))
    assert len(empirical_values("azure", "generated_tokens")) == 19366   # rows of the CSV (SOURCES.md)
    assert set(t.sample(np.random.default_rng(0), 50).tolist()) <= vals
    with pytest.raises(ValueError, match="'field' must be one of"):
        Empirical(kind="empirical", trace="azure", field="nope")


def test_a_bare_number_is_a_constant():
    a = Archetype.model_validate(arch(turns=3))
    assert a.turns == Constant(value=3)


# ---------------------------------------------------------------------------------- planning


def test_first_prompt_and_new_tokens_are_exact(tmp_path, synth, hf):
    w = workload(tmp_path, archetype=arch(system_prompt_tokens=33, first_prompt_tokens=120,
                                          new_tokens={"tool": 45, "think": 12}, output_tokens=9))
    plans = plan_workload(w, synth)
    assert len(plans) == 4
    for p in plans:
        sys_msg, user = p.turns[0].new_messages
        assert (sys_msg["role"], tokens(hf, sys_msg["content"])) == ("system", 33)
        assert tokens(hf, user["content"]) == 120
        assert all(t.max_tokens == 9 for t in p.turns)
        for t in p.turns[1:]:
            (m,) = t.new_messages
            assert tokens(hf, m["content"]) == (45 if t.gap_kind == "tool" else 12)
            assert m["role"] == ("tool" if t.gap_kind == "tool" else "user")
    # the system prompt is shared by the archetype's sessions (prefix sharing across sessions)
    assert len({p.turns[0].new_messages[0]["content"] for p in plans}) == 1
    assert len({p.turns[0].new_messages[1]["content"] for p in plans}) == 4


def test_token_scale_multiplies_the_counts(tmp_path, synth, hf):
    w = workload(tmp_path, archetype=arch(first_prompt_tokens=200, output_tokens=40), token_scale=0.25)
    (p,) = plan_workload(w, synth, sessions=1)
    assert tokens(hf, p.turns[0].new_messages[0]["content"]) == 50 and p.turns[0].max_tokens == 10


def test_kinds_follow_the_probabilities(tmp_path, synth):
    # every later turn a retry
    (p,) = plan_workload(workload(tmp_path, archetype=arch(retry_p=1.0)), synth, sessions=1)
    assert [t.kind for t in p.turns] == ["turn"] + ["retry"] * 5
    assert all(t.new_messages == [] and t.gap_before_s == 0 and t.gap_kind == "none" for t in p.turns[1:])
    # every later turn resumes after ttl_s + extra
    (p,) = plan_workload(workload(tmp_path, archetype=arch(resume_p=1.0, new_tokens={"tool": 5, "think": 5,
                                                                                     "pause": 5})), synth, sessions=1)
    assert [t.kind for t in p.turns[1:]] == ["resume"] * 5
    assert all(t.gap_kind == "pause" and t.gap_before_s > 480 for t in p.turns[1:])
    # every later turn edits the history
    (p,) = plan_workload(workload(tmp_path, archetype=arch(edit_p=1.0)), synth, sessions=1)
    assert [t.kind for t in p.turns[1:]] == ["edit"] * 5
    assert all(t.edit["style"] == "compact" and 0 <= t.edit["keep"] <= 1 for t in p.turns[1:])
    # a fresh side request before every later turn, then the turn itself
    (p,) = plan_workload(workload(tmp_path, archetype=arch(fresh_p=1.0)), synth, sessions=1)
    assert [t.kind for t in p.turns] == ["turn"] + ["fresh", "turn"] * 5


def test_gaps_over_the_ttl_are_resumes_and_the_time_scale_is_exact(tmp_path, synth):
    a = arch(turns=30, gaps={"think": {"p": 0.5, "seconds": 100}, "pause": {"p": 0.5, "seconds": 900}},
             new_tokens={"think": 5, "pause": 5})
    w = workload(tmp_path, archetype=a)
    full = plan_workload(w, synth, sessions=1)[0]
    fast = plan_workload(w, synth, sessions=1, time_scale=0.01)[0]
    kinds = [(t.kind, t.gap_kind) for t in full.turns[1:]]
    assert set(kinds) == {("turn", "think"), ("resume", "pause")}          # 900 s > ttl 480 s
    assert [(t.kind, t.gap_kind) for t in fast.turns[1:]] == kinds          # kinds by the unscaled gap
    assert [t.gap_before_s for t in full.turns[1:]] == [100.0 if k == "think" else 900.0 for _, k in kinds]
    assert [t.gap_before_s for t in fast.turns[1:]] == pytest.approx([t.gap_before_s * 0.01 for t in full.turns[1:]])


def test_earlier_sessions_do_not_change_when_more_are_planned(tmp_path, synth):
    w = workload(tmp_path)
    three = plan_workload(w, synth, sessions=3)
    five = plan_workload(w, synth, sessions=5)
    assert [p.to_dict() for p in five[:3]] == [p.to_dict() for p in three]


def test_trace_sources_plan_sessions_with_arrivals(tmp_path, synth, hf):
    w = workload(tmp_path, sessions=0, mix=[], traces=[
        {"format": "azure", "sessions": 3, "token_scale": 0.5},
        {"format": "mooncake", "sessions": 2, "min_turns": 3, "max_turns": 3, "token_scale": 0.125}])
    plans = plan_workload(w, synth, time_scale=0.5)
    az = [p for p in plans if p.source.startswith("azure")]
    mc = [p for p in plans if p.source.startswith("mooncake")]
    assert len(az) == 3 and len(mc) == 2
    # azure rows 0..2 (CSV): arrivals 0, 4.314579, 4.541877 s; 374/396/879 context tokens, 44/109/55 out
    assert [p.start_at_s for p in az] == pytest.approx([0.0, 4.314579 * 0.5, 4.541877 * 0.5])
    assert [tokens(hf, p.turns[0].new_messages[0]["content"]) for p in az] == [187, 198, 440]
    assert [p.turns[0].max_tokens for p in az] == [22, 54, 28]
    for p in mc:
        assert p.turns[0].kind == "turn" and len(p.turns) == 3
        assert all(t.at_s is not None for t in p.turns[1:])
        assert [t.at_s for t in p.turns[1:]] == sorted(t.at_s for t in p.turns[1:])
    assert [p.start_at_s for p in plans] == sorted(p.start_at_s for p in plans)
