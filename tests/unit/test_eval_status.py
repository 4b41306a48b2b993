"""How the evaluation driver records a run's end from its Locust process's exit code."""

import signal

from turnscope.conductor.evaluation import run_locust, run_status


def test_failed_turns_do_not_fail_a_run_and_a_killed_loadgen_is_aborted():
    assert run_status(0) == "complete"       # Locust ran every session (failed turns are rows, not a failed run)
    assert run_status(2) == "failed"         # the run could not start (bad input)
    assert run_status(1) == "failed"
    assert run_status(-signal.SIGKILL) == "aborted"
    assert run_status(-signal.SIGTERM) == "aborted"


def test_locust_is_told_that_failed_requests_are_not_an_error_exit(monkeypatch, tmp_path):
    """Locust exits 1 when any request failed unless told otherwise; the driver tells it 0."""
    from turnscope.conductor import evaluation

    seen = {}

    def fake_run(argv, **kw):
        seen["argv"] = argv
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(evaluation.subprocess, "run", fake_run)
    s = evaluation.default_settings(tmp_path / "model", log_dir=tmp_path)
    assert run_locust(s, "r1", "http://127.0.0.1:9", "text", "pd") == 0
    argv = seen["argv"]
    assert argv[argv.index("--exit-code-on-error") + 1] == "0"


def test_every_shipped_workload_passes_the_runs_own_check() -> None:
    """`turnscope eval` reads each workload and the traces it names before anything starts
    (turnscope.conductor.evaluation.check_workload): every shipped workload, every trace format, passes."""
    from pathlib import Path

    from loadgen.workload import load_workload
    from turnscope.conductor.evaluation import check_workload

    files = sorted((Path(__file__).resolve().parents[2] / "data" / "workloads").glob("*.yaml"))
    formats = set()
    for f in files:
        check_workload(f)
        formats |= {src.format for src in load_workload(f).traces}
    assert {"kv_cache_tester", "taubench", "mooncake"} <= formats  # the checks above covered them
