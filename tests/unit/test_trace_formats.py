"""The trace-format registry (loadgen.traces.formats): every shipped trace is detected as the format
data/traces/SOURCES.md says it is, and a format registered in one call is found by detection, by
the request stream and by a workload's replay."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from loadgen.traces import formats
from loadgen.traces.errors import TraceFormatError

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "data" / "traces"


@pytest.mark.parametrize("name, expected", [
    ("AzureLLMInferenceTrace_conv.csv", "azure"), ("conversation_trace.jsonl", "mooncake"),
    ("tracelab_round_trace.jsonl", "tracelab"), ("kv-cache-tester", "kv_cache_tester"),
])
def test_shipped_traces_are_detected(name, expected):
    assert formats.detect_format(TRACES / name) == expected


def test_a_store_directory_is_a_run_and_an_unknown_file_is_refused(tmp_path):
    (tmp_path / "turnscope.duckdb").write_bytes(b"")
    assert formats.detect_format(tmp_path) == "run"
    odd = tmp_path / "x.jsonl"
    odd.write_text('{"foo": 1}\n')
    with pytest.raises(TraceFormatError, match=r"x\.jsonl: format not recognised .* name it with --format"):
        formats.detect_format(odd)
    with pytest.raises(TraceFormatError, match="format 'nope' is not one of"):
        formats.iter_agent_requests(odd, "nope")
    with pytest.raises(TraceFormatError, match="format 'taubench' is not one of"):  # replay only
        formats.iter_agent_requests(odd, "taubench")


@pytest.fixture
def toy_format(tmp_path, monkeypatch):
    """A format added as the registry's docs say: one reader module and one register call."""
    (tmp_path / "toy_reader.py").write_text(textwrap.dedent('''
        from loadgen.traces.agent_request import AgentRequest

        def toy_requests(path):
            for i, line in enumerate(path.read_text().splitlines()):
                n = int(line)
                yield AgentRequest("toy", "s0", i, float(i), n, 1, shared_prefix_tokens=0)
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    fmt = formats.register(formats.TraceFormat("toy", detect=lambda s: s.suffix == ".toy",
                                               requests="toy_reader:toy_requests"))
    yield fmt
    del formats._FORMATS["toy"]
    sys.modules.pop("toy_reader", None)


def test_a_registered_format_is_detected_and_read(toy_format, tmp_path):
    path = tmp_path / "a.toy"
    path.write_text("10\n25\n")
    assert formats.detect_format(path) == "toy"
    assert [r.input_tokens for r in formats.iter_agent_requests(path)] == [10, 25]
    with pytest.raises(ValueError, match="registered twice"):
        formats.register(toy_format)


def test_workload_sources_accept_exactly_the_replay_formats():
    from loadgen.workload import TraceSource

    for name in formats.REPLAY_FORMATS:
        assert TraceSource(format=name, path="t").format == name
    with pytest.raises(ValueError, match="format"):
        TraceSource(format="tracelab", path="t")  # streamed by traffic/plan, not replayed by a workload
    assert json.dumps(sorted(formats.REPLAY_FORMATS)) == json.dumps(
        ["azure", "kv_cache_tester", "mooncake", "taubench", "vllm_multiturn"])
