"""``turnscope serve --kubernetes``: the YAML it prints parses and validates (with the validators of
tests/unit/test_kubernetes.py), and a missing ``--image`` fails naming it."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from tests.unit.test_kubernetes import IMAGE, REPO, validate


def test_cli_prints_yaml_that_validates() -> None:
    from turnscope.commands import app

    r = CliRunner().invoke(app, ["serve", "--topology", str(REPO / "data/topologies/vendor-h200-1p1d.yaml"),
                                 "--mode", "pd-bidir", "--kubernetes", "--image", IMAGE, "--namespace", "llm"],
                           env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    objects = [o for o in yaml.safe_load_all(r.stdout) if o]
    assert {o["metadata"]["namespace"] for o in objects} == {"llm"}
    for obj in objects:
        validate(obj)


def test_cli_without_image_fails_naming_it() -> None:
    from turnscope.commands import app

    r = CliRunner().invoke(app, ["serve", "--topology", str(REPO / "data/topologies/embedded-cpu.yaml"),
                                 "--mode", "pd", "--kubernetes"], env={"COLUMNS": "4000"})
    assert r.exit_code == 2 and "--image" in r.output



def test_cli_renders_the_inference_pool_when_asked_and_refuses_a_bad_picker() -> None:
    from turnscope.commands import app

    args = ["serve", "--topology", str(REPO / "data/topologies/embedded-cpu.yaml"), "--mode", "pd", "--kubernetes",
            "--image", IMAGE]
    r = CliRunner().invoke(app, [*args, "--inference-pool", "epp:9010"], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    pool = [o for o in yaml.safe_load_all(r.stdout) if o][-1]
    assert pool["kind"] == "InferencePool" and pool["spec"]["endpointPickerRef"]["port"] == {"number": 9010}
    validate(pool)
    r = CliRunner().invoke(app, [*args, "--inference-pool", "epp:none"], env={"COLUMNS": "4000"})
    assert r.exit_code != 0 and "--inference-pool" in r.output
