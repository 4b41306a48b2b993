"""The streaming client against a local stub that replays handed SSE cases with real sleeps."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gevent.socket
import httpx
import pytest

from loadgen.stream_client import GeventClient, stream_turn
from tests.handed_cases import CASES as HANDED
from tests.integration.http_stub import Script, StubServer, events_script

pytestmark = pytest.mark.timing

REPO = Path(__file__).resolve().parents[2]
CASES = HANDED / "sse"
CASE_FILES = sorted(CASES.glob("*.json"))
TRANSPORT = {"name": "httpx"}
HTTPX_ONLY = {"test_stream_concurrent_threads_share_client"}


@pytest.fixture(autouse=True, params=["httpx", "gevent"])
def transport(request):
    """Every test runs with both transports of stream_turn (httpx.Client and GeventClient),
    except those that are about one of them."""
    if request.param == "gevent" and request.node.originalname in HTTPX_ONLY:
        pytest.skip("about the httpx transport: GeventClient is for one gevent thread")
    TRANSPORT["name"] = request.param
    yield request.param


def make_client():
    """A client of the transport under test (a context manager). gevent resolves addresses on a
    thread pool that starts with the first lookup: started here, before anything is timed."""
    if TRANSPORT["name"] == "gevent":
        gevent.socket.getaddrinfo("127.0.0.1", 80)
        return GeventClient()
    return httpx.Client()


KNOWN_EXPECT = {"status", "error_contains", "ttft_ms", "itl_ms", "completion_tokens", "prompt_tokens",
                "e2e_ms", "time_to_first_content_ms", "text", "tolerance_ms", "http_status", "last_token_ms",
                "tpot_ms", "finish_reason", "tool_calls", "exclude_from_latency", "exclude_from_throughput"}


def _chunk(delta: dict | None = None, *, usage: dict | None = None, finish: str | None = None,
           choices: bool = True, **top: object) -> bytes:
    c: dict = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": "m",
               "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else []}
    if usage is not None:
        c["usage"] = usage
    c.update(top)
    return b"data: " + json.dumps(c).encode() + b"\n\n"


class Turn:
    """One stream_turn call against a stub, with the truths the stub measured independently.

    The scripts time events from the moment the request *arrived* at the stub; the client times
    from the moment it *sent* it. ``shift_s`` (stub arrival minus the instant just before the call)
    is the request's own transit, so a correct client measures an event scripted at ``at`` as
    ``at + shift_s``. ``tol_s`` widens the case tolerance by how late the stub itself sent bytes
    (its own record), so a loaded machine does not fail a correct client; a wrong client still fails.
    """

    def __init__(self, stub: StubServer, path: str, body: dict, tol_ms: float = 8, **kw: object):
        with make_client() as client:
            t_call = time.perf_counter()
            self.r = stream_turn(client, stub.url + path, body, **kw)
        self.shift_s = stub.arrived_at() - t_call
        self.tol_s = tol_ms / 1000.0 + max(stub.lateness_s(), 0.0)
        assert 0 <= self.shift_s < 0.2, f"request took {self.shift_s:.3f} s to reach the stub"

    def at(self, scripted_s: float) -> object:
        """pytest.approx for an instant scripted at ``scripted_s`` after arrival."""
        return pytest.approx(scripted_s + self.shift_s, abs=self.tol_s)

    def gap(self, scripted_s: float) -> object:
        """pytest.approx for a duration between two scripted instants."""
        return pytest.approx(scripted_s, abs=self.tol_s)


def _script_for(case: dict) -> Script:
    if "fragments_b64" in case:
        return Script(fragments=[(at / 1000.0, base64.b64decode(f))
                                 for at, f in zip(case["fragment_at_ms"], case["fragments_b64"], strict=True)])
    return events_script(case["events"])


def test_stream_cases_present() -> None:
    assert len(CASE_FILES) >= 6, f"handed SSE cases missing under {CASES}"


@pytest.mark.parametrize("path", CASE_FILES, ids=[p.stem for p in CASE_FILES])
def test_stream_handed_case(path: Path) -> None:
    case = json.loads(path.read_text())
    exp = case["expect"]
    assert set(exp) <= KNOWN_EXPECT, f"{path.name}: unhandled expect keys {set(exp) - KNOWN_EXPECT}"
    with StubServer(_script_for(case)) as stub:
        t = Turn(stub, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                 tol_ms=exp.get("tolerance_ms", 8), timeout_s=10)
    r = t.r
    assert r.status == exp["status"], (r.status, r.error)
    if "error_contains" in exp:
        assert exp["error_contains"] in (r.error or "")
    if "ttft_ms" in exp:
        if exp["ttft_ms"] is None:
            assert r.ttft_s is None
        else:
            assert r.ttft_s == t.at(exp["ttft_ms"] / 1000.0)
    if "time_to_first_content_ms" in exp:
        assert r.ttfc_s == t.at(exp["time_to_first_content_ms"] / 1000.0)
    if "e2e_ms" in exp:
        assert r.e2e_s == t.at(exp["e2e_ms"] / 1000.0)
    if "itl_ms" in exp:
        assert len(r.itl_s) == len(exp["itl_ms"]), r.itl_s
        for got, want in zip(r.itl_s, exp["itl_ms"], strict=True):
            assert got == t.gap(want / 1000.0)
    if "last_token_ms" in exp:
        assert r.last_token_s == t.at(exp["last_token_ms"] / 1000.0)
    if "tpot_ms" in exp:
        assert r.tpot_s == t.gap(exp["tpot_ms"] / 1000.0)
    for k in ("completion_tokens", "prompt_tokens", "text", "http_status", "finish_reason"):
        if k in exp:
            assert getattr(r, k) == exp[k], k
    if "tool_calls" in exp:
        assert [{"index": c["index"], "id": c.get("id"), "name": c["function"]["name"],
                 "arguments": c["function"]["arguments"]} for c in r.tool_calls] == exp["tool_calls"]
    for k in ("exclude_from_latency", "exclude_from_throughput"):
        if k in exp:
            assert r.counts_for_latency is not exp[k], k


def test_stream_split_fragments_ttft_is_when_event_completes() -> None:
    # Hand-derived from the case: the first content event ("café ...") starts in fragment 2
    # (210 ms) but its UTF-8 character and its blank line only complete in fragment 3 (220 ms),
    # which also carries the " done" event (tokens 3 -> 4, so one ITL sample of ~0 s).
    case = json.loads((CASES / "split_transport_fragments.json").read_text())
    frags = [base64.b64decode(f) for f in case["fragments_b64"]]
    assert b'"content": "caf' in frags[2] and frags[2].endswith(b"\xe2")
    with StubServer(_script_for(case)) as stub:
        t = Turn(stub, "/v1/chat/completions", {"model": "m", "messages": []})
    r = t.r
    assert r.ttft_s == t.at(0.220)
    assert r.itl_kind == "per_token"
    assert r.itl_s == [t.gap(0.0)]
    # The [DONE] marker is split across fragments 3 and 4 (230 ms): E2E ends there.
    assert r.e2e_s == t.at(0.230)


def test_stream_forces_stream_options_and_keeps_caller_body() -> None:
    body = {"model": "m", "messages": [], "stream": False, "stream_options": {"include_usage": False}}
    with StubServer(Script(fragments=[(0.0, _chunk({"content": "x"})), (0.0, b"data: [DONE]\n\n")])) as stub, \
            make_client() as client:
        r = stream_turn(client, stub.url + "/v1/chat/completions", body, headers={"X-Session-ID": "s1"})
    sent = stub.requests[0]
    assert sent["body"]["stream"] is True
    assert sent["body"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sent["headers"]["X-Session-ID"] == "s1"
    assert body["stream"] is False and body["stream_options"] == {"include_usage": False}
    assert r.status == "ok" and r.itl_kind == "inter_chunk" and r.completion_tokens is None


def test_stream_http_500() -> None:
    script = Script(status=500, headers={"Content-Type": "application/json"},
                    fragments=[(0.0, json.dumps({"object": "error", "message": "engine dead",
                                                 "type": "InternalServerError", "code": 500}).encode())])
    with StubServer(script) as stub, make_client() as client:
        r = stream_turn(client, stub.url + "/v1/chat/completions", {"model": "m", "messages": []})
    assert (r.status, r.http_status) == ("error", 500)
    assert r.error == "HTTP 500: engine dead"
    assert r.ttft_s is None and r.itl_s == []


def test_stream_http_400_openai_error_shape() -> None:
    script = Script(status=400, headers={"Content-Type": "application/json"},
                    fragments=[(0.0, b'{"error": {"message": "max_tokens too large", "code": 400}}')])
    with StubServer(script) as stub, make_client() as client:
        r = stream_turn(client, stub.url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert (r.status, r.http_status, r.error) == ("error", 400, "HTTP 400: max_tokens too large")


def test_stream_read_timeout() -> None:
    # Headers at once, then a token at 100 ms, then silence for 3 s; 0.5 s inactivity timeout.
    script = Script(fragments=[(0.1, _chunk({"content": "a"}, usage={"prompt_tokens": 3, "completion_tokens": 1}))],
                    end="hang", hang_s=3.0)
    with StubServer(script) as stub:
        t = Turn(stub, "/v1/chat/completions", {"model": "m", "messages": []}, timeout_s=0.5)
    r = t.r
    assert r.status == "timeout", (r.status, r.error)
    assert "ReadTimeout" in r.error
    assert r.ttft_s == t.at(0.1)
    assert r.text == "a"
    # Gave up 0.5 s after the last byte (0.1 s), not after the 3 s hang; httpx's read timeout
    # fires at 0.5 s of silence, plus scheduling slack.
    assert t.at(0.6).expected <= r.e2e_s < 0.6 + t.shift_s + 0.1


def test_stream_connect_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    with make_client() as client:
        r = stream_turn(client, f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "m"}, timeout_s=2)
    assert r.status == "error" and "ConnectError" in r.error and r.http_status is None


def test_stream_connection_dropped_mid_stream() -> None:
    u = {"prompt_tokens": 7}
    script = Script(fragments=[(0.05, _chunk({"role": "assistant", "content": ""})),
                               (0.2, _chunk({"content": "Hel"}, usage={**u, "completion_tokens": 1})),
                               (0.25, _chunk({"content": "lo"}, usage={**u, "completion_tokens": 2}))],
                    end="drop")
    with StubServer(script) as stub:
        t = Turn(stub, "/v1/chat/completions", {"model": "m", "messages": []})
    r = t.r
    assert r.status == "error"
    assert "RemoteProtocolError" in r.error or "ReadError" in r.error, r.error
    assert r.http_status == 200
    assert r.text == "Hello" and r.completion_tokens == 2 and r.prompt_tokens == 7
    assert r.ttft_s == t.at(0.2)
    assert r.itl_s == [t.gap(0.05)]


def test_stream_clean_end_without_done_is_error() -> None:
    script = Script(fragments=[(0.0, _chunk({"content": "a"}))])
    with StubServer(script) as stub, make_client() as client:
        r = stream_turn(client, stub.url + "/v1/chat/completions", {"model": "m"})
    assert r.status == "error" and "[DONE]" in r.error and r.text == "a"


def test_stream_error_event_mid_stream() -> None:
    script = Script(fragments=[(0.0, _chunk({"content": "a"})),
                               (0.0, b'data: {"error": {"message": "KV load failed", "code": 500}}\n\n'),
                               (0.0, b"data: [DONE]\n\n")])
    with StubServer(script) as stub, make_client() as client:
        r = stream_turn(client, stub.url + "/v1/chat/completions", {"model": "m"})
    assert r.status == "error" and "KV load failed" in r.error


def test_stream_not_event_stream() -> None:
    script = Script(headers={"Content-Type": "application/json"}, fragments=[(0.0, b'{"choices": []}')])
    with StubServer(script) as stub, make_client() as client:
        r = stream_turn(client, stub.url + "/v1/chat/completions", {"model": "m"})
    assert r.status == "error" and "text/event-stream" in r.error


def test_stream_proxy_facts_ids_and_tool_calls() -> None:
    u = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}}
    frags = [
        (0.0, _chunk({"role": "assistant", "content": ""}, prompt_token_ids=[1, 2, 3, 4])),
        (0.05, _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                       "function": {"name": "run", "arguments": ""}}]},
                      usage={**u, "completion_tokens": 1})),
        (0.06, _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"cmd\": "}}]},
                      usage={**u, "completion_tokens": 2})),
        (0.07, _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"ls\"}"}}]},
                      usage={**u, "completion_tokens": 3})),
        (0.08, _chunk({}, finish="tool_calls", usage={**u, "completion_tokens": 3},
                      kv_transfer_params={"remote_block_ids": [[7]], "remote_num_tokens": 6},
                      turnscope={"remote_num_tokens": 6, "reused_tokens": 0})),
        (0.08, _chunk(choices=False, usage={**u, "completion_tokens": 3})),
        (0.08, b"data: [DONE]\n\n"),
    ]
    script = Script(fragments=frags, headers={"Content-Type": "text/event-stream", "X-Request-Id": "req-9",
                                              "X-Turnscope-Reuse": "miss_first_turn"})
    with StubServer(script) as stub:
        t = Turn(stub, "/v1/chat/completions", {"model": "m", "messages": []})
    r = t.r
    assert r.status == "ok"
    assert r.request_id == "req-9" and r.headers["x-turnscope-reuse"] == "miss_first_turn"
    assert r.tool_calls == [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]
    assert r.finish_reason == "tool_calls" and r.text == ""
    assert r.ttft_s == t.at(0.05) and r.ttfc_s is None
    assert r.prompt_token_ids == [1, 2, 3, 4] and r.cached_tokens == 3
    assert r.kv_transfer_params == {"remote_block_ids": [[7]], "remote_num_tokens": 6}
    assert r.proxy_facts == {"remote_num_tokens": 6, "reused_tokens": 0}
    # TPOT = (last token - TTFT) / (3 - 1) = (0.07 - 0.05) / 2: the last usage rise is at 70 ms
    assert r.last_token_s == t.at(0.07)
    assert r.tpot_s == pytest.approx(0.01, abs=t.tol_s / 2)
    assert r.itl_s == [t.gap(0.01), t.gap(0.01)]  # usage 1 -> 2 -> 3 at 50, 60, 70 ms


def test_stream_completions_token_ids() -> None:
    def ch(text: str, ids: list[int], n: int, **extra: object) -> bytes:
        c = {"id": "cmpl-1", "object": "text_completion",
             "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": None, **extra}],
             "usage": {"prompt_tokens": 3, "completion_tokens": n}}
        return b"data: " + json.dumps(c).encode() + b"\n\n"

    frags = [(0.1, ch("", [200], 1, prompt_token_ids=[5, 6, 7])),  # byte token, text held back
             (0.13, ch("\u00e9", [169], 2)), (0.16, ch("z", [122], 3)), (0.16, b"data: [DONE]\n\n")]
    with StubServer(Script(fragments=frags)) as stub:
        t = Turn(stub, "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "return_token_ids": True})
    r = t.r
    assert r.status == "ok" and r.request_id == "cmpl-1"
    assert r.prompt_token_ids == [5, 6, 7] and r.token_ids == [200, 169, 122] and r.text == "\u00e9z"
    assert r.ttft_s == t.at(0.10)  # the id arrived before its text
    assert r.ttfc_s == t.at(0.13)
    assert r.itl_s == [t.gap(0.03), t.gap(0.03)]


def test_stream_concurrent_threads_share_client() -> None:
    u = {"prompt_tokens": 1}
    script = Script(fragments=[(0.3, _chunk({"content": "a"}, usage={**u, "completion_tokens": 1})),
                               (0.3, b"data: [DONE]\n\n")])
    results = []
    with StubServer(script) as stub, make_client() as client:
        ts = [threading.Thread(target=lambda: results.append(
            stream_turn(client, stub.url + "/v1/chat/completions", {"model": "m"}))) for _ in range(4)]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        took = time.perf_counter() - t
    assert [r.status for r in results] == ["ok"] * 4
    assert took < 0.6  # concurrent, not 4 x 0.3 s
    for r in results:
        assert r.ttft_s == pytest.approx(0.3, abs=0.05)


GEVENT_SCRIPT = r"""
from gevent import monkey; monkey.patch_all()
import json, sys, time, gevent, httpx
from loadgen.stream_client import GeventClient, stream_turn
url = sys.argv[1]
with (GeventClient() if sys.argv[2] == "gevent" else httpx.Client()) as client:
    t = time.perf_counter()
    gs = [gevent.spawn(stream_turn, client, url, {"model": "m"}) for _ in range(4)]
    gevent.joinall(gs)
    took = time.perf_counter() - t
print(json.dumps({"took": took, "res": [[g.value.status, g.value.ttft_s, g.value.text] for g in gs]}))
"""


def test_stream_under_gevent_monkey_patching(transport) -> None:
    u = {"prompt_tokens": 1}
    script = Script(fragments=[(0.3, _chunk({"content": "caf\u00e9"}, usage={**u, "completion_tokens": 1})),
                               (0.3, b"data: [DONE]\n\n")])
    with StubServer(script) as stub:
        out = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT, stub.url + "/v1/chat/completions", transport],
                             check=False, cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["took"] < 0.6  # four greenlets overlapped
    for status, ttft, text in res["res"]:
        assert status == "ok" and text == "caf\u00e9"
        assert ttft == pytest.approx(0.3, abs=0.05)


def test_idle_keep_alive_connections_closed_by_the_server_are_not_failures(transport) -> None:
    """uvicorn (vLLM, the proxy) closes idle keep-alive connections: a turn after a long gap must
    not fail on the closed pooled connection (it did, as 'Server disconnected without sending a
    response', before idle connections were dropped client-side)."""
    import asyncio

    import uvicorn

    chunks = [(b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}], '
              b'"usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'), b"data: [DONE]\n\n"]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for c in chunks:
            await send({"type": "http.response.body", "body": c, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_keep_alive=1, lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with (GeventClient(keepalive_s=0.5) if transport == "gevent"
              else httpx.Client(limits=httpx.Limits(keepalive_expiry=0.5))) as client:
            results = []
            for _ in range(3):
                results.append(stream_turn(client, url, {"model": "m"}, timeout_s=5))
                time.sleep(1.3)   # longer than the server's 1 s keep-alive timeout
        assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
        if transport == "gevent":  # also when the client would still reuse it: one retry, no failure
            with GeventClient(keepalive_s=60) as client:
                results = []
                for _ in range(3):
                    results.append(stream_turn(client, url, {"model": "m"}, timeout_s=5))
                    time.sleep(1.3)
            assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    finally:
        server.should_exit = True
        th.join(5)
