"""Sweep planning (turnscope.conductor.prefix_sweep, loadgen.workload.sweep_workloads) as pure logic: the shipped
vendor sweep has the vendor's shape (vLLM blog 2026-10-12, run_multiturn_sweep.sh and
benchmarks/multi_turn/bench_dataset.py), each point is its own workload and run id, and the
recorded parameters and size checks are what the numbers say."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from loadgen.synth_text import LocalTokenizer, TextSynth
from loadgen.workload import Constant, WorkloadError, load_workload, plan_workload, sweep_workloads
from serving.topology import embedded_topology, load_topology
from tests.embedded_tokenizer import tokenizer_json
from turnscope.commands import app
from turnscope.conductor.evaluation import EvalSettings, RunPlan, run_eval
from turnscope.conductor.prefix_sweep import (
    SWEEP_MODES,
    largest_prompt_tokens,
    plan_sweep,
    run_sweep,
    write_workloads,
)

REPO = Path(__file__).resolve().parents[2]
VENDOR = REPO / "data" / "workloads" / "vendor-sweep.yaml"
STAMP = "20261130T120000"


def base(tmp_path: Path, **kw) -> EvalSettings:
    topo = kw.pop("topology", None) or embedded_topology(str(tmp_path / "model"))
    return EvalSettings(topology=topo, store=tmp_path / "store", log_dir=tmp_path / "logs", label="sweep", **kw)


# --------------------------------------------------------------------------- the shipped sweep


def test_vendor_sweep_embedded_scale_is_the_published_shape_scaled():
    w = load_workload(VENDOR)
    points = sweep_workloads(w)
    # x 0.128: the vendor's 2000, 8000, 16000, 24000 prefix tokens.
    assert [v for v, _ in points] == [round(x * 0.128) for x in (2000, 8000, 16000, 24000)] == [256, 1024, 2048, 3072]
    for v, pw in points:
        (a,) = [a for _, a in pw.archetypes()]
        assert pw.sweep is None and pw.name == "vendor-sweep" and pw.seed == w.seed
        assert pw.sessions == 6
        assert a.first_prompt_tokens == Constant(value=v)
        # 5 user requests (num_turns 10 counts user and assistant messages), 150-token user turns.
        assert a.turns == Constant(value=5) and a.new_tokens == {"think": Constant(value=150)}
        assert a.output_tokens == Constant(value=48) and a.system_prompt_tokens == Constant(value=round(500 * 0.128))
        assert set(a.gaps) == {"think"} and a.gaps["think"].seconds == Constant(value=0)
    assert w.sweep.users == 2 and w.sweep.field == "first_prompt_tokens"


def test_vendor_sweep_published_scale_is_the_vendors_script():
    points = sweep_workloads(load_workload(VENDOR), scale="published")
    # PFX_LIST, NUM_CONVERSATIONS=10, INPUT_TOKENS=150, OUTPUT_TOKENS=300, common prefix 500.
    assert [v for v, _ in points] == [2000, 4000, 8000, 12000, 16000, 20000, 24000]
    for _, pw in points:
        (a,) = [a for _, a in pw.archetypes()]
        assert pw.sessions == 10
        assert a.output_tokens == Constant(value=300) and a.system_prompt_tokens == Constant(value=500)
        assert a.new_tokens == {"think": Constant(value=150)} and a.turns == Constant(value=5)


def test_point_sessions_have_the_vendors_prefixes():
    """Planned with the embedded tokenizer: the shared system prompt is the same text for every
    conversation, each conversation's first message is its own text of exactly the point's tokens,
    later user messages are 150 tokens, and every turn asks for 48 tokens."""
    tok = LocalTokenizer(tokenizer_json())
    w = dict(sweep_workloads(load_workload(VENDOR)))[1024]
    plans = plan_workload(w, TextSynth(tok, seed=w.seed))
    assert len(plans) == 6 and all(len(p.turns) == 5 for p in plans)
    systems = {p.turns[0].new_messages[0]["content"] for p in plans}
    firsts = [p.turns[0].new_messages[1]["content"] for p in plans]
    assert len(systems) == 1 and tok.count(list(systems)) == [64]
    assert len(set(firsts)) == 6 and tok.count(firsts) == [1024] * 6
    later = [t.new_messages[0]["content"] for p in plans for t in p.turns[1:]]
    assert tok.count(later) == [150] * 24
    assert {t.max_tokens for p in plans for t in p.turns} == {48}
    assert {t.gap_before_s for p in plans for t in p.turns} == {0.0}


# --------------------------------------------------------------------------- plan and run ids


def test_plan_run_ids_order_and_recorded_parameters(tmp_path):
    plan = plan_sweep(VENDOR, sweep_id=f"sweep-{STAMP}", out_dir=tmp_path / "sweeps")
    assert plan.sweep_id == f"sweep-{STAMP}" and plan.values == [256, 1024, 2048, 3072]
    assert (plan.users, plan.settle_s, plan.sessions, plan.scale) == (2, 2.0, 6, None)
    s = base(tmp_path, modes=list(SWEEP_MODES), histories=["token_ids"])
    runs = plan.runs(s, list(SWEEP_MODES), ["token_ids", "text"])
    assert list(runs) == ["pd-nocache", "pd-bidir-nocache", "pd", "pd-bidir", "aggregated"]
    ids = [r.run_id for rs in runs.values() for r in rs]
    assert len(ids) == len(set(ids)) == 5 * 2 * 4
    pd = runs["pd"]
    # One worker start per mode: every history, every point ascending, on it.
    assert [r.run_id for r in pd] == [f"sweep-{STAMP}-pd-{h}-p{v}" for h in ("token_ids", "text")
                                      for v in (256, 1024, 2048, 3072)]
    assert [r.settle_s for r in pd] == [0.0] + [2.0] * 7
    r = pd[5]  # text, 1024
    assert r.history == "text" and r.settings.histories == ["text"]
    assert r.settings.workload == tmp_path / "sweeps" / f"sweep-{STAMP}" / "p1024" / "vendor-sweep.yaml"
    assert (r.settings.sessions, r.settings.users) == (6, 2)
    # The embedded topology's 8192-token context less the 48-token reply.
    assert r.settings.max_prompt_tokens == 8192 - 48
    sweep = r.spec["sweep"]
    assert sweep == {"name": "vendor-sweep", "id": f"sweep-{STAMP}", "field": "first_prompt_tokens",
                     "prefix_tokens": 1024, "index": 1, "values": [256, 1024, 2048, 3072],
                     "scale": "default", "sessions": 6, "users": 2}
    assert r.spec["workload"]["mix"][0]["archetype"]["first_prompt_tokens"] == {"kind": "constant", "value": 1024.0}
    # The base settings are not changed by planning.
    assert s.workload is None and s.max_prompt_tokens == 3500


def test_point_files_load_back_as_the_point_workloads(tmp_path):
    plan = plan_sweep(VENDOR, sweep_id="x", out_dir=tmp_path, values=[300, 100])
    assert plan.values == [100, 300] and [p.index for p in plan.points] == [0, 1]
    write_workloads(plan)
    for p in plan.points:
        assert p.path.stem == "vendor-sweep"  # the run's `workload` column: the same for every point
        assert load_workload(p.path) == p.workload
        assert yaml.safe_load(p.path.read_text())["mix"][0]["archetype"]["first_prompt_tokens"]["value"] == p.value


def test_largest_prompt_and_context_check(tmp_path):
    w = dict(sweep_workloads(load_workload(VENDOR)))[3072]
    # 64 shared + 3072 own + 4 later turns x (150 new + 48 reply) + 16 template tokens x 10 messages.
    assert largest_prompt_tokens(w) == 64 + 3072 + 4 * 198 + 16 * 10 == 4088
    published = plan_sweep(VENDOR, sweep_id="x", out_dir=tmp_path, scale="published")
    # The first point that does not fit the embedded 8192-token context: 8000 (4000 needs
    # 500 + 4000 + 4 x 450 + 160 = 6460, + 300 output = 6760), 500 + 8000 + 1800 + 160 = 10460.
    assert largest_prompt_tokens(published.points[-1].workload) == 500 + 24000 + 4 * 450 + 160 == 26460
    with pytest.raises(ValueError, match=r"point 8000 of sweep 'vendor-sweep' needs prompts of up to 10460 tokens "
                                         r"plus 300 output, more than max_model_len 8192"):
        published.runs(base(tmp_path), ["pd"], ["text"])
    vendor = load_topology(REPO / "data" / "topologies" / "vendor-h200-1p1d.yaml")
    runs = published.runs(base(tmp_path, topology=vendor), ["pd"], ["text"])
    assert {r.settings.max_prompt_tokens for r in runs["pd"]} == {32768 - 300}
    assert published.settle_s == 20.0 and published.sessions == 10


# --------------------------------------------------------------------------- errors


def _sweep_file(tmp_path: Path, **sweep) -> Path:
    doc = yaml.safe_load(VENDOR.read_text())
    doc["sweep"].update(sweep)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("kw, message", [
    ({"scale": "huge"}, "sweep.scales has no 'huge' (it has: published)"),
    ({"values": [0, 10]}, "distinct integers >= 1 (first_prompt_tokens), got [0, 10]"),
    ({"values": [10, 10]}, "got [10, 10]"),
])
def test_plan_errors_name_the_problem(tmp_path, kw, message):
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        plan_sweep(VENDOR, sweep_id="x", out_dir=tmp_path, **kw)


def test_sweep_section_errors_name_the_field(tmp_path):
    with pytest.raises(WorkloadError, match=r"s.yaml: line \d+: workload field sweep.values: .*distinct"):
        load_workload(_sweep_file(tmp_path, values=[5, 5]))
    with pytest.raises(WorkloadError, match=r"s.yaml: line \d+: workload field sweep.field"):
        load_workload(_sweep_file(tmp_path, field="output_tokens"))
    with pytest.raises(WorkloadError, match=r"sweep.scales.published.archetype.turns"):
        sweep_workloads(load_workload(_sweep_file(tmp_path, scales={"published": {
            "values": [10], "archetype": {"turns": {"kind": "poisson"}}}})), scale="published")
    with pytest.raises(WorkloadError, match="the swept field takes the sweep's values"):
        sweep_workloads(load_workload(_sweep_file(tmp_path, scales={"published": {
            "values": [10], "archetype": {"first_prompt_tokens": 5}}})), scale="published")
    doc = yaml.safe_load(VENDOR.read_text()) | {"token_scale": 0.5}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(WorkloadError, match="leave token_scale at 1"):
        load_workload(tmp_path / "t.yaml")
    with pytest.raises(WorkloadError, match="has no 'sweep' section"):
        sweep_workloads(load_workload("coding-agent"))


def test_run_eval_checks_every_run_before_starting(tmp_path):
    s = base(tmp_path, modes=["pd"], histories=["token_ids"])
    bad = RunPlan(run_id="r", history="tokens", settings=s)
    with pytest.raises(ValueError, match="unknown history mode 'tokens'"):
        run_eval(s, runs={"pd": [bad]})
    missing = RunPlan(run_id="r", history="text", settings=s.model_copy(update={"workload": tmp_path / "no.yaml"}))
    (tmp_path / "model").mkdir()
    with pytest.raises(ValueError, match="no.yaml"):
        run_eval(s, runs={"pd": [missing]})
    assert not (tmp_path / "store").exists()  # nothing was started or written


def test_a_sweep_never_reuses_a_run_id(tmp_path):
    plan = plan_sweep(VENDOR, sweep_id="h200", out_dir=tmp_path / "sweeps", values=[100])
    s = base(tmp_path, modes=["pd"], histories=["text"])
    (tmp_path / "store" / "runs" / "h200-pd-text-p100").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds run h200-pd-text-p100 .1 of this sweep's runs exist."):
        run_sweep(s, plan)
    assert not (tmp_path / "sweeps").exists()  # nothing written, nothing started


# --------------------------------------------------------------------------- the command


def cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "4000"})
    return r.exit_code, " ".join(r.output.split())


def test_cli_dry_run_prints_one_worker_start_per_mode(tmp_path):
    code, out = cli("sweep", "--dry-run", "--topology", str(REPO / "data" / "topologies" / "vendor-h200-1p1d.yaml"),
                    "--scale", "published", "--histories", "text", "--sweep-id", "h200", "--modes",
                    "pd-nocache,pd-bidir-nocache", "--store", str(tmp_path / "store"))
    assert code == 0, out
    assert "sweep h200: vendor-sweep, first_prompt_tokens = 2000, 4000, 8000, 12000, 16000, 20000, 24000 tokens " \
           "(published scale), 10 sessions x 2 users per point" in out
    for mode in ("pd-nocache", "pd-bidir-nocache"):
        assert f"# {mode}: one worker start, then " + ", ".join(
            f"h200-{mode}-text-p{v}" for v in (2000, 4000, 8000, 12000, 16000, 20000, 24000)) in out
    assert not (tmp_path / "store").exists()


def test_cli_attached_workers_default_to_their_mode(tmp_path):
    doc = yaml.safe_load((REPO / "data" / "topologies" / "vendor-h200-1p1d.yaml").read_text())
    doc |= {"launch": False, "attached_mode": "pd-bidir"}
    topo = tmp_path / "attached.yaml"
    topo.write_text(yaml.safe_dump(doc))
    code, out = cli("sweep", "--dry-run", "--topology", str(topo), "--scale", "published", "--sweep-id", "h200")
    assert code == 0, out
    assert "# pd-bidir: one worker start" in out and "# pd:" not in out and "modes pd-bidir;" in out
    code, out = cli("sweep", "--dry-run", "--topology", str(topo), "--modes", "pd")
    assert code == 2 and "cannot run mode 'pd' (it runs: pd-bidir)" in out


@pytest.mark.parametrize("args, message", [
    (["--values", "1,x"], "--values takes comma-separated integers (tokens), got '1,x'"),
    (["--scale", "published"], "point 8000 of sweep 'vendor-sweep' needs prompts of up to 10460 tokens"),
    (["--workload", "nope.yaml"], "workload file nope.yaml does not exist"),
    (["--workload", str(REPO / "data" / "workloads" / "coding-agent.yaml")], "has no 'sweep' section"),
])
def test_cli_errors(args, message):
    code, out = cli("sweep", "--dry-run", "--topology", str(REPO / "data" / "topologies" / "embedded-cpu.yaml"), *args)
    assert code == 2 and message in out, out
